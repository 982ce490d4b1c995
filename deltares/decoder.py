"""One transformer layer (attention then MLP) under any of the five residual modes.

The layer carries `DepthState`: the additive stream h, and for routed modes the
source buffer with each slot's cached 1/rms. For sublayer j:

    x_j = h_j                          baseline, or a sublayer with one source (additive)
    x_j = route(S_j)                   full_attnres, block_attnres  (replacement)
    x_j = h_j + route(S_j)             delta, delta_block           (additive)
    v_j = f_j(x_j);  h_{j+1} = h_j + v_j;  slot write[j] += v_j

The two Kimi modes and the two Delta modes differ only in `replaces_stream`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from deltares import routing
from deltares.config import BLOCK_MODES, dtype_of
from deltares.layers import MLP, Attention, DepthRouter, RMSNorm
from deltares.residual import ResidualPlan, plan_for


STREAM_AXES = ("batch", "length", "act_embed")  # logical names of the stream and of each source
SOURCES_AXES = ("sources",) + STREAM_AXES


class DepthState(NamedTuple):
    h_BTD: jax.Array  # additive stream e + sum of deltas so far
    sources_SBTD: jax.Array | None  # source buffer (None in baseline)
    inv_rms_SBT: jax.Array | None  # float32 1/rms of every slot


def init_depth_state(e_BTD, plan: ResidualPlan, eps: float) -> DepthState:
    """Stream = e; slot 0 of the buffer holds e, all other slots are zero."""
    if not plan.uses_sources:
        return DepthState(e_BTD, None, None)
    sources = jnp.zeros((plan.n_slots,) + e_BTD.shape, e_BTD.dtype).at[0].set(e_BTD)
    sources = nn.with_logical_constraint(sources, SOURCES_AXES)
    inv = jnp.zeros((plan.n_slots,) + e_BTD.shape[:2], jnp.float32).at[0].set(routing.inv_rms(e_BTD, eps))
    return DepthState(e_BTD, sources, inv)


def routing_stats(weights_SBT, routed):
    """Mean weight per slot [S], mean max weight and mean entropy; zeros when not routed.
    Diagnostics only: no gradient flows through them."""
    weights_SBT = jax.lax.stop_gradient(weights_SBT)
    scale = routed.astype(jnp.float32)
    entropy_BT = -jnp.sum(weights_SBT * jnp.log(jnp.where(weights_SBT > 0, weights_SBT, 1.0)), axis=0)
    return dict(
        weights=weights_SBT.mean(axis=(1, 2)) * scale,
        max_weight=weights_SBT.max(axis=0).mean() * scale,
        entropy=entropy_BT.mean() * scale,
    )


def empty_stats(n_slots: int):
    return dict(weights=jnp.zeros((n_slots,), jnp.float32), max_weight=jnp.float32(0), entropy=jnp.float32(0))


class DecoderLayer(nn.Module):
    """Layer `l` of a Transformer with config `config` (a `config.model`)."""

    config: Any
    return_stats: bool = False

    def _delta(self, j, state: DepthState, plan: ResidualPlan, router: str, body):
        """Sublayer j's delta v_j = f_j(norm(x_j)) on `state`, and its routing stats."""
        cfg = self.config
        norm = RMSNorm(cfg.norm_eps, dtype_of(cfg.dtype), dtype_of(cfg.param_dtype), name=f"{router}_norm")
        if plan.uses_sources:
            res = cfg.residual
            valid_S = jnp.asarray(plan.read)[j]
            # A null source is one more source: with it every sublayer routes.
            routed = jnp.asarray(plan.routed | res.get("null_source", False))[j]
            residual = None if plan.replaces_stream else state.h_BTD
            impl = "xla" if self.return_stats else res.get("impl", "xla")  # statistics need the weights
            router_module = DepthRouter(res.get("gate", False), res.get("null_source", False), impl,
                                        res.get("interpret", False), cfg.norm_eps, name=f"{router}_router")
            x_BTD, weights_SBT = router_module(state.sources_SBTD, state.inv_rms_SBT, valid_S, residual)
            if residual is not None:  # single source: no routing, x = h (DESIGN.md section 3)
                x_BTD = jnp.where(routed, x_BTD, state.h_BTD)
            stats = routing_stats(weights_SBT, routed) if self.return_stats else None
        else:
            x_BTD, stats = state.h_BTD, (empty_stats(plan.n_slots) if self.return_stats else None)
        return body(norm(x_BTD)).astype(state.h_BTD.dtype), stats

    def _write(self, j, state: DepthState, v_BTD, plan: ResidualPlan) -> DepthState:
        """h_{j+1} = h_j + v_j, and v_j into sublayer j's write slot."""
        h_BTD = nn.with_logical_constraint(state.h_BTD + v_BTD, STREAM_AXES)
        if not plan.uses_sources:
            return DepthState(h_BTD, None, None)
        slot = jnp.asarray(plan.write)[j]
        # Block modes accumulate the block's partial; other modes write a fresh slot once
        # (overwriting, which lets the store-once backward recompute from the final buffer).
        slot_BTD = state.sources_SBTD[slot] + v_BTD if plan.mode in BLOCK_MODES else v_BTD
        sources = nn.with_logical_constraint(state.sources_SBTD.at[slot].set(slot_BTD), SOURCES_AXES)
        inv = state.inv_rms_SBT.at[slot].set(routing.inv_rms(slot_BTD, self.config.norm_eps))
        return DepthState(h_BTD, sources, inv)

    @nn.compact
    def __call__(self, state: DepthState, layer, cos_TH, sin_TH, cache=None, pos=None, only=None):
        """Returns (state, stats); with an attention `cache` (decoding, see Attention),
        (state, (stats, new cache)). With `only` (0: attention, 1: MLP), runs that sublayer
        alone on `state` and returns its delta and the delta's 1/rms, writing nothing (the
        store-once backward, deltares.depth)."""
        cfg = self.config
        plan = plan_for(cfg)
        dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, dtype, param_dtype, name="attn")
        mlp = MLP(cfg.d_ff, dtype, param_dtype, name="mlp")
        new_cache = []

        def attend(x_BTD):
            if cache is None:
                return attn(x_BTD, cos_TH, sin_TH)
            out_BTD, updated = attn(x_BTD, cos_TH, sin_TH, cache, pos)
            new_cache.append(updated)
            return out_BTD

        sublayers = (("attn", attend), ("mlp", mlp))
        if only is not None:
            v_BTD, _ = self._delta(2 * layer + only, state, plan, *sublayers[only])
            return v_BTD, routing.inv_rms(v_BTD, cfg.norm_eps)
        per_sublayer = []
        for k, (router, body) in enumerate(sublayers):
            v_BTD, stats = self._delta(2 * layer + k, state, plan, router, body)
            state = self._write(2 * layer + k, state, v_BTD, plan)
            per_sublayer.append(stats)
        stats = jax.tree.map(lambda a, b: jnp.stack([a, b]), *per_sublayer) if self.return_stats else None
        return (state, stats) if cache is None else (state, (stats, new_cache[0]))
