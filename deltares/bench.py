"""Training throughput, memory and compile time of every residual mode at one scale, against baseline.

    python -m deltares.bench --config experiments/tiny.py
    python -m deltares.bench --config experiments/s220m.py --modes baseline,delta_block --batch 4 --seq_len 2048
    python -m deltares.bench --config experiments/tiny.py --config.model.remat=full   # any config override

Times the real train step (`deltares.training.program.sharded_train_step`: forward, backward,
optimizer update, donated state) on the default backend (the CPU, or any accelerator
present, over `config.mesh`). Each mode's step is lowered and compiled once (the
compile time reported), run once to warm up, then timed in interleaved rounds (every
mode `--steps` times per round) so that slow drift of a shared machine hits every mode
alike; the median step is reported, with tokens/s, MFU (model FLOPs as in
`deltares.training.metrics`; on a CPU against a nominal peak, so only the ratios mean much) and
the compiled step's memory (`memory_analysis()`: arguments, i.e. state and batch, and
temporaries). `--batch` and `--seq_len` default to the config's. Where the device
reports memory statistics (GPU, TPU), the process's peak is printed at the end: it
covers all modes together, since their states stay alive between rounds.

`--sequential` instead compiles, times and frees each mode before the next (`--rounds` x `--steps`
steps each), so only one mode's state is in memory. Each mode's row is printed as soon as it is
known, and with `--jsonl FILE` appended to FILE as one JSON object, so a run cut short keeps the
modes it finished. `--save_dir DIR` keeps each mode's optimized program (MODE.hlo.gz: in a
checkout, `python -m tests.gpu_calibration --bench` prices it with the GPU step-time model), and
`--profile_steps N` traces N more steps with the JAX profiler and sums the device's kernels.
"""

from __future__ import annotations

import functools
import gc
import gzip
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from deltares.nn.config import MODES
from deltares.training.experiment import field_names, validate_config
from deltares.training.memory import compiled_bytes, device_peak_bytes
from deltares.training.metrics import mfu, model_flops_per_token, peak_flops_per_device
from deltares.training.sharding import make_mesh, shard_batch
from deltares.training.program import sharded_train_step


class BenchError(ValueError):
    """Bad input to the benchmark; the message says what."""


class ModeResult(NamedTuple):
    compile_s: float
    step_s: list[float]  # every timed step
    argument_bytes: int
    temp_bytes: int
    flops_per_step: float
    peak_bytes: int | None = None  # the process's device memory peak when the mode finished (None: not reported)
    kernels: list | None = None  # with --profile_steps: [[kernel, launches, microseconds], ...] per profiled step


