"""Fused depth routing: public entry point, dispatch and the custom VJP.

    z_i = w . RMSNorm_g(s_i)    a = softmax_i(z) over valid sources    out = [residual +] sum_i a_i s_i

`depth_route(sources, valid, query, gain, residual=None, *, implementation="pallas")` means what
`reference.depth_route` means (the oracle, here the "xla" implementation) and returns
the output only, in the sources' dtype. The kernels ("pallas_tpu": Mosaic TPU, "pallas_gpu":
Triton, "pallas_mosaic_gpu": Mosaic GPU, Hopper) make one pass over the sources per token tile: each source's 1/rms and logit against
q = w * g, and a float32 online softmax (running max, sum and weighted sum), then the residual
add. They save the per-token log-sum-exp for the backward (not the weights), which is a
Pallas kernel too: it re-reads the valid sources twice (first for c = sum_k a_k dout.s_k, then
for ds_k), writes ds once, and returns per-tile partial dq, reduced outside; dw = dq g and
dg = dq w follow by autodiff of q = w * g. Bytes moved per call (input dtype):
forward (S + 1 [+ 1 residual]) N D, backward (2 S + 1) N D read + S N D written, counting
only valid sources in the reads (invalid ones are skipped without a DMA on TPU).

Masks: `valid` [S] (static or traced) or anything broadcastable to [S, B, T] (per-token; sent
to the kernels as a float32 additive bias [S, B*T]). Masked sources get zero gradient.

Sources: one array [S, B, T, D], or a sequence of S arrays [B, T, D] (unrolled layers' slots).
The Mosaic GPU kernel takes such a sequence as S operands (no stacked copy; a source a static
mask leaves out is not an operand at all); the others stack it. `pass_sources=True` (a sequence)
returns (out, sources): the same arrays, passed through, so that routing the next sublayer over
them sends their cotangents back through this call's backward pass, where the Mosaic GPU kernel
adds its own into each in place (an aliased operand) instead of making a buffer-sized cotangent
for XLA to sum; for the other implementations the passed sources are the arrays themselves.

Dispatch: implementation="pallas" picks the kernel of the platform being targeted (the platform
of the surrounding mesh, e.g. a `jax.set_mesh` or `jax.shard_map` over TPU devices compiled
ahead of time, else `jax.default_backend()`): TPU -> pallas_tpu, GPU -> pallas_gpu, else xla.
A kernel that cannot run (another platform without interpret=True, or shapes it cannot tile)
falls back to xla with a one-time warning. Under `jax.jit` with sharded inputs a Pallas call
is not partitioned by XLA: call it inside `jax.shard_map` (tokens split, D whole).

Two-phase routing (Kimi; docs/explanations/store-once.md, "Two-phase grouped routing"):
pseudo-queries do not depend on the input, so for the K sublayers of a group the routing over
the sources completed before the group is one read of those sources:
`route_prefix(sources, valid [K, S], queries [K, D], gains [K, D])` returns each query's routed
output and log-sum-exp (float32; the oracle is `reference.route_prefix`). Its kernels
keep K online softmaxes per token tile (on TPU the logits of the K queries are one matmul per
source tile, the K float32 accumulators are the output block itself), and the backward reads the
valid sources once more: with c_k = dout_k . out_k - dlse_k from the saved output,
    ds = sum_k [a_k dout_k + dz_k inv (q_k - z_k inv s / D)],  dz_k = a_k (dout_k . s - c_k),
added into a cotangent buffer in place (`route_prefix_grad_into`; the custom VJP passes zeros).
Each sublayer then merges that result with its few intra-group sources through the lse
(`route_normalized(prefix=)`, in XLA): out = (e^{lse1} o1 + e^{lse2} o2) / (e^{lse1} + e^{lse2}).
It divides source reads by K.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from kernels_pallas import varying_axes, vary_like
from kernels_pallas.depth_route import reference
from kernels_pallas.depth_route.reference import NORM_EPS

# "pallas": the target platform's kernel (falling back to xla where none runs); "auto": the fastest
# measured on the target platform (`implementation_for`); the others force one.
# deltares' config.model.residual.impl takes these values.
IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu")

_PLATFORM_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "pallas_mosaic_gpu": "gpu"}
MOSAIC_GPU = "pallas_mosaic_gpu"  # the one kernel that takes separate sources
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def target_platform() -> str:
    """'tpu', 'gpu', 'cpu', ...: the surrounding mesh's platform, else the default backend's."""
    try:
        platform = getattr(jax.sharding.get_abstract_mesh().abstract_device, "platform", None)
    except Exception:  # noqa: BLE001 - no mesh API or no mesh
        platform = None
    platform = platform or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def wrong_platform(implementation: str, platform: str, interpret=False) -> str | None:
    """Why the kernel `implementation` cannot compile for devices of `platform` ("tpu", "gpu"/"cuda", "cpu"),
    or None: "pallas_tpu" and "pallas_gpu" each compile for their platform only (but with `interpret`)."""
    want = _PLATFORM_OF.get(implementation)
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if want is None or interpret or platform == want:
        return None
    return f"it compiles for {want} only (or runs with interpret=True), the target is {platform}"


def implementation_for(implementation: str, phase_one: bool = False) -> str:
    """The implementation "auto" stands for on the target platform, measured on one H200
    (docs/explanations/performance.md): on a GPU the Triton kernel for a sublayer's routing
    (`depth_route`: s220m `delta_block` 95.4 against 100.5 ms a step, `delta` 139.6 against 159.5)
    and XLA for two-phase routing's phase one (`route_prefix`, `phase_one`: the K-query kernel made
    s1044m `delta` slower, 763.9 against 512.3 ms); XLA elsewhere (no TPU run has compared them).
    Any other value is returned as it is."""
    if implementation != "auto":
        return implementation
    return "pallas_gpu" if target_platform() == "gpu" and not phase_one else "xla"


def _backend(impl: str):
    if impl == "pallas_tpu":
        from kernels_pallas.depth_route import pallas_tpu as module
    elif impl == MOSAIC_GPU:
        from kernels_pallas.depth_route import pallas_mosaic_gpu as module
    else:
        from kernels_pallas.depth_route import pallas_gpu as module
    return module


def _resolve(implementation, interpret, N, D, dtype, K=None, S=1, bias=True) -> str:
    """The implementation to run: `K` queries for phase one (`route_prefix`), None for `depth_route`
    (over `S` sources; `bias`: a traced or per-token mask, for the Mosaic GPU kernel's limits)."""
    platform = target_platform()
    impl = implementation_for(implementation, phase_one=K is not None)
    if impl == "pallas":
        impl = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "xla")
    if impl == "xla":
        return impl
    reason = wrong_platform(impl, platform, interpret)
    if reason is None:
        backend = _backend(impl)
        if K is not None:
            reason = backend.prefix_unsupported(N, D, dtype, K)
        elif impl == MOSAIC_GPU:
            reason = backend.unsupported(N, D, dtype, S, bias) or (interpret and backend.interpreter_missing())
        else:
            reason = backend.unsupported(N, D, dtype)
    if reason:
        _warn_once(f"{'depth_route' if K is None else 'route_prefix'}: {impl} cannot run ({reason}); using the xla implementation")
        return "xla"
    return impl


