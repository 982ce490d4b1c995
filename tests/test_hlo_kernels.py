"""The GPU step-time model's reading of a compiled program (deltares/training/hlo_kernels.py) and its fit
(tests/gpu_calibration.py), on a hand-written HLO module whose kernels' bytes and FLOPs are counted
here by hand, and on rows made from known constants; the band a held-out error puts on a ratio, and the
goal verdicts, on constructed cases."""

import gzip
import io
import json
import tarfile

import numpy as np
import pytest

from deltares.training import gpu_step_time, hlo_kernels
from tests import gpu_calibration

# One entry computation: a gemm fusion (bf16 [64,128] x [128,32]), an elementwise fusion over a buffer
# passed twice, a fusion that reads one [4,64] slice of a [16,4,64] f32 buffer through a bitcast, a fusion
# writing one [1,64] row of that buffer in place, a cuDNN attention call, a copy, and a while loop of 5
# iterations whose body launches one elementwise fusion, and a Pallas Triton kernel (a kernel of its own).
HLO = """HloModule jit_step, entry_computation_layout={()->()}

%gemm_body (p0: bf16[64,128], p1: bf16[128,32]) -> f32[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add_body (a: f32[1024], b: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  ROOT %add.2 = f32[1024]{0} add(%a, %b)
}

%slice_body (buf: f32[16,4,64], i: s32[]) -> f32[4,64] {
  %buf = f32[16,4,64]{2,1,0} parameter(0)
  %flat = f32[64,64]{1,0} bitcast(%buf)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[4,64]{1,0} dynamic-slice(%flat, %i, %zero), dynamic_slice_sizes={4,64}
  ROOT %neg = f32[4,64]{1,0} negate(%ds)
}

%update_body (buf2: f32[16,4,64], row: f32[1,1,64], j: s32[]) -> f32[16,4,64] {
  %buf2 = f32[16,4,64]{2,1,0} parameter(0)
  %row = f32[1,1,64]{2,1,0} parameter(1)
  %j = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[16,4,64]{2,1,0} dynamic-update-slice(%buf2, %row, %j, %z, %z)
}

%step_body (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %mul = f32[256]{0} multiply(%x, %x)
}

%loop_body (t: (s32[], f32[256])) -> (s32[], f32[256]) {
  %t = (s32[], f32[256]{0}) parameter(0)
  %k = s32[] get-tuple-element(%t), index=0
  %v = f32[256]{0} get-tuple-element(%t), index=1
  %f = f32[256]{0} fusion(%v), kind=kLoop, calls=%step_body
  ROOT %out = (s32[], f32[256]{0}) tuple(%k, %f)
}

%loop_cond (c: (s32[], f32[256])) -> pred[] {
  %c = (s32[], f32[256]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (w: bf16[64,128], v: bf16[128,32], x: f32[1024], buf: f32[16,4,64], i: s32[], row: f32[1,1,64], q: bf16[2,512,4,64], init: (s32[], f32[256])) -> f32[64,32] {
  %w = bf16[64,128]{1,0} parameter(0)
  %v = bf16[128,32]{1,0} parameter(1)
  %x = f32[1024]{0} parameter(2)
  %buf = f32[16,4,64]{2,1,0} parameter(3)
  %i = s32[] parameter(4)
  %row = f32[1,1,64]{2,1,0} parameter(5)
  %q = bf16[2,512,4,64]{3,2,1,0} parameter(6)
  %init = (s32[], f32[256]{0}) parameter(7)
  %gemm_fusion = f32[64,32]{1,0} fusion(%w, %v), kind=kCustom, calls=%gemm_body, metadata={op_name="jit(step)/dot_general"}
  %twice = f32[1024]{0} fusion(%x, %x), kind=kLoop, calls=%add_body, metadata={op_name="jit(step)/layers_0/attn_router/add"}
  %sliced = f32[4,64]{1,0} fusion(%buf, %i), kind=kLoop, calls=%slice_body
  %updated = f32[16,4,64]{2,1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%update_body
  %fmha = (bf16[2,512,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]},"mask_type":"CAUSAL"}}
  %copied = f32[1024]{0} copy(%twice)
  %tri = f32[1024]{0} custom-call(%copied, %x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/depth_route_fwd"}
  %loop = (s32[], f32[256]{0}) while(%init), condition=%loop_cond, body=%loop_body, backend_config={"known_trip_count":{"n":"5"}}
  %view = f32[64,32]{1,0} bitcast(%gemm_fusion)
  ROOT %r = f32[64,32]{1,0} copy(%view)
}
"""


