"""Ahead-of-time memory proof: compile the real train step for a TPU slice or NVIDIA GPUs on a
CPU-only machine.

    python -m deltares.aot --config experiments/s7b6.py:delta_block --topology v5p:2x2x2
    python -m deltares.aot --config experiments/s7b6.py:baseline --topology v6e:4x4 \
        --config.model.remat=full --json
    python -m deltares.aot --config experiments/debug.py --topology v5e:2x2 --mesh 1,2,2
    python -m deltares.aot --config experiments/s533m.py:delta_block --gpu h100
    python -m deltares.aot --config experiments/s1044m.py:delta_block --gpu h100:8
    python -m deltares.aot --config experiments/s220m.py:delta_block --gpu h200 --estimate
    python -m deltares.aot --config experiments/s220m.py:delta --topology v5p:2x2x1 \
        --config.model.remat=full --estimate

The train step is the one `deltares.train` runs (`deltares.training.program.sharded_train_step`:
forward, backward, gradient clipping and the AdamW update, the state donated), lowered for
the experiment's global batch and sequence length and compiled by the TPU compiler of
`libtpu` (a PyPI wheel, pinned in requirements.txt) for compile-only devices of the
topology (`jax.experimental.topologies`). Nothing runs on a TPU; no TPU is needed.

Topology strings are libtpu's `generation:chips`, e.g. `v4:2x2x2`, `v5p:2x2x2`, `v5e:4x4`,
`v6e:8x8`, `tpu7x:2x2x1`. v4 and v5p are compiled in megacore mode (one device per chip,
as JAX uses them), the others with one device per TensorCore as libtpu lays them out.

`--gpu h100|h200` (instead of `--topology`) compiles for one such GPU with XLA's CUDA compiler,
the PJRT plugin of JAX's CUDA build with CUDA's ptxas and libdevice from wheels
(requirements-cuda-compiler.txt, not in requirements.txt; no CUDA toolkit is read: see
deltares/training/gpu_aot.py), for the GPU described in deltares/training/gpu_targets/. Pallas kernels
are Triton or Mosaic GPU kernels there (`pallas_kernel_calls` counts both). `--gpu h100:8` compiles for 8 of them in one host, as one process of the
trainer uses a node's GPUs: the step sharded over the mesh of config.mesh (or --mesh) with its
collectives, and the memory of each device; the compiler makes N compile-only GPUs itself, so these
are the sharded program's own figures, not one GPU's scaled. The GPU compiler states no memory
limit, so `hbm` is the device memory of the target config; JAX on a GPU preallocates 75% of it
unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise. cuDNN's fused attention (the "auto" attention in
bf16) is compiled as on the GPU: the target config states cuDNN's version and the compute capability.

`--estimate` with `--gpu` prices the compiled program's kernels (`deltares.training.gpu_step_time`:
each launch's bytes at the memory bandwidth, its FLOPs at the tensor-core peak, plus a cost per
launch, a Pallas kernel's bytes at a bandwidth of its own; constants fitted to step times measured on
an H200) and reports launches per step and per sublayer, the routing's share and the time by kind of
kernel: a model, not a measurement. For a routed mode it compiles baseline's step too and reports the
mode's ratio to it with the band the model's error on a mode's cost over baseline (on the rows held
out of its fit) puts on it. It is for one GPU and refused with `NAME:N`: the model knows no traffic
between GPUs.

Reported, per device: arguments (the sharded train state and batch), outputs (the new
state and the metrics), the bytes outputs share with donated arguments (aliased, counted
once), temporaries (activations, gradients, optimizer scratch) and the program itself;
total = arguments + outputs - aliased + temporaries + program. `hbm` is the HBM the
compiler can allocate on one device, as the compiler states it (it is probed with a
deliberately oversized program; a table of nominal per-chip HBM is the fallback).

FLOPs per step are counted from the traced step (jaxpr): 2 * M * N * K for every matrix
product of the global batch, and cuDNN's fused attention as its kernels compute it (4 B H T S D
forward, 2.5 times that backward, halved under the causal mask: the convention of the GPU
estimate), a `scan`'s body times its length, rematerialised forwards included; elementwise work
is left out. The compiler's own cost analysis is reported
beside it (`xla_flops_per_step` = its per-device figure times the devices); it counts the
body of a loop once, so with `scan_layers` it sees one layer of the stack.

A program that does not fit is no error: the compiler's RESOURCE_EXHAUSTED is reported as
`fits: false` with the compiler's figures. Exit status: 0 fits, 1 does not fit, 2 error.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags, logging
from ml_collections import config_flags

from deltares import command_line
from deltares.training.compile_only import (  # noqa: F401 - re-exported: the tool's public names
    EXAMPLE_TOPOLOGIES,
    AotError,
    check_config,
    step_mesh,
    topology_devices,
    train_step,
)
from deltares.nn.config import check_platform
from deltares.training.experiment import field_names
from deltares.training.memory import compiled_bytes

GIB = 2**30

# Nominal HBM of one JAX device (`device_kind`), used only when the compiler's own figure
# cannot be had. Google Cloud TPU documentation: v2 8 GiB and v3 16 GiB per TensorCore,
# v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB per chip, TPU7x 192 GiB per chip of two devices.
NOMINAL_HBM_GIB = {
    "TPU v2": 8,
    "TPU v3": 16,
    "TPU v4": 32,
    "TPU v5 lite": 16,
    "TPU v5e": 16,
    "TPU v5": 95,
    "TPU v5p": 95,
    "TPU v6 lite": 32,
    "TPU v6e": 32,
    "TPU7x": 96,
}
# --------------------------------------------------------------------------- compiler figures

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_SIZE = r"([\d.]+)\s*([KMGTP]?)(?:i?B)?"


def _size(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.upper()])


def parse_oom(message: str) -> dict:
    """The figures of a compiler RESOURCE_EXHAUSTED message: `required` (bytes the program
    needs, as the compiler puts it), `required_what` (what that figure counts) and `hbm`."""
    out: dict = {}
    used = re.search(rf"Used {_SIZE} of {_SIZE} hbm", message)
    if used:
        out.update(required=_size(*used.group(1, 2)), hbm=_size(*used.group(3, 4)), required_what="total")
    temps = re.search(rf"required for HLO temporaries \({_SIZE}\) exceeds available HBM \({_SIZE}\)", message)
    if temps and "required" not in out:
        out.update(required=_size(*temps.group(1, 2)), hbm=_size(*temps.group(3, 4)), required_what="temporaries")
    if "hbm" not in out:
        available = re.search(rf"available HBM \({_SIZE}\)", message) or re.search(rf"of {_SIZE} hbm", message)
        if available:
            out["hbm"] = _size(*available.group(1, 2))
    return out


def is_oom(err: BaseException) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


def hbm_of(device) -> tuple[int | None, str]:
    """(bytes the compiler may allocate on `device`, where the figure comes from). The
    compiler states its limit when a program exceeds it, so a program that needs far more
    than any chip has is compiled (a fraction of a second) to read it."""
    probe = jax.jit(lambda x: jnp.sin(x) + jnp.cos(x)[::-1])
    arg = jax.ShapeDtypeStruct((2**40 // 4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        probe.lower(arg).compile()
    except Exception as err:  # noqa: BLE001 - any failure falls back to the table
        hbm = parse_oom(str(err)).get("hbm")
        if hbm:
            return hbm, "compiler"
    nominal = NOMINAL_HBM_GIB.get(device.device_kind)
    return (nominal * GIB, "nominal") if nominal else (None, "unknown")


def pallas_kernel_calls(hlo_text: str) -> int:
    """Pallas kernels in a compiled program's HLO: Mosaic custom calls (TPU), kernels of their own (GPU:
    `hlo_kernels.OWN_KERNELS`: Triton, Mosaic GPU)."""
    from deltares.training.hlo_kernels import own_kernel_calls

    return hlo_text.count('custom_call_target="tpu_custom_call"') + own_kernel_calls(hlo_text)


# --------------------------------------------------------------------------- FLOPs


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


# jax's cuDNN fused attention (jax.nn.dot_product_attention, implementation "cudnn"): primitive -> backward
FUSED_ATTENTION = {"dot_product_attention_fwd": False, "dot_product_attention_fwd_wrapper": False,
                   "dot_product_attention_bwd": True, "dot_product_attention_bwd_wrapper": True}


def fused_attention_eqn_flops(eqn) -> float:
    """FLOPs of one cuDNN fused attention equation (hlo_kernels.fused_attention_flops, as the GPU estimate
    counts the compiled call): its query and key shapes in the equation's layout (BTNH or BNTH)."""
    from deltares.training.hlo_kernels import fused_attention_flops

    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if eqn.params["layout"] == 1:  # BNTH
        (B, H, T, D), S = q, k[2]
    else:  # BTNH
        (B, T, H, D), S = q, k[1]
    mask = getattr(eqn.params["mask_type"], "name", str(eqn.params["mask_type"]))
    return fused_attention_flops(B * H, T, S, D, backward=FUSED_ATTENTION[eqn.primitive.name],
                                 causal=mask in ("CAUSAL", "PADDING_CAUSAL"))


