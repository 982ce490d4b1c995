"""Pallas kernels for deltares, one folder per kernel (api, reference, per-backend files).

    from kernels_pallas.depth_route import depth_route

Each kernel's public entry point takes `implementation=` ("xla", "pallas_tpu", "pallas_gpu" (Triton),
"pallas_mosaic_gpu", "pallas" = the target platform's kernel) and falls back to the XLA reference when a
kernel cannot run.

The package stands alone: it imports jax, never deltares (each kernel's oracle is its own
reference.py; deltares' tests hold it to deltares' routing). Only the benchmark's train-step table
(depth_route/bench.py) runs deltares' model.
"""

from __future__ import annotations

import jax


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A pallas_call output shape that varies over the same manual mesh axes as `like`
    (needed inside `jax.shard_map` with check_vma; the keyword is `manual_axis_type` in
    jax 0.10, `vma` before)."""
    aval = jax.typeof(like)
    for key in ("manual_axis_type", "vma"):
        if getattr(aval, key, None) is not None:
            try:
                return jax.ShapeDtypeStruct(shape, dtype, **{key: getattr(aval, key)})
            except TypeError:
                continue
    return jax.ShapeDtypeStruct(shape, dtype)


def varying_axes(x) -> frozenset:
    """Manual mesh axes `x` varies over inside `jax.shard_map` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", None) or ())


def vary_like(xs, axes: frozenset):
    """Casts each array of `xs` (None passes) to vary over `axes`, so that a custom VJP's
    cotangents vary as its inputs do; the transpose of the cast sums over those axes."""

    def cast(x):
        missing = () if x is None else tuple(sorted(axes - varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return [cast(x) for x in xs]