@pytest.fixture(scope="module")
def launched():
    return {k.name: k for k in hlo_kernels.kernels(hlo_kernels.parse_module(HLO))}


def test_each_launch_is_found_with_its_loop_count(launched):
    assert set(launched) == {"gemm_fusion", "twice", "sliced", "updated", "fmha", "copied", "tri", "f", "r"}
    assert launched["f"].count == 5  # the loop body's fusion, once per iteration
    assert all(k.count == 1 for name, k in launched.items() if name != "f")


def test_bytes_count_what_each_kernel_moves(launched):
    assert launched["gemm_fusion"].bytes == 64 * 128 * 2 + 128 * 32 * 2 + 64 * 32 * 4
    assert launched["twice"].bytes == 1024 * 4 + 1024 * 4  # one operand passed twice is read once
    assert launched["sliced"].bytes == (4 * 64 * 4 + 4) + 4 * 64 * 4  # the slice (through the bitcast) and i
    assert launched["updated"].bytes == 64 * 4 + 4 + 64 * 4  # the row and j read, the row written in place
    assert launched["copied"].bytes == 2 * 1024 * 4
    assert launched["f"].bytes == 2 * 256 * 4
    assert launched["fmha"].bytes == 2 * 512 * 4 * 64 * 2 * 2  # q (passed three times) read once, the output
    assert launched["tri"].bytes == 3 * 1024 * 4  # two operands read, one output written


def test_flops_of_products_and_attention(launched):
    assert launched["gemm_fusion"].flops == 2 * 64 * 32 * 128 and launched["gemm_fusion"].what == "gemm"
    assert not launched["gemm_fusion"].f32  # bf16 operands: the bf16 peak
    # causal attention: 4 B H T S D / 2
    assert launched["fmha"].flops == 4 * 2 * 4 * 512 * 512 * 64 / 2
    assert sum(k.flops for k in launched.values()) == launched["gemm_fusion"].flops + launched["fmha"].flops


def test_routing_and_kinds(launched):
    assert gpu_step_time.is_routing(launched["twice"]) and not gpu_step_time.is_routing(launched["gemm_fusion"])
    assert gpu_step_time.kind_of(launched["fmha"]) == "attention (cuDNN)"
    assert gpu_step_time.kind_of(launched["gemm_fusion"]) == "matrix products"
    assert gpu_step_time.kind_of(launched["copied"]) == "unfused copy"
    assert gpu_step_time.kind_of(launched["tri"]) == "Pallas kernels (Triton)" and gpu_step_time.is_routing(launched["tri"])
    assert launched["tri"].own == "Triton" and {k.own for n, k in launched.items() if n != "tri"} == {""}


def test_kernels_of_their_own_are_recognised_by_their_target(monkeypatch):
    """OWN_KERNELS is the one place a backend's custom call is named: the count of aot's report, the kind and
    the price follow it (a backend added there, here a made-up one, is recognised as Triton's is)."""
    from deltares import aot

    other = HLO.replace("__gpu$xla.gpu.triton", "__gpu$other_backend_kernel")
    assert hlo_kernels.own_kernel_calls(HLO) == aot.pallas_kernel_calls(HLO) == 1
    assert hlo_kernels.own_kernel_calls(other) == 0
    monkeypatch.setitem(hlo_kernels.OWN_KERNELS, "other_backend_kernel", "Other")
    assert hlo_kernels.own_kernel_calls(other) == aot.pallas_kernel_calls(other) == 1
    tri = {k.name: k for k in hlo_kernels.kernels(hlo_kernels.parse_module(other))}["tri"]
    assert tri.own == "Other" and gpu_step_time.kind_of(tri) == "Pallas kernels (Other)"
    cal = gpu_step_time.Calibration(0.5, 0.25, 0.0, kernel_bw_efficiency=0.2)
    assert gpu_step_time.price(tri, 1e12, cal).seconds == pytest.approx(tri.bytes / 0.2e12)


