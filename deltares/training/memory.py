"""Peak memory figures for metrics.jsonl (`peak_bytes`) and the benchmark, and the routing modes'
physical memory floor (`routing_floor_bytes`).

Where the backend keeps memory statistics (GPU, TPU) the figure is the devices'
high-water mark (`peak_bytes_in_use`, the largest over local devices; it covers
everything the process allocated so far). Elsewhere (the CPU) it is the compiled
step's footprint from XLA's `memory_analysis()`: arguments + outputs +
temporaries, less the output bytes that reuse donated argument buffers.
"""

from __future__ import annotations

import jax


def device_peak_bytes() -> int | None:
    """The largest memory high-water mark of the local devices, or None where the backend has none."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory statistics raise or return None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def compiled_bytes(compiled) -> dict | None:
    """{arguments, outputs, temporaries, aliased, code, total} bytes of a compiled executable, or None;
    total = arguments + outputs + temporaries - aliased (outputs written into donated arguments)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = dict(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes),
        temporaries=int(m.temp_size_in_bytes),
        aliased=int(m.alias_size_in_bytes),
        code=int(m.generated_code_size_in_bytes),
    )
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


class PeakMemory:
    """`peak_bytes` of a training run: the device high-water mark when available, else the compiled
    footprint of `step` (a jitted function or `MeshStep`), lowered once with the arguments of the
    first call (the executable comes from the compilation cache)."""

    def __init__(self, step):
        self.step, self.compiled = step, None

    def __call__(self, *args) -> int | None:
        peak = device_peak_bytes()
        if peak is not None:
            return peak
        if self.compiled is None:
            figures = compiled_bytes(self.step.lower(*args).compile())
            self.compiled = figures["total"] if figures else -1
        return self.compiled if self.compiled >= 0 else None


def _mesh_sizes(cfg, mesh) -> dict:
    """{data, fsdp, tensor} sizes of `mesh`: a jax Mesh, a mapping of axis sizes, or a number of
    devices (then config.mesh splits them, as deltares.training.sharding.mesh_shape does)."""
    from deltares.training.sharding import MESH_AXES, mesh_shape

    if isinstance(mesh, int):
        mesh_cfg = cfg.mesh if "mesh" in cfg and cfg.mesh is not None else dict(data=1, fsdp=-1, tensor=1)
        return dict(zip(MESH_AXES, mesh_shape(mesh_cfg, mesh)))
    shape = mesh.shape if hasattr(mesh, "axis_names") else mesh
    return {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}


def routing_floor_bytes(cfg, mesh, *, cotangent_dtype=None, modes=None) -> dict:
    """The physical floor of each residual mode's extra memory: the bytes per device a training
    step of `cfg` must hold beyond baseline, whatever the implementation. {mode: figures}.

    A routed mode's sources must survive to the backward pass: every slot of the source buffer
    that a later sublayer (or the Kimi modes' output routing) reads, each [B, T, D] in the compute
    dtype (`config.model.dtype`; the buffer has the embedding's dtype), `live_slots` of the
    ResidualPlan's `n_slots` (delta: 2L of 2L + 1, the last delta is read by nobody; block
    modes: all n_blocks + 1 with include_partial). The backward pass needs one cotangent buffer
    of the same shape: `cotangent_dtype` (default the compute dtype, where the depth pass is
    moving its cotangents; `total_bytes_float32_cotangent` is the figure with float32 ones).
    Baseline keeps no sources: 0. Slot 0 (the embedding) is counted: the buffer keeps its own copy.
    Left out as small: the cached float32 1/rms per slot ([S, B, T], 2/D of the buffer in bf16).

    Per device: B is one micro-batch (global_batch / micro_batches) split over the mesh's
    data x fsdp axes (logical `batch`, the largest shard where uneven), T is whole, D is split
    over `tensor` where it divides D (logical `act_embed`; deltares.training.sharding).
    `mesh`: a jax Mesh, a mapping {data, fsdp, tensor}, or a number of devices (config.mesh).
    `modes`: the modes to report (default all five), each on `cfg`'s model with only the mode
    changed (block_layers and include_partial as configured, block_layers at most n_layers)."""
    import numpy as np

    from deltares.nn.config import MODES, dtype_of
    from deltares.nn.residual import make_plan

    model = cfg.model
    sizes = _mesh_sizes(cfg, mesh)
    rows = cfg.train.global_batch // cfg.train.micro_batches
    rows_per_device = -(-rows // (sizes["data"] * sizes["fsdp"]))
    d_per_device = model.d_model // sizes["tensor"] if model.d_model % sizes["tensor"] == 0 else model.d_model
    tokens = rows_per_device * cfg.data.seq_len
    compute = np.dtype(dtype_of(model.dtype))
    cotangent = np.dtype(cotangent_dtype if cotangent_dtype is not None else compute)
    res = model.residual
    out = {}
    for mode in modes or MODES:
        plan = make_plan(mode, model.n_layers, min(res.block_layers, model.n_layers), res.include_partial)
        live = int((plan.read.any(axis=0) | plan.final_read).sum()) if plan.uses_sources else 0
        slot_elements = tokens * d_per_device
        sources = live * slot_elements * compute.itemsize
        cot = live * slot_elements * cotangent.itemsize
        cot32 = live * slot_elements * 4
        out[mode] = dict(
            n_slots=int(plan.n_slots) if plan.uses_sources else 0,
            live_slots=live,
            slot_shape_per_device=(rows_per_device, cfg.data.seq_len, d_per_device),
            sources_bytes=sources,
            cotangent_bytes=cot,
            total_bytes=sources + cot,
            total_bytes_float32_cotangent=sources + cot32,
            dtype=compute.name,
            cotangent_dtype=cotangent.name,
            mesh=sizes,
        )
    return out