def jaxpr_flops(jaxpr) -> float:
    """Matrix-product FLOPs of a jaxpr (2 * output size * contracted size per dot_general, and
    a cuDNN fused attention call as `fused_attention_eqn_flops` counts it), a scan's body counted
    `length` times, a cond's costliest branch, a while body once, a Pallas kernel's body once per
    grid step, a `shard_map` body (one device's shapes) once per device of its manual mesh axes."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            contracted = math.prod(lhs.shape[d] for d in lhs_contract)
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
            continue
        if name in FUSED_ATTENTION:
            total += fused_attention_eqn_flops(eqn)
            continue
        inner = [jaxpr_flops(sub) for sub in _subjaxprs(eqn)]
        if not inner:
            continue
        if name == "cond":
            total += max(inner)
        elif name == "scan":
            total += eqn.params["length"] * sum(inner)
        elif name == "pallas_call":
            total += math.prod(eqn.params["grid_mapping"].grid) * sum(inner)
        elif name == "shard_map":
            mesh = eqn.params["mesh"]
            total += math.prod(mesh.shape[a] for a in eqn.params["newly_manual_axes"]) * sum(inner)
        else:
            total += sum(inner)
    return total


# --------------------------------------------------------------------------- the proof


def _per_device_bytes(abstract_tree) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings (the largest
    shard, where uneven)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _trace(step, *args):
    """`jax.stages.Traced` of the sharded step: traced as `step.lower` traces it (in its mesh and
    the logical axis rules of deltares.training.sharding)."""
    import flax.linen as nn

    from deltares.training.sharding import LOGICAL_RULES

    with jax.set_mesh(step.mesh), nn.logical_axis_rules(LOGICAL_RULES):
        return step.fn.trace(*args)


def _gpu_target(spec: str, estimate: bool) -> tuple[str, int]:
    """(GPU name, how many) of `--gpu NAME[:N]`; AotError for another form, and for `estimate` with N > 1
    (the GPU step-time model prices one GPU's kernels and knows nothing of the traffic between GPUs)."""
    from deltares.training.gpu_aot import parse_gpu

    try:
        name, count = parse_gpu(spec)
    except ValueError as err:
        raise AotError(str(err)) from None
    if estimate and count > 1:
        raise AotError(f"--estimate prices one GPU's kernels and models no traffic between GPUs, so not --gpu={spec}; "
                       f"estimate one GPU at the per-device batch (--gpu {name} "
                       f"--config.train.global_batch=<global batch / {count}>)")
    return name, count


def _gpu_devices(name: str, count: int) -> list:
    from deltares.training import gpu_aot

    try:
        return gpu_aot.gpu_devices(name, count)
    except gpu_aot.CudaCompilerMissing as err:
        raise AotError(str(err)) from None


def analyze(cfg, topology: str | None, mesh_override: str | None = None, config_name: str = "",
            gpu: str | None = None, estimate: bool = False, vs_baseline: bool = True) -> dict:
    """Compiles the train step of `cfg` for `topology` (a TPU slice) or `gpu` (GPUs of one host: "h100",
    "h200:8") and returns the report (see module doc); with `gpu` and `estimate` (one GPU), the GPU
    step-time model of the compiled program too (`deltares.training.gpu_step_time`), and for a routed mode
    with `vs_baseline` baseline's step compiled and estimated as well: the mode's ratio to it, with the
    band the model's error on a mode's cost over baseline puts on it (`gpu_step_time.ratio_band`)."""
    from deltares.training.metrics import model_flops_per_token

    if gpu:
        gpu, count = _gpu_target(gpu, estimate)  # the report names the GPU; `devices` says how many
    check_config(cfg)
    devices = _gpu_devices(gpu, count) if gpu else topology_devices(topology)
    try:  # a kernel that cannot compile for the target: one line, not the lowering's traceback
        check_platform(cfg.model, devices[0].platform, cfg.data.seq_len)
    except ValueError as err:
        raise AotError(f"config: {err} (the target: {topology or gpu})") from None
    mesh = step_mesh(cfg, devices, topology or f"{count} x {gpu}", mesh_override)
    global_batch, seq_len = cfg.train.global_batch, cfg.data.seq_len
    try:
        step, abstract_state, batch_sharding = train_step(cfg, mesh)
    except ValueError as err:
        raise AotError(f"config: {err}") from None
    batch = jax.ShapeDtypeStruct((global_batch, seq_len + 1), jnp.int32, sharding=batch_sharding)
    report = _report_header(cfg, topology, gpu, devices, mesh, abstract_state, config_name)

    start = time.perf_counter()
    flops = jaxpr_flops(_trace(step, abstract_state, batch).jaxpr.jaxpr)
    report["flops_per_step"] = flops
    report["flops_per_device"] = flops / len(devices)
    report["model_flops_per_step"] = model_flops_per_token(cfg.model, seq_len) * global_batch * seq_len
    lowered = step.lower(abstract_state, batch)
    try:
        compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - JaxRuntimeError; anything but an OOM is re-raised
        if not is_oom(err):
            raise
        report["compile_seconds"] = round(time.perf_counter() - start, 1)
        return _report_oom(report, err, _per_device_bytes((abstract_state, batch)))
    report["compile_seconds"] = round(time.perf_counter() - start, 1)
    report = _report_compiled(report, compiled, len(devices), cfg.model.residual.impl)
    if gpu and estimate:
        from deltares.training.gpu_step_time import estimate as gpu_estimate

        report["estimate"] = gpu_estimate(compiled.as_text(), gpu, cfg.model.n_layers)
        report["estimate"]["mfu"] = estimated_mfu(report)
        if vs_baseline and cfg.model.residual.mode != "baseline":
            report["estimate"]["vs_baseline"] = _vs_baseline(cfg, mesh_override, config_name, gpu,
                                                             report["estimate"]["seconds"])
    return report


def _vs_baseline(cfg, mesh_override, config_name: str, gpu: str, seconds: float) -> dict:
    """Baseline's step of the same config compiled and estimated: the mode's ratio to it and its band."""
    from deltares.training.gpu_step_time import ratio_band

    base_cfg = cfg.copy_and_resolve_references()
    base_cfg.model.residual.mode = "baseline"
    say("compiling baseline's step too, for the ratio ...")
    base = analyze(base_cfg, None, mesh_override, config_name, gpu, estimate=True)
    if "estimate" not in base:  # baseline's step did not fit the device
        return {}
    return dict(ratio_band(seconds, base["estimate"]["seconds"]), baseline_seconds=base["estimate"]["seconds"])


def _report_header(cfg, topology, gpu, devices, mesh, abstract_state, config_name: str) -> dict:
    """What the report says before compiling: the target, the run's shapes, the device's memory and
    the mode's routing floor (memory.routing_floor_bytes: what any implementation holds beyond baseline)."""
    from deltares.training.memory import routing_floor_bytes

    if gpu:  # the GPU compiler compiles any size; the target config states the device's memory
        from deltares.training.gpu_aot import device_memory_bytes

        hbm, hbm_source = device_memory_bytes(gpu), "target_config"
    else:
        hbm, hbm_source = hbm_of(devices[0])
    mode = cfg.model.residual.mode
    floor = routing_floor_bytes(cfg, mesh, modes=(mode,))[mode]
    return dict(
        config=config_name,
        scale=cfg.scale,
        mode=mode,
        topology=topology,
        gpu=gpu,
        device_kind=devices[0].device_kind,
        devices=len(devices),
        mesh={k: int(v) for k, v in mesh.shape.items()},
        global_batch=cfg.train.global_batch,
        seq_len=cfg.data.seq_len,
        micro_batches=cfg.train.micro_batches,
        remat=cfg.model.remat,
        dtype=cfg.model.dtype,
        n_layers=cfg.model.n_layers,
        params=sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state["params"])),
        hbm_bytes=hbm,
        hbm_source=hbm_source,
        floor_bytes=floor["total_bytes"],
        floor_sources_bytes=floor["sources_bytes"],
        floor_live_slots=floor["live_slots"],
    )


