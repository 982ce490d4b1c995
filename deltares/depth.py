"""The depth pass with a store-once source buffer for the backward pass.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from deltares.config import BLOCK_MODES
from deltares.decoder import DepthState
from deltares.residual import ResidualPlan


def _input_state(final: DepthState, saved, layer, plan: ResidualPlan) -> DepthState:
    """Layer `layer`'s input state: slots before its first write slot come from the final
    buffer, later slots are zero as they were, and in block modes its write slot (the
    running partial) comes from `saved`.

    Per-sublayer modes take the final buffer as it is, without a masked copy: a sublayer
    reads only slots before its own write slot (the rest are masked out of its softmax, so
    they get neither weight nor gradient) and overwrites its write slot with its delta."""
    h_BTD, partial = saved
    if plan.mode not in BLOCK_MODES:
        return DepthState(h_BTD, final.sources_SBTD, final.inv_rms_SBT)
    first = jnp.asarray(plan.write)[2 * layer]
    slots = jnp.arange(plan.n_slots)
    before = slots < first
    sources = jnp.where(before[:, None, None, None], final.sources_SBTD, 0)
    inv = jnp.where(before[:, None, None], final.inv_rms_SBT, 0)
    if partial is not None:
        slot_BTD, slot_inv_BT = partial
        sources = sources.at[first].set(slot_BTD)
        inv = inv.at[first].set(slot_inv_BT)
    return DepthState(h_BTD, sources, inv)


def _saved(state: DepthState, layer, plan: ResidualPlan):
    """What the backward pass cannot rebuild from the final buffer: the stream, and in block
    modes the partial (per-sublayer modes write fresh slots, which are zero at layer input)."""
    if plan.mode not in BLOCK_MODES:
        return state.h_BTD, None
    first = jnp.asarray(plan.write)[2 * layer]
    return state.h_BTD, (state.sources_SBTD[first], state.inv_rms_SBT[first])


def depth_scan(layer_fn: Callable, params_L: Any, state: DepthState, plan: ResidualPlan):
    """Runs `layer_fn(params_l, state, l) -> (state, stats_l)` over the L stacked layers of
    `params_L`; returns (final state, stacked stats). Differentiable in params and state."""
    n_layers = plan.n_layers

    def forward(params_L, state):
        def body(state, xs):
            params_l, layer = xs
            saved = _saved(state, layer, plan)
            state, stats = layer_fn(params_l, state, layer)
            return state, (stats, saved)

        final, (stats, saved) = jax.lax.scan(body, state, (params_L, jnp.arange(n_layers)))
        return (final, stats), (params_L, saved, final)

    def backward(residuals, cotangents):
        params_L, saved, final = residuals
        d_final, d_stats = cotangents

        def body(d_state, xs):
            params_l, layer, saved_l, d_stats_l = xs
            state_l = _input_state(final, saved_l, layer, plan)
            _, vjp = jax.vjp(lambda p, s: layer_fn(p, s, layer), params_l, state_l)
            d_params_l, d_state_l = vjp((d_state, d_stats_l))
            return d_state_l, d_params_l

        xs = (params_L, jnp.arange(n_layers), saved, d_stats)
        d_state, d_params = jax.lax.scan(body, d_final, xs, reverse=True)
        return d_params, d_state

    @jax.custom_vjp
    def run(params_L, state):
        return forward(params_L, state)[0]

    run.defvjp(forward, backward)
    return run(params_L, state)
