"""The GPU step-time model's reading of a compiled program (deltares/training/hlo_kernels.py) and its fit
(tests/gpu_calibration.py), on a hand-written HLO module whose kernels' bytes and FLOPs are counted
here by hand, and on rows made from known constants."""

import numpy as np
import pytest

from deltares.training import gpu_step_time, hlo_kernels
from tests import gpu_calibration

# One entry computation: a gemm fusion (bf16 [64,128] x [128,32]), an elementwise fusion over a buffer
# passed twice, a fusion that reads one [4,64] slice of a [16,4,64] f32 buffer through a bitcast, a fusion
# writing one [1,64] row of that buffer in place, a cuDNN attention call, a copy, and a while loop of 5
# iterations whose body launches one elementwise fusion.
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
  %loop = (s32[], f32[256]{0}) while(%init), condition=%loop_cond, body=%loop_body, backend_config={"known_trip_count":{"n":"5"}}
  %view = f32[64,32]{1,0} bitcast(%gemm_fusion)
  ROOT %r = f32[64,32]{1,0} copy(%view)
}
"""


@pytest.fixture(scope="module")
def launched():
    return {k.name: k for k in hlo_kernels.kernels(hlo_kernels.parse_module(HLO))}


def test_each_launch_is_found_with_its_loop_count(launched):
    assert set(launched) == {"gemm_fusion", "twice", "sliced", "updated", "fmha", "copied", "f", "r"}
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


def test_fit_recovers_known_constants():
    """Rows priced with known constants: the fit finds them (to its grid) and predicts every row."""
    rng = np.random.default_rng(0)
    bw, true = 4.8e12, (0.72, 0.55, 6e-6)
    rows = []
    for n in range(6):
        kernels = [[float(rng.uniform(1e6, 5e8)), float(rng.choice([0.0, rng.uniform(1e10, 2e12)])), 0,
                    int(rng.integers(1, 40)), 0] for _ in range(200 + 150 * n)]
        result = dict(kernels=kernels)
        ms = gpu_calibration.predict(result, *true, bw) * 1e3
        rows.append(gpu_calibration.Row(f"r{n}", "s220m:baseline", {}, ms, fit=True, result=result))
    b, f, c = gpu_calibration.fit(rows, bw)
    assert (b, f) == pytest.approx(true[:2], abs=0.011)
    assert c == pytest.approx(true[2], rel=0.1)
    for r in rows:
        assert gpu_calibration.predict(r.result, b, f, c, bw) * 1e3 == pytest.approx(r.measured_ms, rel=0.01)


def test_calibration_rows_are_the_documented_measurements():
    """Every row names an experiment and settings that exist, with a positive time; fit and held-out rows both."""
    import importlib

    assert any(r.fit for r in gpu_calibration.ROWS) and any(not r.fit for r in gpu_calibration.ROWS)
    for r in gpu_calibration.ROWS:
        assert r.measured_ms > 0
        scale, mode = r.experiment.split(":")
        importlib.import_module(f"experiments.{scale}").get_config(mode)
        cfg = gpu_calibration.config_of(r)
        assert (cfg.train.global_batch, cfg.data.seq_len) == (8, 2048)
