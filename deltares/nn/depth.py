"""Depth state (stream, source buffer, cached 1/rms), its per-sublayer read and write, and the
depth pass with a store-once source buffer for the backward pass.

Reverse-mode AD of a scan saves the carry at every step, so a source buffer
carried through L layers is stored L times: O(L x S x B x T x D) memory, quadratic
in depth (DESIGN.md section 5, "Memory trap"). Sources are write-once (block
modes: each slot changes only while its block runs), so the final buffer holds
every value a layer read. `depth_scan` therefore saves, per layer, only the
stream h and the layer's own write slot (the running partial in block modes),
and its backward pass walks the layers in reverse, rebuilds each layer's input
buffer from the final one, recomputes the layer and accumulates cotangents.
Memory: one final buffer, one cotangent buffer, and O(L x B x T x D) for the
per-layer saves, the same order as baseline with remat.

The per-sublayer modes (`delta`, `full_attnres`, S = 2L + 1 slots) go further: their
backward pass differentiates each sublayer alone as (params, h, final buffer) -> delta,
so a recomputation never writes, and so never copies, the buffer; block modes (a few
slots) recompute whole layers from the rebuilt input buffer.
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
    sources_SBTD: jax.Array | None  # source buffer (None in baseline)
    inv_rms_SBT: jax.Array | None  # float32 1/rms of every slot


def init_depth_state(e_BTD, plan: ResidualPlan, eps: float = routing.NORM_EPS) -> DepthState:
    """Stream = e; slot 0 of the buffer holds e, all other slots are zero."""
    if not plan.uses_sources:
        return DepthState(e_BTD, None, None)
    sources = jnp.zeros((plan.n_slots,) + e_BTD.shape, e_BTD.dtype).at[0].set(e_BTD)
    sources = nn.with_logical_constraint(sources, SOURCES_AXES)
    inv = jnp.zeros((plan.n_slots,) + e_BTD.shape[:2], jnp.float32).at[0].set(routing.inv_rms(e_BTD, eps))
    return DepthState(e_BTD, sources, inv)


def sublayer_input(plan: ResidualPlan, state: DepthState, j, router, null_source: bool = False):
    """Sublayer j's input x_j (DESIGN.md section 3) and its routing: returns (x_BTD, weights_SBT or
    None, routed). `router(sources, inv_rms, valid, residual) -> (out, weights)` is a DepthRouter
    (linen or NNX) or `apply_router` on parameters; `j` may be traced (a scanned layer).

        x_j = h_j                  baseline, or an additive sublayer with a single source
        x_j = route(S_j)           replacement modes (Kimi)
        x_j = h_j + route(S_j)     additive modes (Delta)

    A null source is one more source: with it every sublayer routes."""
    if not plan.uses_sources:
        return state.h_BTD, None, jnp.asarray(False)
    routed = jnp.asarray(plan.routed | null_source)[j]
    residual = None if plan.replaces_stream else state.h_BTD
    x_BTD, weights_SBT = router(state.sources_SBTD, state.inv_rms_SBT, jnp.asarray(plan.read)[j], residual)
    if residual is not None:  # single source: no routing, x = h
        x_BTD = jnp.where(routed, x_BTD, state.h_BTD)
    return x_BTD, weights_SBT, routed


def add_delta(plan: ResidualPlan, state: DepthState, j, v_BTD, eps: float = routing.NORM_EPS) -> DepthState:
    """h_{j+1} = h_j + v_j, and v_j into sublayer j's write slot (with its 1/rms)."""
    h_BTD = nn.with_logical_constraint(state.h_BTD + v_BTD, STREAM_AXES)
    if not plan.uses_sources:
        return DepthState(h_BTD, None, None)
    slot = jnp.asarray(plan.write)[j]
    # Block modes accumulate the block's partial; other modes write a fresh slot once
    # (overwriting, which lets the store-once backward recompute from the final buffer).
    slot_BTD = state.sources_SBTD[slot] + v_BTD if plan.mode in BLOCK_MODES else v_BTD
    sources = nn.with_logical_constraint(state.sources_SBTD.at[slot].set(slot_BTD), SOURCES_AXES)
    inv = state.inv_rms_SBT.at[slot].set(routing.inv_rms(slot_BTD, eps))
    return DepthState(h_BTD, sources, inv)


def stack_output(plan: ResidualPlan, state: DepthState, final_router=None):
    """The stack's output before the final norm: the Kimi modes route over every source with
    `final_router` (own parameters), the others return the stream h_2L."""
    if not plan.replaces_stream:
        return state.h_BTD
    if final_router is None:
        raise ValueError(f"mode {plan.mode!r} routes its output: pass a final router")
    out_BTD, _ = final_router(state.sources_SBTD, state.inv_rms_SBT, jnp.asarray(plan.final_read))
    return out_BTD


def _input_state(final: DepthState, saved, layer, plan: ResidualPlan) -> DepthState:
    """A block mode's layer `layer` input state: slots before its first write slot come from
    the final buffer, later slots are zero as they were, and its write slot (the running
    partial) comes from `saved`."""
    h_BTD, partial = saved
    first = jnp.asarray(plan.write)[2 * layer]
    slots = jnp.arange(plan.n_slots)
    before = slots < first
    sources = jnp.where(before[:, None, None, None], final.sources_SBTD, 0)
    inv = jnp.where(before[:, None, None], final.inv_rms_SBT, 0)
    slot_BTD, slot_inv_BT = partial
    return DepthState(h_BTD, sources.at[first].set(slot_BTD), inv.at[first].set(slot_inv_BT))