def _report_oom(report: dict, err: Exception, argument_bytes: int) -> dict:
    """The report of a step the compiler refused for memory: what it says it needed."""
    figures = parse_oom(str(err))
    required = figures.get("required")
    if required is not None and figures.get("required_what") == "temporaries":
        required += argument_bytes  # the compiler names only its temporaries; the state is there too
    if figures.get("hbm"):
        report.update(hbm_bytes=figures["hbm"], hbm_source="compiler")
    report.update(fits=False, per_device_bytes=required, argument_bytes=argument_bytes,
                  compiler_message=str(err).strip()[:4000])
    return report


def _report_compiled(report: dict, compiled, n_devices: int, routing_impl: str) -> dict:
    """The report of a compiled step: its memory by part, whether it fits, XLA's FLOPs and the
    Pallas kernels (Mosaic on TPU, Triton on GPU: the fused depth routing when impl is a kernel)."""
    mem = compiled_bytes(compiled)
    total = mem["total"] + mem["code"]  # aliased bytes are counted once, in the arguments
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_flops = float((cost or {}).get("flops", math.nan))
    report.update(argument_bytes=mem["arguments"], output_bytes=mem["outputs"], alias_bytes=mem["aliased"],
                  temp_bytes=mem["temporaries"], code_bytes=mem["code"])
    report.update(
        per_device_bytes=total,
        fits=bool(report["hbm_bytes"] is not None and total <= report["hbm_bytes"]),
        xla_flops_per_device=xla_flops,
        xla_flops_per_step=xla_flops * n_devices,
        routing_impl=routing_impl,
        pallas_kernel_calls=pallas_kernel_calls(compiled.as_text()),
    )
    return report


