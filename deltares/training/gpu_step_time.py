"""A model of a GPU train step's time, from the program XLA's CUDA compiler builds on a CPU.

`python -m deltares.aot --gpu h200 --estimate` compiles the real train step for the GPU
(`deltares.training.gpu_aot`) and reads its kernels from the optimized HLO
(`deltares.training.hlo_kernels`). Each launch is priced as

    t = max(bytes / (bandwidth x BW_EFFICIENCY), flops / (peak x FLOPS_EFFICIENCY)) + LAUNCH_SECONDS

with the device's memory bandwidth from its target config and its dense tensor-core peak (bf16;
TF32 for float32 products), and the step's time is the sum over its launches (a GPU runs one
kernel at a time on one stream). cuDNN attention and cuBLAS calls are priced by their own FLOPs
and bytes; Pallas kernels ("kernels of their own", `hlo_kernels.OWN_KERNELS`: Triton) by their
bytes at a bandwidth efficiency of their own (`Calibration.kernel_bw_efficiency`), fitted on the
steps measured with such a kernel. The constants are fitted to train steps measured on one H200
(`CALIBRATION`; the fit, its error on whole settings left out of it, on the step time and on each
mode's cost over baseline: docs/explanations/performance.md); `ratio_band` turns that error into
the range of a mode's ratio to baseline. It is a model, not a measurement: it knows nothing of
caches, overlap between kernels, or how well a given kernel uses the device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deltares.training.hlo_kernels import Kernel, kernels, parse_module

# Dense tensor-core peaks of the GH100 chip (H100 SXM and H200 alike), FLOP/s: bf16/f16 and TF32.
PEAK_BF16 = 989.4e12
PEAK_TF32 = 494.7e12
CAVEAT = ("a model of the GPU's kernels (bytes at the memory bandwidth, FLOPs at the tensor-core peak, a fixed cost "
          "per launch; constants fitted to H200 step times), not a measurement")


@dataclass(frozen=True)
class Calibration:
    """The model's constants: the fractions of bandwidth and peak a kernel reaches, the cost of a launch, the
    fraction of bandwidth a kernel of its own reaches (a Pallas kernel: `hlo_kernels.OWN_KERNELS`; None: as
    XLA's kernels), and the range of the model's relative error on a mode's cost over baseline (model /
    measured - 1 of the step time less baseline's) over the rows held out of the fit."""

    bw_efficiency: float
    flops_efficiency: float
    launch_seconds: float
    kernel_bw_efficiency: float | None = None
    overhead_error: tuple[float, float] = (0.0, 0.0)
    fitted_on: str = ""


# Fitted by `python -m tests.gpu_calibration` on 2026-12-06 (jax 0.10.2's CUDA compiler) to the 26 H200 step times
# of 2026-12-04, the kernels of their own (Triton) on the 4 that ran one; each of the 6 settings held out in turn:
# step time mean |error| 4.6% (at most 19.2%), a mode's cost over baseline -24.5% to +21.8%
# (docs/explanations/performance.md). The launch cost came out 0: with XLA's command buffers (CUDA graphs, on by
# default) launches cost no measurable time here.
CALIBRATION = Calibration(bw_efficiency=0.77, flops_efficiency=0.66, launch_seconds=0.0, kernel_bw_efficiency=0.593,
                          overhead_error=(-0.245, 0.218),
                          fitted_on="fitted to 26 H200 step times; on whole settings held out, step time mean error "
                                    "4.6%, a mode's cost over baseline -24.5% to +21.8%")


def bandwidth_of(gpu: str) -> float:
    """Bytes per second of the GPU's memory, as its target config (deltares/training/gpu_targets) states."""
    from deltares.training.gpu_aot import target_config

    m = re.search(r"^\s*memory_bandwidth:\s*(\d+)", target_config(gpu), re.M)
    if not m:
        raise ValueError(f"deltares/training/gpu_targets/{gpu}.txtpb has no memory_bandwidth")
    return float(m.group(1))


@dataclass
class Priced:
    kernel: Kernel
    memory_s: float  # bytes at the effective bandwidth
    compute_s: float  # FLOPs at the effective peak
    seconds: float  # one launch: max of the two plus the launch cost


def bw_efficiency_of(kernel: Kernel, cal: Calibration) -> float:
    """The fraction of the bandwidth `kernel` reaches: a kernel of its own's, else XLA's kernels'."""
    return cal.kernel_bw_efficiency if kernel.own and cal.kernel_bw_efficiency else cal.bw_efficiency


def price(kernel: Kernel, bandwidth: float, cal: Calibration) -> Priced:
    """One launch of `kernel`: its bytes at the effective bandwidth, its FLOPs at the effective peak."""
    memory = kernel.bytes / (bandwidth * bw_efficiency_of(kernel, cal))
    compute = kernel.flops / ((PEAK_TF32 if kernel.f32 else PEAK_BF16) * cal.flops_efficiency)
    return Priced(kernel, memory, compute, max(memory, compute) + cal.launch_seconds)


def program_kernels(hlo_text: str) -> list[Kernel]:
    """The kernels one run of a compiled program launches (loops unrolled by their trip counts)."""
    return list(kernels(parse_module(hlo_text)))


def step_seconds(ks: list[Kernel], bandwidth: float, cal: Calibration = CALIBRATION) -> float:
    return sum(price(k, bandwidth, cal).seconds * k.count for k in ks)


def is_routing(kernel: Kernel) -> bool:
    """A kernel of the depth routing: made by a router (its jax op name names one) or by the store-once pass."""
    return "_router" in kernel.op_name or "depth_route" in kernel.op_name or "DepthRouting" in kernel.op_name


def kind_of(kernel: Kernel) -> str:
    what = kernel.what
    if what.startswith("custom-call:"):
        target = what.split(":", 1)[1]
        if "fmha" in target or "cudnn" in target:
            return "attention (cuDNN)"
        if kernel.own:
            return f"Pallas kernels ({kernel.own})"
        if "cublas" in target or "gemm" in target:
            return "matrix products"
        return f"custom call {target}"
    if what == "gemm":
        return "matrix products"
    if what.startswith("fusion:"):
        return "other fusions"
    return f"unfused {what}"


def estimate(hlo_text: str, gpu: str, n_layers: int, cal: Calibration = CALIBRATION) -> dict:
    """The estimate of one step of a compiled program for `gpu`: time, launches, bytes, FLOPs, by kind
    and for the routing, launches per sublayer (2 per layer)."""
    ks = program_kernels(hlo_text)
    bandwidth = bandwidth_of(gpu)
    by_kind: dict[str, dict] = {}
    routing = dict(kernels=0, seconds=0.0, bytes=0.0)
    total = dict(kernels=0, seconds=0.0, bytes=0.0, flops=0.0, launch_seconds=0.0)
    for k in ks:
        p = price(k, bandwidth, cal)
        row = by_kind.setdefault(kind_of(k), dict(kernels=0, seconds=0.0, bytes=0.0, flops=0.0))
        for d in (row, total):
            d["kernels"] += k.count
            d["seconds"] += p.seconds * k.count
            d["bytes"] += k.bytes * k.count
            d["flops"] += k.flops * k.count
        total["launch_seconds"] += cal.launch_seconds * k.count
        if is_routing(k):
            routing["kernels"] += k.count
            routing["seconds"] += p.seconds * k.count
            routing["bytes"] += k.bytes * k.count
    sublayers = max(2 * n_layers, 1)
    return dict(
        seconds=total["seconds"],
        kernels=total["kernels"],
        kernels_per_sublayer=total["kernels"] / sublayers,
        routing_kernels=routing["kernels"],
        routing_kernels_per_sublayer=routing["kernels"] / sublayers,
        routing_seconds=routing["seconds"],
        routing_bytes=routing["bytes"],
        bytes_accessed=total["bytes"],
        flops=total["flops"],
        launch_seconds=total["launch_seconds"],
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["seconds"])),
        bandwidth=bandwidth,
        calibration=dict(bw_efficiency=cal.bw_efficiency, flops_efficiency=cal.flops_efficiency,
                         launch_seconds=cal.launch_seconds, kernel_bw_efficiency=cal.kernel_bw_efficiency,
                         overhead_error=list(cal.overhead_error), fitted_on=cal.fitted_on),
        caveat=CAVEAT,
    )


# --------------------------------------------------------------------------- a mode against baseline


def ratio_band(mode_seconds: float, baseline_seconds: float, cal: Calibration = CALIBRATION) -> dict:
    """A mode's estimated step over baseline's, and the range the ratio lies in if the model errs on the
    mode's cost over baseline (its step less baseline's) as it did on the held-out rows: the measured
    overhead is the model's / (1 + error), error in `cal.overhead_error` (baseline taken as estimated)."""
    overhead = mode_seconds - baseline_seconds
    ends = [1 + overhead / (1 + e) / baseline_seconds for e in cal.overhead_error]
    return dict(ratio=mode_seconds / baseline_seconds, low=min(ends), high=max(ends), overhead_seconds=overhead)


def verdict(low: float, high: float, goal: float) -> str:
    """A goal of at most `goal`: "met" when the whole band lies at or below it, "missed" when it lies above,
    else "undecided until measured"."""
    if high <= goal:
        return "met"
    if low > goal:
        return "missed"
    return "undecided until measured"
