"""The TPU compiler's estimate of a train step's time, from compiles of shallow unrolled models.

`compiled.cost_analysis()` of a TPU compile (a dict in jax 0.10) holds `optimal_seconds`, the
compiler's own estimate of the program's run time on one device, beside `flops` and
`bytes accessed` (per device). It is the compiler's cost model, NOT a measurement: no TPU
runs anything, and the figure knows nothing of host input, launch overheads, or how well
the real chip overlaps what the model assumes it overlaps. Use it to compare programs
(residual modes against baseline), not as a promise of wall-clock time.

The cost analysis counts the body of a loop once, whatever its trip count, so:

- every layer scan must be unrolled (`config.model.scan_unroll=True`: nn.scan and the two
  scans of the store-once depth pass); unrolled, the layers' remat forbids the compiler to merge
  the recomputed forward with the forward (`prevent_cse`), which inside the loop of the real
  program it cannot do anyway;
- the chunked loss (`config.model.loss_chunk`, a `lax.map` over chunks of the sequence,
  forward and backward) is a loop that stays: its body is measured by one more compile with
  half the chunk (the body's cost is linear in the chunk's tokens: b(c) = 2 (t(c) - t(c/2)))
  and the missing G - 1 bodies are added (`loss_loop`; it does not depend on depth or mode);
- `train.micro_batches` > 1 is a loop around the whole gradient: not corrected (refused).

Unrolling a deep model makes compiles slow (36 unrolled layers take many minutes on a few
cores), so the step is compiled at a few small depths, all else equal, and extrapolated.
Baseline's cost is linear in depth: through two depths, t(L) = t(a) + (L - a)(t(b) - t(a))/(b - a)
(`extrapolate`). A routed mode's per-layer cost grows with the slots its routers read (and whose
cotangents its backward pass updates): the store-once scan runs in segments whose routers read
the slots written before the segment's end (`ResidualPlan.segments`), so the cost is fitted as
t = c0 + c1 L + c2 R, R the slots read summed over the layers (`slot_reads`), through three
compiles (`extrapolate_reads`) and evaluated at the model's L and R. Block modes are compiled
with a small block size (`compile_plan`) so that the slot count varies across the compiles as it
does with depth.

Two-phase grouped routing (`deltares.nn.residual.two_phase`, opt-in) reads the whole buffer
once per group of G layers (R = L x n_slots) and, per sublayer, only the slots written inside
its group (cost in L x G): at a fixed G the same form. For G > 1 the compiles are at G, 2G and
3G layers (blocks kept) so that each has the model's groups (`default_layers`).

`estimate_step_time(..., full=True)` compiles the whole unrolled model instead: the check of
the extrapolation. A model whose layers are unrolled anyway (`config.model.scan_layers=False`) is
compiled whole by default: its program is the full unroll, and its cost need not be extrapolated
(at s220m baseline's line through 2 and 4 layers is 2.7% above it).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from deltares.nn.config import BLOCK_MODES

CAVEAT = ("the TPU compiler's cost model (cost_analysis optimal_seconds), not a measurement; "
          "for comparing programs, not a wall-clock promise")
FIGURES = ("seconds", "flops", "bytes_accessed")  # per device, as the compiler counts them
_COST_KEYS = {"seconds": "optimal_seconds", "flops": "flops", "bytes_accessed": "bytes accessed"}


def extrapolate(points: Mapping[int, float], n_layers: int) -> float:
    """The value at `n_layers` of the polynomial through `points` ({layers: value}, degree
    len(points) - 1): two points give t(a) + (L - a) (t(b) - t(a)) / (b - a), three the parabola."""
    xs = sorted(points)
    if len(xs) < 2:
        raise ValueError(f"extrapolate needs at least two layer counts, got {xs}")
    total = 0.0
    for i, xi in enumerate(xs):  # Lagrange form
        weight = 1.0
        for j, xj in enumerate(xs):
            if j != i:
                weight *= (n_layers - xj) / (xi - xj)
        total += weight * points[xi]
    return total


def extrapolate_reads(points: Mapping[tuple[int, int], float], n_layers: int, reads: int) -> float:
    """The cost of a routed model of `n_layers` layers whose routers read `reads` slots in all
    (`slot_reads`) from compiles at other (layers, reads) `points`, under t = c0 + c1 L + c2 R:
    every layer does the same work plus work in proportion to the slots its routers read (and
    whose cotangents its backward pass updates). Three points: solved exactly; more: least
    squares; two: the line in L (R ignored)."""
    import numpy as np

    keys = sorted(points)
    if len(keys) < 2 or len({L for L, _ in keys}) < 2:
        raise ValueError(f"extrapolate_reads needs at least two layer counts, got {keys}")
    if len(keys) == 2:
        return extrapolate({L: points[(L, R)] for L, R in keys}, n_layers)
    design = np.array([[1.0, L, R] for L, R in keys])
    coef, *_ = np.linalg.lstsq(design, np.array([points[k] for k in keys]), rcond=None)
    return float(coef @ np.array([1.0, n_layers, reads]))


def slot_reads(plan, grouped: bool = False, unrolled: bool = False) -> float:
    """Slots a routed model's routers read, summed over its layers: each layer of a store-once
    scan segment reads the segment's `n_read` slots (`ResidualPlan.segments`); with two-phase
    routing (`grouped`) every group reads all n_slots; unrolled layers (`scan_layers=False`, the
    sources held apart) read each router's own, up to its last (a layer counts the mean of its two
    sublayers), and with two-phase routing each group's phase one its stacked prefix once plus each
    sublayer its own intra-group slots; 0 in baseline."""
    if not plan.uses_sources:
        return 0
    if unrolled and grouped:
        G = plan.group_layers
        prefix = sum(plan.group_prefix_read(f, min(G, plan.n_layers - f)).shape[1] for f in range(0, plan.n_layers, G))
        return prefix + float(plan.intra_read.sum()) / 2
    if unrolled:
        last_J = plan.read.shape[1] - plan.read[:, ::-1].argmax(axis=1)
        return float(last_J.sum()) / 2
    if grouped:
        return plan.n_layers * plan.n_slots
    return sum(seg.n_units * seg.n_read for seg in plan.segments)


def _model_slot_reads(model_cfg, plan) -> float:
    """`slot_reads` of `plan` as `model_cfg` runs it (two-phase groups, unrolled layers)."""
    from deltares.nn.residual import two_phase

    return slot_reads(plan, two_phase(model_cfg), not model_cfg.scan_layers)


def default_layers(model_cfg) -> tuple[int, ...]:
    """Depths to compile: (2, 4) in baseline (its cost is linear in depth); (2, 4, 6) in the
    routed modes, whose per-layer cost grows with the slots its routers read (`extrapolate_reads`); with
    two-phase routing over groups of G > 1 layers the first three multiples of G (of the block in
    the block modes), so that every compile has the model's groups (and blocks)."""
    if model_cfg.residual.mode == "baseline":
        return (2, 4)
    from deltares.nn.residual import plan_for

    if _multi_layer_groups(model_cfg):
        res = model_cfg.residual
        G = res.block_layers if res.mode in BLOCK_MODES else plan_for(model_cfg).group_layers
        return (G, 2 * G, 3 * G)
    return (2, 4, 6)


