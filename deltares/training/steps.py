"""Pure training and evaluation steps: state in, state out.

The train state is a dict `{step, params, opt_state}` of float32 master weights
and optimizer state; the model computes in `config.model.dtype`. A batch is
`[B, T + 1]` tokens: inputs are the first T, targets the last T.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from deltares.nn.losses import masked_mean
from deltares.nn.model import Transformer
from deltares.training.optim import make_optimizer


def abstract_params(model: Transformer, seq_len: int):
    """Shapes (and logical names, boxed) of the parameters, without allocating them."""
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def make_init(model: Transformer, tx: optax.GradientTransformation, seq_len: int):
    """seed -> initial train state (to be jitted)."""

    def init(seed):
        params = model.init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))["params"]
        params = nn.meta.unbox(params)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return init


def document_segments(tokens_BT, eos_id: int):
    """The documents of each row numbered in order: an end-of-text starts the next document (every
    document follows one in the token stream), so that the first token of a document is predicted
    from its end-of-text alone, as if the document stood at the start of a window."""
    return jnp.cumsum(tokens_BT == eos_id, axis=1, dtype=jnp.int32)


def batch_nll(model: Transformer, params, tokens_BT, eos_id: int | None = None):
    """Per-token NLL [B, T] of a batch's targets, through the model's loss path (the logits
    chunked over the sequence by `config.model.loss_chunk`, never all [B, T, V] at once).
    With `eos_id` (document masks) each token sees only its own document."""
    inputs_BT = tokens_BT[:, :-1]
    segments_BT = None if eos_id is None else document_segments(inputs_BT, eos_id)
    return model.apply({"params": params}, inputs_BT, targets_BT=tokens_BT[:, 1:], segments_BT=segments_BT)


def make_train_step(model: Transformer, tx: optax.GradientTransformation, micro_batches: int = 1,
                    eos_id: int | None = None):
    """(state, batch) -> (state, {loss, grad_norm, max_token}); with `micro_batches` > 1 the batch is
    split and gradients are averaged over micro-batches (gradient accumulation). `max_token`, the
    largest id in the batch (over all processes), lets the trainer refuse data the vocabulary lacks."""

    def loss_fn(params, tokens_BT):
        return masked_mean(batch_nll(model, params, tokens_BT, eos_id))

    grad_fn = jax.value_and_grad(loss_fn)

    def accumulate(params, tokens_BT):
        if micro_batches == 1:
            return grad_fn(params, tokens_BT)
        micro_MBT = tokens_BT.reshape((micro_batches, -1) + tokens_BT.shape[1:])

        def body(acc, micro_BT):
            loss, grads = grad_fn(params, micro_BT)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(body, zeros, micro_MBT)
        return jax.tree.map(lambda x: x / micro_batches, (loss, grads))

    def train_step(state, tokens_BT):
        loss, grads = accumulate(state["params"], tokens_BT)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "max_token": jnp.max(tokens_BT)}

    return train_step


def make_eval_step(model: Transformer, eos_id: int | None = None):
    """(params, batch) -> (sum of token NLL, number of tokens); `eos_id`: with document masks."""

    def eval_step(params, tokens_BT):
        nll_BT = batch_nll(model, params, tokens_BT, eos_id)
        return nll_BT.sum(), nll_BT.size

    return eval_step


def make_stats_step(model: Transformer, eos_id: int | None = None):
    """(params, batch) -> routing statistics of the batch (see Transformer)."""

    def stats_step(params, tokens_BT):
        inputs_BT = tokens_BT[:, :-1]
        segments_BT = None if eos_id is None else document_segments(inputs_BT, eos_id)
        return model.apply({"params": params}, inputs_BT, return_stats=True, segments_BT=segments_BT)[1]

    return stats_step


def build(cfg):
    """Model, optimizer, learning-rate schedules and the parameters' shapes (boxed with their logical
    names) of an experiment config; the model is traced once."""
    model = Transformer(cfg.model)
    boxed = abstract_params(model, cfg.data.seq_len)
    tx, schedules = make_optimizer(cfg, nn.meta.unbox(boxed), scanned=cfg.model.scan_layers)
    return model, tx, schedules, boxed


def abstract_state(boxed_params, tx: optax.GradientTransformation) -> dict:
    """The shapes of the train state that `make_init` returns, from the parameters' shapes: the same
    as `jax.eval_shape` of it, without tracing the model again (seconds at a paper scale)."""
    params = nn.meta.unbox(boxed_params)
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": jax.eval_shape(tx.init, params)}
