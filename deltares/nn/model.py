"""The deltares language model: a Qwen3-style decoder with a pluggable residual scheme.

    e = Embed(tokens);  layers 0..L-1 (DecoderLayer, scanned or unrolled);
    out = route([all sources]) for the Kimi modes, else h_2L;
    logits = Head(RMSNorm(out));  or, given targets, per-token NLL chunked over the sequence
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from deltares.nn.config import REMAT_POLICIES, dtype_of, validate_model_config
from deltares.nn.decoder import DecoderLayer
from deltares.nn.axes import STREAM_AXES
from deltares.nn.depth import depth_scan, init_depth_state, stack_output
from deltares.nn.layers import (
    DepthRouter, Projection, Rope, RMSNorm, _param_init, dense_init, document_rope, rope_tables,
)
from deltares.nn.losses import head_token_nll
from deltares.nn.residual import plan_for, two_phase


def _frozen(cfg):
    if isinstance(cfg, ml_collections.FrozenConfigDict):
        return cfg
    return ml_collections.FrozenConfigDict(cfg)


class Transformer(nn.Module):
    """Decoder LM built from `config.model`. Validates the config when constructed."""

    config: Any

    def __post_init__(self):
        validate_model_config(self.config)
        object.__setattr__(self, "config", _frozen(self.config))
        super().__post_init__()

    def _store_once(self, plan) -> bool:
        """Routed modes under remat differentiate depth with `depth_scan` (sources stored once);
        initialisation always goes through nn.scan, which creates the stacked parameters."""
        return plan.uses_sources and self.config.remat != "none" and not self.is_initializing()

    def _layer_class(self):
        layer = DecoderLayer
        if self.config.remat != "none":
            # unrolled: the layer index stays a Python int (its sources are a tuple, deltares.nn.depth)
            static = () if self.config.scan_layers else (2,)
            layer = nn.remat(layer, prevent_cse=not self.config.scan_layers, policy=REMAT_POLICIES[self.config.remat],
                             static_argnums=static)
        return layer

    def _layers(self, layer_cls, state, rope, return_stats, cache=None, pos=None):
        """The L layers, scanned or unrolled, threading each layer's attention cache when decoding.
        Returns (state, stacked stats or None, new cache or None)."""
        cfg = self.config
        if cfg.scan_layers:
            scanned = nn.scan(
                layer_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, 0, nn.broadcast),
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
                unroll=cfg.n_layers if cfg.scan_unroll else 1,
            )
            layers = jnp.arange(cfg.n_layers)
            state, out = scanned(cfg, return_stats, name="layers")(state, layers, rope, cache, pos)
        else:
            per_layer = []
            for layer in range(cfg.n_layers):
                layer_cache = None if cache is None else jax.tree.map(lambda c: c[layer], cache)
                state, out_l = layer_cls(cfg, return_stats, name=f"layers_{layer}")(
                    state, layer, rope, layer_cache, pos
                )
                per_layer.append(out_l)
            out = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
        stats, cache = out if cache is not None else (out, None)
        return state, stats, cache

    @nn.compact
    def __call__(self, tokens_BT, return_stats: bool = False, cache=None, pos=0, logits_at=None, targets_BT=None,
                 segments_BT=None):
        """Logits [B, T, V] (float32), and routing stats with `return_stats`.

        `targets_BT` (the loss path): per-token NLL [B, T] (float32) of those targets in place
        of the logits, computed `config.loss_chunk` tokens at a time (`head_token_nll`), so
        the [B, T, V] float32 logits never exist at once.

        Decoding: with `cache` (from `init_cache`) the tokens sit at positions pos..pos+T-1
        after the cached ones, and the call returns (logits, new cache). Routing is per
        token, so only attention needs a cache; every residual mode decodes the same way.
        `logits_at` [B] (prefilling right-padded prompts): logits [B, 1, V] of one position
        per row only, so the head never runs over the whole prompt.
        `segments_BT` (document masks, `config.data.document_mask`): each row's documents numbered in
        order; a token attends only to its own document, whose positions start at 0."""
        cfg = self.config
        if cache is not None and return_stats:
            raise ValueError("return_stats is not available while decoding with a cache")
        if targets_BT is not None and (cache is not None or logits_at is not None):
            raise ValueError("targets_BT (the loss) is not available with a cache or logits_at")
        dtype, param_dtype = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        plan = plan_for(cfg)
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
        if cache is not None:  # decoding: nothing is differentiated, no remat
            state, _, cache = self._layers(DecoderLayer, state, rope, False, cache, pos)
        elif cfg.scan_layers and self._store_once(plan):
            layer = DecoderLayer(cfg, return_stats, parent=None)

            def layer_fn(params_l, state, index, only=None, prefix=None):
                return layer.apply({"params": params_l}, state, index, rope, only=only, prefix=prefix)

            params_L = nn.meta.unbox(self.variables["params"]["layers"])
            grouped = two_phase(cfg) and not return_stats  # statistics need every weight: one pass per sublayer
            state, stats = depth_scan(layer_fn, params_L, state, plan, unroll=cfg.scan_unroll, eps=cfg.norm_eps,
                                      queries_fn=layer_queries if grouped else None, impl=cfg.residual.impl,
                                      interpret=cfg.residual.interpret)
        else:
            state, stats, _ = self._layers(self._layer_class(), state, rope, return_stats)

        if plan.replaces_stream:
            res = cfg.residual
            final_router = DepthRouter(impl=res.impl, interpret=res.interpret,
                                       epsilon=cfg.norm_eps, name="final_router")
        else:
            final_router = None
        out_BTD = stack_output(plan, state, final_router)
        if logits_at is not None:
            out_BTD = jnp.take_along_axis(out_BTD, jnp.asarray(logits_at)[:, None, None], axis=1)
        x_BTD = RMSNorm(cfg.norm_eps, dtype, param_dtype, name="final_norm")(out_BTD)
        if cfg.tie_embeddings:
            head = embed.attend
        else:
            head = Projection(
                "btd,dv->btv", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dtype, param_dtype, name="lm_head"
            )
        if targets_BT is None:
            result = head(x_BTD).astype(jnp.float32)  # logits [B, T, V]
        else:  # the head's kernel [D, V] (tied: the embedding table transposed), chunked NLL [B, T]
            kernel_DV = embed.embedding.T if cfg.tie_embeddings else head.kernel
            kernel_DV = nn.with_logical_constraint(kernel_DV, ("embed", "vocab"))
            result = head_token_nll(x_BTD, kernel_DV, targets_BT, cfg.loss_chunk, dtype)
        if cache is not None:
            return result, cache
        if not return_stats:
            return result
        n_sub = 2 * cfg.n_layers
        stats = {k: v.reshape((n_sub,) + v.shape[2:]) for k, v in stats.items()}
        stats["n_sources"] = jnp.asarray(plan.n_sources)
        return result, stats


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
