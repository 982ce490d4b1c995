"""Sharded training on 8 simulated CPU devices equals the single-device step, for every mode.

The checks run in a subprocess (tests/sharded_worker.py) because the device count is
fixed when JAX starts: XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deltares.nn.config import MIXING_MODES, MODES, ROUTING_MODES
from tests.jax_cache import ENV

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results():
    env = dict(ENV)  # CPU, and the persistent compilation cache: a program the worker compiles twice compiles once
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharded_worker.py")], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode, mesh", [(mode, mesh) for mesh in ("data2_fsdp2_tensor2", "fsdp8") for mode in MODES
                                        if mesh == "data2_fsdp2_tensor2" or mode not in MIXING_MODES])
def test_sharded_step_equals_single_device(results, mode, mesh):
    """Every mode on the mesh that splits data, parameters and the model dimension; the routing modes (whose
    routing splits D over `tensor` in a shard_map of its own) on the one without `tensor` too."""
    single = results["modes"][mode]["single"]
    sharded = results["modes"][mode][mesh]
    np.testing.assert_allclose(sharded["losses"], single, rtol=1e-6)
    assert sharded["param_change"] > 1e-3  # the steps really moved the parameters...
    # ...to the same place as on one device. mhc to 1e-4: Sinkhorn's result does not change when a constant is
    # added to a row or a column of its logits, so the gradients of its mixing biases along those directions
    # are roundoff, which Adam's normalisation turns into updates of up to the learning rate (3 steps: ~3e-5)
    assert sharded["max_param_diff"] < (1e-4 if mode == "mhc" else 1e-5)
    assert sharded["sharded_fraction"] > 0.98
    assert sharded["embedding_spec"] == "P('tensor', 'fsdp')"


@pytest.mark.parametrize("mode", ["full_attnres", "delta", "delta_block"])
def test_store_once_backward_under_tensor_split_equals_single_device(results, mode):
    """remat=full (the store-once depth backward, sublayer by sublayer for full_attnres and
    delta) on data=2, fsdp=2, tensor=2 gives the single-device losses and parameters."""
    got = results["remat_full"][mode]
    np.testing.assert_allclose(got["losses"], results["modes"][mode]["single"], rtol=1e-6)
    assert got["max_param_diff"] < 1e-5


@pytest.mark.parametrize("mode", ["full_attnres", "delta", "delta_block"])
def test_two_phase_routing_under_tensor_split_equals_single_device(results, mode):
    """Two-phase grouped routing (group_layers=3, remat full) on data=2, fsdp=2, tensor=2, its
    phase one on each device's slice of D: the single-device losses and parameters."""
    got = results["two_phase"][mode]
    np.testing.assert_allclose(got["losses"], results["modes"][mode]["single"], rtol=1e-6)
    assert got["max_param_diff"] < 1e-5


def test_two_phase_kernel_under_a_mesh_equals_single_device(results):
    """delta_block with phase one as the fused K-query kernel (pallas_tpu in interpret mode, inside
    shard_map: tokens split over data and fsdp, D whole) on data=2, fsdp=2, tensor=2: the
    single-device (xla, ungrouped) losses and parameters."""
    got = results["two_phase_kernel"]
    np.testing.assert_allclose(got["losses"], results["modes"]["delta_block"]["single"], rtol=1e-6)
    assert got["max_param_diff"] < 1e-5


def test_splash_attention_under_a_mesh_equals_single_device(results):
    got = results["splash"]
    assert got["kernel_in_shard_map"]
    np.testing.assert_allclose(got["losses"], got["single"], rtol=1e-5)
    assert got["max_param_diff"] < 1e-5


@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_routing_splits_the_model_dimension_over_tensor(results, mode):
    """With tensor > 1 every routed sublayer (2 per layer, plus the Kimi modes' output routing)
    sums partial logits with psum over `tensor` inside shard_map, in the forward and backward
    pass; without a tensor axis, and in baseline, none does."""
    counts = {mesh: results["modes"][mode][mesh]["tensor_psum_routings"] for mesh in ("data2_fsdp2_tensor2", "fsdp8")}
    assert counts["fsdp8"] == 0
    if mode == "baseline":
        assert counts["data2_fsdp2_tensor2"] == 0
    else:
        assert counts["data2_fsdp2_tensor2"] >= 4, counts  # debug has 2 layers: 4 routed sublayers at least