# --------------------------------------------------------------------------- output


def _gib(n) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.1f}{unit}"
    return str(n)


def format_report(r: dict) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"{r['config'] or r['scale']}: {_count(r['params'])} parameters, mode {r['mode']}, remat {r['remat']}, "
        f"compute {r['dtype']}",
        f"{'gpu ' + r['gpu'] if r.get('gpu') else 'topology ' + r['topology']}: {r['devices']} x {r['device_kind']}, "
        f"mesh {mesh}",
        f"step: global batch {r['global_batch']} x {r['seq_len']} tokens, {r['micro_batches']} micro-batch(es); "
        f"traced and compiled in {r['compile_seconds']:.0f} s",
        "",
    ]
    source = {"compiler": "as the compiler states it", "nominal": "nominal, the compiler's figure was not had",
              "target_config": "the device memory of deltares/training/gpu_targets/"}
    hbm = f"{_gib(r['hbm_bytes'])} HBM ({source.get(r['hbm_source'], r['hbm_source'])})"
    if "temp_bytes" in r:
        share = f", {100 * r['per_device_bytes'] / r['hbm_bytes']:.0f}%" if r["hbm_bytes"] else ""
        lines += [
            "per device:",
            f"  arguments    {_gib(r['argument_bytes']):>12}",
            f"  outputs      {_gib(r['output_bytes']):>12}",
            f"  aliased      {'-' + _gib(r['alias_bytes']):>12}  (outputs written into donated arguments)",
            f"  temporaries  {_gib(r['temp_bytes']):>12}",
            f"  program      {_gib(r['code_bytes']):>12}",
            f"  total        {_gib(r['per_device_bytes']):>12}  of {hbm}{share}",
        ]
    else:
        first = r["compiler_message"].splitlines()[0]
        lines += [
            f"the compiler ran out of HBM: {first}",
            f"per device: at least {_gib(r['per_device_bytes'])} of {hbm}",
        ]
    if r.get("floor_live_slots"):
        lines.append(f"  routing floor {_gib(r['floor_bytes']):>11}  beyond baseline: {r['floor_live_slots']} live source slots "
                     f"({_gib(r['floor_sources_bytes'])}) and one cotangent buffer, in {r['dtype']}")
    if "estimate" in r and r.get("gpu"):
        lines += _format_gpu_estimate(r)
    elif "estimate" in r:
        e = r["estimate"]
        lines += [
            "",
            f"estimated step time: {_seconds(e['seconds'])} per step ({e['method']} from unrolled compiles at "
            f"{e['layers_compiled']} layers; {_gib(e['bytes_accessed'])} accessed and {e['flops']:.3e} FLOPs "
            f"per device); {e['caveat']}",
            f"estimated MFU: {_percent(e.get('mfu'))} (the 6N+attention FLOPs per step against the bf16 peak of "
            f"{r['devices']} x {r['device_kind']} at the estimated step time)",
        ]
    lines += [
        "",
        f"FLOPs per step: {r['flops_per_step']:.3e} ({r['flops_per_device']:.3e} per device; matrix products of the "
        f"traced step, cuDNN attention included); 6N+attention estimate {r['model_flops_per_step']:.3e}",
        f"fits: {'yes' if r['fits'] else 'NO'}",
    ]
    return "\n".join(lines)


