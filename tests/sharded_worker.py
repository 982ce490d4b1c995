"""Run by tests/test_sharding.py in a subprocess with 8 simulated CPU devices.

Prints one JSON object: for every residual mode and mesh (the mixing modes: the tensor
mesh only), the losses and updated parameters of 3 sharded train steps next to the single-device ones, and how many
tensor-split routings (shard_map + psum over `tensor`) the step holds; depth routing
with D split over `tensor` against the unsplit routing; a checkpoint saved on one
mesh and restored on another; the sharded-bytes fraction.
"""

import importlib.util
import json
import os
import sys
import tempfile
import warnings

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import ml_collections
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deltares.nn import routing  # noqa: E402
from deltares.training.checkpoint import Checkpointer  # noqa: E402
from deltares.nn.layers import xla_route  # noqa: E402
from deltares.nn.config import MIXING_MODES, MODES  # noqa: E402
from deltares.training.sharding import LOGICAL_RULES, make_mesh, shard_batch, sharded_fraction  # noqa: E402
from deltares.training.program import sharded_train_step  # noqa: E402
from deltares.training.steps import build, make_init, make_train_step  # noqa: E402

MESHES = {"data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2), "fsdp8": dict(data=1, fsdp=8, tensor=1)}
TENSOR_MESH = "data2_fsdp2_tensor2"  # the mesh every mode runs on; the routing modes run on all of MESHES
STEPS = 3


def debug_config(mode):
    spec = importlib.util.spec_from_file_location("debug", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(mode)
    cfg.model.vocab_size = 264  # divisible by the tensor axis, so the vocabulary is split too
    cfg.model.loss_chunk = 12  # the chunked loss (3 chunks of T = 32, the last padded) under every mesh
    cfg.train.global_batch = 8
    cfg.optim.warmup_steps = 1
    return cfg


def batches(cfg):
    rng = np.random.RandomState(0)
    return [rng.randint(0, 257, (8, cfg.data.seq_len + 1)).astype(np.int32) for _ in range(STEPS)]


def single_device(cfg):
    model, tx, *_ = build(cfg)
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


def tensor_psum_routings(training, state, batch) -> int:
    """How many psums over `tensor` (`psum_invariant` in newer jax) sit inside the `shard_map`s of
    the train step's jaxpr: one per tensor-split routing in the forward pass."""
    with jax.set_mesh(training.mesh), nn.logical_axis_rules(LOGICAL_RULES):
        jaxpr = jax.make_jaxpr(training.step.fn)(state, shard_batch(batch, training.batch_sharding))

    def sub_jaxprs(eqn):
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, jax.extend.core.ClosedJaxpr):
                    yield v.jaxpr
                elif isinstance(v, jax.extend.core.Jaxpr):
                    yield v

    def walk(jaxpr, inside_shard_map=False):
        count = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if inside_shard_map and name.startswith("psum") and "tensor" in eqn.params.get("axes", ()):
                count += 1
            for sub in sub_jaxprs(eqn):
                count += walk(sub, inside_shard_map or name == "shard_map")
        return count

    return walk(jaxpr.jaxpr)


def tensor_split_routing():
    """Depth routing with D split over `tensor` (inside shard_map) on 8 devices, against the
    unsplit computation: outputs, weights and gradients, with a residual and a null source."""
    rng = np.random.RandomState(1)
    S, B, T, D = 5, 4, 3, 16
    inputs = {
        "sources": rng.randn(S, B, T, D).astype(np.float32),
        "valid": np.array([1, 1, 0, 1, 1], bool),
        "query": rng.randn(D).astype(np.float32) * 0.5,
        "gain": (1 + 0.1 * rng.randn(D)).astype(np.float32),
        "residual": rng.randn(B, T, D).astype(np.float32),
        "null": rng.randn(D).astype(np.float32) * 0.3,
    }

    def loss(route, sources, query, gain, residual, null):
        out, weights = route(sources, routing.inv_rms(sources), inputs["valid"], query, gain, residual, null)
        return jnp.sum(jnp.sin(out)) + jnp.sum(weights**2), (out, weights)

    args = [jnp.asarray(inputs[k]) for k in ("sources", "query", "gain", "residual", "null")]
    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True)
    (_, (ref_out, ref_weights)), ref_grads = jax.jit(grad, static_argnums=0)(routing.route_normalized, *args)
    out = {"inputs": {k: np.asarray(v).tolist() for k, v in inputs.items()}}
    for name, mesh_cfg in {"tensor4_data2": dict(data=2, fsdp=1, tensor=4), **MESHES}.items():
        mesh = make_mesh(ml_collections.ConfigDict(mesh_cfg))
        with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):  # the rules place D and the batch
            (_, (got_out, got_weights)), got_grads = jax.jit(grad, static_argnums=0)(xla_route, *args)
            text = str(jax.make_jaxpr(lambda *a: xla_route(a[0], routing.inv_rms(a[0]), inputs["valid"], *a[1:]))(*args))
        out[name] = {
            "out": np.asarray(got_out).tolist(),
            "weights": np.asarray(got_weights).tolist(),
            "max_out_diff": float(jnp.max(jnp.abs(got_out - ref_out))),
            "max_grad_diff": max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got_grads, ref_grads)),
            "shard_map": "shard_map" in text and "psum" in text,
        }
    return out