def modes_to_time(wanted: list[str], baseline: bool = True) -> list[str]:
    """The modes to time, each once, in order: baseline first when `baseline`, else only those `wanted`."""
    modes = (["baseline"] if baseline else []) + [m for m in dict.fromkeys(wanted) if m != "baseline" or not baseline]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise BenchError(f"unknown mode{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    if not modes:
        raise BenchError("no mode to time: --nobaseline needs --modes")
    return modes


def mode_config(cfg, mode: str, batch: int, seq_len: int):
    """`cfg` with the residual mode, global batch and sequence length replaced."""
    if mode not in MODES:
        raise BenchError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    cfg = cfg.copy_and_resolve_references()
    cfg.model.residual.mode = mode
    cfg.train.global_batch, cfg.data.seq_len = batch, seq_len
    if batch % cfg.train.micro_batches:
        raise BenchError(f"--batch {batch} is not divisible by config.train.micro_batches={cfg.train.micro_batches}")
    return cfg


class _Prepared(NamedTuple):
    compiled: Any
    state: Any
    batch: Any
    compile_s: float
    memory: dict | None
    flops_per_step: float


def _prepare(cfg, mesh, tokens_BT: np.ndarray, hlo_path: str | None = None) -> _Prepared:
    training = sharded_train_step(cfg, mesh)
    state = training.init(cfg.seed)
    batch = shard_batch(tokens_BT, training.batch_sharding)
    start = time.perf_counter()
    compiled = training.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    if hlo_path:  # the optimized program, kept before it first runs (a step that fails leaves it behind)
        try:
            save_hlo(compiled, hlo_path)
        except Exception as err:  # noqa: BLE001 - e.g. a program loaded from a cache without its HLO: timed anyway
            print(f"warning: the optimized HLO of {cfg.model.residual.mode} is not kept: {err}", file=sys.stderr)
    state, out = compiled(state, batch)  # warm-up
    jax.block_until_ready((state, out))
    flops = model_flops_per_token(cfg.model, cfg.data.seq_len) * tokens_BT.shape[0] * cfg.data.seq_len
    return _Prepared(compiled, state, batch, compile_s, compiled_bytes(compiled), flops)


def save_hlo(compiled, path: str) -> None:
    """The compiled program's optimized HLO text, gzipped, written whole (a temporary file renamed)."""
    with gzip.open(path + ".tmp", "wt") as f:
        f.write(compiled.as_text())
    os.replace(path + ".tmp", path)


def _time(p: _Prepared, steps: int) -> tuple[_Prepared, list[float]]:
    state, times = p.state, []
    for _ in range(steps):
        start = time.perf_counter()
        state, out = p.compiled(state, p.batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - start)
    return p._replace(state=state), times


def _result(p: _Prepared, times: list[float]) -> ModeResult:
    memory = p.memory
    return ModeResult(p.compile_s, times, memory["arguments"] if memory else -1,
                      memory["temporaries"] if memory else -1, p.flops_per_step, device_peak_bytes())


def benchmark(cfg, modes, batch: int, seq_len: int, rounds: int, steps: int, sequential: bool = False,
              save_dir: str | None = None, profile_steps: int = 0,
              on_mode: Callable[[str, ModeResult], None] | None = None) -> dict[str, ModeResult]:
    """{mode: ModeResult} for the train step of `cfg` in each mode (see the module docstring). `sequential`:
    each mode compiled, timed and freed before the next (else all prepared, then timed in interleaved rounds).
    `save_dir`: each mode's optimized HLO written there (MODE.hlo.gz), and its profile's trace
    (MODE.trace.json.gz). `profile_steps`: after the timing, that many steps traced by the profiler, their
    kernels summed (`profile_kernels`). `on_mode(mode, result)` is called as each mode's figures are known."""
    if rounds < 1 or steps < 1 or batch < 1 or seq_len < 1:
        raise BenchError("--batch, --seq_len, --rounds and --steps must be positive")
    if profile_steps < 0:
        raise BenchError("--profile_steps must be at least 0")
    validate_config(cfg)  # every field's type, choices and range, before anything is compiled
    cfgs = {mode: mode_config(cfg, mode, batch, seq_len) for mode in modes}  # checks every mode first
    mesh = make_mesh(cfg.mesh)
    tokens_BT = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (batch, seq_len + 1), dtype=np.int32)

    def hlo_path(mode):
        return os.path.join(save_dir, f"{mode}.hlo.gz") if save_dir else None

    def finish(mode, p, times):
        result = _result(p, times)
        if on_mode:
            on_mode(mode, result)
        if profile_steps:
            trace = os.path.join(save_dir, f"{mode}.trace.json.gz") if save_dir else None
            result = result._replace(kernels=profile(p, profile_steps, trace))
            if on_mode:
                on_mode(mode, result)
        return result

    results = {}
    if sequential:
        for mode in modes:
            p = _prepare(cfgs[mode], mesh, tokens_BT, hlo_path(mode))
            p, times = _time(p, rounds * steps)
            results[mode] = finish(mode, p, times)
            del p  # the state, batch and program freed before the next mode
            gc.collect()
        return results
    prepared = {mode: _prepare(cfgs[mode], mesh, tokens_BT, hlo_path(mode)) for mode in modes}
    times = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            prepared[mode], t = _time(prepared[mode], steps)
            times[mode] += t
    return {mode: finish(mode, p, times[mode]) for mode, p in prepared.items()}


# --------------------------------------------------------------------------- the profile


def profile(p: _Prepared, steps: int, trace_path: str | None = None) -> list:
    """`steps` more steps under the JAX profiler: the kernels the device ran (`profile_kernels`), each
    launch count and time per step; the Perfetto trace copied to `trace_path`."""
    import glob
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            _time(p, steps)
        found = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            return []
        if trace_path:
            shutil.copyfile(found[0], trace_path)
        with gzip.open(found[0], "rt") as f:
            return profile_kernels(json.load(f), steps)