def _format_gpu_estimate(r: dict) -> list[str]:
    e = r["estimate"]
    cal = e["calibration"]
    lines = [
        "",
        f"estimated step time: {_seconds(e['seconds'])} per step on one {r['gpu'].upper()} ({e['caveat']})",
        f"  {e['kernels']:,} kernel launches per step, {e['kernels_per_sublayer']:.1f} per sublayer "
        f"({2 * r['n_layers']} sublayers); routing {e['routing_kernels']:,} ({e['routing_kernels_per_sublayer']:.1f} "
        f"per sublayer), {_seconds(e['routing_seconds'])}, {_gib(e['routing_bytes'])} accessed",
        f"  {_gib(e['bytes_accessed'])} accessed and {e['flops']:.3e} FLOPs per step at {e['bandwidth'] / 1e12:.2f} TB/s "
        f"x {cal['bw_efficiency']:.2f} and the tensor-core peak x {cal['flops_efficiency']:.2f}, "
        f"{cal['launch_seconds'] * 1e6:.1f} us per launch ({cal['fitted_on']})",
        f"  {'kind':<26} {'launches':>9} {'time':>10} {'accessed':>12} {'FLOPs':>10}",
    ]
    for kind, row in e["by_kind"].items():
        lines.append(f"  {kind:<26} {row['kernels']:>9,} {_seconds(row['seconds']):>10} {_gib(row['bytes']):>12} "
                     f"{row['flops']:>10.3e}")
    lines.append(f"estimated MFU: {_percent(e.get('mfu'))} (the 6N+attention FLOPs per step against the bf16 peak at "
                 "the estimated step time)")
    v = e.get("vs_baseline")
    if v:
        lo, hi = cal["overhead_error"]
        lines.append(f"estimated vs baseline: {v['ratio']:.3f}x of baseline's {_seconds(v['baseline_seconds'])}, "
                     f"{v['low']:.3f}x to {v['high']:.3f}x with the model's error on a mode's cost over baseline "
                     f"({100 * lo:+.0f}% to {100 * hi:+.0f}% on the held-out rows); a goal within that band is "
                     "undecided until measured")
    return lines