def test_price_is_the_larger_of_memory_and_compute_plus_a_launch(launched):
    cal = gpu_step_time.Calibration(bw_efficiency=0.5, flops_efficiency=0.25, launch_seconds=1e-6)
    bw = 1e12
    gemm = gpu_step_time.price(launched["gemm_fusion"], bw, cal)
    memory = launched["gemm_fusion"].bytes / (0.5 * bw)
    compute = 2 * 64 * 32 * 128 / (gpu_step_time.PEAK_BF16 * 0.25)
    assert gemm.seconds == pytest.approx(max(memory, compute) + 1e-6)
    total = gpu_step_time.step_seconds(list(launched.values()), bw, cal)
    by_hand = sum((max(k.bytes / (0.5 * bw), k.flops / (gpu_step_time.PEAK_BF16 * 0.25)) + 1e-6) * k.count
                  for k in launched.values())
    assert total == pytest.approx(by_hand)
    # a kernel of its own at its own efficiency, the others as before
    own = gpu_step_time.Calibration(bw_efficiency=0.5, flops_efficiency=0.25, launch_seconds=1e-6,
                                    kernel_bw_efficiency=0.2)
    assert gpu_step_time.price(launched["tri"], bw, own).seconds == pytest.approx(3 * 1024 * 4 / (0.2 * bw) + 1e-6)
    assert gpu_step_time.price(launched["copied"], bw, own).seconds == gpu_step_time.price(launched["copied"], bw, cal).seconds
    assert gpu_step_time.step_seconds(list(launched.values()), bw, own) == pytest.approx(
        by_hand + 3 * 1024 * 4 / bw * (1 / 0.2 - 1 / 0.5))
    # the calibration's vectorised price is the same sum
    result = gpu_calibration.kernels_of(HLO, n_layers=1)
    fit = gpu_calibration.Fit(0.5, 0.25, 1e-6, 0.2)
    assert gpu_calibration.predict(result, fit, bw) == pytest.approx(
        gpu_step_time.step_seconds(list(launched.values()), bw, own))


def _synthetic_rows(rng, bw, true, settings=3, own_in=(0, 1)):
    """Rows of `settings` settings (a baseline, delta_block and delta each), priced exactly with `true`
    (a Fit); the routed modes of the settings in `own_in` launch kernels of their own."""
    rows = []
    for s in range(settings):
        for m, mode in enumerate(("baseline", "delta_block", "delta")):
            n = 200 + 150 * s + 60 * m
            kernels = [[float(rng.uniform(1e6, 5e8)), float(rng.choice([0.0, rng.uniform(1e10, 2e12)])), 0,
                        int(rng.integers(1, 40)), 0, 0] for _ in range(n)]
            if mode != "baseline" and s in own_in:
                kernels += [[float(rng.uniform(1e8, 2e9)), 0.0, 0, 12, 1, 1] for _ in range(4)]
            result = dict(kernels=kernels, program=f"p{s}{m}")
            ms = gpu_calibration.predict(result, true, bw) * 1e3
            rows.append(gpu_calibration.Row(f"r{s} {mode}", f"s220m:{mode}", {}, ms, setting=f"setting {s}",
                                            result=result))
    return rows


def test_fit_recovers_known_constants():
    """Rows priced with known constants, kernels of their own at an efficiency of their own: the fit finds
    every constant (to its grid) and predicts every row; each setting held out in turn, its rows and its
    cost over baseline are predicted as well (errors near 0)."""
    rng = np.random.default_rng(0)
    bw, true = 4.8e12, gpu_calibration.Fit(0.72, 0.55, 6e-6, 0.41)
    rows = _synthetic_rows(rng, bw, true)
    found = gpu_calibration.fit(rows, {"h200": bw})
    assert (found.bw, found.fl) == pytest.approx((true.bw, true.fl), abs=0.011)
    assert found.launch == pytest.approx(true.launch, rel=0.1)
    assert found.kernel_bw == pytest.approx(true.kernel_bw, rel=0.03)
    for r in rows:
        assert gpu_calibration.predict(r.result, found, bw) * 1e3 == pytest.approx(r.measured_ms, rel=0.01)
    held = gpu_calibration.cross_validate(rows, {"h200": bw})
    assert set(held) == {r.name for r in rows}
    assert max(abs(h["error"]) for h in held.values()) < 0.01
    overheads = [h["overhead_error"] for h in held.values() if "overhead_error" in h]
    assert len(overheads) == 6 and max(map(abs, overheads)) < 0.03
    # without rows of kernels of their own there is no such efficiency to fit
    plain = [r for r in _synthetic_rows(rng, bw, true, own_in=())]
    assert gpu_calibration.fit(plain, {"h200": bw}).kernel_bw is None