def _masks(valid, S, B, T):
    """(valid_S int32, additive bias [S, B*T] float32 or None for a per-source mask)."""
    v = reference.valid_mask(valid, S)
    if v.shape[1:] == (1, 1):
        return jnp.broadcast_to(v[:, 0, 0], (S,)).astype(jnp.int32), None
    v_SN = jnp.broadcast_to(v, (S, B, T)).reshape(S, B * T)
    return v_SN.any(axis=1).astype(jnp.int32), jnp.where(v_SN, 0.0, -jnp.inf).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route(cfg, src_SND, valid_S, bias_SN, q_D, res_ND):
    return _route_fwd(cfg, src_SND, valid_S, bias_SN, q_D, res_ND)[0]


def _route_fwd(cfg, src_SND, valid_S, bias_SN, q_D, res_ND):
    impl, eps, interpret, _ = cfg
    out_ND, lse = _backend(impl).forward(src_SND, valid_S, bias_SN, q_D, res_ND, eps=eps, interpret=interpret)
    return out_ND, (src_SND, valid_S, bias_SN, q_D, lse)


def _route_bwd(cfg, saved, dout_ND):
    impl, eps, interpret, res_dtype = cfg
    src_SND, valid_S, bias_SN, q_D, lse = saved
    ds_SND, dq_D = _backend(impl).backward(src_SND, valid_S, bias_SN, q_D, lse, dout_ND, eps=eps,
                                           interpret=interpret)
    dres_ND = None if res_dtype is None else dout_ND.astype(res_dtype)
    return ds_SND, None, None, dq_D, dres_ND


_route.defvjp(_route_fwd, _route_bwd)


