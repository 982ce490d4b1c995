"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices.

Prints one JSON object: for every residual mode and mesh, the losses and updated
parameters of 3 sharded train steps next to the single-device ones; a checkpoint
saved on one mesh and restored on another; the sharded-bytes fraction.
"""

import importlib.util
import json
import os
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deltares.checkpoint import Checkpointer  # noqa: E402
from deltares.config import MODES  # noqa: E402
from deltares.sharding import make_mesh, shard_batch, sharded_fraction, sharded_train_step  # noqa: E402
from deltares.steps import build, make_init, make_train_step  # noqa: E402

MESHES = {"data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2), "fsdp8": dict(data=1, fsdp=8, tensor=1)}
STEPS = 3


def debug_config(mode):
    spec = importlib.util.spec_from_file_location("debug", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(mode)
    cfg.model.vocab_size = 264  # divisible by the tensor axis, so the vocabulary is split too
    cfg.train.global_batch = 8
    cfg.optim.warmup_steps = 1
    return cfg


def batches(cfg):
    rng = np.random.RandomState(0)
    return [rng.randint(0, 257, (8, cfg.data.seq_len + 1)).astype(np.int32) for _ in range(STEPS)]


def single_device(cfg):
    model, tx, _ = build(cfg)
    state = jax.jit(make_init(model, tx, cfg.data.seq_len))(cfg.seed)
    step = jax.jit(make_train_step(model, tx))
    losses = []
    for batch in batches(cfg):
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
    return losses, state


def sharded(cfg, mesh_cfg, state=None, data=None):
    training = sharded_train_step(cfg, make_mesh(ml_collections.ConfigDict(mesh_cfg)))
    state = training.init(cfg.seed) if state is None else state
    losses = []
    for batch in data if data is not None else batches(cfg):
        state, out = training.step(state, shard_batch(batch, training.batch_sharding))
        losses.append(float(out["loss"]))
    return losses, state, training


def max_param_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])))


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {"modes": {}}
    for mode in MODES:
        cfg = debug_config(mode)
        ref_losses, ref_state = single_device(cfg)
        out["modes"][mode] = {"single": ref_losses}
        for name, mesh_cfg in MESHES.items():
            losses, state, training = sharded(cfg, mesh_cfg)
            out["modes"][mode][name] = {
                "losses": losses,
                "max_param_diff": max_param_diff(state, ref_state),
                "param_change": max_param_diff(state, jax.device_get(training.init(cfg.seed))),
                "sharded_fraction": sharded_fraction(training.abstract_state, training.state_shardings),
                "embedding_spec": str(state["params"]["embed"]["embedding"].sharding.spec),
            }

    # A checkpoint saved on one mesh restores on another, and training continues identically.
    cfg = debug_config("delta_block")
    data = batches(cfg)
    with tempfile.TemporaryDirectory() as workdir:
        losses_a, state_a, _ = sharded(cfg, MESHES["data2_fsdp2_tensor2"], data=data[:2])
        ckpt = Checkpointer(workdir, async_save=False)
        ckpt.save(2, state_a, {"next_index": 2}, {})
        ckpt.wait()
        training_b = sharded_train_step(cfg, make_mesh(ml_collections.ConfigDict(MESHES["fsdp8"])))
        restored, _ = ckpt.restore(2, training_b.abstract_state)
        ckpt.close()
        continued, _, _ = sharded(cfg, MESHES["fsdp8"], state=restored, data=data[2:])
        out["reshard"] = {
            "uninterrupted": single_device(cfg)[0],
            "resumed": losses_a + continued,
            "restored_spec": str(restored["params"]["embed"]["embedding"].sharding.spec),
        }

    # The start-up warning when too few parameter bytes are sharded with fsdp > 1.
    cfg = debug_config("baseline")
    cfg.model.d_model, cfg.model.vocab_size = 30, 257  # divisible by neither axis: nothing splits
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.d_ff = 3, 1, 63
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded_train_step(cfg, make_mesh(ml_collections.ConfigDict(MESHES["fsdp8"])))
    out["warnings"] = [str(w.message) for w in caught]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
