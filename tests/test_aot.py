"""The ahead-of-time TPU memory proof (`python -m deltares.aot`).

The compiles run in subprocesses: libtpu is loaded there as a compiler for compile-only
TPU devices and never meets the CPU backend of the other tests. Each takes seconds.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from deltares import aot
from deltares.training.compile_only import parse_topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_libtpu = pytest.mark.skipif(
    not __import__("importlib.util").util.find_spec("libtpu"), reason="libtpu is not installed (requirements.txt)"
)


def run_aot(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "deltares.aot", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


def report_of(proc):
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON report; stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1])


@needs_libtpu
def test_debug_config_fits_a_small_slice():
    proc = run_aot("--config", "experiments/debug.py:delta_block", "--topology", "v5e:2x2", "--json")
    assert proc.returncode == 0, proc.stderr
    r = report_of(proc)
    assert r["fits"] is True
    assert r["devices"] == 4 and r["device_kind"] == "TPU v5 lite"
    assert r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}  # default: FSDP over every device
    assert (r["global_batch"], r["seq_len"]) == (4, 32)  # the experiment's own batch
    for key in ("per_device_bytes", "argument_bytes", "output_bytes", "code_bytes", "hbm_bytes", "flops_per_step"):
        assert r[key] > 0, key
    assert r["per_device_bytes"] <= r["hbm_bytes"]
    assert 15 * 2**30 < r["hbm_bytes"] <= 16 * 2**30 and r["hbm_source"] == "compiler"  # v5e: 16 GiB chips
    # The donated state is written in place: outputs alias the arguments.
    assert r["alias_bytes"] > 0.9 * r["argument_bytes"]
    # Counted FLOPs of the step agree with the 6N + attention estimate.
    assert r["flops_per_step"] == pytest.approx(r["model_flops_per_step"], rel=0.15)
    assert r["flops_per_device"] * r["devices"] == pytest.approx(r["flops_per_step"])
    # The routing floor: 3 layers in blocks of 2 -> slots e, c_0, c_1, all read later; per device one
    # row of 32 tokens x d=32 in float32 = 4 KiB a slot; the sources and one cotangent buffer.
    assert r["floor_live_slots"] == 3
    assert r["floor_sources_bytes"] == 3 * 32 * 32 * 4
    assert r["floor_bytes"] == 2 * 3 * 32 * 32 * 4


@needs_libtpu
def test_estimate_reports_the_compilers_step_time():
    proc = run_aot("--config", "experiments/debug.py:delta", "--topology", "v5p:2x2x1", "--config.model.remat=full",
                   "--estimate", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    e = report_of(proc)["estimate"]
    assert e["mode"] == "delta" and e["n_layers"] == 3 and e["layers_compiled"] == [2, 4, 6]
    assert e["seconds"] > 0 and e["flops"] > 0 and e["bytes_accessed"] > 0
    # the compiled points themselves: deeper unrolled programs cost more
    costs = [e["points"][f"{n}/{bl}"]["seconds"] for n, bl in zip(e["layers_compiled"], e["block_layers_compiled"])]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    # estimated MFU: 6N+attention FLOPs per step over the step time and 4 v5p chips' bf16 peak (459 TFLOP/s)
    r = report_of(proc)
    assert r["device_kind"] == "TPU v5" and r["devices"] == 4
    assert e["mfu"] == pytest.approx(r["model_flops_per_step"] / (e["seconds"] * 4 * 459e12))


def test_estimated_mfu():
    from deltares.aot import estimated_mfu

    report = dict(device_kind="TPU v5 lite", devices=8, model_flops_per_step=1.97e15, estimate=dict(seconds=2.0))
    assert estimated_mfu(report) == pytest.approx(1.97e15 / (2.0 * 8 * 197e12))  # 6.25%
    assert estimated_mfu({**report, "device_kind": "TPU v9"}) is None


@needs_libtpu
def test_search_compiles_every_remat_policy_and_loss():
    proc = run_aot("--config", "experiments/debug.py:baseline", "--topology", "v5e:2x2", "--search", "--json",
                   "--config.model.loss_chunk=8")
    assert proc.returncode == 0, proc.stderr
    s = report_of(proc)
    settings = [(t["remat"], t["loss_chunk"]) for t in s["trials"]]
    assert settings == [("none", 0), ("none", 8), ("dots", 0), ("dots", 8), ("full", 0), ("full", 8)]
    assert all(t["fits"] and t["per_device_bytes"] > 0 for t in s["trials"])
    by = {(t["remat"], t["loss_chunk"]): t["per_device_bytes"] for t in s["trials"]}
    # each setting was compiled as set: rematerialisation and the loss change the program's memory (at this
    # toy size remat costs more than the few activations it frees)
    assert by[("full", 0)] != by[("none", 0)] and by[("none", 8)] != by[("none", 0)]
    assert (s["fastest"]["remat"], s["fastest"]["loss_chunk"], s["ranked_by"]) == ("none", 0, "order")


def test_fastest_fitting_ranks_by_estimate_else_order():
    trials = [dict(remat="none", loss_chunk=0, fits=False), dict(remat="none", loss_chunk=512, fits=True),
              dict(remat="dots", loss_chunk=0, fits=True), dict(remat="full", loss_chunk=0, fits=True)]
    assert aot.fastest_fitting(trials) is trials[1]  # no estimates: the first that fits
    for t, seconds in zip(trials[1:], (0.30, 0.25, 0.28)):
        t["seconds"] = seconds
    assert aot.fastest_fitting(trials) is trials[2]  # the least estimated time among those that fit
    assert aot.fastest_fitting([dict(trials[0])]) is None


def test_search_candidates_follow_the_sequence_length():
    from deltares.nn.config import model_config

    cfg = __import__("ml_collections").ConfigDict(dict(model=model_config(loss_chunk=256, residual=dict(
        mode="baseline")), data=dict(seq_len=2048)))
    assert aot.search_candidates(cfg)[:2] == [("none", 0), ("none", 256)]
    cfg.model.loss_chunk = 0  # the plain loss configured: the chunked candidate is 512 tokens
    assert aot.search_candidates(cfg)[1] == ("none", 512)
    cfg.data.seq_len = 512  # no chunk below the sequence: only the plain loss
    assert aot.search_candidates(cfg) == [("none", 0), ("dots", 0), ("full", 0)]
    cfg.model.residual.mode = "delta"  # store-once under any remat: "dots" is "full"
    assert aot.search_candidates(cfg) == [("none", 0), ("full", 0)]


@needs_libtpu
def test_human_report_and_mesh_flag_on_megacore_v4():
    proc = run_aot("--config", "experiments/debug.py:baseline", "--topology", "v4:2x2x1", "--mesh", "2,1,-1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "4 x TPU v4" in out  # megacore: one device per chip
    assert "mesh data=2 fsdp=1 tensor=2" in out
    for word in ("arguments", "outputs", "temporaries", "total", "FLOPs per step", "fits: yes"):
        assert word in out, word


# tiny_deep made wide enough for the source buffer to count: d=512, 24 scanned layers, bfloat16,
# remat full, 4 x 2048 tokens per chip; one slot per device is 8 MiB, the buffer (49 slots) 392 MiB.
DEEP = ("--topology", "v5p:2x2x1", "--config.model.scan_layers=True", "--config.model.remat=full",
        "--config.model.dtype=bfloat16", "--config.model.d_model=512", "--config.model.d_ff=1536",
        "--config.train.global_batch=16", "--config.data.seq_len=2048", "--json")


@needs_libtpu
def test_delta_step_on_tpu_stays_near_its_floor():
    """The TPU program of delta's train step holds, beyond baseline's, little more than its routing
    floor (the live sources and one cotangent buffer). Measured 2026-12-07 (libtpu 0.0.42.1):
    baseline 1046.9 MiB, delta 2170.9 (1.46 floors more); before the backward pass kept its loop's
    buffers in place and stopped saving every layer's stream (13aee90's parent), 2991.4 (2.53 floors).
    At 8 x 2048 tokens per chip (2026-12-04, a compile of minutes): 1.43 floors, 2.50 before."""
    base, delta = (report_of(run_aot("--config", f"experiments/tiny_deep.py:{mode}", *DEEP)) for mode in
                   ("baseline", "delta"))
    assert delta["floor_live_slots"] == 48 and delta["floor_bytes"] == 2 * 48 * 4 * 2048 * 512 * 2
    excess = (delta["per_device_bytes"] - base["per_device_bytes"]) / delta["floor_bytes"]
    assert 1.0 < excess < 1.8, excess


@needs_libtpu
def test_out_of_hbm_is_a_report_not_a_traceback():
    proc = run_aot(
        "--config",
        "experiments/debug.py",
        "--topology",
        "v5e:2x2",
        "--config.train.global_batch=4096",
        "--config.data.seq_len=8192",
        "--json",
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    r = report_of(proc)
    assert r["fits"] is False
    assert r["per_device_bytes"] > r["hbm_bytes"] > 0
    assert "RESOURCE_EXHAUSTED" in r["compiler_message"]


@needs_libtpu
def test_7b_on_four_v5e_chips_does_not_fit():
    """The 7.6B model's float32 parameters and AdamW moments alone (~91 GB) exceed 4 x 16 GiB;
    the compiler gives up within seconds and its figure is the report."""
    proc = run_aot("--config", "experiments/s7b6.py:delta_block", "--topology", "v5e:2x2", "--json")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    r = report_of(proc)
    assert r["fits"] is False and (r["global_batch"], r["seq_len"]) == (64, 2048)
    assert r["per_device_bytes"] > r["argument_bytes"] > 7.5e9 * 12 / 4  # params + Adam moments, split 4 ways
    # s7b6 trains with remat=full: forward, recomputed forward and backward, 8 N per token.
    assert r["remat"] == "full"
    assert r["flops_per_step"] == pytest.approx(8 * 7.57e9 * 64 * 2048, rel=0.15)


@needs_libtpu
@pytest.mark.parametrize(
    "topology, words",
    [("v9z:2x2", "Invalid TPU"), ("v5e-16", "GENERATION:AxB"), ("v5e:4x4", "does not split"),
     ("v5e:2x2 --config.model.residual.impl=pallas_gpu", "'pallas_gpu' is invalid: cannot run here (it compiles for "
      "gpu only (or runs with interpret=True), the target is tpu)")],
)
def test_bad_topology_or_batch_is_one_error_line(topology, words):
    """(And a kernel named for another platform than the target's: the GPU routing kernel on a TPU slice.)"""
    proc = run_aot("--config", "experiments/debug.py", "--topology", *topology.split())
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], proc.stderr