def _multi_layer_groups(model_cfg) -> bool:
    """Two-phase routing over groups of more than one layer: the compiles must have the model's
    groups (and, in block modes, blocks). One-layer groups are the same at every depth and block size."""
    from deltares.nn.residual import plan_for, two_phase

    return two_phase(model_cfg) and plan_for(model_cfg).group_layers > 1


def compile_plan(model_cfg, layers: Sequence[int] | None = None) -> tuple[tuple[int, int, int], ...]:
    """(n_layers, block_layers, slot reads) of each shallow compile for `layers` (default
    `default_layers`). Block modes are compiled with block_layers = min(block_layers, smallest
    depth): kept when small (2 in s220m, so (2, 4, 6) are the deep model's own blocks), reduced
    otherwise (s1044m's 6), so that the slot count grows across the compiles as it does with
    depth; clamped to one block, 2 and 4 layers of block_layers 6 would both have 2 slots and
    say nothing of the 7 slots every router of the 36-layer model reads. With two-phase routing
    over groups of more than one layer the model's own block size is kept: the groups tile its
    blocks (`default_layers` then compiles at multiples of it)."""
    from deltares.nn.residual import make_plan

    layers = tuple(int(n) for n in (layers if layers is not None else default_layers(model_cfg)))
    if len(set(layers)) != len(layers) or min(layers) < 1:
        raise ValueError(f"layers={layers}: distinct positive layer counts")
    res = model_cfg.residual
    block_layers = res.block_layers
    if res.mode in BLOCK_MODES and not _multi_layer_groups(model_cfg):
        block_layers = min(res.block_layers, min(layers))
    out = []
    for n in sorted(layers):
        bl = min(block_layers, n)
        plan = make_plan(res.mode, n, bl, res.include_partial, max(1, res.group_layers), res.scan_segments)
        out.append((n, bl, _model_slot_reads(model_cfg, plan)))
    return tuple(out)