def max_param_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])))


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {"modes": {}, "remat_full": {}, "two_phase": {}}
    ref_states = {}
    for mode in MODES:
        cfg = debug_config(mode)
        ref_losses, ref_state = single_device(cfg)
        ref_states[mode] = ref_state
        out["modes"][mode] = {"single": ref_losses}
        for name, mesh_cfg in MESHES.items():
            if mode in MIXING_MODES and name != TENSOR_MESH:  # no routing to split: their sharding is the model's
                continue
            losses, state, training = sharded(cfg, mesh_cfg)
            fresh = training.init(cfg.seed)
            out["modes"][mode][name] = {
                "tensor_psum_routings": tensor_psum_routings(training, fresh, batches(cfg)[0]),
                "losses": losses,
                "max_param_diff": max_param_diff(state, ref_state),
                "param_change": max_param_diff(state, jax.device_get(training.init(cfg.seed))),
                "sharded_fraction": sharded_fraction(training.abstract_state, training.state_shardings),
                "embedding_spec": str(state["params"]["embed"]["embedding"].sharding.spec),
            }

    # The store-once depth backward (remat=full) under the tensor-split mesh, against the
    # single-device step without remat.
    for mode in ("full_attnres", "delta", "delta_block"):
        cfg = debug_config(mode)
        cfg.model.remat = "full"
        losses, state, _ = sharded(cfg, MESHES["data2_fsdp2_tensor2"])
        out["remat_full"][mode] = {"losses": losses, "max_param_diff": max_param_diff(state, ref_states[mode])}
        # two-phase grouped routing (phase one inside shard_map on each device's slice of D)
        cfg.model.residual.group_layers = 3  # delta: the 3 layers in one group; delta_block: its blocks
        losses, state, _ = sharded(cfg, MESHES["data2_fsdp2_tensor2"])
        out["two_phase"][mode] = {"losses": losses, "max_param_diff": max_param_diff(state, ref_states[mode])}
    # phase one as the fused K-query kernel (interpret mode), inside shard_map with tokens split, D whole
    cfg = debug_config("delta_block")
    cfg.model.remat, cfg.model.residual.group_layers = "full", 3
    cfg.model.residual.impl, cfg.model.residual.interpret = "pallas_tpu", True
    losses, state, _ = sharded(cfg, MESHES["data2_fsdp2_tensor2"])
    out["two_phase_kernel"] = {"losses": losses, "max_param_diff": max_param_diff(state, ref_states["delta_block"])}

    # splash attention (the TPU kernel, interpret mode) inside shard_map: sequences over data and fsdp, key/value
    # heads with their query heads over tensor; against the single-device step with XLA's attention
    cfg = debug_config("delta_block")
    cfg.data.seq_len = 128  # a multiple of the kernel's 128-token block
    ref_losses, ref_state = single_device(cfg)
    cfg.model.attention, cfg.model.residual.interpret = "splash", True
    losses, state, training = sharded(cfg, MESHES["data2_fsdp2_tensor2"])
    with jax.set_mesh(training.mesh), nn.logical_axis_rules(LOGICAL_RULES):
        text = str(jax.make_jaxpr(training.step.fn)(training.init(cfg.seed), shard_batch(batches(cfg)[0],
                                                                                      training.batch_sharding)))
    out["splash"] = {"losses": losses, "single": ref_losses, "max_param_diff": max_param_diff(state, ref_state),
                     "kernel_in_shard_map": "pallas_call" in text and "shard_map" in text}

    out["tensor_split_routing"] = tensor_split_routing()

    # A checkpoint saved on one mesh restores on another, and training continues identically.
    cfg = debug_config("delta_block")
    data = batches(cfg)
    with tempfile.TemporaryDirectory() as workdir:
        losses_a, state_a, _ = sharded(cfg, MESHES["data2_fsdp2_tensor2"], data=data[:2])
        ckpt = Checkpointer(workdir, async_save=False)
        ckpt.save(2, state_a, {"next_index": 2}, cfg.to_dict())
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