def test_parse_oom_reads_both_compiler_messages():
    temps = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (36.00G) "
        "exceeds available HBM (15.75G)."
    )
    assert aot.parse_oom(temps) == dict(required=36 * 2**30, hbm=int(15.75 * 2**30), required_what="temporaries")
    used = (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
        "Used 112.50G of 95.74G hbm. Exceeded hbm capacity by 16.76G."
    )
    figures = aot.parse_oom(used)
    assert figures["required"] == int(112.5 * 2**30) and figures["hbm"] == int(95.74 * 2**30)
    assert aot.parse_oom("something else") == {}


def test_parse_topology():
    assert parse_topology("v5p:2x2x2") == ("v5p", (2, 2, 2))
    assert parse_topology("v6e:8x8") == ("v6e", (8, 8))
    for bad in ("v5p", "v5p-16", "v5p:2x", ""):
        with pytest.raises(aot.AotError):
            parse_topology(bad)


def test_jaxpr_flops_counts_scans_and_grads():
    a = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 16, 16), jnp.float32)

    def layers(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    forward = 2 * 8 * 16 * 16 * 4
    assert aot.jaxpr_flops(jax.make_jaxpr(layers)(w, a).jaxpr) == forward
    # backward: one product for the input gradient and one for the weight gradient per layer
    assert aot.jaxpr_flops(jax.make_jaxpr(jax.grad(layers))(w, a).jaxpr) == 3 * forward
    remat = jax.checkpoint(layers)
    assert aot.jaxpr_flops(jax.make_jaxpr(jax.value_and_grad(remat))(w, a).jaxpr) == 4 * forward


def test_jaxpr_flops_counts_kernel_grids_and_shard_map_devices():
    """A Pallas kernel's body runs once per grid step, a shard_map body once per device: the same
    product as one plain matmul of the whole arrays."""
    from jax.experimental import pallas as pl

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    whole = 2 * 16 * 16 * 32  # x @ x.T

    def block(x_ref, o_ref):
        o_ref[...] = x_ref[...] @ x_ref[...].T

    def tiled(x):  # 2 row blocks of 8, each against itself: half the whole product
        return pl.pallas_call(block, out_shape=jax.ShapeDtypeStruct((16, 8), jnp.float32), grid=(2,),
                              in_specs=[pl.BlockSpec((8, 32), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)), interpret=True)(x)

    assert aot.jaxpr_flops(jax.make_jaxpr(tiled)(x).jaxpr) == whole // 2
    mesh = jax.sharding.AbstractMesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    per_device = jax.shard_map(lambda x: x @ x.T, mesh=mesh, in_specs=jax.P(None, "d"), out_specs=jax.P(),
                               check_vma=False)
    # each device: a [16, 8] slice of x against itself, the partial sums of the whole product
    with jax.sharding.use_abstract_mesh(mesh):
        assert aot.jaxpr_flops(jax.make_jaxpr(per_device)(x).jaxpr) == whole


@needs_libtpu
def test_fused_routing_kernel_compiles_into_the_train_step():
    """impl=pallas: the Mosaic depth-routing kernel, inside shard_map over the fsdp axis, is part of
    the compiled TPU train step (forward and backward kernels), with no fallback to xla."""
    args = ("--config", "experiments/debug.py:delta_block", "--topology", "v5e:2x2", "--json",
            "--config.model.remat=full", "--config.model.dtype=bfloat16")
    kernel = run_aot(*args, "--config.model.residual.impl=pallas")
    assert kernel.returncode == 0, kernel.stderr
    assert "using the xla implementation" not in kernel.stderr
    r = report_of(kernel)
    assert r["fits"] is True and r["routing_impl"] == "pallas"
    assert r["pallas_kernel_calls"] >= 2
    assert report_of(run_aot(*args))["pallas_kernel_calls"] == 0