def profile_kernels(trace: dict | list, steps: int = 1) -> list:
    """[[kernel, launches, microseconds], ...] per step, longest first, of a Chrome/Perfetto trace: the events
    on a GPU's streams (processes named "/device:GPU:...", their "Stream" threads where named), each kernel
    named by the HLO instruction it ran (its `hlo_op` argument) where the trace says, else by its own name."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpus = {pid for pid, name in process.items() if name.startswith("/device:GPU")}
    streams = {key for key, name in thread.items() if key[0] in gpus and name.startswith("Stream")}
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        if streams and (e.get("pid"), e.get("tid")) not in streams:
            continue  # the derived lines (XLA Ops, XLA Modules) repeat the streams' kernels
        args = e.get("args") or {}
        name = str(args.get("hlo_op") or e.get("name", "?"))
        row = totals.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += float(e.get("dur", 0.0))
    rows = [[name, n / steps, us / steps] for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


# --------------------------------------------------------------------------- output


def record(result: ModeResult, mode: str, cfg, tokens_per_step: int, hlo: str | None) -> dict:
    """One mode's figures as one JSON object (a line of --jsonl)."""
    m = cfg.model
    device = jax.devices()[0]
    out = dict(mode=mode, scale=cfg.scale or "?", n_layers=m.n_layers, median_ms=statistics.median(result.step_s) * 1e3,
               step_ms=[t * 1e3 for t in result.step_s], compile_s=result.compile_s,
               argument_bytes=result.argument_bytes, temp_bytes=result.temp_bytes, peak_bytes=result.peak_bytes,
               flops_per_step=result.flops_per_step, tokens_per_step=tokens_per_step,
               attention=m.attention, impl=m.residual.impl, remat=m.remat, scan_layers=m.scan_layers,
               block_layers=m.residual.block_layers, group_layers=m.residual.group_layers, dtype=m.dtype,
               device_kind=device.device_kind, platform=device.platform, devices=jax.device_count(),
               hlo=hlo)
    if result.kernels is not None:
        out["kernels"] = result.kernels
    return out


def table_row(mode: str, r: ModeResult, base: ModeResult | None, tokens_per_step: int, peak_flops: float | None) -> str:
    med = statistics.median(r.step_s)
    base_s = statistics.median(base.step_s) if base else None
    temp_ratio = (f"{r.temp_bytes / base.temp_bytes:.2f}x" if base and base.temp_bytes > 0 and r.temp_bytes >= 0
                  else "-")
    util = mfu(r.flops_per_step, med, peak_flops)  # None on a device of unknown peak
    return (f"| {mode} | {med * 1e3:.1f} | {tokens_per_step / med:,.0f} | "
            f"{f'{med / base_s:.3f}x' if base_s else '-'} | {'-' if util is None else f'{util:.1%}'} | "
            f"{r.compile_s:.1f} | {r.argument_bytes / 2**20:.1f} | {r.temp_bytes / 2**20:.1f} | {temp_ratio} |")