# --------------------------------------------------------------------------- the fastest setting that fits

SEARCH_REMAT = ("none", "dots", "full")  # least recomputation first


def search_candidates(cfg) -> list[tuple[str, int]]:
    """(remat, loss_chunk) settings to try, in the order assumed fastest first: less recomputation,
    then the plain loss before the chunked one (the experiment's chunk, else 512 tokens). A routed
    mode skips "dots": under any remat its layers run the store-once pass, whose backward recomputes
    each sublayer whatever the policy (the same program as "full")."""
    chunk = cfg.model.loss_chunk if 0 < cfg.model.loss_chunk < cfg.data.seq_len else 512
    chunks = (0, chunk) if chunk < cfg.data.seq_len else (0,)
    policies = SEARCH_REMAT if cfg.model.residual.mode == "baseline" else ("none", "full")
    return [(remat, c) for remat in policies for c in chunks]


def fastest_fitting(trials: list[dict]) -> dict | None:
    """The trial to run: the one of least estimated step time among those that fit, or (no estimates)
    the first that fits in `search_candidates` order."""
    fitting = [t for t in trials if t["fits"]]
    if not fitting:
        return None
    if all("seconds" in t for t in fitting):
        return min(fitting, key=lambda t: t["seconds"])
    return fitting[0]