def n_slots_of(model_cfg) -> int:
    """Source slots of the model (0 in baseline)."""
    from deltares.nn.residual import plan_for

    plan = plan_for(model_cfg)
    return plan.n_slots if plan.uses_sources else 0


def _with(cfg, n_layers: int | None = None, loss_chunk: int | None = None, block_layers: int | None = None):
    """A copy of `cfg` with every layer scan unrolled and, if given, another depth, block size or
    loss chunk; block_layers is clamped to the depth (validate_model_config's rule)."""
    out = copy.deepcopy(cfg)
    out.model.scan_unroll = True
    if block_layers is not None:
        out.model.residual.block_layers = block_layers
    if n_layers is not None:
        out.model.n_layers = n_layers
        out.model.residual.block_layers = min(out.model.residual.block_layers, n_layers)
    if loss_chunk is not None:
        out.model.loss_chunk = loss_chunk
    return out


def _loss_chunks(cfg) -> tuple[int, int]:
    """(chunk, number of chunks) of the chunked loss; (0, 1) for the plain loss (no loop)."""
    chunk, seq_len = cfg.model.loss_chunk, cfg.data.seq_len
    if not chunk or chunk >= seq_len:
        return 0, 1
    return chunk, -(-seq_len // chunk)


def compile_costs(cfg, mesh) -> dict:
    """Compiles the train step of `cfg` (deltares.aot's: the real sharded step, state donated) for
    `mesh` and returns the compiler's per-device figures: seconds (optimal_seconds), flops,
    bytes_accessed; and compile_seconds, while_loops (loops left in the program)."""
    from deltares.training.compile_only import train_step

    step, abstract_state, batch_sharding = train_step(cfg, mesh)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), jnp.int32, sharding=batch_sharding)
    start = time.perf_counter()
    compiled = step.lower(abstract_state, batch).compile()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out = {name: float(cost.get(key, math.nan)) for name, key in _COST_KEYS.items()}
    out.update(compile_seconds=round(seconds, 1), while_loops=compiled.as_text().count(" while("))
    return out