@pytest.mark.parametrize("mesh", ["tensor4_data2", "data2_fsdp2_tensor2", "fsdp8"])
def test_tensor_split_routing_matches_reference(results, mesh):
    """Routing with D split over `tensor` equals the float64 NumPy reference (the null source
    as one more valid source), and its gradients equal those of the unsplit routing."""
    from test_routing import ref_route  # noqa: PLC0415 - the shared float64 reference

    split = results["tensor_split_routing"]
    inp = {k: np.asarray(v) for k, v in split["inputs"].items()}
    S, B, T, D = inp["sources"].shape
    sources = np.concatenate([inp["sources"], np.broadcast_to(inp["null"], (1, B, T, D))])
    ref_out, ref_weights = ref_route(sources, np.append(inp["valid"], True), inp["query"], inp["gain"], inp["residual"])
    got = split[mesh]
    np.testing.assert_allclose(got["out"], ref_out, atol=2e-5)
    np.testing.assert_allclose(got["weights"], ref_weights[:S], atol=2e-6)
    assert got["max_grad_diff"] < 2e-5
    assert got["shard_map"] == (mesh != "fsdp8")


def test_checkpoint_restores_on_another_mesh(results):
    reshard = results["reshard"]
    np.testing.assert_allclose(reshard["resumed"], reshard["uninterrupted"], rtol=1e-6)
    assert reshard["restored_spec"] == "P('tensor', 'fsdp')"


def test_warns_when_parameters_are_not_sharded(results):
    assert any("of parameter bytes are sharded" in w for w in results["warnings"]), results["warnings"]


def test_shard_map_specs_come_from_the_logical_rules():
    """deltares.nn.layers.shard_spec reads the rules in context (no mesh axis names in nn): under
    LOGICAL_RULES the buffer's batch goes to data x fsdp and D to tensor; other rules move them,
    no rules keep everything whole, size-1 axes drop and uneven dimensions stay whole."""
    import flax.linen as nn
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from deltares.nn.axes import SOURCES_AXES
    from deltares.nn.axes import shard_spec
    from deltares.training.sharding import LOGICAL_RULES

    mesh = AbstractMesh((2, 2, 4), ("data", "fsdp", "tensor"))
    with nn.logical_axis_rules(LOGICAL_RULES):
        assert shard_spec(mesh, SOURCES_AXES, (5, 4, 3, 16)) == P(None, ("data", "fsdp"), None, "tensor")
        assert shard_spec(mesh, SOURCES_AXES, (5, 6, 3, 18)) == P(None, None, None, None)  # 4 and 4 do not divide
        assert shard_spec(AbstractMesh((1, 2, 1), ("data", "fsdp", "tensor")), SOURCES_AXES, (5, 4, 3, 16)) == P(
            None, "fsdp", None, None)
    with nn.logical_axis_rules((("batch", "tensor"), ("act_embed", "data"))):
        assert shard_spec(mesh, SOURCES_AXES, (5, 4, 3, 16)) == P(None, "tensor", None, "data")
    assert shard_spec(mesh, SOURCES_AXES, (5, 4, 3, 16)) == P(None, None, None, None)


def test_attention_and_layers_do_not_import_each_other():
    """The sharding helpers live in deltares.nn.axes: attention needs them without importing layers
    (which imports attention), so neither module imports the other in a cycle."""
    import ast  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def imported(path):
        tree = ast.parse(open(os.path.join(root, path)).read())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}

    assert "deltares.nn.layers" not in imported("deltares/nn/attention.py")
    assert "deltares.nn.attention" in imported("deltares/nn/layers.py")
    assert "deltares.nn.axes" in imported("deltares/nn/attention.py")
