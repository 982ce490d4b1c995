"""Routing under the caller's sharding (deltares.nn.axes): a DepthStack under JAX's default mesh
(Explicit axes, an explicitly sharded input) and under MaxText-style rule names with `axis_names`,
on 8 simulated CPU devices, equals the stack without a mesh; with `axis_names` the source buffer
is sharded as the caller's activations are, without it (names the rules do not know) it is not.
The device count is fixed when JAX starts, so the checks run in tests/axis_names_worker.py."""

import json
import os
import subprocess
import sys

import pytest

from deltares.nn.axes import alias_rules, check_axis_names
from tests.jax_cache import ENV

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("delta", "delta_block", "full_attnres")


@pytest.fixture(scope="module")
def results():
    env = dict(ENV)  # CPU, and the persistent compilation cache: a program the worker compiles twice compiles once
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "axis_names_worker.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
def test_explicit_mesh_equals_no_mesh(results, mode):
    r = results[mode]
    assert r["explicit_diff"] < 1e-5 * r["grad_scale"]  # values and every gradient


@pytest.mark.parametrize("mode", MODES)
def test_callers_axis_names_shard_the_buffer(results, mode):
    r = results[mode]
    assert r["named_diff"] < 1e-5 * r["grad_scale"]
    assert r["specs_named"] == ["P(None, 'data', None, 'model')"]  # [S, B, T, D]: batch over data, D over model
    assert r["specs_default"] == ["P(None, None, None, None)"]  # deltares' names unknown to these rules: whole


def test_alias_rules_resolve_through_the_callers_rules():
    rules = (("activation_batch", ("data", "fsdp")), ("activation_embed", "tensor"))
    got = alias_rules(dict(batch="activation_batch", embed="activation_embed", length=None, sources="nope"), rules)
    assert got == (("batch", ("data", "fsdp")), ("act_embed", "tensor"), ("length", None), ("sources", None))


@pytest.mark.parametrize("bad,words", [({"batchh": "x"}, "unknown role"), ({"batch": 3}, "logical axis name"),
                                       (["batch"], "must be a mapping")])
def test_bad_axis_names_are_one_clear_error(bad, words):
    with pytest.raises(ValueError, match=words):
        check_axis_names(bad)


# ---------------------------------------------------------------- tensor-parallel and sequence-split streams

TP_CASES = ("batch_x_width", "width", "batch_x_tokens")


@pytest.fixture(scope="module")
def tp_results():
    """tests/tp_worker.py on 4 simulated CPU devices."""
    env = dict(ENV)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "tp_worker.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


TP_RUNS = [("delta", axes, case) for axes in ("Explicit", "Auto") for case in TP_CASES] + [
    ("delta_block", "Explicit", "batch_x_width"), ("delta_block", "Auto", "width")]


@pytest.mark.parametrize("mode,axes,case", TP_RUNS)
def test_split_width_or_tokens_equals_the_unsharded_stack(tp_results, mode, axes, case):
    """Values and every gradient as without a mesh; a split width routes on each device's slice
    (shard_map) with the routers' parameters split as the caller's rules place `embed` (or, in
    the `width` case, left where they are: replicated), and under Explicit axes the output keeps
    the stream's sharding."""
    r = tp_results[f"{mode}/{axes}/{case}"]
    assert r["diff"] < 1e-5
    width_split = case != "batch_x_tokens"
    assert r["shard_map"] == width_split
    assert r["router_spec"] == ("P(None, 'model')" if width_split else "P(None, None)")  # ('layers', 'embed')
    if axes == "Explicit":
        assert r["out_spec"] == {"batch_x_width": "P('data', None, 'model')", "width": "P(None, None, 'model')",
                                 "batch_x_tokens": "P('data', 'seq', None)"}[case]
