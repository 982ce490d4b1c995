"""Depth state (stream, source buffer, cached 1/rms), its per-sublayer read and write, and the
depth pass with a store-once source buffer for the backward pass.

Reverse-mode AD of a scan saves the carry at every step, so a source buffer
carried through L layers is stored L times: O(L x S x B x T x D) memory, quadratic
in depth (docs/explanations/store-once.md). Every slot is written once for good
(per-sublayer modes: a delta; block modes: a completed block's sum, the running
partial being the stream minus the stream at the block's start, read from the
stream and never stored for the backward pass), so the final buffer holds every
source value any sublayer read. `depth_scan` therefore saves per layer at most what
baseline's remat saves, the layer's input stream h (block modes; the per-sublayer modes
recompute it from the final buffer's deltas, `_stream_checkpoints`), and its backward pass
walks the sublayers in reverse, each differentiated alone as (params, h, final buffer) ->
delta: a recomputation never writes, and so never copies, the buffer. Memory beyond
baseline: the final buffer and one cotangent buffer, updated in place.

Both passes run as one scan per segment of layers (`ResidualPlan.segments`; one segment by
default): a router reads, and its VJP updates the cotangent of, only the slots its segment can
have written (a static prefix of the buffer), not all S.

Given the routers' queries (`depth_scan(queries_fn=)`), the scan routes two-phase over
groups of layers (docs/explanations/store-once.md; `_grouped_forward`, `_grouped_backward`): the
slots completed before a group are routed for all its sublayers in one pass (`Prefix`),
and each sublayer merges that with the sources written inside its group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from deltares.nn import mixing, routing
from deltares.nn.axes import SOURCES_AXES, STREAM_AXES, constrain
from deltares.nn.config import BLOCK_MODES, HYPER_MODES
from deltares.nn.layers import PassedSources
from deltares.nn.residual import ResidualPlan, Segment, row
from kernels_pallas.depth_route.api import implementation_for



class Prefix(NamedTuple):
    """Two-phase routing: one sublayer's routing over the slots completed before its group
    (`routing.route_prefix`: out, lse) and, in the per-sublayer modes, the group's window of
    slots as the backward pass reads them (None: read from the state)."""

    out_BTD: jax.Array
    lse_BT: jax.Array
    window_SBTD: jax.Array | None = None
    window_inv_SBT: jax.Array | None = None


class DepthState(NamedTuple):
    h_BTD: jax.Array  # additive stream e + sum of deltas so far
    sources_SBTD: jax.Array | tuple | None  # source buffer [S, B, T, D], or the slots so far (None in baseline)
    inv_rms_SBT: jax.Array | tuple | None  # float32 1/rms of every slot
    h_block_BTD: jax.Array | None = None  # block modes: the stream where the running block began
    segment: Segment | None = None  # a store-once scan's segment: routers read its first n_read slots only
    streams_RBTD: jax.Array | None = None  # hyper, mhc: the R parallel streams (then h_BTD is None)


def init_depth_state(e_BTD, plan: ResidualPlan, eps: float = routing.NORM_EPS, listed: bool = False) -> DepthState:
    """Stream = e; slot 0 of the buffer holds e, all other slots are zero. `listed` (unrolled
    layers, sublayer indices known when tracing): the sources are a tuple of the slots written so
    far, so a write appends or replaces one array and never copies a buffer. `hyper`, `mhc`: R streams
    holding e; `denseformer`: the stream e and the layer outputs' buffer with X_0 = e."""
    if plan.mode in HYPER_MODES:
        return DepthState(None, None, None, streams_RBTD=mixing.expand_streams(e_BTD, plan.n_slots))
    if plan.mode == "denseformer":
        if listed:
            return DepthState(e_BTD, (e_BTD,), None)
        sources = jnp.broadcast_to(jnp.zeros_like(e_BTD)[None], (plan.n_slots,) + e_BTD.shape).at[0].set(e_BTD)
        return DepthState(e_BTD, constrain(sources, SOURCES_AXES), None)
    if not plan.uses_sources:
        return DepthState(e_BTD, None, None)
    h_block = e_BTD if plan.mode in BLOCK_MODES else None
    if listed:
        return DepthState(e_BTD, (e_BTD,), (routing.inv_rms(e_BTD, eps),), h_block)
    # zeros made from e itself carry its sharding, so the buffer follows an explicitly sharded e (jax's
    # default mesh axes) where a fresh, replicated jnp.zeros would refuse the write of e
    inv_BT = routing.inv_rms(e_BTD, eps)
    sources = jnp.broadcast_to(jnp.zeros_like(e_BTD)[None], (plan.n_slots,) + e_BTD.shape).at[0].set(e_BTD)
    sources = constrain(sources, SOURCES_AXES)
    inv = jnp.broadcast_to(jnp.zeros_like(inv_BT)[None], (plan.n_slots,) + inv_BT.shape).at[0].set(inv_BT)
    return DepthState(e_BTD, sources, inv, h_block)


def _check_listed(state: DepthState, j) -> bool:
    """Whether the state's sources are a tuple (`init_depth_state(listed=True)`), which only a
    sublayer index known when tracing (an int) can address."""
    listed = isinstance(state.sources_SBTD, tuple)
    if listed and not isinstance(j, int):
        raise TypeError(f"sources held as a tuple (unrolled layers) need a Python int sublayer index, got {j!r}")
    return listed


def _block_partial(state: DepthState, dtype, eps: float):
    """The running block's partial p = h - h_block (block modes) in `dtype`, and its 1/rms."""
    p_BTD = (state.h_BTD.astype(jnp.float32) - state.h_block_BTD.astype(jnp.float32)).astype(dtype)
    return p_BTD, routing.inv_rms(p_BTD, eps)


def routing_sources(plan: ResidualPlan, state: DepthState, j, eps: float = routing.NORM_EPS, final: bool = False):
    """The buffer and 1/rms sublayer j routes over: the state's (within a `segment`, its first
    n_read slots). With `final` (the state holds the final buffer: a backward pass), block modes'
    partial slot (j's write slot, where the final buffer holds the completed block) is read from
    the stream instead, h - h_block: the value `add_delta` wrote there, by the same arithmetic."""
    sources, inv = state.sources_SBTD, state.inv_rms_SBT
    seg = state.segment
    if seg is not None:
        sources, inv = sources[: seg.n_read], inv[: seg.n_read]
    if plan.mode not in BLOCK_MODES or not final:
        return sources, inv
    p_BTD, p_inv_BT = _block_partial(state, sources.dtype, eps)
    if seg is not None and seg.write is not None:  # one block: its partial's slot is known
        if seg.write >= seg.n_read:  # not read (include_partial off)
            return sources, inv
        w = seg.write
        return (jnp.concatenate([sources[:w], p_BTD[None], sources[w + 1:]]),
                jnp.concatenate([inv[:w], p_inv_BT[None], inv[w + 1:]]))
    is_slot = jnp.arange(sources.shape[0]) == row(plan.write, j, seg)
    return (jnp.where(is_slot[:, None, None, None], p_BTD[None], sources),
            jnp.where(is_slot[:, None, None], p_inv_BT[None], inv))