def loss_loop_costs(cfg, mesh, costs_at_chunk: dict | None = None) -> dict | None:
    """What the cost analysis misses of the chunked loss: with G chunks of c tokens it counts
    one body b(c) of the loop, so the missing part is (G - 1) b(c), and b(c) = 2 (t(c) - t(c/2))
    from one more compile with half the chunk (`costs_at_chunk`: the compile at chunk c, if
    already had). None for the plain loss. Depth and mode do not enter the loss, so the figure
    holds for any depth of `cfg`'s model."""
    chunk, n_chunks = _loss_chunks(cfg)
    if n_chunks == 1:
        return None
    if chunk < 2:
        raise ValueError(f"config.model.loss_chunk={chunk}: too small to measure the loss loop")
    full = costs_at_chunk or compile_costs(cfg, mesh)
    half = compile_costs(_with(cfg, loss_chunk=chunk // 2), mesh)
    out = loss_loop_from(full, half, chunk, n_chunks)
    out["compile_seconds"] = half["compile_seconds"] + (0 if costs_at_chunk else full["compile_seconds"])
    return out


def loss_loop_from(at_chunk: dict, at_half_chunk: dict, chunk: int, n_chunks: int) -> dict:
    """The loss loop's figures from compiles at chunk c and c/2 (each counts one body):
    body b(c) = 2 (t(c) - t(c/2)); missing = (n_chunks - 1) b(c), to add to t(c)."""
    body = {k: 2.0 * (at_chunk[k] - at_half_chunk[k]) for k in FIGURES}
    return dict(chunk=chunk, chunks=n_chunks, body=body, missing={k: (n_chunks - 1) * v for k, v in body.items()})


def _mesh(cfg, topology: str, mesh_override: str | None):
    from deltares.training.compile_only import AotError, check_config, step_mesh, topology_devices

    check_config(cfg)
    devices = topology_devices(topology)
    mesh = step_mesh(cfg, devices, topology, mesh_override)
    if cfg.train.micro_batches != 1:
        raise AotError("the step-time estimate needs train.micro_batches=1 (the micro-batch loop is counted once)")
    return mesh, devices


def _figures_at_depth(points: dict, specs, n_layers: int, n_slots: int, reads, full: bool) -> tuple[dict, str]:
    """(the FIGURES at the model's depth, the method): the full compile's, or extrapolated from the
    shallow compiles `points` (baseline: in layers; routed modes: in layers and slot reads)."""
    if full:
        return {k: points[(n_layers, specs[0][1])][k] for k in FIGURES}, "full"
    if n_slots == 0:
        figures = {k: extrapolate({n: points[(n, bl)][k] for n, bl, _ in specs}, n_layers) for k in FIGURES}
        return figures, "linear" if len(specs) == 2 else f"polynomial degree {len(specs) - 1}"
    figures = {k: extrapolate_reads({(n, R): points[(n, bl)][k] for n, bl, R in specs}, n_layers, reads)
               for k in FIGURES}
    return figures, "linear" if len(specs) == 2 else "layers and slot reads"


def estimate_step_time(cfg, topology: str, mesh_override: str | None = None, layers: Sequence[int] | None = None,
                       full: bool = False) -> dict:
    """The TPU compiler's estimated time of one train step of `cfg` on `topology` (the mesh as
    deltares.aot builds it: `mesh_override` 'DATA,FSDP,TENSOR', else config.mesh).

    CAVEAT: the compiler's cost model (cost_analysis `optimal_seconds`), not a measurement.

    Compiles the step, every layer scan unrolled, at the shallow depths of
    `compile_plan(cfg.model, layers)` (default (2, 4) in baseline, (2, 4, 6) in the routed modes;
    block modes at a small block size) and extrapolates to the model's depth and slot count
    (`extrapolate_reads`; baseline: `extrapolate`, the line t(a) + (L - a)(t(b) - t(a))/(b - a));
    `full=True` compiles the full unrolled model instead, as does a model whose layers are unrolled
    anyway (`scan_layers=False`: the real program has no layer loop) unless `layers` is given. The missed bodies of the chunked loss
    loop are added (`loss_loop_costs`, measured at the smallest depth). Returns per device: `seconds`, `flops`, `bytes_accessed`;
    `flops_per_step` (times the devices); `points` (each compile's figures, the loss loop not
    corrected); `layers_compiled`, `block_layers_compiled`; `method`; `loss_loop`;
    `compile_seconds` (all compiles); and what was estimated (mode, depth, topology, mesh,
    batch, remat). Raises the compiler's error where a compile fails (e.g. out of HBM)."""
    mesh, devices = _mesh(cfg, topology, mesh_override)
    from deltares.nn.residual import plan_for

    full = full or (not cfg.model.scan_layers and layers is None)

    n_layers, n_slots = cfg.model.n_layers, n_slots_of(cfg.model)
    reads = _model_slot_reads(cfg.model, plan_for(cfg.model))
    shallow = compile_plan(cfg.model, layers)
    specs = ((n_layers, cfg.model.residual.block_layers, reads),) if full else shallow
    points = {(n, bl): compile_costs(_with(cfg, n_layers=n, block_layers=bl), mesh) for n, bl, _ in specs}
    if _loss_chunks(cfg)[1] == 1:
        loss = None
    else:  # measured on a shallow model: the loss does not depend on depth
        n, bl, _ = shallow[0]
        loss = loss_loop_costs(_with(cfg, n_layers=n, block_layers=bl), mesh, None if full else points[(n, bl)])
    figures, method = _figures_at_depth(points, specs, n_layers, n_slots, reads, full)
    if loss:
        figures = {k: v + loss["missing"][k] for k, v in figures.items()}
    compile_seconds = sum(p["compile_seconds"] for p in points.values())
    if loss:
        compile_seconds += loss["compile_seconds"]
    return dict(
        figures,
        flops_per_step=figures["flops"] * len(devices),
        mode=cfg.model.residual.mode,
        n_layers=n_layers,
        n_slots=n_slots,
        slot_reads=reads,
        block_layers=cfg.model.residual.block_layers,
        topology=topology,
        devices=len(devices),
        mesh={k: int(v) for k, v in mesh.shape.items()},
        global_batch=cfg.train.global_batch,
        seq_len=cfg.data.seq_len,
        remat=cfg.model.remat,
        dtype=cfg.model.dtype,
        method=method,
        layers_compiled=[n for n, _, _ in specs],
        block_layers_compiled=[bl for _, bl, _ in specs],
        points={f"{n}/{bl}": p for (n, bl), p in points.items()},
        loss_loop=loss,
        compile_seconds=round(compile_seconds, 1),
        caveat=CAVEAT,
    )
