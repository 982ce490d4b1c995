"""A small GPT written from scratch in flax.linen, with deltares depth routing (Delta Block).

    python -m examples.gpt_linen        # from the repository root: a few training steps on Moby-Dick,
                                        # then a few tokens generated with the KV cache

It needs the `train` extra (`pip install ".[train]"`: the data pipeline and the optimizer), and
without it ends with one `error:` line naming what is missing, as the tools do.

Attention and MLP are this file's own; deltares supplies only the routing: `DepthStack` stacks
the two sublayers `n_layers` times (parameters on a leading layer axis, one `DepthRouter` per
sublayer, the store-once backward pass). The blocks are Qwen3-like (pre-norm RMSNorm, attention
with per-head q/k norm and rotary embeddings, SwiGLU, tied embeddings), so the model computes
what deltares' Transformer computes on the same weights (tests/test_own_model.py). With
`decode=True` attention keeps a key/value cache (the `cache` collection, stacked per layer by
the stack) and `generate` produces tokens one at a time, as the full forward pass would.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import deltares

deltares.require_train("examples/gpt_linen.py (its data pipeline and optimizer) needs")  # the `train` extra

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from deltares.data.dataset import TokenData, train_dataset  # noqa: E402
from deltares.data.documents import BUILTIN  # noqa: E402
from deltares.data.prepare import prepare  # noqa: E402
from deltares.nn import BLOCK_MODES, DepthRouting, DepthStack  # noqa: E402

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


def rope(x_BTHE, theta, positions_T=None):
    """Rotary embedding, rotate-half layout, at `positions_T` (default 0 .. T-1)."""
    T, E = x_BTHE.shape[1], x_BTHE.shape[-1]
    positions_T = jnp.arange(T) if positions_T is None else positions_T
    freqs_TE = positions_T[:, None] / theta ** (jnp.arange(0, E, 2) / E)[None, :]
    cos, sin = (f(jnp.concatenate([freqs_TE, freqs_TE], -1))[None, :, None, :] for f in (jnp.cos, jnp.sin))
    rotated = jnp.concatenate([-x_BTHE[..., E // 2:], x_BTHE[..., : E // 2]], -1)
    return x_BTHE * cos + rotated * sin


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],)), self.eps)


class Attention(nn.Module):
    """Causal attention; with `decode`, over a key/value cache: variables["cache"] holds the keys
    and values [B, C, H, E] of the positions so far and `index`, the next position. `init` on
    tokens [B, C] sizes the cache for C positions; each call then writes its T tokens at
    index .. index + T - 1 and attends to everything up to each of them."""

    cfg: GPTConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x_BTD):
        cfg = self.cfg
        E = cfg.d_model // cfg.n_heads
        q, k, v = (jnp.einsum("btd,dhe->bthe", x_BTD, self.param(n, init, (cfg.d_model, cfg.n_heads, E)))
                   for n in ("q", "k", "v"))
        B, T = x_BTD.shape[:2]
        positions_T, cached = jnp.arange(T), False
        if self.decode:
            cached = self.has_variable("cache", "k")  # after init: decoding
            k_cache = self.variable("cache", "k", jnp.zeros, (B, T, cfg.n_heads, E))
            v_cache = self.variable("cache", "v", jnp.zeros, (B, T, cfg.n_heads, E))
            index = self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
            if cached:
                positions_T = index.value + jnp.arange(T)
        q = rope(rms_norm(q, self.param("q_norm", nn.initializers.ones, (E,)), cfg.eps), cfg.rope_theta, positions_T)
        k = rope(rms_norm(k, self.param("k_norm", nn.initializers.ones, (E,)), cfg.eps), cfg.rope_theta, positions_T)
        if cached:
            k_cache.value = jax.lax.dynamic_update_slice(k_cache.value, k, (0, index.value, 0, 0))
            v_cache.value = jax.lax.dynamic_update_slice(v_cache.value, v, (0, index.value, 0, 0))
            index.value = index.value + T
            k, v = k_cache.value, v_cache.value
        C = k.shape[1]
        scores_BHTC = jnp.einsum("bthe,bche->bhtc", q, k) / jnp.sqrt(E)
        scores_BHTC = jnp.where(jnp.arange(C)[None, :] <= positions_T[:, None], scores_BHTC, -jnp.inf)
        out_BTHE = jnp.einsum("bhtc,bche->bthe", jax.nn.softmax(scores_BHTC, axis=-1), v)
        return jnp.einsum("bthe,hed->btd", out_BTHE, self.param("o", init, (cfg.n_heads, E, cfg.d_model)))


class MLP(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x_BTD):
        D, F = self.cfg.d_model, self.cfg.d_ff
        gate, up = (x_BTD @ self.param(n, init, (D, F)) for n in ("gate", "up"))
        return (nn.silu(gate) * up) @ self.param("down", init, (F, D))


class PreNorm(nn.Module):
    """A sublayer of the stack: RMSNorm, then `body` (Attention or MLP), mapping [B, T, D] to its delta."""

    cfg: GPTConfig
    body: type
    decode: bool = False

    @nn.compact
    def __call__(self, x_BTD):
        kw = dict(decode=self.decode) if self.body is Attention else {}
        return self.body(self.cfg, name="body", **kw)(RMSNorm(self.cfg.eps, name="norm")(x_BTD))


class GPT(nn.Module):
    """Embedding, the `DepthStack` of n_layers (attention, MLP) layers, final norm, tied head.
    Parameters: `embed`, `stack` (`layers`: attn, attn_router, mlp, mlp_router, each leaf
    [n_layers, ...]; `final_router` in the Kimi modes), `final_norm`."""

    cfg: GPTConfig
    decode: bool = False

    @nn.compact
    def __call__(self, tokens_BT):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="embed")
        sublayers = (functools.partial(PreNorm, cfg, Attention, self.decode), functools.partial(PreNorm, cfg, MLP))
        stack = DepthStack(sublayers, cfg.n_layers, cfg.mode, block_layers=cfg.routing().block_layers,
                           epsilon=cfg.eps, name="stack")
        return embed.attend(RMSNorm(cfg.eps, name="final_norm")(stack(embed(tokens_BT))))


def generate(cfg: GPTConfig, params, prompt_BP, steps: int):
    """Greedy decoding with the KV cache: the prompt [B, P] in one call, then one token per call.
    Returns (the `steps` new tokens [B, steps], their logits [B, steps, V])."""
    model = GPT(cfg, decode=True)
    B, P = prompt_BP.shape
    cache = model.init(jax.random.key(0), jnp.zeros((B, P + steps), jnp.int32))["cache"]
    step = jax.jit(lambda cache, tokens_BT: model.apply({"params": params, "cache": cache}, tokens_BT,
                                                        mutable=["cache"]))
    logits_BTV, written = step(cache, prompt_BP)
    tokens, logits = [], []
    for _ in range(steps):
        logits.append(logits_BTV[:, -1])
        tokens.append(jnp.argmax(logits[-1], axis=-1).astype(jnp.int32))
        logits_BTV, written = step(written["cache"], tokens[-1][:, None])
    return jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1)


def loss_fn(logits_BTV, targets_BT):
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def builtin_batches(workdir: str, seq_len: int, batch: int, seed: int = 0):
    """Batches [batch, seq_len + 1] of the built-in corpus (Moby-Dick), byte-tokenized into `workdir`."""
    path = os.path.join(workdir, "dataset")
    if not os.path.exists(os.path.join(path, "meta.json")):
        prepare(BUILTIN, "bytes", path, val_fraction=0.05, progress=False)
    return iter(train_dataset(TokenData(path).tokens("train"), seq_len, batch, seed))


def train(cfg: GPTConfig, steps: int = 20, seq_len: int = 64, batch: int = 8, lr: float = 3e-3, workdir=None,
          return_params: bool = False):
    """Trains `steps` AdamW steps; returns the losses (with `return_params`, and the parameters)."""
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
    return (losses, params) if return_params else losses


def main():
    cfg = GPTConfig()
    _, params = train(cfg, return_params=True)
    prompt = jnp.asarray([list(b"Call me Ishmael.")], jnp.int32)
    tokens, _ = generate(cfg, params, prompt, steps=16)
    print("generated:", repr(bytes(int(t) % 256 for t in tokens[0])))


if __name__ == "__main__":
    main()
