"""The sharded training of a config on a mesh, assembled in one place: the model and optimizer
(steps.build), the train state's shardings (sharding.state_shardings), and the jitted steps with
them (train step with a donated state, evaluation, routing statistics) and the initialiser."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from deltares.nn.model import Transformer
from deltares.training.sharding import MIN_SHARDED_FRACTION, MeshStep, logical_sharding, sharded_fraction, state_shardings
from deltares.training.steps import abstract_state, build, make_eval_step, make_init, make_stats_step, make_train_step


class ShardedTraining(NamedTuple):
    step: MeshStep  # (state, batch) -> (state, {loss, grad_norm}), state donated
    init: Any  # seed -> sharded initial state
    abstract_state: Any  # ShapeDtypeStructs with shardings (for restore and AOT lowering)
    state_shardings: Any
    batch_sharding: NamedSharding
    model: Transformer
    tx: Any
    schedules: dict
    mesh: jax.sharding.Mesh
    eval_step: MeshStep  # (params, batch) -> (summed nll, tokens)
    stats_step: MeshStep  # (params, batch) -> routing statistics


def sharded_train_step(cfg, mesh, eos_id: int | None = None) -> ShardedTraining:
    """The train step of `cfg` jitted for `mesh` with in/out shardings and a donated state,
    and what goes with it. Warns when fsdp > 1 and under 98% of parameter bytes are split.
    `eos_id`: the dataset's end-of-text, for document masks (`config.data.document_mask`; a
    program compiled ahead of time without data masks at id 0, the same cost)."""
    model, tx, schedules, boxed = build(cfg)  # the model and its steps (steps), then their shardings (sharding)
    init_fn = make_init(model, tx, cfg.data.seq_len)
    eos = (eos_id or 0) if cfg.data.document_mask else None
    train_fn = make_train_step(model, tx, cfg.train.micro_batches, eos)
    eval_fn, stats_fn = make_eval_step(model, eos), make_stats_step(model, eos)
    state_shapes = abstract_state(boxed, tx)
    shardings = state_shardings(boxed, state_shapes, mesh)
    batch_sharding = logical_sharding(mesh, ("batch", None))
    if mesh.shape["fsdp"] > 1 and (fraction := sharded_fraction(state_shapes, shardings)) < MIN_SHARDED_FRACTION:
        warnings.warn(f"only {fraction:.1%} of parameter bytes are sharded on mesh {dict(mesh.shape)}", stacklevel=2)
    state_shapes = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), state_shapes, shardings
    )
    replicated = NamedSharding(mesh, P())
    step = jax.jit(train_fn, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated), donate_argnums=0)
    # Initialisation runs outside the rules: flax would constrain each layer's parameters
    # inside nn.scan with the unstacked names; out_shardings places the result.
    init = jax.jit(init_fn, static_argnums=0, out_shardings=shardings)
    return ShardedTraining(
        MeshStep(step, mesh), init, state_shapes, shardings, batch_sharding, model, tx, schedules, mesh,
        MeshStep(jax.jit(eval_fn), mesh), MeshStep(jax.jit(stats_fn), mesh),
    )