def search(cfg, topology: str | None, mesh_override: str | None = None, config_name: str = "",
           gpu: str | None = None, estimate: bool = False) -> dict:
    """Compiles the train step at every `search_candidates` setting and reports which fit (and,
    with `estimate`, the estimated step time of those that fit) and the fastest that fits."""
    trials = []
    for remat, chunk in search_candidates(cfg):
        trial_cfg = cfg.copy_and_resolve_references()
        trial_cfg.model.remat, trial_cfg.model.loss_chunk = remat, chunk
        say(f"compiling with remat {remat}, loss_chunk {chunk} ...")
        r = analyze(trial_cfg, topology, mesh_override, config_name, gpu, estimate=bool(gpu and estimate),
                    vs_baseline=False)
        hbm = r["hbm_bytes"]
        trial = dict(remat=remat, loss_chunk=chunk, fits=r["fits"], per_device_bytes=r["per_device_bytes"])
        if gpu and estimate and r["fits"]:
            trial.update(seconds=r["estimate"]["seconds"], bytes_accessed=r["estimate"]["bytes_accessed"])
        elif estimate and r["fits"]:
            from deltares.training.step_time import estimate_step_time

            say(f"estimating the step time with remat {remat}, loss_chunk {chunk} ...")
            e = estimate_step_time(trial_cfg, topology, mesh_override)
            trial.update(seconds=e["seconds"], bytes_accessed=e["bytes_accessed"])
        trials.append(trial)
    best = fastest_fitting(trials)
    return dict(config=config_name, scale=cfg.scale, mode=cfg.model.residual.mode, topology=topology, gpu=gpu,
                hbm_bytes=hbm, trials=trials, fastest=best,
                ranked_by="estimate" if best is not None and "seconds" in best else "order")


def format_search(s: dict) -> str:
    where = f"gpu {s['gpu']}" if s.get("gpu") else f"topology {s['topology']}"
    lines = [f"{s['config'] or s['scale']} on {where} ({_gib(s['hbm_bytes'])} HBM per device):",
             f"  {'remat':<6} {'loss_chunk':>10} {'per device':>12}  fits  {'est. step':>10}"]
    for t in s["trials"]:
        est = _seconds(t["seconds"]) if "seconds" in t else "-"
        lines.append(f"  {t['remat']:<6} {t['loss_chunk']:>10} {_gib(t['per_device_bytes']):>12}  "
                     f"{'yes ' if t['fits'] else 'NO  '}  {est:>10}")
    best = s["fastest"]
    if best is None:
        lines.append("nothing fits: add devices or --config.train.micro_batches")
    else:
        model = "the GPU kernel model" if s.get("gpu") else "the TPU compiler's cost model"
        how = (f"the least estimated step time ({model}, not a measurement)"
               if s["ranked_by"] == "estimate" else "the first that fits, in the order above (less recomputation, "
               "then the plain loss; add --estimate to rank by the cost model)")
        lines.append(f"fastest that fits: --config.model.remat={best['remat']} --config.model.loss_chunk="
                     f"{best['loss_chunk']} ({how})")
    return "\n".join(lines)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def estimated_mfu(report: dict) -> float | None:
    """Model FLOPs utilisation at the estimated step time; None for a device kind of unknown peak."""
    from deltares.training.metrics import peak_flops_of

    peak = peak_flops_of(report["device_kind"])
    if peak is None:
        return None
    return report["model_flops_per_step"] / (report["estimate"]["seconds"] * report["devices"] * peak)


