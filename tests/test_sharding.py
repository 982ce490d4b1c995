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

from deltares.config import MODES

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharded_worker.py")], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh", ["data2_fsdp2_tensor2", "fsdp8"])
def test_sharded_step_equals_single_device(results, mode, mesh):
    single = results["modes"][mode]["single"]
    sharded = results["modes"][mode][mesh]
    np.testing.assert_allclose(sharded["losses"], single, rtol=1e-6)
    assert sharded["param_change"] > 1e-3  # the steps really moved the parameters...
    assert sharded["max_param_diff"] < 1e-5  # ...to the same place as on one device
    assert sharded["sharded_fraction"] > 0.98
    assert sharded["embedding_spec"] == "P('tensor', 'fsdp')"


def test_checkpoint_restores_on_another_mesh(results):
    reshard = results["reshard"]
    np.testing.assert_allclose(reshard["resumed"], reshard["uninterrupted"], rtol=1e-6)
    assert reshard["restored_spec"] == "P('tensor', 'fsdp')"


def test_warns_when_parameters_are_not_sharded(results):
    assert any("of parameter bytes are sharded" in w for w in results["warnings"]), results["warnings"]
