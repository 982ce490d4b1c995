"""The deltares language model: a Qwen3-style decoder with a pluggable residual scheme.

    e = Embed(tokens);  layers 0..L-1 (DecoderLayer, scanned or unrolled);
    out = route([all sources]) for the Kimi modes, else h_2L;
    logits = Head(RMSNorm(out));  or, given targets, per-token NLL chunked over the sequence
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from deltares.nn.axes import STREAM_AXES
from deltares.nn.config import REMAT_POLICIES, dtype_of, validate_model_config
from deltares.nn.decoder import DecoderLayer, router_impl
from deltares.nn.depth import init_depth_state, stack_output
from deltares.nn.layers import (
    DepthRouter, Projection, Rope, RMSNorm, _param_init, dense_init, document_rope, rope_tables,
)
from deltares.nn.losses import head_token_nll
from deltares.nn.residual import two_phase
from deltares.nn.routed import STATS_COLLECTION, DepthRouting, sublayer_stats, wants_stats
from deltares.nn.stack import stack_layers


def _frozen(cfg):
    import ml_collections  # here, not at the top: the layers of deltares.nn do without it

    if isinstance(cfg, ml_collections.FrozenConfigDict):
        return cfg
    return ml_collections.FrozenConfigDict(cfg)


class Transformer(nn.Module):
    """deltares' decoder language model (Qwen3-style: grouped-query attention with q/k RMSNorm and
    rotary embeddings, SwiGLU MLP) under the residual scheme of its config; its layers run as one
    stack (deltares.nn.stack.stack_layers: scanned or unrolled, remat and the store-once pass).
    Validates the config when constructed (one ValueError naming the field).

    Attributes:
        config: a `config.model` (`model_config`; the fields are in the config reference).

    Example:
        ```python
        import jax
        import jax.numpy as jnp
        from deltares.nn import Transformer, model_config

        cfg = model_config(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128,
                           dtype="float32", residual=dict(mode="delta_block", block_layers=1))
        model = Transformer(cfg)
        tokens_BT = jnp.zeros((2, 16), jnp.int32)
        variables = model.init(jax.random.key(0), tokens_BT)
        logits_BTV, stats = model.apply(variables, tokens_BT, return_stats=True)
        print(logits_BTV.shape, stats["entropy"].shape)  # (2, 16, 256) (4,): one per sublayer
        ```
    """

    config: Any

    def __post_init__(self):
        validate_model_config(self.config)
        object.__setattr__(self, "config", _frozen(self.config))
        super().__post_init__()

    def _layers(self, routing: DepthRouting, state, rope, return_stats: bool, cache=None, pos=None):
        """The L layers (deltares.nn.stack.stack_layers: the one layer stack, scanned or unrolled, with
        remat and the store-once pass), threading each layer's attention cache when decoding
        (nothing differentiated: no remat). Returns (state, stacked stats or None, new cache or None)."""
        cfg = self.config
        decoding = cache is not None
        grouped = two_phase(cfg) and not return_stats  # statistics need every weight: one pass per sublayer
        state, out = stack_layers(
            self, DecoderLayer, (cfg, return_stats), routing, state, (rope, pos), xs=cache, scan=cfg.scan_layers,
            remat=cfg.remat != "none" and not decoding, policy=REMAT_POLICIES[cfg.remat], unroll=cfg.scan_unroll,
            queries_fn=layer_queries if grouped else None, impl=cfg.residual.impl, interpret=cfg.residual.interpret)
        stats, cache = out if decoding else (out, None)
        return state, stats, cache

    @nn.compact
    def __call__(self, tokens_BT, return_stats: bool = False, cache=None, pos=0, logits_at=None, targets_BT=None,
                 segments_BT=None):
        """The logits, or the loss's per-token NLL, of a batch of token sequences.

        Args:
            tokens_BT: token ids [B, T] (int).
            return_stats: also return the routing statistics per sublayer (`n_sources`, `max_weight`,
                `entropy` [2L], `weights` [2L, S]; deltares.nn.routed.sublayer_stats); they are also
                sown as `variables["routing"]["stats"]` where `routing` is mutable.
            cache: decoding: the attention cache (`init_cache`); the tokens sit at positions
                pos..pos+T-1 after the cached ones, and the call returns (logits, new cache). Routing
                is per token, so only attention needs a cache; every residual mode decodes the same way.
            pos: decoding: the position of the first token (an int or an int32 scalar).
            logits_at: [B] (prefilling right-padded prompts): the logits of one position per row only,
                [B, 1, V], so the head never runs over the whole prompt.
            targets_BT: the loss path: the per-token NLL [B, T] (float32) of these targets in place of
                the logits, computed `config.loss_chunk` tokens at a time, so the [B, T, V] float32
                logits never exist at once.
            segments_BT: document masks (`config.data.document_mask`): each row's documents numbered
                in order; a token attends only to its own document, whose positions start at 0.

        Returns:
            The logits [B, T, V] (float32), or the NLL [B, T]; with `return_stats` (that, stats); with
            `cache` (logits, new cache).
        """
        cfg = self.config
        if cache is not None and return_stats:
            raise ValueError("return_stats is not available while decoding with a cache")
        if targets_BT is not None and (cache is not None or logits_at is not None):
            raise ValueError("targets_BT (the loss) is not available with a cache or logits_at")
        dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        routing = DepthRouting.from_config(cfg)
        plan = routing.plan
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=_param_init(dense_init, ("vocab", "embed")),
            dtype=dtype,
            param_dtype=param_dtype,
            name="embed",
        )
        e_BTD = nn.with_logical_constraint(embed(tokens_BT), STREAM_AXES)
        if segments_BT is None:
            rope = Rope(*rope_tables(pos + jnp.arange(tokens_BT.shape[1]), cfg.head_dim, cfg.rope_theta))
        else:
            rope = document_rope(segments_BT, cfg.head_dim, cfg.rope_theta)
        state = init_depth_state(e_BTD, plan, cfg.norm_eps, listed=not cfg.scan_layers)
        want_stats = cache is None and (return_stats or wants_stats(self))
        state, stats, cache = self._layers(routing, state, rope, want_stats, cache, pos)
        if want_stats:
            stats = sublayer_stats(stats, plan)
            if wants_stats(self):
                self.sow(STATS_COLLECTION, "stats", stats)

        final_router = None
        if plan.replaces_stream:
            res = cfg.residual
            final_router = DepthRouter(impl=router_impl(cfg), interpret=res.interpret, epsilon=cfg.norm_eps,
                                       name="final_router")
        out_BTD = stack_output(plan, state, final_router)
        if logits_at is not None:
            out_BTD = jnp.take_along_axis(out_BTD, jnp.asarray(logits_at)[:, None, None], axis=1)
        result = self._head(embed, RMSNorm(cfg.norm_eps, dtype, param_dtype, name="final_norm")(out_BTD), targets_BT)
        if cache is not None:
            return result, cache
        return (result, stats) if return_stats else result


    def _head(self, embed: nn.Embed, x_BTD, targets_BT):
        """Logits [B, T, V] (float32), or given targets their per-token NLL [B, T] computed in chunks by
        `head_token_nll` from the head's kernel [D, V] (tied: the embedding table transposed)."""
        cfg = self.config
        dtype = dtype_of(cfg.dtype)
        if cfg.tie_embeddings:
            head = embed.attend
        else:
            head = Projection("btd,dv->btv", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dtype,
                              dtype_of(cfg.param_dtype), name="lm_head")
        if targets_BT is None:
            return head(x_BTD).astype(jnp.float32)
        kernel_DV = embed.embedding.T if cfg.tie_embeddings else head.kernel
        kernel_DV = nn.with_logical_constraint(kernel_DV, ("embed", "vocab"))
        return head_token_nll(x_BTD, kernel_DV, targets_BT, cfg.loss_chunk, dtype)


def layer_queries(params_l):
    """A DecoderLayer's two routers' query and gain, each [2, D] (attention, MLP): what two-phase
    routing reads before running the layer (deltares.nn.depth.depth_scan)."""
    routers = (params_l["attn_router"], params_l["mlp_router"])
    return tuple(jnp.stack([r[name] for r in routers]) for name in ("query", "gain"))


def init_cache(model_cfg, batch: int, max_len: int):
    """An empty attention cache for `batch` sequences of up to `max_len` tokens:
    (keys, values), each [L, B, max_len, n_kv_heads, head_dim] in the compute dtype."""
    shape = (model_cfg.n_layers, batch, max_len, model_cfg.n_kv_heads, model_cfg.head_dim)
    return tuple(jnp.zeros(shape, dtype_of(model_cfg.dtype)) for _ in range(2))


__all__ = ["Transformer", "init_cache", "layer_queries"]