def _static_mask(valid, S: int):
    """A per-source mask known when tracing, as a NumPy bool [S]; None for a traced or per-token one."""
    if isinstance(valid, jax.core.Tracer):
        return None
    v = np.asarray(valid, bool)
    if v.ndim and v.shape[0] != S:
        return None  # reference.check names the error
    v = v.reshape(v.shape + (1,) * (3 - v.ndim))
    return np.broadcast_to(v[:, 0, 0], (S,)) if v.shape[1:] == (1, 1) else None


def depth_route(sources, valid, query, gain, residual=None, *, implementation="pallas", interpret=False,
                eps=NORM_EPS, pass_sources=False):
    """Route over `sources` [S, B, T, D] or S arrays [B, T, D] (see the module docstring); returns [B, T, D],
    or with `pass_sources` (a sequence of sources) (out, the sources passed through).

    implementation: "xla", "pallas" (the kernel of the target platform), "pallas_tpu", "pallas_gpu" (Triton),
      "pallas_mosaic_gpu" (Mosaic GPU) or "auto" (`implementation_for`: the Triton kernel on a GPU, xla elsewhere).
    interpret: run the Pallas kernel in interpret mode (on CPU, for tests): True, or for
      pallas_tpu a `pltpu.InterpretParams()` for the TPU interpret mode (pallas_mosaic_gpu: the Mosaic GPU
      interpreter, jax 0.11 and later, `plgpu.InterpretGPUParams`).
    eps: the key norm's, 1 / sqrt(mean(s^2) + eps) (config.model.norm_eps in the model).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    listed = isinstance(sources, (tuple, list))
    if pass_sources and not listed:
        raise ValueError("pass_sources takes a sequence of sources [B, T, D]")
    if listed:
        sources = tuple(sources)
        shapes = {(jnp.shape(s), jnp.dtype(s.dtype)) for s in sources}
        if not sources or len(shapes) != 1 or len(jnp.shape(sources[0])) != 3:
            raise ValueError(f"sources must be [S, B, T, D] or a sequence of S arrays [B, T, D] of one shape and "
                             f"dtype, got {sorted(str(s) for s in shapes)}")
    stacked = jax.ShapeDtypeStruct((len(sources),) + sources[0].shape, sources[0].dtype) if listed else sources
    valid = jnp.asarray(valid, bool) if isinstance(valid, jax.core.Tracer) else np.asarray(valid, bool)
    reference.check(stacked, valid, query, gain, residual)
    S, B, T, D = stacked.shape
    static = _static_mask(valid, S)
    impl = _resolve(implementation, interpret, B * T, D, sources[0].dtype if listed else sources.dtype,
                    S=S, bias=static is None)
    if impl == MOSAIC_GPU and listed:
        return _route_separate(sources, valid, static, query, gain, residual, interpret, eps, pass_sources)
    if listed:
        sources = jnp.stack(sources)
    if impl == "xla":
        out = reference.depth_route(sources, valid, query, gain, residual, eps=eps)
    else:
        valid_S, bias_SN = _masks(valid, S, B, T)
        q_D = query.astype(jnp.float32) * gain.astype(jnp.float32)
        res_ND = None if residual is None else residual.reshape(B * T, D)
        args = [sources.reshape(S, B * T, D), valid_S, bias_SN, q_D, res_ND]
        args = vary_like(args, frozenset().union(*(varying_axes(x) for x in args if x is not None)))
        cfg = (impl, float(eps), interpret, None if residual is None else jnp.dtype(residual.dtype).name)
        out = _route(cfg, *args).reshape(B, T, D)
    return (out, tuple(sources)) if pass_sources else out


# ----------------------------------------------------------------------------- separate sources (Mosaic GPU)

def _route_separate(sources, valid, static, query, gain, residual, interpret, eps, pass_sources):
    """The Mosaic GPU kernel over separate sources: those a static mask leaves out are not operands (and
    are passed through untouched), a traced or per-token mask is a bias over all of them."""
    S, (B, T, D) = len(sources), sources[0].shape
    keep = list(range(S)) if static is None else [s for s in range(S) if static[s]]
    if not keep:
        raise ValueError("valid masks every source: depth routing needs at least one")
    bias_SN = None
    if static is None:
        v_SN = jnp.broadcast_to(reference.valid_mask(valid, S), (S, B, T)).reshape(S, B * T)
        bias_SN = jnp.where(v_SN, 0.0, -jnp.inf).astype(jnp.float32)
    q_D = query.astype(jnp.float32) * gain.astype(jnp.float32)
    res_ND = None if residual is None else residual.reshape(B * T, D)
    srcs = tuple(sources[s].reshape(B * T, D) for s in keep)
    axes = frozenset().union(*(varying_axes(x) for x in (*srcs, bias_SN, q_D, res_ND) if x is not None))
    srcs = tuple(vary_like(list(srcs), axes))
    bias_SN, q_D, res_ND = vary_like([bias_SN, q_D, res_ND], axes)
    cfg = (float(eps), interpret, None if residual is None else jnp.dtype(residual.dtype).name)
    out_ND, passed = _route_mgpu(cfg, srcs, bias_SN, q_D, res_ND)
    if not pass_sources:
        return out_ND.reshape(B, T, D)
    through = list(sources)
    for s, p in zip(keep, passed):
        through[s] = p.reshape(B, T, D)
    return out_ND.reshape(B, T, D), tuple(through)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route_mgpu(cfg, srcs, bias_SN, q_D, res_ND):
    eps, interpret, _ = cfg
    from kernels_pallas.depth_route import pallas_mosaic_gpu as mgpu

    out_ND, _ = mgpu.route_forward(srcs, bias_SN, q_D, res_ND, eps=eps, interpret=interpret)
    return out_ND, srcs


def _route_mgpu_fwd(cfg, srcs, bias_SN, q_D, res_ND):
    """With symbolic zeros: each argument comes as a CustomVJPPrimal (value, perturbed)."""
    eps, interpret, _ = cfg
    from kernels_pallas.depth_route import pallas_mosaic_gpu as mgpu

    srcs = tuple(s.value for s in srcs)
    bias_SN, q_D = bias_SN.value if bias_SN is not None else None, q_D.value
    res_ND = res_ND.value if res_ND is not None else None
    out_ND, lse_N = mgpu.route_forward(srcs, bias_SN, q_D, res_ND, eps=eps, interpret=interpret)
    return (out_ND, srcs), (srcs, bias_SN, q_D, lse_N)


def _route_mgpu_bwd(cfg, saved, cotangents):
    """The passed sources' cotangents (zero where a source is not routed again) are the buffers the
    kernel adds each source's gradient into, in place."""
    eps, interpret, res_dtype = cfg
    from kernels_pallas.depth_route import pallas_mosaic_gpu as mgpu

    srcs, bias_SN, q_D, lse_N = saved
    dout_ND, d_passed = cotangents
    if isinstance(dout_ND, SymbolicZero):
        dout_ND = jnp.zeros(srcs[0].shape, srcs[0].dtype)
    acc = tuple(None if isinstance(d, SymbolicZero) else d for d in d_passed)
    ds, dq_D = mgpu.route_backward(srcs, bias_SN, q_D, lse_N, dout_ND.astype(srcs[0].dtype), acc, eps=eps,
                                   interpret=interpret)
    dres_ND = None if res_dtype is None else dout_ND.astype(res_dtype)
    axes = frozenset().union(*(varying_axes(x) for x in (*srcs, q_D)))  # a cotangent varies as its primal
    *ds, dq_D, dres_ND = vary_like([*ds, dq_D, dres_ND], axes)
    return tuple(ds), None, dq_D, dres_ND


