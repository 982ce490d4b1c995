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

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from deltares.nn import routing
from deltares.nn.config import dtype_of
from deltares.nn.depth import DepthState, Prefix, add_delta, sublayer_input, sublayer_prefix
from deltares.nn.layers import MLP, Attention, DepthRouter, RMSNorm
from deltares.nn.residual import ResidualPlan, plan_for


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

    def _delta(self, j, state: DepthState, plan: ResidualPlan, router: str, body, final: bool = False,
               prefix: Prefix | None = None):
        """Sublayer j's delta v_j = f_j(norm(x_j)) on `state` (`final`: holding the final buffer;
        `prefix`: two-phase routing; deltares.nn.depth.sublayer_input), and its routing stats."""
        cfg = self.config
        norm = RMSNorm(cfg.norm_eps, dtype_of(cfg.dtype), dtype_of(cfg.param_dtype), name=f"{router}_norm")
        if plan.uses_sources:
            res = cfg.residual
            # statistics need the weights; a null source has no kernel outside the two-phase merge (which
            # is XLA): initialisation and decoding route it in XLA
            impl = "xla" if self.return_stats or (res.null_source and prefix is None) else res.impl
            router_module = DepthRouter(res.gate, res.null_source, impl, res.interpret, cfg.norm_eps,
                                        name=f"{router}_router")
            x_BTD, weights_SBT, routed = sublayer_input(plan, state, j, router_module, res.null_source, cfg.norm_eps,
                                                        final, prefix)
            if prefix is not None and self.return_stats:
                raise ValueError("routing statistics need the whole weights: call without a prefix")
            stats = routing_stats(weights_SBT, routed) if self.return_stats else None
        else:
            x_BTD, stats = state.h_BTD, (empty_stats(plan.n_slots) if self.return_stats else None)
        return body(norm(x_BTD)).astype(state.h_BTD.dtype), stats

    def _write(self, j, state: DepthState, v_BTD, plan: ResidualPlan) -> DepthState:
        """h_{j+1} = h_j + v_j, and v_j into sublayer j's write slot (deltares.nn.depth.add_delta)."""
        return add_delta(plan, state, j, v_BTD, self.config.norm_eps)

    @nn.compact
    def __call__(self, state: DepthState, layer, rope, cache=None, pos=None, only=None, prefix=None):
        """Returns (state, stats); with an attention `cache` (decoding, see Attention),
        (state, (stats, new cache)). With `only` (0: attention, 1: MLP), runs that sublayer
        alone on `state`, which holds the final source buffer, and returns its delta and the delta's
        1/rms, writing nothing (the store-once backward, deltares.nn.depth). `prefix`: the layer's
        two-phase routing `Prefix` (deltares.nn.depth.depth_scan with `queries_fn`)."""
        cfg = self.config
        plan = plan_for(cfg)
        dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, dtype, param_dtype, cfg.attention,
                         cfg.residual.interpret, name="attn")
        mlp = MLP(cfg.d_ff, dtype, param_dtype, name="mlp")
        new_cache = []

        def attend(x_BTD):
            if cache is None:
                return attn(x_BTD, rope)
            out_BTD, updated = attn(x_BTD, rope, cache, pos)
            new_cache.append(updated)
            return out_BTD

        sublayers = (("attn", attend), ("mlp", mlp))
        if only is not None:
            v_BTD, _ = self._delta(2 * layer + only, state, plan, *sublayers[only], final=True,
                                   prefix=sublayer_prefix(prefix, only))
            return v_BTD, routing.inv_rms(v_BTD, cfg.norm_eps)
        per_sublayer = []
        for k, (router, body) in enumerate(sublayers):
            v_BTD, stats = self._delta(2 * layer + k, state, plan, router, body, prefix=sublayer_prefix(prefix, k))
            state = self._write(2 * layer + k, state, v_BTD, plan)
            per_sublayer.append(stats)
        stats = jax.tree.map(lambda a, b: jnp.stack([a, b]), *per_sublayer) if self.return_stats else None
        return (state, stats) if cache is None else (state, (stats, new_cache[0]))
