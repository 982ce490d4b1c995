"""Depth state (stream, source buffer, cached 1/rms), its per-sublayer read and write, and the
depth pass with a store-once source buffer for the backward pass.

Reverse-mode AD of a scan saves the carry at every step, so a source buffer
carried through L layers is stored L times: O(L x S x B x T x D) memory, quadratic
in depth (DESIGN.md section 5, "Memory trap"). Every slot is written once for good
(per-sublayer modes: a delta; block modes: a completed block's sum, the running
partial being the stream minus the stream at the block's start, read from the
stream and never stored for the backward pass), so the final buffer holds every
source value any sublayer read. `depth_scan` therefore saves per layer only what
baseline's remat saves, the layer's input stream h, and its backward pass walks the
sublayers in reverse, each differentiated alone as (params, h, final buffer) -> delta:
a recomputation never writes, and so never copies, the buffer. Memory beyond
baseline: the final buffer and one cotangent buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from deltares.nn import routing
from deltares.nn.config import BLOCK_MODES
from deltares.nn.residual import ResidualPlan

STREAM_AXES = ("batch", "length", "act_embed")  # logical names of the stream and of each source
SOURCES_AXES = ("sources",) + STREAM_AXES


class DepthState(NamedTuple):
    h_BTD: jax.Array  # additive stream e + sum of deltas so far
    sources_SBTD: jax.Array | tuple | None  # source buffer [S, B, T, D], or the slots so far (None in baseline)
    inv_rms_SBT: jax.Array | tuple | None  # float32 1/rms of every slot
    h_block_BTD: jax.Array | None = None  # block modes: the stream where the running block began


def init_depth_state(e_BTD, plan: ResidualPlan, eps: float = routing.NORM_EPS, listed: bool = False) -> DepthState:
    """Stream = e; slot 0 of the buffer holds e, all other slots are zero. `listed` (unrolled
    layers, sublayer indices known when tracing): the sources are a tuple of the slots written so
    far, so a write appends or replaces one array and never copies a buffer."""
    if not plan.uses_sources:
        return DepthState(e_BTD, None, None)
    h_block = e_BTD if plan.mode in BLOCK_MODES else None
    if listed:
        return DepthState(e_BTD, (e_BTD,), (routing.inv_rms(e_BTD, eps),), h_block)
    sources = jnp.zeros((plan.n_slots,) + e_BTD.shape, e_BTD.dtype).at[0].set(e_BTD)
    sources = nn.with_logical_constraint(sources, SOURCES_AXES)
    inv = jnp.zeros((plan.n_slots,) + e_BTD.shape[:2], jnp.float32).at[0].set(routing.inv_rms(e_BTD, eps))
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
    """The buffer and 1/rms sublayer j routes over: the state's. With `final` (the state holds the
    final buffer: a backward pass), block modes' partial slot (j's write slot, where the final
    buffer holds the completed block) is read from the stream instead, h - h_block: the value
    `add_delta` wrote there, by the same arithmetic."""
    if plan.mode not in BLOCK_MODES or not final:
        return state.sources_SBTD, state.inv_rms_SBT
    slot = jnp.asarray(plan.write)[j]
    p_BTD, p_inv_BT = _block_partial(state, state.sources_SBTD.dtype, eps)
    is_slot = jnp.arange(plan.n_slots) == slot
    sources = jnp.where(is_slot[:, None, None, None], p_BTD[None], state.sources_SBTD)
    inv = jnp.where(is_slot[:, None, None], p_inv_BT[None], state.inv_rms_SBT)
    return sources, inv


def sublayer_input(plan: ResidualPlan, state: DepthState, j, router, null_source: bool = False,
                   eps: float = routing.NORM_EPS, final: bool = False):
    """Sublayer j's input x_j (DESIGN.md section 3) and its routing: returns (x_BTD, weights_SBT or
    None, routed). `router(sources, inv_rms, valid, residual) -> (out, weights)` is a DepthRouter
    (linen or NNX) or `apply_router` on parameters; `j` may be traced (a scanned layer).

        x_j = h_j                  baseline, or an additive sublayer with a single source
        x_j = route(S_j)           replacement modes (Kimi)
        x_j = h_j + route(S_j)     additive modes (Delta)

    A null source is one more source: with it every sublayer routes. `eps` is the norm's epsilon
    of the cached 1/rms; `final`: the state holds the final buffer (`routing_sources`)."""
    if not plan.uses_sources:
        return state.h_BTD, None, jnp.asarray(False)
    _check_listed(state, j)
    routed = jnp.asarray(plan.routed | null_source)[j]
    residual = None if plan.replaces_stream else state.h_BTD
    sources, inv = routing_sources(plan, state, j, eps, final)
    if isinstance(j, int):  # unrolled (listed or not): only the slots up to the last one j reads
        n = int(plan.read[j].nonzero()[0].max()) + 1
        x_BTD, weights_SBT = router(sources[:n], inv[:n], plan.read[j][:n], residual)
        if weights_SBT is not None:
            weights_SBT = jnp.pad(weights_SBT, ((0, plan.n_slots - n), (0, 0), (0, 0)))
    else:
        x_BTD, weights_SBT = router(sources, inv, jnp.asarray(plan.read)[j], residual)
    if residual is not None:  # single source: no routing, x = h
        x_BTD = jnp.where(routed, x_BTD, state.h_BTD)
    return x_BTD, weights_SBT, routed


def add_delta(plan: ResidualPlan, state: DepthState, j, v_BTD, eps: float = routing.NORM_EPS) -> DepthState:
    """h_{j+1} = h_j + v_j, and sublayer j's write slot: v_j (per-sublayer modes), or the block's
    sum so far h_{j+1} - h_block (block modes; h_block = h_j where j opens the block), with its 1/rms."""
    h_BTD = nn.with_logical_constraint(state.h_BTD + v_BTD, STREAM_AXES)
    if not plan.uses_sources:
        return DepthState(h_BTD, None, None)
    listed = _check_listed(state, j)
    dtype = state.sources_SBTD[0].dtype
    h_block = None
    if plan.mode in BLOCK_MODES:
        if listed:  # j is known
            h_block = state.h_BTD if plan.opens_block[j] else state.h_block_BTD
        else:
            h_block = jnp.where(jnp.asarray(plan.opens_block)[j], state.h_BTD, state.h_block_BTD)
        slot_BTD, slot_inv_BT = _block_partial(DepthState(h_BTD, None, None, h_block), dtype, eps)
    else:
        slot_BTD = v_BTD.astype(dtype)
        slot_inv_BT = routing.inv_rms(slot_BTD, eps)
    if listed:  # a new slot is appended, a block's running slot (the last) replaced
        keep = int(plan.write[j])
        sources = state.sources_SBTD[:keep] + (nn.with_logical_constraint(slot_BTD, STREAM_AXES),)
        return DepthState(h_BTD, sources, state.inv_rms_SBT[:keep] + (slot_inv_BT,), h_block)
    slot = jnp.asarray(plan.write)[j]
    sources = nn.with_logical_constraint(state.sources_SBTD.at[slot].set(slot_BTD), SOURCES_AXES)
    inv = state.inv_rms_SBT.at[slot].set(slot_inv_BT)
    return DepthState(h_BTD, sources, inv, h_block)


def stack_output(plan: ResidualPlan, state: DepthState, final_router=None):
    """The stack's output before the final norm: the Kimi modes route over every source with
    `final_router` (own parameters), the others return the stream h_2L."""
    if not plan.replaces_stream:
        return state.h_BTD
    if final_router is None:
        raise ValueError(f"mode {plan.mode!r} routes its output: pass a final router")
    out_BTD, _ = final_router(state.sources_SBTD, state.inv_rms_SBT, jnp.asarray(plan.final_read))
    return out_BTD


def depth_scan(layer_fn: Callable, params_L: Any, state: DepthState, plan: ResidualPlan, unroll: bool = False,
               eps: float = routing.NORM_EPS):
    """Runs `layer_fn(params_l, state, l) -> (state, stats_l)` over the L stacked layers of
    `params_L`; returns (final state, stacked stats). Differentiable in params and state.

    The backward pass (`_sublayer_backward`) differentiates sublayer by sublayer over the final
    buffer with `layer_fn(params_l, state, l, only=k) -> (v, 1/rms(v))` (sublayer k of layer l
    alone on a state holding the final buffer, `sublayer_input(..., final=True)`, writing nothing). Per layer, the forward pass saves only its input stream.
    `unroll` unrolls both scans (the same program without loops); `eps` is the 1/rms epsilon."""

    def forward(params_L, state):
        def body(state, xs):
            params_l, layer = xs
            h_l = state.h_BTD
            state, stats = layer_fn(params_l, state, layer)
            return state, (stats, h_l)

        final, (stats, h_L) = jax.lax.scan(body, state, (params_L, jnp.arange(plan.n_layers)), unroll=unroll)
        return (final, stats), (params_L, h_L, final)

    def backward(residuals, cotangents):
        params_L, h_L, final = residuals
        d_final, _ = cotangents  # statistics carry no gradient
        return _sublayer_backward(layer_fn, params_L, h_L, final, d_final, plan, unroll, eps)

    @jax.custom_vjp
    def run(params_L, state):
        return forward(params_L, state)[0]

    run.defvjp(forward, backward)
    return run(params_L, state)


def _sublayer_backward(layer_fn, params_L, h_L, final: DepthState, d_final: DepthState, plan: ResidualPlan,
                       unroll: bool = False, eps: float = routing.NORM_EPS):
    """The backward pass, sublayer by sublayer in reverse.

    Sublayer j reads the final buffer (slots from its own write slot on are masked out of its
    softmax; block modes read their partial from the stream, `routing_sources`) and the stream
    h_j, and produces v_j = h_{j+1} - h_j. Its cotangent is d h_{j+1}, plus, in the per-sublayer
    modes, what later readers sent to its slot (d_sources[write[j]], and through 1/rms
    d_inv[write[j]]). In block modes a slot's value is c = h_end - h_block, written by the block's
    last sublayer: its cotangent (from later readers) goes to h_end there and, negated, to h_block;
    h_block's cotangent (also from every partial read) is added to the stream's at the sublayer
    that opened the block. h_j comes from the saved layer input (attention) or as h_l + v_attn
    (MLP): v_attn is the final buffer's slot (per-sublayer modes) or recomputed (block modes)."""
    write = jnp.asarray(plan.write)
    block = plan.mode in BLOCK_MODES
    opens, closes = jnp.asarray(plan.opens_block), jnp.asarray(plan.closes_block)
    block_start = jnp.asarray(plan.block_start_layer)

    def body(carry, xs):
        d_h, d_sources, d_inv, d_block = carry
        params_l, layer, h_l = xs
        h_block = h_L[block_start[layer]] if block else None

        def delta(p, h, sources, inv, h_block, k):
            return layer_fn(p, DepthState(h, sources, inv, h_block), layer, only=k)

        primals = (final.sources_SBTD, final.inv_rms_SBT, h_block)
        if block:
            v_attn, attn_vjp = jax.vjp(lambda p, h, *rest: delta(p, h, *rest, 0), params_l, h_l, *primals)
            v_attn = v_attn[0]
        else:
            v_attn = final.sources_SBTD[write[2 * layer]]
        h_mid = h_l + v_attn.astype(h_l.dtype)
        d_params_l = None
        for k, h_in in ((1, h_mid), (0, h_l)):
            j = 2 * layer + k
            slot = write[j]
            if block:
                if k == 1:  # blocks are whole layers: only an MLP sublayer can close one
                    # the block's last write: c = h_{j+1} - h_block, read by later blocks
                    _, inv_vjp = jax.vjp(lambda c: routing.inv_rms(c, eps), final.sources_SBTD[slot])
                    (d_c_inv,) = inv_vjp(d_inv[slot])
                    d_c = jnp.where(closes[j], d_sources[slot].astype(jnp.float32) + d_c_inv, 0)
                    d_h = d_h + d_c.astype(d_h.dtype)
                    d_block = d_block - d_c.astype(d_block.dtype)
                d_v, d_v_inv = d_h.astype(h_in.dtype), jnp.zeros_like(d_inv[slot])
            else:
                d_v, d_v_inv = (d_h + d_sources[slot]).astype(h_in.dtype), d_inv[slot]
            if block and k == 0:
                vjp = attn_vjp
            else:
                _, vjp = jax.vjp(lambda p, h, *rest, k=k: delta(p, h, *rest, k), params_l, h_in, *primals)
            d_p, d_h_in, d_src, d_inv_k, d_block_k = vjp((d_v, d_v_inv))
            d_h, d_sources, d_inv = d_h + d_h_in, d_sources + d_src, d_inv + d_inv_k
            if block:
                d_block = d_block + d_block_k.astype(d_block.dtype)
                if k == 0:  # only an attention sublayer can open a block; h_block is its input h_j
                    d_h = jnp.where(opens[j], d_h + d_block.astype(d_h.dtype), d_h)
                    d_block = jnp.where(opens[j], 0, d_block)
            d_params_l = d_p if d_params_l is None else jax.tree.map(jnp.add, d_params_l, d_p)
        return (d_h, d_sources, d_inv, d_block), d_params_l

    d_block0 = d_final.h_block_BTD if block else None
    carry = (d_final.h_BTD, d_final.sources_SBTD, d_final.inv_rms_SBT, d_block0)
    xs = (params_L, jnp.arange(plan.n_layers), h_L)
    (d_h, d_sources, d_inv, d_block), d_params = jax.lax.scan(body, carry, xs, reverse=True, unroll=unroll)
    # Every slot but 0 (the embedding) is overwritten: the initial buffer's values there do not
    # reach the output.
    first = (jnp.arange(plan.n_slots) == 0)
    d_sources = jnp.where(first[:, None, None, None], d_sources, 0).astype(d_final.sources_SBTD.dtype)
    d_inv = jnp.where(first[:, None, None], d_inv, 0)
    return d_params, DepthState(d_h, d_sources, d_inv, d_block)