_route_mgpu.defvjp(_route_mgpu_fwd, _route_mgpu_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- phase one: K queries, one read

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefix(cfg, src_SND, valid_S, bias_SK, q_KD):
    return _prefix_fwd(cfg, src_SND, valid_S, bias_SK, q_KD)[0]


def _prefix_fwd(cfg, src_SND, valid_S, bias_SK, q_KD):
    impl, eps, interpret = cfg
    out_KND, lse_KN = _backend(impl).prefix_forward(src_SND, valid_S, bias_SK, q_KD, eps=eps, interpret=interpret)
    return (out_KND, lse_KN), (src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN)


def _prefix_grad(cfg, acc_SND, src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN, dout_KND, dlse_KN):
    """(acc + d sources, d q) of phase one: the backward kernel, accumulating into `acc_SND`."""
    impl, eps, interpret = cfg
    dout_KND = dout_KND.astype(jnp.float32)
    c_KN = jnp.sum(dout_KND * out_KND, axis=-1) - dlse_KN  # sum_s a_ks (dout_k . s) - dlse_k
    return _backend(impl).prefix_backward(src_SND, valid_S, bias_SK, q_KD, lse_KN, c_KN, dout_KND, acc_SND, eps=eps,
                                          interpret=interpret)


def _prefix_bwd(cfg, saved, cotangents):
    src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN = saved
    ds_SND, dq_KD = _prefix_grad(cfg, jnp.zeros_like(src_SND), src_SND, valid_S, bias_SK, q_KD, out_KND, lse_KN,
                                 *cotangents)
    return ds_SND, None, None, dq_KD


_prefix.defvjp(_prefix_fwd, _prefix_bwd)


def _prefix_args(sources, valid, queries, gains, implementation, interpret):
    """Checks; then (impl, kernel operands [src_SND, valid_S, bias_SK, q_KD] or None for xla)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if jnp.ndim(sources) != 4:
        raise ValueError(f"sources must be [S, B, T, D], got shape {jnp.shape(sources)}")
    S, B, T, D = sources.shape
    K = jnp.shape(queries)[0] if jnp.ndim(queries) == 2 else None
    for name, arr, want in (("queries", queries, (K, D)), ("gains", gains, (K, D)), ("valid", valid, (K, S))):
        if K is None or jnp.shape(arr) != want:
            raise ValueError(f"{name} must have shape {('K', D) if K is None else want} (K queries), "
                             f"got {jnp.shape(arr)}")
    valid = jnp.asarray(valid, bool)
    impl = _resolve(implementation, interpret, B * T, D, sources.dtype, K)
    if impl == "xla":
        return impl, None
    q_KD = queries.astype(jnp.float32) * gains.astype(jnp.float32)
    bias_SK = jnp.where(valid.T, 0.0, -jnp.inf).astype(jnp.float32)
    return impl, [sources.reshape(S, B * T, D), valid.any(axis=0).astype(jnp.int32), bias_SK, q_KD]


def route_prefix(sources, valid, queries, gains, *, implementation="pallas", interpret=False, eps=NORM_EPS):
    """Phase one of two-phase routing: K queries `queries`, `gains` [K, D] over `sources`
    [S, B, T, D] in one read, query k over the sources of `valid` [K, S] (at least one each).
    Returns (out [K, B, T, D], lse [K, B, T]), float32: each query's routing and the log-sum-exp
    of its logits, what deltares' routing merges with a sublayer's other sources (the oracle is
    `reference.route_prefix`, the "xla" implementation). Differentiable in sources,
    queries and gains; the backward is one more read of the valid sources (writes ds once)."""
    impl, args = _prefix_args(sources, valid, queries, gains, implementation, interpret)
    if args is None:
        return reference.route_prefix(sources, valid, queries, gains, eps=eps)
    K, (S, B, T, D) = queries.shape[0], sources.shape
    args = vary_like(args, frozenset().union(*(varying_axes(x) for x in args)))
    out_KND, lse_KN = _prefix((impl, float(eps), interpret), *args)
    return out_KND.reshape(K, B, T, D), lse_KN.reshape(K, B, T)


def route_prefix_grad_into(d_sources, sources, valid, queries, gains, out, lse, d_out, d_lse, *,
                           implementation="pallas", interpret=False, eps=NORM_EPS):
    """`route_prefix`'s VJP with the sources' cotangent added into `d_sources` [S, B, T, D]: given the
    forward's (out, lse) and their cotangents, returns (d_sources + d sources, d queries, d gains).
    The kernels write `d_sources` in place (an aliased output), touching only slots some query reads,
    so a training step needs no second buffer-sized cotangent (what the custom VJP of `route_prefix`
    must return); "xla" adds `jax.vjp`'s result."""
    impl, args = _prefix_args(sources, valid, queries, gains, implementation, interpret)
    if args is None:
        _, vjp = jax.vjp(lambda s, q, g: reference.route_prefix(s, valid, q, g, eps=eps), sources, queries, gains)
        ds, dq, dg = vjp((d_out.astype(jnp.float32), d_lse.astype(jnp.float32)))
        return d_sources + ds.astype(d_sources.dtype), dq, dg
    K, (S, B, T, D) = queries.shape[0], sources.shape
    ops = [d_sources.reshape(S, B * T, D), *args, out.reshape(K, B * T, D).astype(jnp.float32),
           lse.reshape(K, B * T).astype(jnp.float32), d_out.reshape(K, B * T, D), d_lse.reshape(K, B * T)]
    ops = vary_like(ops, frozenset().union(*(varying_axes(x) for x in ops)))
    acc, src, valid_S, bias_SK, q_KD = ops[:5]
    ds_SND, dq_KD = _prefix_grad((impl, float(eps), interpret), acc, src, valid_S, bias_SK, q_KD, *ops[5:])
    gains32, queries32 = gains.astype(jnp.float32), queries.astype(jnp.float32)
    return (ds_SND.reshape(S, B, T, D).astype(d_sources.dtype), (dq_KD * gains32).astype(queries.dtype),
            (dq_KD * queries32).astype(gains.dtype))