HEADER = ("| mode | step ms | tokens/s | vs baseline | MFU | compile s | arguments MiB | temporaries MiB | "
          "temp vs baseline |\n|---|---|---|---|---|---|---|---|---|")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax logs its backend probing at INFO
    cfg = _CONFIG.value
    if cfg is None:
        sys.exit("error: --config is required, e.g. --config experiments/tiny.py")
    try:
        modes = modes_to_time(_MODES.value, _BASELINE.value)
    except BenchError as err:
        sys.exit(f"error: {err}")
    for path, what in ((_JSONL.value, "--jsonl"), (_SAVE_DIR.value, "--save_dir")):
        parent = os.path.dirname(os.path.abspath(path)) if what == "--jsonl" and path else path
        if parent and not os.path.isdir(parent):
            sys.exit(f"error: {what} {path}: no such directory {parent}")
    batch = _BATCH.value or cfg.train.global_batch
    seq_len = _SEQ.value or cfg.data.seq_len
    m = cfg.model
    device = jax.devices()[0]
    print(
        f"{cfg.scale or '?'}: d={m.d_model} L={m.n_layers} block_layers={m.residual.block_layers} "
        f"batch={batch} seq={seq_len} dtype={m.dtype} remat={m.remat} scan_layers={m.scan_layers} "
        f"device={jax.device_count()} x {device.device_kind} ({device.platform}); "
        f"{_ROUNDS.value} rounds x {_STEPS.value} steps per mode{', one mode at a time' if _SEQUENTIAL.value else ''}",
        flush=True,
    )
    peak_flops = peak_flops_per_device(cfg.train.peak_tflops)
    peak_flops = peak_flops and peak_flops * jax.device_count()  # None: unknown device, MFU "-"
    tokens = batch * seq_len
    done: dict[str, ModeResult] = {}

    def on_mode(mode: str, result: ModeResult) -> None:
        """Each mode's row printed (once) and recorded as soon as it is known, so a run cut short keeps it."""
        if mode not in done:
            if not done:
                print(HEADER, flush=True)
            base = result if mode == "baseline" else done.get("baseline")
            print(table_row(mode, result, base, tokens, peak_flops), flush=True)
        done[mode] = result
        if result.kernels is not None:
            spent = sum(k[2] for k in result.kernels)
            print(f"profile of {mode}: {sum(k[1] for k in result.kernels):,.0f} kernels, {spent / 1e3:.1f} ms on the "
                  f"device per step; the longest: " + ", ".join(f"{k[0]} {k[2] / 1e3:.2f} ms" for k in result.kernels[:5]),
                  flush=True)
        if _JSONL.value:
            kept = _SAVE_DIR.value and os.path.exists(os.path.join(_SAVE_DIR.value, f"{mode}.hlo.gz"))
            hlo = f"{mode}.hlo.gz" if kept else None
            line = record(result, mode, mode_config(cfg, mode, batch, seq_len), tokens, hlo)
            line["what"] = "profile" if result.kernels is not None else "timing"
            with open(_JSONL.value, "a") as f:
                f.write(json.dumps(line) + "\n")

    try:
        results = benchmark(cfg, modes, batch, seq_len, _ROUNDS.value, _STEPS.value, sequential=_SEQUENTIAL.value,
                            save_dir=_SAVE_DIR.value, profile_steps=_PROFILE_STEPS.value, on_mode=on_mode)
    except (BenchError, ValueError) as err:
        sys.exit(f"error: {err}")
    except jax.errors.JaxRuntimeError as err:  # e.g. RESOURCE_EXHAUSTED: the step does not fit
        sys.exit(f"error: {str(err).strip().splitlines()[0]}")
    ran = len(results)
    del results  # each mode's row was printed as it finished (on_mode)
    peak = device_peak_bytes()
    if peak is not None:
        alive = "one mode at a time" if _SEQUENTIAL.value or ran == 1 else "all modes' states alive"
        print(f"device memory peak of the whole benchmark ({alive}): {peak / 2**30:.2f} GiB")


def cli() -> None:
    """The command line (`python -m deltares.bench`, `deltares-bench`); flags only here, so modules
    import side by side."""
    global _CONFIG, _BATCH, _SEQ, _ROUNDS, _STEPS, _MODES, _BASELINE, _SEQUENTIAL, _JSONL, _SAVE_DIR, _PROFILE_STEPS
    from deltares import command_line
    from deltares.common.domains import AT_LEAST_1, NON_NEGATIVE, define_number

    _CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, e.g. experiments/tiny.py (or by name: tiny).")
    integer = functools.partial(define_number, flags.DEFINE_integer)
    _BATCH = integer("batch", None, "Sequences per step (default: config.train.global_batch).", AT_LEAST_1)
    _SEQ = integer("seq_len", None, "Tokens per sequence (default: config.data.seq_len).", AT_LEAST_1)
    _ROUNDS = integer("rounds", 5, "Interleaved timing rounds.", AT_LEAST_1)
    _STEPS = integer("steps", 4, "Timed steps per mode per round.", AT_LEAST_1)
    _MODES = flags.DEFINE_list("modes", list(MODES), "Modes to time (baseline is always included, unless --nobaseline).")
    _BASELINE = flags.DEFINE_bool("baseline", True, "Time baseline too (first), the reference of 'vs baseline'.")
    _SEQUENTIAL = flags.DEFINE_bool(
        "sequential", False, "Each mode compiled, timed, reported and freed before the next (only one mode's state in "
        "memory; its peak is its own when it is the only mode), instead of interleaved rounds over all modes.")
    _JSONL = flags.DEFINE_string("jsonl", None, "Append each mode's figures to this file as one JSON line when known.")
    _SAVE_DIR = flags.DEFINE_string(
        "save_dir", None, "An existing folder for each mode's optimized HLO (MODE.hlo.gz, written when compiled) and "
        "its profile's trace (MODE.trace.json.gz).")
    _PROFILE_STEPS = define_number(
        flags.DEFINE_integer, "profile_steps", 0, "After the timing, this many steps under the JAX profiler: the "
        "device's kernels, launches and time per step (printed, and in --jsonl).", NON_NEGATIVE)
    command_line.run(main, config_fields=field_names)


if __name__ == "__main__":
    cli()