def test_held_out_settings_never_share_a_baseline_or_program_with_the_fit():
    """Each fold holds out whole settings: no held-out row's baseline and no held-out program is fitted, also
    where two settings hold one program (they are left out together)."""
    rng = np.random.default_rng(1)
    bw, true = 4.8e12, gpu_calibration.Fit(0.8, 0.6, 0.0, 0.5)
    rows = _synthetic_rows(rng, bw, true, settings=4)
    rows[10].result = dict(rows[1].result)  # setting 3's delta_block runs setting 0's program
    folds = gpu_calibration.folds(rows)
    assert sorted(sorted({r.setting for r in held}) for _, held in folds) == [
        ["setting 0", "setting 3"], ["setting 1"], ["setting 2"]]
    for fitted, held in folds:
        assert {r.setting for r in fitted}.isdisjoint({r.setting for r in held})
        assert {r.result["program"] for r in fitted}.isdisjoint({r.result["program"] for r in held})
        for r in held:
            base = gpu_calibration.baseline_of(r, rows)
            assert base is None or base in held
        assert len(fitted) + len(held) == len(rows)
    held = gpu_calibration.cross_validate(rows, {"h200": bw})
    assert "overhead_error" not in held["r0 baseline"] and "overhead_error" in held["r0 delta"]


def test_ratio_band_and_the_goal_verdicts():
    """A 10 ms overhead on a 100 ms baseline, the model's overhead between 20% low and 10% high on the held-out
    rows: the measured overhead is 10 / 1.1 to 10 / 0.8 ms, the ratio 1.0909x to 1.125x; a goal is met only
    above the band, missed only below it, else undecided."""
    cal = gpu_step_time.Calibration(0.8, 0.6, 0.0, overhead_error=(-0.2, 0.1))
    band = gpu_step_time.ratio_band(0.110, 0.100, cal)
    assert band["ratio"] == pytest.approx(1.10)
    assert (band["low"], band["high"]) == pytest.approx((1 + 0.1 / 1.1, 1 + 0.1 / 0.8))
    assert band["overhead_seconds"] == pytest.approx(0.010)
    verdicts = {goal: gpu_step_time.verdict(band["low"], band["high"], goal) for goal in (1.08, 1.09, 1.10, 1.125, 1.13)}
    assert verdicts == {1.08: "missed", 1.09: "missed", 1.10: "undecided until measured",
                        1.125: "met", 1.13: "met"}
    # no error measured: the band is the ratio itself, and decides exactly
    exact = gpu_step_time.ratio_band(0.110, 0.100, gpu_step_time.Calibration(0.8, 0.6, 0.0))
    assert exact["low"] == exact["high"] == pytest.approx(1.10)
    assert gpu_step_time.verdict(exact["low"], exact["high"], 1.10) == "met"
    # the shipped calibration's band brackets its own estimate
    shipped = gpu_step_time.ratio_band(0.110, 0.100)
    assert shipped["low"] <= shipped["ratio"] <= shipped["high"]


