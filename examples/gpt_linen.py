"""A small GPT written from scratch in flax.linen, with deltares depth routing (Delta Block).

    python -m examples.gpt_linen        # from the repository root: a few training steps on Moby-Dick

Attention and MLP are this file's own; deltares supplies only the routing: `DepthRouting`
gives each sublayer its routed input and keeps the sources, `DepthRouter` holds one
sublayer's routing parameters. The blocks are Qwen3-like (pre-norm RMSNorm, attention with
per-head q/k norm and rotary embeddings, SwiGLU, tied embeddings), so the model computes
what deltares' Transformer computes on the same weights (tests/test_own_model.py).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from deltares.data.dataset import TokenData, train_dataset
from deltares.data.documents import BUILTIN
from deltares.data.prepare import prepare
from deltares.nn import BLOCK_MODES, DepthRouter, DepthRouting

init = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 257  # the `bytes` tokenizer
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 128
    mode: str = "delta_block"  # any of deltares' five residual modes
    block_layers: int = 2  # the block modes' block size (the other modes have no blocks)
    rope_theta: float = 1e6
    eps: float = 1e-6

    def routing(self) -> DepthRouting:
        block_layers = self.block_layers if self.mode in BLOCK_MODES else 1
        return DepthRouting(self.mode, self.n_layers, block_layers, epsilon=self.eps)


def rms_norm(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x_BTHE, theta):
    """Rotary embedding, rotate-half layout."""
    T, E = x_BTHE.shape[1], x_BTHE.shape[-1]
    freqs_TE = jnp.arange(T)[:, None] / theta ** (jnp.arange(0, E, 2) / E)[None, :]
    cos, sin = (f(jnp.concatenate([freqs_TE, freqs_TE], -1))[None, :, None, :] for f in (jnp.cos, jnp.sin))
    rotated = jnp.concatenate([-x_BTHE[..., E // 2:], x_BTHE[..., : E // 2]], -1)
    return x_BTHE * cos + rotated * sin


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],)), self.eps)


class Attention(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BTD):
        cfg = self.cfg
        E = cfg.d_model // cfg.n_heads
        q, k, v = (jnp.einsum("btd,dhe->bthe", x_BTD, self.param(n, init, (cfg.d_model, cfg.n_heads, E)))
                   for n in ("q", "k", "v"))
        q = rope(rms_norm(q, self.param("q_norm", nn.initializers.ones, (E,)), cfg.eps), cfg.rope_theta)
        k = rope(rms_norm(k, self.param("k_norm", nn.initializers.ones, (E,)), cfg.eps), cfg.rope_theta)
        T = x_BTD.shape[1]
        scores_BHTC = jnp.einsum("bthe,bche->bhtc", q, k) / jnp.sqrt(E)
        scores_BHTC = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores_BHTC, -jnp.inf)
        out_BTHE = jnp.einsum("bhtc,bche->bthe", jax.nn.softmax(scores_BHTC, axis=-1), v)
        return jnp.einsum("bthe,hed->btd", out_BTHE, self.param("o", init, (cfg.n_heads, E, cfg.d_model)))


class MLP(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BTD):
        D, F = self.cfg.d_model, self.cfg.d_ff
        gate, up = (x_BTD @ self.param(n, init, (D, F)) for n in ("gate", "up"))
        return (nn.silu(gate) * up) @ self.param("down", init, (F, D))


class Block(nn.Module):
    """Layer `layer`: attention then MLP, each reading its routed input and adding its delta."""

    cfg: GPTConfig
    layer: int

    @nn.compact
    def __call__(self, state):
        routing = self.cfg.routing()
        for k, (name, sublayer) in enumerate((("attn", Attention(self.cfg, name="attn")), ("mlp", MLP(self.cfg, name="mlp")))):
            j = 2 * self.layer + k
            x_BTD = routing.input(state, j, DepthRouter(epsilon=self.cfg.eps, name=f"{name}_router"))
            v_BTD = sublayer(RMSNorm(self.cfg.eps, name=f"{name}_norm")(x_BTD))
            state = routing.add(state, j, v_BTD)
        return state


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens_BT):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="embed")
        state = cfg.routing().start(embed(tokens_BT))
        for layer in range(cfg.n_layers):
            state = Block(cfg, layer, name=f"block_{layer}")(state)
        out_BTD = cfg.routing().output(state, DepthRouter(epsilon=cfg.eps, name="final_router"))  # Kimi modes only
        return embed.attend(RMSNorm(cfg.eps, name="final_norm")(out_BTD))


def loss_fn(logits_BTV, targets_BT):
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def builtin_batches(workdir: str, seq_len: int, batch: int, seed: int = 0):
    """Batches [batch, seq_len + 1] of the built-in corpus (Moby-Dick), byte-tokenized into `workdir`."""
    path = os.path.join(workdir, "dataset")
    if not os.path.exists(os.path.join(path, "meta.json")):
        prepare(BUILTIN, "bytes", path, val_fraction=0.05, progress=False)
    return iter(train_dataset(TokenData(path).tokens("train"), seq_len, batch, seed))


def train(cfg: GPTConfig, steps: int = 20, seq_len: int = 64, batch: int = 8, lr: float = 3e-3, workdir=None):
    """Trains `steps` AdamW steps; returns the losses."""
    workdir = workdir or os.path.join(tempfile.gettempdir(), "deltares_examples")
    batches = builtin_batches(workdir, seq_len, batch)
    model, optimizer = GPT(cfg), optax.adamw(lr)
    params = model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens_BT):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, tokens_BT[:, :-1]),
                                                           tokens_BT[:, 1:]))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(next(batches)))
        losses.append(float(loss))
        print(f"step {i + 1:3d}  loss {losses[-1]:.4f}")
    return losses


def main():
    train(GPTConfig())


if __name__ == "__main__":
    main()