def _saved(state: DepthState, layer, plan: ResidualPlan):
    """What the backward pass cannot rebuild from the final buffer: the stream, and in block
    modes the partial (per-sublayer modes rebuild everything else from the final buffer)."""
    if plan.mode not in BLOCK_MODES:
        return state.h_BTD, None
    first = jnp.asarray(plan.write)[2 * layer]
    return state.h_BTD, (state.sources_SBTD[first], state.inv_rms_SBT[first])


def depth_scan(layer_fn: Callable, params_L: Any, state: DepthState, plan: ResidualPlan, unroll: bool = False):
    """Runs `layer_fn(params_l, state, l) -> (state, stats_l)` over the L stacked layers of
    `params_L`; returns (final state, stacked stats). Differentiable in params and state.

    Block modes differentiate layer by layer (`layer_fn` on the rebuilt input state); the
    per-sublayer modes sublayer by sublayer over the final buffer with
    `layer_fn(params_l, state, l, only=k) -> (v, 1/rms(v))` (sublayer k of layer l alone,
    writing nothing; `_sublayer_backward`), so their backward pass never writes the buffer.
    `unroll` unrolls both scans (the same program without loops)."""
    n_layers = plan.n_layers
    by_sublayer = plan.mode not in BLOCK_MODES

    def forward(params_L, state):
        def body(state, xs):
            params_l, layer = xs
            saved = _saved(state, layer, plan)
            state, stats = layer_fn(params_l, state, layer)
            return state, (stats, saved)

        final, (stats, saved) = jax.lax.scan(body, state, (params_L, jnp.arange(n_layers)), unroll=unroll)
        return (final, stats), (params_L, saved, final)

    def backward(residuals, cotangents):
        params_L, saved, final = residuals
        d_final, d_stats = cotangents
        if by_sublayer:
            return _sublayer_backward(layer_fn, params_L, saved[0], final, d_final, plan, unroll)

        def body(d_state, xs):
            params_l, layer, saved_l, d_stats_l = xs
            state_l = _input_state(final, saved_l, layer, plan)
            _, vjp = jax.vjp(lambda p, s: layer_fn(p, s, layer), params_l, state_l)
            d_params_l, d_state_l = vjp((d_state, d_stats_l))
            return d_state_l, d_params_l

        xs = (params_L, jnp.arange(n_layers), saved, d_stats)
        d_state, d_params = jax.lax.scan(body, d_final, xs, reverse=True, unroll=unroll)
        return d_params, d_state

    @jax.custom_vjp
    def run(params_L, state):
        return forward(params_L, state)[0]

    run.defvjp(forward, backward)
    return run(params_L, state)


def _sublayer_backward(layer_fn, params_L, h_L, final: DepthState, d_final: DepthState, plan: ResidualPlan,
                       unroll: bool = False):
    """The backward pass of the per-sublayer modes, sublayer by sublayer in reverse.

    Sublayer j reads the final buffer (slots from its own write slot on are masked out of
    its softmax) and the stream h_j, and produces v_j, which is both slot write[j] and
    h_{j+1} - h_j. So v_j's cotangent is d h_{j+1} plus what later readers sent to its slot
    (d_sources[write[j]], and through 1/rms d_inv[write[j]]); its vjp adds to d h_j and to the
    buffer's cotangent, which the scan carries. h_j comes from the saved
    layer input (attention) or as h_l + final slot of the attention's delta (MLP), which is
    the value the forward pass computed. Statistics carry no gradient."""
    write = jnp.asarray(plan.write)

    def body(carry, xs):
        d_h, d_sources, d_inv = carry
        params_l, layer, h_l = xs
        h_mid = h_l + final.sources_SBTD[write[2 * layer]]
        d_params_l = None
        for k, h_in in ((1, h_mid), (0, h_l)):
            slot = write[2 * layer + k]

            def delta(p, h, sources, inv, k=k):
                return layer_fn(p, DepthState(h, sources, inv), layer, only=k)

            _, vjp = jax.vjp(delta, params_l, h_in, final.sources_SBTD, final.inv_rms_SBT)
            d_v = (d_h + d_sources[slot]).astype(h_in.dtype)
            d_p, d_h_in, d_src, d_inv_k = vjp((d_v, d_inv[slot]))
            d_h, d_sources, d_inv = d_h + d_h_in, d_sources + d_src, d_inv + d_inv_k
            d_params_l = d_p if d_params_l is None else jax.tree.map(jnp.add, d_params_l, d_p)
        return (d_h, d_sources, d_inv), d_params_l

    carry = (d_final.h_BTD, d_final.sources_SBTD, d_final.inv_rms_SBT)
    xs = (params_L, jnp.arange(plan.n_layers), h_L)
    (d_h, d_sources, d_inv), d_params = jax.lax.scan(body, carry, xs, reverse=True, unroll=unroll)
    # Every slot but 0 (the embedding) is overwritten by its sublayer: the initial buffer's
    # values there do not reach the output.
    first = (jnp.arange(plan.n_slots) == 0)
    d_sources = jnp.where(first[:, None, None, None], d_sources, 0).astype(d_final.sources_SBTD.dtype)
    d_inv = jnp.where(first[:, None, None], d_inv, 0)
    return d_params, DepthState(d_h, d_sources, d_inv)