def select(flag, a, b):
    """jnp.where(flag, a, b), decided when tracing where the flag is known (`row`)."""
    if isinstance(flag, (bool, np.bool_)):
        return a if flag else b
    return jnp.where(flag, a, b)


def _window_start(plan: ResidualPlan, j):
    """Per-sublayer modes: the first slot written inside sublayer j's group."""
    P = plan.unit_size
    return (j // (P * plan.group_layers)) * P * plan.group_layers + 1


def group_window(plan: ResidualPlan, state: DepthState, first_unit):
    """Per-sublayer modes: the P G - 1 slots a group of G units of P sublayers starting at `first_unit`
    writes and reads inside itself (the last delta of a group is read by later groups only), and
    their 1/rms."""
    P = plan.unit_size
    start, size = P * first_unit + 1, P * plan.group_layers - 1
    return (jax.lax.dynamic_slice_in_dim(state.sources_SBTD, start, size),
            jax.lax.dynamic_slice_in_dim(state.inv_rms_SBT, start, size))


def _intra_sources(plan: ResidualPlan, state: DepthState, j, prefix: Prefix, eps: float):
    """Sublayer j's sources written inside its group (two-phase routing): (sources, 1/rms, valid).
    Listed sources (unrolled layers): the slots themselves, or where j reads none (it opens its
    group or block) the stream as one invalid source, which the merge's softmax weighs 0. Scanned,
    block modes: the partial, read from the stream; per-sublayer modes: the group's window (from
    `prefix`, else the state), valid up to j's own slot."""
    if _check_listed(state, j):
        slots = plan.intra_read[j].nonzero()[0]
        if not len(slots):
            return (state.h_BTD,), (jnp.ones_like(state.inv_rms_SBT[0]),), np.zeros(1, bool)
        return (tuple(state.sources_SBTD[s] for s in slots), tuple(state.inv_rms_SBT[s] for s in slots),
                np.ones(len(slots), bool))
    if plan.mode in BLOCK_MODES:
        p_BTD, p_inv_BT = _block_partial(state, state.sources_SBTD.dtype, eps)
        return p_BTD[None], p_inv_BT[None], jnp.asarray(plan.intra_read.any(axis=1))[j][None]
    window, window_inv = prefix.window_SBTD, prefix.window_inv_SBT
    if window is None:
        start = _window_start(plan, j)  # its group's first unit: (start - 1) / P
        window, window_inv = group_window(plan, state, start // plan.unit_size if plan.unit_size > 1 else start - 1)
    if not window.shape[0]:  # groups of one one-sublayer unit: nothing written inside the group
        return state.h_BTD[None], jnp.ones_like(state.inv_rms_SBT[:1]), jnp.zeros(1, bool)
    return window, window_inv, jnp.arange(window.shape[0]) < j + 1 - _window_start(plan, j)


def sublayer_input(plan: ResidualPlan, state: DepthState, j, router, null_source: bool = False,
                   eps: float = routing.NORM_EPS, final: bool = False, prefix: Prefix | None = None):
    """Sublayer j's input x_j (docs/explanations/modes.md) and its routing: returns (x_BTD, weights_SBT or
    None, routed, state). The state is `state`, or where a kernel passed listed sources through
    (`deltares.nn.layers.PassedSources`) the state holding those, for later sublayers to route over. `router(sources, inv_rms, valid, residual) -> (out, weights)` is a DepthRouter
    (linen or NNX) or `apply_router` on parameters; `j` may be traced (a scanned layer).

        x_j = h_j                  baseline, or an additive sublayer with a single source
        x_j = route(S_j)           replacement modes (Kimi)
        x_j = h_j + route(S_j)     additive modes (Delta)

    A null source is one more source: with it every sublayer routes. `eps` is the norm's epsilon
    of the cached 1/rms; `final`: the state holds the final buffer (`routing_sources`).
    `prefix` (two-phase routing): the routing over the slots before j's group,
    merged with j's intra-group sources; the weights then cover those sources only."""
    if not plan.uses_sources:
        return state.h_BTD, None, jnp.asarray(False), state
    routed = row(plan.routed | null_source, j, state.segment)
    residual = None if plan.replaces_stream else state.h_BTD
    if prefix is not None:
        sources, inv, valid = _intra_sources(plan, state, j, prefix, eps)
        x_BTD, weights_SBT = router(sources, inv, valid, residual, prefix=(prefix.out_BTD, prefix.lse_BT))
        return (_saveable((x_BTD if residual is None else jnp.where(routed, x_BTD, state.h_BTD)), routed), weights_SBT,
                routed, state)
    sources, inv = routing_sources(plan, state, j, eps, final)
    if isinstance(j, int):  # unrolled (listed or not): only the slots up to the last one j reads
        n = int(plan.read[j].nonzero()[0].max()) + 1
        x_BTD, weights_SBT = router(sources[:n], inv[:n], plan.read[j][:n], residual)
        if isinstance(weights_SBT, PassedSources):  # later sublayers route over what the kernel passed through
            state = state._replace(sources_SBTD=tuple(weights_SBT) + tuple(state.sources_SBTD[n:]))
            weights_SBT = None
    else:
        n = sources.shape[0]  # within a segment, its first n_read slots
        x_BTD, weights_SBT = router(sources, inv, row(plan.read, j, state.segment)[:n], residual)
    if weights_SBT is not None and n < plan.n_slots:  # statistics cover every slot
        weights_SBT = jnp.pad(weights_SBT, ((0, plan.n_slots - n), (0, 0), (0, 0)))
    if residual is not None:  # single source: no routing, x = h
        x_BTD = select(routed, x_BTD, state.h_BTD)
    return x_BTD, weights_SBT, routed, state


ROUTED_INPUT = "routed_input"  # the name remat policies save a two-phase sublayer input by (config.REMAT_POLICIES)


def _saveable(x_BTD, routed):
    """A two-phase sublayer input named ROUTED_INPUT, so that remat `dots` keeps it: its backward pass
    then recomputes the sublayer from x instead of merging again over its group-mates' sources. (One
    pass per sublayer reads few sources where it is the default, the block modes: keeping their inputs
    cost memory and a little time by the TPU estimate.)"""
    if isinstance(routed, (bool, np.bool_)) and not routed:
        return x_BTD
    return checkpoint_name(x_BTD, ROUTED_INPUT)


def add_delta(plan: ResidualPlan, state: DepthState, j, v_BTD, eps: float = routing.NORM_EPS) -> DepthState:
    """h_{j+1} = h_j + v_j, and sublayer j's write slot: v_j (per-sublayer modes), or the block's
    sum so far h_{j+1} - h_block (block modes; h_block = h_j where j opens the block), with its 1/rms."""
    h_BTD = constrain(state.h_BTD + v_BTD, STREAM_AXES)
    if not plan.uses_sources:
        return DepthState(h_BTD, None, None)
    listed = _check_listed(state, j)
    dtype = state.sources_SBTD[0].dtype
    h_block = None
    if plan.mode in BLOCK_MODES:
        if listed:  # j is known
            h_block = state.h_BTD if plan.opens_block[j] else state.h_block_BTD
        else:
            h_block = select(row(plan.opens_block, j, state.segment), state.h_BTD, state.h_block_BTD)
        slot_BTD, slot_inv_BT = _block_partial(DepthState(h_BTD, None, None, h_block), dtype, eps)
    else:
        slot_BTD = v_BTD.astype(dtype)
        slot_inv_BT = routing.inv_rms(slot_BTD, eps)
    if listed:  # a new slot is appended, a block's running slot (the last) replaced
        keep = int(plan.write[j])
        sources = state.sources_SBTD[:keep] + (constrain(slot_BTD, STREAM_AXES),)
        return DepthState(h_BTD, sources, state.inv_rms_SBT[:keep] + (slot_inv_BT,), h_block)
    slot = row(plan.write, j, state.segment)
    sources = constrain(state.sources_SBTD.at[slot].set(slot_BTD), SOURCES_AXES)
    inv = state.inv_rms_SBT.at[slot].set(slot_inv_BT)
    return DepthState(h_BTD, sources, inv, h_block, state.segment)


def stack_output(plan: ResidualPlan, state: DepthState, final_router=None):
    """The stack's output before the final norm: the Kimi modes route over every source with
    `final_router` (own parameters), `hyper` and `mhc` sum their streams, the others return the stream h_2L."""
    if plan.mode in HYPER_MODES:
        return mixing.reduce_streams(state.streams_RBTD)
    if not plan.replaces_stream:
        return state.h_BTD
    if final_router is None:
        raise ValueError(f"mode {plan.mode!r} routes its output: pass a final router")
    out_BTD, _ = final_router(state.sources_SBTD, state.inv_rms_SBT, jnp.asarray(plan.final_read))
    return out_BTD


class Outputs(NamedTuple):
    """What a unit returns beside its depth state (`depth_scan`'s `layer_fn`), when some of it is
    differentiated: `sublayers`, one pytree (or None) per sublayer of the unit, whose cotangent reaches
    that sublayer's parameters and inputs (an auxiliary loss, a returned value the loss reads), and
    `rest`, anything else (statistics, written collections), which carries no gradient."""

    sublayers: tuple
    rest: Any = None


def depth_scan(layer_fn: Callable, params_L: Any, state: DepthState, plan: ResidualPlan, unroll: bool = False,
               eps: float = routing.NORM_EPS, queries_fn: Callable | None = None, impl: str = "xla",
               interpret: bool = False, consts: Any = None, tail_params: Any = None):
    """Runs `layer_fn(params_u, state, u) -> (state, out_u)` over the plan's units (`ResidualPlan`:
    one layer each, or one repeat of a layer pattern): the `plan.n_units` whole units whose
    parameters `params_L` are stacked on a leading axis, scanned, then, where the plan has a
    remainder (`plan.tail_size`), the remainder unit on `tail_params`, called with u = n_units (a
    Python int). Returns (final state, the units' outs stacked), with a remainder (final state,
    (the whole units' outs stacked, the remainder's out)). Differentiable in the parameters and
    the state; an out is not (statistics), except the `sublayers` of an `Outputs`.

    The backward pass (`_sublayer_backward`) differentiates sublayer by sublayer over the final
    buffer with `layer_fn(params_u, state, u, only=k) -> (v, 1/rms(v))` (sublayer k of unit u
    alone on a state holding the final buffer, `sublayer_input(..., final=True)`, writing nothing),
    or, where the unit's out is an `Outputs` whose entry k is not None, (v, 1/rms(v), that entry).
    Per unit, the forward pass saves its input stream in the block modes (and its block's start
    where a block may open inside a unit), nothing in the others. `unroll` unrolls both scans (the
    same program without loops); `eps` is the 1/rms epsilon.

    With `queries_fn(params_u) -> (query [P, D], gain [P, D])` (the unit's P routers), routing
    is two-phase over groups of `plan.group_layers` units (`_grouped_forward`): `layer_fn` is then
    also called with `prefix=` a `Prefix` of the unit's sublayers (leading axis P); the remainder
    unit routes one pass per sublayer. Phase one routes with `impl` (`layers.route_prefix`: xla
    or the fused K-query kernel, `interpret` for tests).

    `consts` (a pytree, or None): values every unit reads but that are not differentiated (rng
    keys, a cache, batch statistics), passed to `layer_fn` as `consts=` in both passes. They must
    come in here rather than in `layer_fn`'s closure: a closure over a value traced by an outer
    transformation (NNX's gradient passes a module's whole state) would leak it into the backward."""
    group_prefix = prefix_grad = None
    outer_layer_fn = layer_fn
    tail = plan.segments[-1] if plan.tail_size else None
    main_segments = plan.segments[:-1] if tail is not None else plan.segments

    def bind(consts):
        return outer_layer_fn if consts is None else functools.partial(outer_layer_fn, consts=consts)
    rules = tuple(nn.get_logical_axis_rules())  # the backward pass is traced later, maybe outside this context
    if queries_fn is not None:
        impl = implementation_for(impl, phase_one=True)  # "auto": XLA for phase one
        group_prefix = functools.partial(_group_prefix, queries_fn, impl=impl, interpret=interpret, eps=eps)
        if impl != "xla":  # the kernel adds phase one's source cotangent into the buffer's, in place
            prefix_grad = functools.partial(_group_prefix_grad_into, queries_fn, impl=impl, interpret=interpret,
                                            eps=eps)

    def forward(params_L, tail_params, state, consts):
        layer_fn = bind(consts)
        h_0 = state.h_BTD
        if group_prefix is not None:
            state, outs, h_L = _grouped_forward(layer_fn, group_prefix, params_L, state, plan, unroll)
        else:
            outs, h_L = [], []  # per segment: the units' outs and saved streams (block modes)
            for seg in main_segments:
                def body(state, xs, seg=seg):
                    params_u, u = xs
                    record = _unit_record(plan, seg, state)
                    state, out = layer_fn(params_u, state._replace(segment=seg), u)
                    return state._replace(segment=None), (out, record)

                state, (outs_s, h_s) = jax.lax.scan(body, state, (_segment_of(params_L, seg), _layers_of(seg)),
                                                    unroll=unroll)
                outs.append(outs_s)
                h_L.append(h_s)
            outs, h_L = jax.tree.map(lambda *a: jnp.concatenate(a), *outs), tuple(h_L)
        tail_record = None
        if tail is not None:  # the remainder unit, on its own
            tail_record = _unit_record(plan, tail, state)
            state, tail_out = layer_fn(tail_params, state._replace(segment=tail), plan.n_units)
            state, outs = state._replace(segment=None), (outs, tail_out)
        return (state, outs), (params_L, tail_params, h_L, tail_record, state, h_0, consts)

    def backward(residuals, cotangents):
        params_L, tail_params, h_L, tail_record, final, h_0, consts = residuals
        layer_fn = bind(consts)
        d_final, d_outs = cotangents
        d_outs, d_tail_out = d_outs if tail is not None else (d_outs, None)
        block = plan.mode in BLOCK_MODES
        with nn.logical_axis_rules(rules):
            streams = h_L if _saves_streams(plan) else _stream_checkpoints(plan, final, h_0, unroll)
            carry = d_tail_params = None
            if tail is not None:  # the remainder first, on its own, one pass per sublayer
                carry = (d_final.h_BTD, _buffer_cotangent(d_final), d_final.inv_rms_SBT,
                         d_final.h_block_BTD if block else None, None)
                (d_h, d_sources, d_inv, d_block, _), d_tail_params = _unit_backward(
                    layer_fn, plan, tail, final, streams, None, tail_params, plan.n_units, tail_record,
                    _sublayer_cotangents(d_tail_out), carry, eps)
                carry = (d_h, d_sources, d_inv, d_block)
            if group_prefix is not None:
                d = _grouped_backward(layer_fn, group_prefix, params_L, streams, final, d_final, plan, unroll,
                                      eps, prefix_grad, carry, _sublayer_cotangents(d_outs))
            else:
                d = _sublayer_backward(layer_fn, params_L, streams, final, d_final, plan, unroll, eps, carry,
                                       _sublayer_cotangents(d_outs))
        return (d[0], d_tail_params, d[1], jax.tree.map(_zero_cotangent, consts))

    @jax.custom_vjp
    def run(params_L, tail_params, state, consts):
        return forward(params_L, tail_params, state, consts)[0]

    run.defvjp(forward, backward)
    return run(params_L, tail_params, state, consts)


def _sublayer_cotangents(d_out):
    """The differentiated part of a unit's out's cotangent (`Outputs.sublayers`), else None."""
    return d_out.sublayers if isinstance(d_out, Outputs) else None


def _unit_record(plan: ResidualPlan, seg: Segment, state: DepthState):
    """What the forward pass saves of a unit for the backward pass: block modes its input stream
    (and, where `seg.block_start`, its block's start), nothing in the others."""
    if not _saves_streams(plan):
        return None
    return (state.h_BTD, state.h_block_BTD) if seg.block_start else state.h_BTD


def _zero_cotangent(x):
    """The zero cotangent of a value that is not differentiated (float0 for integers and keys)."""
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _saves_streams(plan: ResidualPlan) -> bool:
    """Whether the forward pass saves each unit's input stream for the backward pass: the block
    modes do; in the per-sublayer modes the final buffer holds every delta, and the streams are
    recomputed from it (`_stream_checkpoints`)."""
    return plan.mode in BLOCK_MODES


class _Streams(NamedTuple):
    """The per-sublayer modes' unit inputs, recomputed in the backward pass: the stream at every
    `STREAM_CHECKPOINT_EVERY`-th unit, and the final buffer whose slots hold the deltas added in between."""

    checkpoints_CBTD: jax.Array
    sources_SBTD: jax.Array
    write: np.ndarray
    unit_size: int = 2


STREAM_CHECKPOINT_EVERY = 2  # per-sublayer modes: units per saved stream in the backward pass


def _stream_checkpoints(plan: ResidualPlan, final: DepthState, h_0, unroll: bool = False) -> _Streams:
    """The stream at units 0, k, 2k, ... (k = `STREAM_CHECKPOINT_EVERY`), from the initial stream
    `h_0` and the final buffer by the forward pass's own additions h_{j+1} = h_j + v_j, in its
    order: bit for bit the streams it ran on. Saving U / k streams instead of U (2.25 GiB less per
    device for delta at 7.6B) costs 2(k - 1) additions of a slot per layer (`_stream_at`); k is
    fixed so that each layer costs the same at any depth (the step-time estimate fits per-layer
    costs from shallow compiles; with k = 4, 1.1 GiB less memory at 7.6B, it fit them worse).
    `unroll`: the walk over the units unrolled."""
    k = STREAM_CHECKPOINT_EVERY
    P = plan.unit_size
    n_units = plan.n_units + (plan.tail_size > 0)  # the remainder's input stream too
    table = plan.write if n_units * P == len(plan.write) else np.r_[plan.write, [plan.write[-1]] * (
        n_units * P - len(plan.write))]  # the remainder's missing sublayers add after its own (unread)
    write = jnp.asarray(table)

    def layer(carry, l):
        h, checkpoints = carry
        l = jax.lax.optimization_barrier(l)  # unrolled too, every layer does the same work (`_stream_at`)
        c = l // k  # the stream enters its chunk's slot at the chunk's first layer
        checkpoints = checkpoints.at[c].set(jnp.where(l % k == 0, h, checkpoints[c]))
        for j in [P * l] + [P * l + i for i in range(1, P)]:
            h = h + final.sources_SBTD[write[j]].astype(h.dtype)
        return (h, checkpoints), None

    # the checkpoints start as copies of h_0: a broadcast constant XLA would sink into the loop
    checkpoints = jnp.broadcast_to(h_0, (-(-n_units // k),) + h_0.shape)
    (_, checkpoints), _ = jax.lax.scan(layer, (h_0, checkpoints), jnp.arange(n_units), unroll=unroll)
    return _Streams(checkpoints, final.sources_SBTD, plan.write, P)


def _stream_at(streams: _Streams, layer):
    """Unit `layer`'s input stream: its checkpoint plus the deltas of the sublayers since, added in
    the forward pass's order (a fixed number of steps, those past the unit masked)."""
    k = STREAM_CHECKPOINT_EVERY
    P = streams.unit_size
    # a layer index known to XLA (unrolled layers) would fold the masks away, and the additions
    # would differ from layer to layer: in a scanned program, which this one estimates, they do not
    layer = jax.lax.optimization_barrier(layer)
    first = (layer // k) * k
    h = streams.checkpoints_CBTD[layer // k]

    def add(i, h):
        j = P * first + i
        slot = jnp.asarray(streams.write)[jnp.minimum(j, len(streams.write) - 1)]
        return jnp.where(j < P * layer, h + streams.sources_SBTD[slot].astype(h.dtype), h)

    return jax.lax.fori_loop(0, P * (k - 1), add, h, unroll=True)


def _flag(plan: ResidualPlan, table: np.ndarray, u, k: int, seg: Segment | None, j=None):
    """`row(table, j, seg)` of a bool table for sublayer j (default unit_size * u + k), at position k of
    unit u; a NumPy False where the table is False at position k of every unit of `seg` (default: the
    whole units), so that the step is not traced."""
    P = plan.unit_size
    first, count = (seg.first_sublayer, seg.n_sublayers) if seg is not None else (0, plan.n_units * P)
    if not isinstance(u, (int, np.integer)) and not table[first + k: first + count: P].any():
        return np.False_
    return row(table, P * u + k if j is None else j, seg)


def _unit_backward(layer_fn, plan: ResidualPlan, seg: Segment, final: DepthState, streams, h_seg, params_u, u, record,
                   d_out, carry, eps: float):
    """The backward pass of unit u (of segment `seg`): its sublayers' input streams recomputed (block
    modes: from the saved stream, each sublayer's forward under `jax.vjp`; per-sublayer modes: from
    the final buffer's deltas), then `_layer_backward`. `record`: what the forward saved of the unit
    (`_unit_record`); `h_seg`: the segment's saved streams (block modes: the block's start, where it
    opened in the segment); `d_out`: the cotangents of the unit's `Outputs.sublayers`, or None.
    Returns (carry, the unit's d params)."""
    block = plan.mode in BLOCK_MODES
    P = seg.n_sublayers // seg.n_units
    d_h, d_sources, d_inv, d_block, _ = carry
    h_block = None
    if block:
        if seg.block_start:
            h_l, h_block = record
        else:  # segments hold whole blocks: the block's first unit is in this one
            h_l = record
            table = np.repeat(plan.block_start_unit[: plan.n_units], P)
            h_block = h_seg[row(table, plan.unit_size * u, seg) - seg.first]
    else:
        h_l = _stream_at(streams, u)
    n = seg.n_read

    def delta(p, h, sources, inv, h_block, k):
        return layer_fn(p, DepthState(h, sources, inv, h_block, seg), u, only=k)

    # the VJP is with respect to the slots the segment reads: its cotangent updates those only.
    # Sliced from a start that depends on the unit (0 always), so that the slice is read in
    # place by each unit rather than hoisted out of the loop as a copy per segment.
    start = jnp.minimum(u, 0)
    primals = (jax.lax.dynamic_slice_in_dim(final.sources_SBTD, start, n),
               jax.lax.dynamic_slice_in_dim(final.inv_rms_SBT, start, n))
    if block and seg.block_start:  # the block may open at the unit's first sublayer
        h_block = select(_flag(plan, plan.opens_block, u, 0, seg), h_l, h_block)
    hs, h_blocks, forward_vjps, vs, slots, v_invs = [h_l], [h_block], [], [], [], []
    for k in range(P - 1):  # the sublayers' inputs: h_{k+1} = h_k + v_k
        if block:
            v, vjp_k = jax.vjp(lambda p, h, *rest, k=k: delta(p, h, *rest, k), params_u, hs[k], *primals,
                               h_blocks[k])
            v = v[0]
            forward_vjps.append(vjp_k)
        else:
            slot = row(plan.write, plan.unit_size * u + k, seg) if k else row(plan.write, plan.unit_size * u, seg)
            v, v_inv = final.sources_SBTD[slot], final.inv_rms_SBT[slot]
            slots.append(slot)
            v_invs.append(v_inv)
        hs.append(hs[k] + v.astype(h_l.dtype))
        if block:
            opens = _flag(plan, plan.opens_block, u, k + 1, seg)
            h_blocks.append(select(opens, hs[k + 1], h_blocks[k]))
        else:
            h_blocks.append(h_block)
            vs.append(v)

    def vjp_of(k, h_in, h_block):
        if block or k == 0:
            return jax.vjp(lambda p, h, *rest: delta(p, h, *rest, k), params_u, h_in, *primals, h_block)[1]
        # a later sublayer reads its unit-mates' slots as inputs of its own, whose cotangents are then
        # their slot cotangents with no read of an updated buffer (`absorb`)
        is_mate = [jnp.arange(n) == slots[i] for i in range(k)]

        def sublayer(p, h, sources, inv, *rest):
            vs, invs, h_block = rest[:k], rest[k: 2 * k], rest[2 * k]
            for i in range(k):
                sources = jnp.where(is_mate[i][:, None, None, None], vs[i][None], sources)
            for i in range(k):
                inv = jnp.where(is_mate[i][:, None, None], invs[i][None], inv)
            return delta(p, h, sources, inv, h_block, k)
        return jax.vjp(sublayer, params_u, h_in, *primals, *vs[:k], *v_invs[:k], h_block)[1]

    def absorb(acc, d_reads):
        """The reads' cotangents into the buffer's (the segment's slots). A later sublayer's reads
        also give the cotangents of its unit-mates' slots (read apart, `vjp_of`), each added to the
        buffer's from before any update of this unit: read back from the updated buffer, it had XLA
        write that update out as one more buffer-sized array."""
        d_sources, d_inv, mates = acc
        d_src, d_inv_k, *d_mates = d_reads
        if d_mates:
            m, mates = len(d_mates) // 2, list(mates)
            for i in range(m):
                base = mates[i]
                if base is None:
                    mates[i] = (d_sources[slots[i]] + d_mates[i].astype(d_sources.dtype),
                                d_inv[slots[i]] + d_mates[m + i])
                else:
                    mates[i] = (base[0] + d_mates[i].astype(d_sources.dtype), base[1] + d_mates[m + i])
            mates = tuple(mates)
        return d_sources.at[:n].add(d_src), d_inv.at[:n].add(d_inv_k), mates

    def slot_cotangent(acc, k, slot):
        d_sources, d_inv, mates = acc
        return mates[k] if mates[k] is not None else (d_sources[slot], d_inv[slot])

    d_h, d_block, d_params_u, (d_sources, d_inv, _) = _layer_backward(
        plan, seg, u, P, hs, h_blocks, forward_vjps, vjp_of, absorb, slot_cotangent, final, d_h,
        d_block, (d_sources, d_inv, (None,) * P), eps, d_out)
    # slot 0's cotangent leaves the loop on its own: read from the loop's buffer after it, it
    # had XLA lay that buffer out for the read (a relayout copy of it at the loop's entry)
    return (d_h, d_sources, d_inv, d_block, d_sources[0]), d_params_u


def _sublayer_backward(layer_fn, params_L, streams, final: DepthState, d_final: DepthState, plan: ResidualPlan,
                       unroll: bool = False, eps: float = routing.NORM_EPS, carry=None, d_outs=None):
    """The backward pass of the whole units, sublayer by sublayer in reverse (`carry`: the
    cotangents (stream, buffer, 1/rms, block start) after them; the remainder's backward ran first).

    Sublayer j reads the final buffer (slots from its own write slot on are masked out of its
    softmax; block modes read their partial from the stream, `routing_sources`) and the stream
    h_j, and produces v_j = h_{j+1} - h_j. Its cotangent is d h_{j+1}, plus, in the per-sublayer
    modes, what later readers sent to its slot (d_sources[write[j]], and through 1/rms
    d_inv[write[j]]). In block modes a slot's value is c = h_end - h_block, written by the block's
    last sublayer: its cotangent (from later readers) goes to h_end there and, negated, to h_block;
    h_block's cotangent (also from every partial read) is added to the stream's at the sublayer
    that opened the block. h_j is the unit's input h_u plus the deltas of its earlier sublayers: h_u
    is saved per unit (block modes, `streams` per segment) or recomputed from the final buffer
    (per-sublayer modes, `streams` from `_stream_checkpoints`); the deltas are the final buffer's
    slots (per-sublayer modes) or recomputed (block modes)."""
    block = plan.mode in BLOCK_MODES
    segments = plan.segments[:-1] if plan.tail_size else plan.segments

    def body(carry, xs, seg: Segment, h_seg):
        params_u, u, record, d_out = xs
        return _unit_backward(layer_fn, plan, seg, final, streams, h_seg, params_u, u, record, d_out, carry, eps)

    if carry is None:
        carry = (d_final.h_BTD, _buffer_cotangent(d_final), d_final.inv_rms_SBT, d_final.h_block_BTD if block else None)
    d_h, d_sources, d_inv, d_block = carry
    carry = (d_h, d_sources, d_inv, d_block, d_sources[0] if plan.tail_size else d_final.sources_SBTD[0])
    d_params = []
    h_L = streams if block else (None,) * len(segments)
    for seg, h_seg in reversed(list(zip(segments, h_L))):
        xs = (_segment_of(params_L, seg), _layers_of(seg), h_seg, _segment_of(d_outs, seg))
        step = functools.partial(body, seg=seg, h_seg=h_seg)
        carry, d_params_s = jax.lax.scan(step, carry, xs, reverse=True, unroll=unroll)
        d_params.insert(0, d_params_s)
    d_params = jax.tree.map(lambda *a: jnp.concatenate(a), *d_params)
    d_h, _, d_inv, d_block, d_first = carry
    return d_params, _initial_cotangent(plan, d_h, d_first, d_inv, d_block, d_final.sources_SBTD.dtype)


def _buffer_cotangent(d_final: DepthState):
    """The buffer's cotangent as the backward loop's initial value: the final state's, plus a zero
    XLA cannot see. In the modes that output the stream it is all zeros, a constant that XLA
    (TPU) sinks into the loop as `select(first iteration, 0, carry)` and writes out as one more
    buffer-sized array per iteration; a computed zero makes a plain buffer, updated in place."""
    zero = jax.lax.optimization_barrier(jnp.zeros((), d_final.sources_SBTD.dtype))
    return d_final.sources_SBTD + zero


def _layer_backward(plan: ResidualPlan, seg: Segment | None, u, P: int, hs, h_blocks, forward_vjps, vjp_of, absorb,
                    slot_cotangent, final: DepthState, d_h, d_block, acc, eps: float, d_out=None):
    """One unit's P sublayers in reverse (the last first): the slot bookkeeping both backward passes
    share. `hs[k]`, `h_blocks[k]`: sublayer k's input stream and block start; `vjp_of(k, h_in, h_block)`
    is sublayer k's VJP (in block modes, sublayer k < P - 1's is `forward_vjps[k]`, from the
    recomputation that gave its delta), returning (d params, d h, *d reads, d h_block); `acc` holds the
    buffer's cotangents (d_sources, d_inv) first, then whatever else the reads' cotangents go to
    (`absorb(acc, d reads) -> acc`); `slot_cotangent(acc, k, slot)`: per-sublayer modes, what later
    readers sent to sublayer k's slot; `d_out`: sublayer k's cotangent of its differentiated output
    (`Outputs`), or None. Returns (d_h, d_block, the unit's d params, acc)."""
    block = plan.mode in BLOCK_MODES
    d_params_u = None
    for k in reversed(range(P)):
        h_in = hs[k]
        j = plan.unit_size * u + k
        slot = row(plan.write, j, seg)
        if block:
            d_h, d_block = _closed_block_cotangent(final, acc[0], acc[1], slot, _flag(plan, plan.closes_block, u, k, seg, j),
                                                   d_h, d_block, eps)
            d_v, d_v_inv = d_h.astype(h_in.dtype), jnp.zeros_like(acc[1][slot])
        else:
            d_slot, d_slot_inv = slot_cotangent(acc, k, slot)
            d_v, d_v_inv = (d_h + d_slot).astype(h_in.dtype), d_slot_inv
        vjp = forward_vjps[k] if block and k < P - 1 else vjp_of(k, h_in, h_blocks[k])
        cotangent = (d_v, d_v_inv) if d_out is None or d_out[k] is None else (d_v, d_v_inv, d_out[k])
        d_p, d_h_in, *d_reads, d_block_k = vjp(cotangent)
        d_h = d_h + d_h_in
        acc = absorb(acc, d_reads)
        if block:
            d_block = d_block + d_block_k.astype(d_block.dtype)
            opens_j = _flag(plan, plan.opens_block, u, k, seg, j)  # h_block is then this sublayer's input h_j
            if not (isinstance(opens_j, np.bool_) and not opens_j):
                d_h = select(opens_j, d_h + d_block.astype(d_h.dtype), d_h)
                d_block = select(opens_j, jnp.zeros_like(d_block), d_block)
        d_params_u = d_p if d_params_u is None else jax.tree.map(jnp.add, d_params_u, d_p)
    return d_h, d_block, d_params_u, acc


def _segment_of(params_L, seg: Segment):
    """The stacked parameters of a segment's units."""
    return jax.tree.map(lambda a: a[seg.first: seg.first + seg.n_units], params_L)


def _layers_of(seg: Segment):
    return jnp.arange(seg.first, seg.first + seg.n_units)


def _closed_block_cotangent(final: DepthState, d_sources, d_inv, slot, closes_j, d_h, d_block, eps: float):
    """Block modes, at an MLP sublayer j: where j closes its block, the block's slot holds its last
    write c = h_{j+1} - h_block (read by later blocks), whose cotangent (through 1/rms too) goes to
    h_{j+1} and, negated, to h_block. Returns (d_h, d_block)."""
    if isinstance(closes_j, (bool, np.bool_)) and not closes_j:  # known when tracing: nothing to add
        return d_h, d_block
    _, inv_vjp = jax.vjp(lambda c: routing.inv_rms(c, eps), final.sources_SBTD[slot])
    (d_c_inv,) = inv_vjp(d_inv[slot])
    d_c = select(closes_j, d_sources[slot].astype(jnp.float32) + d_c_inv, jnp.zeros_like(d_c_inv))
    return d_h + d_c.astype(d_h.dtype), d_block - d_c.astype(d_block.dtype)


def _initial_cotangent(plan: ResidualPlan, d_h, d_first, d_inv, d_block, dtype) -> DepthState:
    """The initial state's cotangent from the stream's, slot 0's (`d_first`, the embedding's), the
    1/rms buffer's and the block start's. Every slot but 0 is overwritten: the initial buffer's
    values there do not reach the output."""
    first = (jnp.arange(plan.n_slots) == 0)
    d_sources = jnp.where(first[:, None, None, None], d_first[None], 0).astype(dtype)
    d_inv = jnp.where(first[:, None, None], d_inv, 0)
    return DepthState(d_h, d_sources, d_inv, d_block)


# ----------------------------------------------------------------------------- two-phase grouped routing

def sublayer_prefix(prefix: Prefix | None, k: int) -> Prefix | None:
    """Sublayer k's part of a layer's `Prefix` (out and lse have a leading axis of 2)."""
    if prefix is None:
        return None
    return prefix._replace(out_BTD=prefix.out_BTD[k], lse_BT=prefix.lse_BT[k])


def _group_sources(plan: ResidualPlan, first_layer, n: int):
    """Which slots each of the P n queries of the n units of P sublayers from `first_layer` reads: [P n, S]."""
    P = plan.unit_size
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(plan.prefix_read), P * first_layer, P * n)


def _group_queries(queries_fn, params_G):
    """The group's P n queries and gains, each [P n, D] (the units' sublayers in order)."""
    query_N2D, gain_N2D = jax.vmap(queries_fn)(params_G)
    D = query_N2D.shape[-1]
    return query_N2D.reshape(-1, D), gain_N2D.reshape(-1, D)


def _group_prefix(queries_fn, params_G, sources_SBTD, inv_rms_SBT, plan: ResidualPlan, first_layer, n: int, *,
                  impl: str, interpret: bool, eps: float):
    """Phase one for the n units from `first_layer`: their P n queries over the slots completed
    before the group, one pass over the buffer. Returns (out [P n, B, T, D], lse [P n, B, T])."""
    return _phase_one(sources_SBTD, inv_rms_SBT, _group_sources(plan, first_layer, n),
                      *_group_queries(queries_fn, params_G), impl=impl, interpret=interpret, eps=eps)


def listed_group_prefix(queries_fn, params_layers, state: DepthState, plan: ResidualPlan, first_layer: int, n: int,
                        *, impl: str = "xla", interpret: bool = False, eps: float = routing.NORM_EPS):
    """`_group_prefix` on listed sources (unrolled layers, `init_depth_state(listed=True)`), the n
    layers' parameters `params_layers` apart: the slots completed before the group, stacked once
    into a buffer of just those slots."""
    valid_KS = plan.group_prefix_read(first_layer, n)
    n_read = valid_KS.shape[1]
    sources_SBTD = constrain(jnp.stack(state.sources_SBTD[:n_read]), SOURCES_AXES)
    query_KD, gain_KD = (jnp.concatenate(q) for q in zip(*map(queries_fn, params_layers)))
    return _phase_one(sources_SBTD, jnp.stack(state.inv_rms_SBT[:n_read]), valid_KS, query_KD, gain_KD,
                      impl=impl, interpret=interpret, eps=eps)


def _phase_one(sources_SBTD, inv_rms_SBT, valid_KS, query_KD, gain_KD, *, impl: str, interpret: bool, eps: float):
    """The group's queries over `sources_SBTD` (`deltares.nn.layers.route_prefix`)."""
    from deltares.nn.layers import route_prefix  # noqa: PLC0415 - layers imports the routing math only

    return route_prefix(sources_SBTD, inv_rms_SBT, valid_KS, query_KD, gain_KD, impl=impl, interpret=interpret,
                        eps=eps)


def _group_prefix_grad_into(queries_fn, params_G, sources_SBTD, plan: ResidualPlan, first_layer, n: int, out, lse,
                            d_out, d_lse, d_sources_SBTD, *, impl: str, interpret: bool, eps: float):
    """Phase one's VJP by the fused kernel: (d params_G, d_sources + phase one's source cotangent,
    added in place). The kernel renormalises the sources itself: no 1/rms cotangent."""
    from deltares.nn.layers import route_prefix_grad_into  # noqa: PLC0415 - layers imports the routing math only

    (query_KD, gain_KD), queries_vjp = jax.vjp(lambda p: _group_queries(queries_fn, p), params_G)
    d_sources_SBTD, d_query_KD, d_gain_KD = route_prefix_grad_into(
        d_sources_SBTD, sources_SBTD, _group_sources(plan, first_layer, n), query_KD, gain_KD, out, lse, d_out, d_lse,
        impl=impl, interpret=interpret, eps=eps)
    return queries_vjp((d_query_KD, d_gain_KD))[0], d_sources_SBTD


def _groups(plan: ResidualPlan, params_L):
    """The full groups' parameters [n_groups, G, ...] with their first units, and the remainder's
    (the last block of a block mode may be shorter): (params, firsts, params_rest or None)."""
    G = plan.group_layers
    n_groups, rest = divmod(plan.n_units, G)
    full = jax.tree.map(lambda a: a[: n_groups * G].reshape((n_groups, G) + a.shape[1:]), params_L)
    tail = jax.tree.map(lambda a: a[n_groups * G:], params_L) if rest else None
    return full, jnp.arange(n_groups) * G, tail


def _ungroup(full, tail):
    """[n_groups, G, ...] (and the remainder's [r, ...]) back to [units, ...]."""
    flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), full)
    return flat if tail is None else jax.tree.map(lambda a, b: jnp.concatenate([a, b]), flat, tail)


def _layer_of(params_G, i: int):
    return jax.tree.map(lambda a: a[i], params_G)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _grouped_forward(layer_fn, group_prefix, params_L, state: DepthState, plan: ResidualPlan, unroll: bool):
    """The forward pass of two-phase routing over the whole units: per group, phase one over the
    slots completed before it (`_group_prefix`), then its units, each sublayer merging that with its
    intra-group sources (`sublayer_input(prefix=)`). Returns (final state, outs [units, ...], input
    streams h [units, B, T, D])."""
    P = plan.unit_size

    def run_group(state, params_G, first_layer, n):
        out, lse = group_prefix(params_G, state.sources_SBTD, state.inv_rms_SBT, plan, first_layer, n)
        h, outs = [], []
        for i in range(n):
            h.append(state.h_BTD if _saves_streams(plan) else None)
            prefix = Prefix(out[P * i: P * i + P], lse[P * i: P * i + P])
            state, out_l = layer_fn(_layer_of(params_G, i), state, first_layer + i, prefix=prefix)
            outs.append(out_l)
        return state, (_stack(outs), jnp.stack(h) if _saves_streams(plan) else None)

    full, firsts, tail = _groups(plan, params_L)
    G = plan.group_layers
    state, out_full = jax.lax.scan(lambda st, xs: run_group(st, xs[0], xs[1], G), state, (full, firsts),
                                   unroll=unroll)
    out_tail = None
    if tail is not None:
        state, out_tail = run_group(state, tail, firsts.shape[0] * G, plan.n_units % G)
    outs, h_L = _ungroup(out_full, out_tail)
    return state, outs, h_L


def _absorb_prefix(acc, d_reads):
    """Two-phase backward: a sublayer's prefix cotangent into the unit's (d out, d lse) and, in the
    per-sublayer modes, the group window's; the buffer's (acc[:2]) gets phase one's once per group."""
    (d_prefix,) = d_reads
    d_sources, d_inv, d_window, d_window_inv, d_out, d_lse = acc
    if d_window is not None:
        d_window, d_window_inv = d_window + d_prefix.window_SBTD, d_window_inv + d_prefix.window_inv_SBT
    return d_sources, d_inv, d_window, d_window_inv, d_out + d_prefix.out_BTD, d_lse + d_prefix.lse_BT


def _grouped_layer_backward(layer_fn, plan: ResidualPlan, final: DepthState, params_l, layer, i: int, h_l, h_block,
                            prefix: Prefix, d_h, d_block, acc, eps: float, d_out=None):
    """Two-phase backward of unit i of its group (`_layer_backward` with the unit's `prefix`: its P
    sublayers' phase-one out and lse, and in the per-sublayer modes the group's window of slots).
    `acc` = (d_sources, d_inv, d_window, d_window_inv). Returns (d_h, d_block, the unit's d params,
    (d_window, d_window_inv, d out, d lse))."""
    window = prefix.window_SBTD
    block = plan.mode in BLOCK_MODES
    P = plan.unit_size

    def delta(p, h, pre, hb, k):
        return layer_fn(p, DepthState(h, final.sources_SBTD, final.inv_rms_SBT, hb), layer, only=k, prefix=pre)

    hs, vs, forward_vjps = [h_l], [], []
    for k in range(P - 1):  # the sublayers' inputs (groups tile blocks: a block opens only at a unit's start)
        if block:  # the sublayer's forward gives its delta
            if k:
                hs.append(hs[k - 1] + vs[k - 1].astype(h_l.dtype))
            v, vjp_k = jax.vjp(lambda p, h, pre, hb, k=k: delta(p, h, pre, hb, k), params_l, hs[k], prefix, h_block)
            vs.append(v[0])
            forward_vjps.append(vjp_k)
        else:
            vs.append(window[P * i + k])  # slot P * unit + k + 1

    def vjp_of(k, h_in, h_block):
        return jax.vjp(lambda p, h, pre, hb: delta(p, h, pre, hb, k), params_l, h_in, prefix, h_block)[1]

    def slot_cotangent(acc, k, slot):  # read by later groups (the buffer) and group-mates (the window)
        d_slot, d_slot_inv = acc[0][slot], acc[1][slot]
        if P * i + k < window.shape[0]:
            d_slot, d_slot_inv = d_slot + acc[2][P * i + k].astype(d_slot.dtype), d_slot_inv + acc[3][P * i + k]
        return d_slot, d_slot_inv

    zeros = (jnp.zeros_like(prefix.out_BTD[0]), jnp.zeros_like(prefix.lse_BT[0]))  # d out, d lse of the unit
    for k in range(len(hs) - 1, P - 1):
        hs.append(hs[k] + vs[k].astype(h_l.dtype))
    d_h, d_block, d_params_l, acc = _layer_backward(plan, None, layer, P, hs, [h_block] * P, forward_vjps, vjp_of,
                                                    _absorb_prefix, slot_cotangent, final, d_h, d_block, acc + zeros,
                                                    eps, d_out)
    return d_h, d_block, d_params_l, acc[2:]


def _grouped_backward(layer_fn, group_prefix, params_L, h_L, final: DepthState, d_final: DepthState,
                      plan: ResidualPlan, unroll: bool = False, eps: float = routing.NORM_EPS, prefix_grad=None,
                      carry=None, d_outs=None):
    """The backward pass of two-phase routing, group by group in reverse (`_sublayer_backward` is
    the ungrouped one; the slot bookkeeping is the same). Per group: phase one is recomputed on
    the final buffer under `jax.vjp`; the sublayers walk in reverse, each differentiated alone
    with respect to its parameters, stream, block start and prefix (out, lse, window); the
    prefix cotangents of all of them go through phase one's VJP once, which is the only place
    the group adds to the cotangent of the buffer (slots before the group). The window's
    cotangent (per-sublayer modes: slots written and read inside the group) is consumed by the
    slots' writers in the same walk. With `prefix_grad` (a fused kernel, `_group_prefix_grad_into`)
    phase one is recomputed without a VJP and its backward adds into the buffer's cotangent in place.
    `carry`: the cotangents after the whole units (the remainder's backward ran first), by default
    the final state's; `d_outs`: the units' `Outputs.sublayers` cotangents, or None."""
    block = plan.mode in BLOCK_MODES
    block_start = jnp.asarray(plan.block_start_unit[: plan.n_units])
    P = plan.unit_size

    def run_group(carry, params_G, first_layer, n, d_out_G):
        d_h, d_sources, d_inv, d_block = carry
        # under checkpoint: the VJP keeps only its inputs (the live final buffer), not a float32
        # copy of the buffer and the weights for the whole walk; phase one is recomputed in it
        if prefix_grad is None:
            (out, lse), prefix_vjp = jax.vjp(
                jax.checkpoint(lambda p, s, iv: group_prefix(p, s, iv, plan, first_layer, n)),
                params_G, final.sources_SBTD, final.inv_rms_SBT)
        else:
            out, lse = group_prefix(params_G, final.sources_SBTD, final.inv_rms_SBT, plan, first_layer, n)
        window = window_inv = d_window = d_window_inv = None
        if not block:
            window, window_inv = group_window(plan, final, first_layer)
            d_window, d_window_inv = jnp.zeros_like(window), jnp.zeros_like(window_inv)
        d_out, d_lse, d_params = [None] * n, [None] * n, [None] * n
        for i in reversed(range(n)):
            layer = first_layer + i
            # the unit's recomputation waits for the later unit's cotangent: without the barrier
            # XLA may recompute every unit of the group at once, holding all their activations
            h_l = h_L[layer] if block else _stream_at(h_L, layer)
            d_h, h_l = jax.lax.optimization_barrier((d_h, h_l))
            h_block = h_L[block_start[layer]] if block else None
            prefix = Prefix(out[P * i: P * i + P], lse[P * i: P * i + P], window, window_inv)
            d_h, d_block, d_params_l, (d_window, d_window_inv, d_out_l, d_lse_l) = _grouped_layer_backward(
                layer_fn, plan, final, _layer_of(params_G, i), layer, i, h_l, h_block, prefix, d_h, d_block,
                (d_sources, d_inv, d_window, d_window_inv), eps, _layer_of(d_out_G, i))
            d_out[i], d_lse[i], d_params[i] = d_out_l, d_lse_l, d_params_l
        d_out, d_lse = jnp.concatenate(d_out), jnp.concatenate(d_lse)
        if prefix_grad is None:
            d_params_G, d_src, d_iv = prefix_vjp((d_out, d_lse))
            d_sources, d_inv = d_sources + d_src.astype(d_sources.dtype), d_inv + d_iv
        else:
            d_params_G, d_sources = prefix_grad(params_G, final.sources_SBTD, plan, first_layer, n, out, lse, d_out,
                                                d_lse, d_sources)
        d_params_G = jax.tree.map(jnp.add, _stack(d_params), d_params_G)
        return (d_h, d_sources, d_inv, d_block), d_params_G

    full, firsts, tail = _groups(plan, params_L)
    d_full_outs, _, d_tail_outs = _groups(plan, d_outs) if d_outs is not None else (None, None, None)
    G = plan.group_layers
    if carry is None:
        carry = (d_final.h_BTD, _buffer_cotangent(d_final), d_final.inv_rms_SBT,
                 d_final.h_block_BTD if block else None)
    d_tail = None
    if tail is not None:  # the last group runs first
        carry, d_tail = run_group(carry, tail, firsts.shape[0] * G, plan.n_units % G, d_tail_outs)
    carry, d_full = jax.lax.scan(lambda c, xs: run_group(c, xs[0], xs[1], G, xs[2]), carry,
                                 (full, firsts, d_full_outs), reverse=True, unroll=unroll)
    d_h, d_sources, d_inv, d_block = carry
    return _ungroup(d_full, d_tail), _initial_cotangent(plan, d_h, d_sources[0], d_inv, d_block,
                                                        d_final.sources_SBTD.dtype)


__all__ = ["DepthState", "Outputs", "Prefix", "add_delta", "depth_scan", "init_depth_state", "listed_group_prefix", "stack_output",
           "sublayer_input"]
