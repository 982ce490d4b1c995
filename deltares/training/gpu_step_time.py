"""A model of a GPU train step's time, from the program XLA's CUDA compiler builds on a CPU.

`python -m deltares.aot --gpu h200 --estimate` compiles the real train step for the GPU
(`deltares.training.gpu_aot`) and reads its kernels from the optimized HLO
(`deltares.training.hlo_kernels`). Each launch is priced as

    t = max(bytes / (bandwidth x BW_EFFICIENCY), flops / (peak x FLOPS_EFFICIENCY)) + LAUNCH_SECONDS

with the device's memory bandwidth from its target config and its dense tensor-core peak (bf16;
TF32 for float32 products), and the step's time is the sum over its launches (a GPU runs one
kernel at a time on one stream). cuDNN attention and cuBLAS calls are priced by their own FLOPs
and bytes, Pallas (Triton) kernels by their bytes. The three constants are fitted to train steps
measured on one H200 (`CALIBRATION`; the fit and its error on the rows left out of it:
docs/explanations/performance.md). It is a model, not a measurement: it knows nothing of caches,
overlap between kernels, or how well a given kernel uses the device.
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
    """The model's constants: the fractions of bandwidth and peak a kernel reaches, the cost of a launch."""

    bw_efficiency: float
    flops_efficiency: float
    launch_seconds: float
    fitted_on: str = ""


# Fitted by `python -m tests.gpu_calibration` on 2026-12-05 (jax 0.10.2's CUDA compiler): 7 H200 step times
# fitted, 19 held out (mean |error| 4.8%, at most 19.9%; docs/explanations/performance.md). The launch cost
# came out 0: with XLA's command buffers (CUDA graphs, on by default) launches cost no measurable time here.
CALIBRATION = Calibration(bw_efficiency=0.81, flops_efficiency=0.63, launch_seconds=0.0,
                          fitted_on="fitted to 7 H200 step times, 19 held out: mean error 4.8%, at most 19.9%")


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


def price(kernel: Kernel, bandwidth: float, cal: Calibration) -> Priced:
    """One launch of `kernel`: its bytes at the effective bandwidth, its FLOPs at the effective peak."""
    memory = kernel.bytes / (bandwidth * cal.bw_efficiency)
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
        if "triton" in target:
            return "Pallas kernels (Triton)"
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
                         launch_seconds=cal.launch_seconds, fitted_on=cal.fitted_on),
        caveat=CAVEAT,
    )