def _percent(fraction: float | None) -> str:
    return "unknown (no peak FLOPs known for this device kind)" if fraction is None else f"{100 * fraction:.1f}%"


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    if _TOPOLOGY.value and _GPU.value:
        print("error: --topology (a TPU slice) and --gpu (GPUs) exclude each other; pass one", file=sys.stderr)
        sys.exit(2)
    if _CONFIG.value is None or not (_TOPOLOGY.value or _GPU.value):
        example = "--config experiments/s7b6.py:delta_block --topology v5p:2x2x2 (or --gpu h100)"
        print(f"error: --config and --topology or --gpu are required, e.g. {example}", file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(logging.WARNING)
    name = getattr(flags.FLAGS["config"], "config_filename", "")  # 'experiments/s7b6.py:delta_block'
    if _SEARCH.value:
        try:
            found = search(_CONFIG.value, _TOPOLOGY.value, _MESH.value, config_name=name, gpu=_GPU.value,
                           estimate=_ESTIMATE.value)
        except AotError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps(found) if _JSON.value else format_search(found), flush=True)
        sys.exit(0 if found["fastest"] else 1)
    try:
        report = analyze(_CONFIG.value, _TOPOLOGY.value, _MESH.value, config_name=name, gpu=_GPU.value,
                         estimate=_ESTIMATE.value)
        if _ESTIMATE.value and not _GPU.value:
            from deltares.training.step_time import estimate_step_time

            how = "unrolled compiles at a few depths" if _CONFIG.value.model.scan_layers else "the whole model compiled"
            print(f"estimating the step time: {how} ...", file=sys.stderr, flush=True)
            report["estimate"] = estimate_step_time(_CONFIG.value, _TOPOLOGY.value, _MESH.value)
            report["estimate"]["mfu"] = estimated_mfu(report)
    except AotError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(report) if _JSON.value else format_report(report), flush=True)
    sys.exit(0 if report["fits"] else 1)


def cli() -> None:
    """The command line (`python -m deltares.aot`, `deltares-aot`); flags only here, so modules import side by side."""
    global _CONFIG, _TOPOLOGY, _GPU, _MESH, _JSON, _ESTIMATE, _SEARCH
    _CONFIG = config_flags.DEFINE_config_file(
        "config", None, "Experiment file, e.g. experiments/s7b6.py:delta_block (or a shipped one by name: s7b6:delta_block)."
    )
    _TOPOLOGY = flags.DEFINE_string("topology", None, f"TPU topology, e.g. {EXAMPLE_TOPOLOGIES}.")
    _GPU = flags.DEFINE_string("gpu", None, "NVIDIA GPUs of one host instead of a TPU topology: h100 or h200 "
                               "(deltares/training/gpu_targets/), one GPU, or NAME:N for N of them (h100:8).")
    _MESH = flags.DEFINE_string(
        "mesh", None, "DATA,FSDP,TENSOR mesh sizes (one may be -1); default config.mesh, else fsdp over all devices."
    )
    _JSON = flags.DEFINE_bool("json", False, "Print the report as one JSON object.")
    _ESTIMATE = flags.DEFINE_bool(
        "estimate", False, "Also an estimate of the step time. TPU: the TPU compiler's cost model "
        "(deltares.training.step_time: unrolled compiles at a few depths, extrapolated, or with unrolled layers the "
        "whole model). One GPU: a model of the compiled program's kernels (deltares.training.gpu_step_time: bytes at the "
        "memory bandwidth, FLOPs at the peak, a cost per launch, fitted to H200 measurements; for a routed mode baseline "
        "compiled too: the ratio to it, with the band of the model's error on a mode's cost over baseline). Models, "
        "not measurements.")
    _SEARCH = flags.DEFINE_bool(
        "search", False, "Compile at every remat policy (none, dots, full) with the plain and the chunked loss and "
        "report which fit and the fastest that fits (by the estimate with --estimate, else by the order of less "
        "recomputation, then the plain loss).")
    if "JAX_PLATFORMS" not in os.environ:  # never touch TPU hardware: the step runs on compile-only devices
        jax.config.update("jax_platforms", "cpu")
    command_line.run(main, quiet_libtpu=False, config_fields=field_names)  # libtpu is set up as a compiler (topology_devices)


if __name__ == "__main__":
    cli()