def _bench_folder(path, gpu="NVIDIA H200"):
    """A folder as launch/gpu_bench.py writes it: env.json, rows.jsonl, programs.tar (the HLO above)."""
    path.mkdir()
    (path / "env.json").write_text(json.dumps(dict(gpu=gpu, date="2026-12-06 10:00 UTC", commit="abc1234")))
    lines = [dict(stage="s220m_defaults", setting="s220m defaults", mode="baseline", what="timing", scale="s220m",
                  n_layers=12, median_ms=60.0, step_ms=[60.0] * 9, program="s220m_defaults.baseline.hlo.gz",
                  xla_flags=""),
             dict(stage="s220m_defaults", setting="s220m defaults", mode="delta_block", what="timing", scale="s220m",
                  n_layers=12, median_ms=66.0, step_ms=[66.0] * 9, program="s220m_defaults.delta_block.hlo.gz",
                  xla_flags=""),
             dict(stage="s220m_profile", setting="s220m defaults", mode="delta_block", what="timing", scale="s220m",
                  n_layers=12, median_ms=70.0, step_ms=[70.0] * 2, program="s220m_profile.delta_block.hlo.gz",
                  xla_flags=""),
             dict(stage="s220m_profile", setting="s220m defaults", mode="delta_block", what="profile", scale="s220m",
                  n_layers=12, median_ms=70.0, step_ms=[70.0] * 2, kernels=[["fusion.1", 1, 10.0]],
                  program="s220m_profile.delta_block.hlo.gz", xla_flags=""),
             dict(stage="s220m_no_command_buffers", setting="s220m defaults, command buffers off", mode="baseline",
                  what="timing", scale="s220m", n_layers=12, median_ms=65.0, step_ms=[65.0] * 9,
                  program="s220m_no_command_buffers.baseline.hlo.gz", xla_flags="--xla_gpu_enable_command_buffer="),
             dict(stage="s220m_xla", setting="s220m defaults", mode="delta", skipped="about 90 s needed, 20 s left"),
             dict(stage="s220m_xla", setting="s220m defaults", mode="delta_block", what="timing", scale="s220m",
                  n_layers=12, median_ms=75.0, step_ms=[75.0] * 9, program="s220m_xla.delta_block.hlo.gz")]
    (path / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    baseline = HLO.replace("  %tri = ", "  %untimed = ").replace('custom_call_target="__gpu$xla.gpu.triton"',
                                                                   'custom_call_target="__cublas$gemm"')
    programs = {"s220m_defaults.baseline.hlo.gz": baseline, "s220m_defaults.delta_block.hlo.gz": HLO,
                "s220m_profile.delta_block.hlo.gz": HLO, "s220m_no_command_buffers.baseline.hlo.gz": baseline}
    for i, (name, text) in enumerate(programs.items()):  # the last one in a second tar, as past the size limit
        with tarfile.open(path / ("programs.tar" if i < 3 else "programs-2.tar"), "a") as tar:
            data = gzip.compress(text.encode())
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_bench_folder_is_calibration_input(tmp_path):
    """A bench's timed modes become rows of their setting, with the program that ran (read from its saved HLO,
    not compiled): a program timed twice counts once (the longer timing), skipped modes and modes without a
    saved program are left out, and the rows run with XLA flags of their own are marked (not fitted)."""
    rows = gpu_calibration.bench_rows(str(_bench_folder(tmp_path / "bench")))
    by = {r.name.split(" ", 4)[-1]: r for r in rows}
    assert set(by) == {"s220m_defaults baseline", "s220m_defaults delta_block", "s220m_no_command_buffers baseline"}
    assert {r.setting for r in rows} == {"bench h200 2026-12-06 abc1234 s220m defaults",
                                         "bench h200 2026-12-06 abc1234 s220m defaults, command buffers off"}
    assert by["s220m_defaults delta_block"].measured_ms == 66.0 and by["s220m_defaults baseline"].mode == "baseline"
    assert by["s220m_no_command_buffers baseline"].note and not by["s220m_defaults baseline"].note
    own = np.array(by["s220m_defaults delta_block"].result["kernels"])[:, 5]
    assert own.sum() == 1 and np.array(by["s220m_defaults baseline"].result["kernels"])[:, 5].sum() == 0
    assert gpu_calibration.baseline_of(by["s220m_defaults delta_block"], rows) is by["s220m_defaults baseline"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(gpu_calibration.BenchError, match="not a GPU bench's output"):
        gpu_calibration.bench_rows(str(tmp_path / "empty"))


def test_calibration_rows_are_the_documented_measurements():
    """Every row names an experiment and settings that exist, with a positive time; fit and held-out rows both."""
    import importlib

    settings = {r.setting for r in gpu_calibration.ROWS}
    assert len(settings) == 6 and len(gpu_calibration.ROWS) == 26
    for setting in settings:  # one baseline each
        assert sum(r.mode == "baseline" for r in gpu_calibration.ROWS if r.setting == setting) == 1
    for r in gpu_calibration.ROWS + gpu_calibration.ESTIMATES:
        assert (r.measured_ms is None) == (r in gpu_calibration.ESTIMATES) and (r.measured_ms or 1) > 0
        scale, mode = r.experiment.split(":")
        importlib.import_module(f"experiments.{scale}").get_config(mode)
        cfg = gpu_calibration.config_of(r)
        assert (cfg.train.global_batch, cfg.data.seq_len) == (8, 2048)
    goals = {(r.scale, r.mode) for r in gpu_calibration.ESTIMATES} & set(gpu_calibration.GOALS)
    assert goals == set(gpu_calibration.GOALS)  # every goal is estimated
