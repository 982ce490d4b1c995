"""One transformer layer (attention then MLP) under any residual mode.

The layer carries `DepthState`: the additive stream h, and for routed modes the
source buffer with each slot's cached 1/rms. For sublayer j:

    x_j = h_j                          baseline, or a sublayer with one source (additive)
    x_j = route(S_j)                   full_attnres, block_attnres  (replacement)
    x_j = h_j + route(S_j)             delta, delta_block           (additive)
    v_j = f_j(RMSNorm(x_j));  h_{j+1} = h_j + v_j;  slot write[j] += v_j

The two Kimi modes and the two Delta modes differ only in `replaces_stream`. The routing itself
is `DepthRouting.layer` (deltares.nn.routed), the code a user's own layers run too; this module
supplies the Qwen3 sublayers and their routers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from deltares.nn.config import dtype_of
from deltares.nn.depth import DepthState
from deltares.nn.layers import MLP, Attention, RMSNorm
from deltares.nn.routed import DepthRouting


def router_impl(model_cfg, return_stats: bool = False, two_phase: bool = False) -> str:
    """The routing implementation of the Transformer's routers: `residual.impl`, but XLA where statistics need
    the weights, where a null source has no kernel (outside the two-phase merge, which is XLA), and for "auto"
    under remat: the backward pass would recompute the kernel's forward and the stacking of its sources
    (1044M on an H200, 12 layers, remat full: XLA 1.035x baseline's step, the kernel 1.052x). "auto" is then
    resolved by platform (kernels_pallas.depth_route.api.implementation_for)."""
    res = model_cfg.residual
    if return_stats or (res.null_source and not two_phase) or (res.impl == "auto" and model_cfg.remat != "none"):
        return "xla"
    return res.impl


class DecoderLayer(nn.Module):
    """Layer `l` of a Transformer with config `config` (a `config.model`)."""

    config: Any
    return_stats: bool = False

    def _router(self, name: str, k: int, routing: DepthRouting, two_phase: bool):
        """Sublayer `name`'s (the k-th of two) router, or None (`DepthRouting.has_router`)."""
        res = self.config.residual
        impl = router_impl(self.config, self.return_stats, two_phase)
        return routing.linen_router(k, 2, f"{name}_router", gate=res.gate, null_source=res.null_source, impl=impl,
                                    interpret=res.interpret)

    def _pre_norm(self, name: str, body):
        """f(x) = body(RMSNorm(x)), the norm named `name + "_norm"`."""
        cfg = self.config
        norm = RMSNorm(cfg.norm_eps, dtype_of(cfg.dtype), dtype_of(cfg.param_dtype), name=f"{name}_norm")
        return lambda x_BTD: body(norm(x_BTD))

    @nn.compact
    def __call__(self, state: DepthState, layer, cache, rope, pos=None, only=None, prefix=None):
        """Returns (state, stats); with an attention `cache` (decoding, see Attention),
        (state, (stats, new cache)). With `only` (0: attention, 1: MLP), runs that sublayer
        alone on `state`, which holds the final source buffer, and returns its delta and the delta's
        1/rms, writing nothing (the store-once backward, deltares.nn.depth). `prefix`: the layer's
        two-phase routing `Prefix` (deltares.nn.depth.depth_scan with `queries_fn`)."""
        cfg = self.config
        routing = DepthRouting.from_config(cfg)
        dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        attn = Attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, dtype, param_dtype, cfg.attention,
                         cfg.residual.interpret, name="attn")
        new_cache = []

        def attend(x_BTD):
            if cache is None:
                return attn(x_BTD, rope)
            out_BTD, updated = attn(x_BTD, rope, cache, pos)
            new_cache.append(updated)
            return out_BTD

        bodies = (("attn", attend), ("mlp", MLP(cfg.d_ff, dtype, param_dtype, name="mlp")))
        pairs = [(self._router(name, k, routing, prefix is not None), self._pre_norm(name, body))
                 for k, (name, body) in enumerate(bodies)]
        out = routing.layer(state, layer, pairs, only=only, prefix=prefix, stats=self.return_stats)
        if only is not None or cache is None:
            return out
        state, stats = out
        return state, (stats, new_cache[0])


__all__ = ["DecoderLayer"]
