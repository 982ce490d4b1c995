"""The GPT of examples/gpt_linen.py written from scratch in Flax NNX, with deltares depth routing.

    python -m examples.gpt_nnx          # from the repository root: a few training steps on Moby-Dick

It needs the `train` extra (`pip install ".[train]"`), and without it ends with one `error:` line.

The same architecture and configuration as the linen example; deltares supplies the NNX
`DepthStack` (the two sublayers created `n_layers` times with their state stacked, one
`DepthRouter` per sublayer, named and initialised as the linen one, the store-once backward pass).
"""

from __future__ import annotations

import os
import tempfile

import deltares

deltares.require_train("examples/gpt_nnx.py (its data pipeline and optimizer) needs")  # the `train` extra

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from deltares.nn.nnx import DepthStack  # noqa: E402
from examples.gpt_linen import GPTConfig, builtin_batches, loss_fn, rms_norm, rope  # noqa: E402

init = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale, self.eps = nnx.Param(jnp.ones((dim,))), eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        D, H, E = cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads
        self.q, self.k, self.v = (nnx.Param(init(rngs.params(), (D, H, E))) for _ in range(3))
        self.o = nnx.Param(init(rngs.params(), (H, E, D)))
        self.q_norm, self.k_norm = nnx.Param(jnp.ones((E,))), nnx.Param(jnp.ones((E,)))
        self.cfg = cfg

    def __call__(self, x_BTD):
        cfg, E = self.cfg, self.cfg.d_model // self.cfg.n_heads
        q, k, v = (jnp.einsum("btd,dhe->bthe", x_BTD, w[...]) for w in (self.q, self.k, self.v))
        q = rope(rms_norm(q, self.q_norm[...], cfg.eps), cfg.rope_theta)
        k = rope(rms_norm(k, self.k_norm[...], cfg.eps), cfg.rope_theta)
        T = x_BTD.shape[1]
        scores_BHTC = jnp.einsum("bthe,bche->bhtc", q, k) / jnp.sqrt(E)
        scores_BHTC = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores_BHTC, -jnp.inf)
        out_BTHE = jnp.einsum("bhtc,bche->bthe", jax.nn.softmax(scores_BHTC, axis=-1), v)
        return jnp.einsum("bthe,hed->btd", out_BTHE, self.o[...])


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.gate, self.up = (nnx.Param(init(rngs.params(), (D, F))) for _ in range(2))
        self.down = nnx.Param(init(rngs.params(), (F, D)))

    def __call__(self, x_BTD):
        return (nnx.silu(x_BTD @ self.gate[...]) * (x_BTD @ self.up[...])) @ self.down[...]


class PreNorm(nnx.Module):
    """A sublayer of the stack: RMSNorm, then `body` (Attention or MLP), mapping [B, T, D] to its delta."""

    def __init__(self, cfg: GPTConfig, body, rngs: nnx.Rngs):
        self.norm, self.body = RMSNorm(cfg.d_model, cfg.eps), body(cfg, rngs)

    def __call__(self, x_BTD):
        return self.body(self.norm(x_BTD))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, rngs=rngs)
        self.stack = DepthStack(lambda rngs: (PreNorm(cfg, Attention, rngs), PreNorm(cfg, MLP, rngs)), cfg.n_layers,
                                cfg.d_model, cfg.mode, block_layers=cfg.routing().block_layers, epsilon=cfg.eps,
                                rngs=rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.eps)

    def __call__(self, tokens_BT):
        return self.embed.attend(self.final_norm(self.stack(self.embed(tokens_BT))))


def train(cfg: GPTConfig, steps: int = 20, seq_len: int = 64, batch: int = 8, lr: float = 3e-3, workdir=None):
    """Trains `steps` AdamW steps; returns the losses."""
    workdir = workdir or os.path.join(tempfile.gettempdir(), "deltares_examples")
    batches = builtin_batches(workdir, seq_len, batch)
    model = GPT(cfg, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens_BT):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(tokens_BT[:, :-1]), tokens_BT[:, 1:]))(model)
        optimizer.update(model, grads)
        return loss

    losses = []
    for i in range(steps):
        losses.append(float(step(model, optimizer, jnp.asarray(next(batches)))))
        print(f"step {i + 1:3d}  loss {losses[-1]:.4f}")
    return losses


def main():
    train(GPTConfig())


if __name__ == "__main__":
    main()
