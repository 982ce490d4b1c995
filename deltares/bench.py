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
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
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


def _prepare(cfg, mesh, tokens_BT: np.ndarray) -> _Prepared:
    training = sharded_train_step(cfg, mesh)
    state = training.init(cfg.seed)
    batch = shard_batch(tokens_BT, training.batch_sharding)
    start = time.perf_counter()
    compiled = training.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state, out = compiled(state, batch)  # warm-up
    jax.block_until_ready((state, out))
    flops = model_flops_per_token(cfg.model, cfg.data.seq_len) * tokens_BT.shape[0] * cfg.data.seq_len
    return _Prepared(compiled, state, batch, compile_s, compiled_bytes(compiled), flops)


def benchmark(cfg, modes, batch: int, seq_len: int, rounds: int, steps: int) -> dict[str, ModeResult]:
    """{mode: ModeResult} for the train step of `cfg` in each mode (see the module docstring)."""
    if rounds < 1 or steps < 1 or batch < 1 or seq_len < 1:
        raise BenchError("--batch, --seq_len, --rounds and --steps must be positive")
    validate_config(cfg)  # every field's type, choices and range, before anything is compiled
    cfgs = {mode: mode_config(cfg, mode, batch, seq_len) for mode in modes}  # checks every mode first
    mesh = make_mesh(cfg.mesh)
    tokens_BT = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    prepared = {mode: _prepare(cfgs[mode], mesh, tokens_BT) for mode in modes}
    times = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            p = prepared[mode]
            state = p.state
            for _ in range(steps):
                start = time.perf_counter()
                state, out = p.compiled(state, p.batch)
                jax.block_until_ready((state, out))
                times[mode].append(time.perf_counter() - start)
            prepared[mode] = p._replace(state=state)
    results = {}
    for mode, p in prepared.items():
        memory = p.memory
        results[mode] = ModeResult(
            p.compile_s,
            times[mode],
            memory["arguments"] if memory else -1,
            memory["temporaries"] if memory else -1,
            p.flops_per_step,
        )
    return results


def table(results: dict[str, ModeResult], tokens_per_step: int, peak_flops: float | None) -> str:
    base = results["baseline"]
    base_s = statistics.median(base.step_s)
    lines = [
        "| mode | step ms | tokens/s | vs baseline | MFU | compile s | arguments MiB | temporaries MiB | temp vs baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        med = statistics.median(r.step_s)
        temp_ratio = f"{r.temp_bytes / base.temp_bytes:.2f}x" if base.temp_bytes > 0 and r.temp_bytes >= 0 else "-"
        util = mfu(r.flops_per_step, med, peak_flops)  # None on a device of unknown peak
        lines.append(
            f"| {mode} | {med * 1e3:.1f} | {tokens_per_step / med:,.0f} | {med / base_s:.3f}x | "
            f"{'-' if util is None else f'{util:.1%}'} | {r.compile_s:.1f} | {r.argument_bytes / 2**20:.1f} | "
            f"{r.temp_bytes / 2**20:.1f} | {temp_ratio} |"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # jax logs its backend probing at INFO
    cfg = _CONFIG.value
    if cfg is None:
        sys.exit("error: --config is required, e.g. --config experiments/tiny.py")
    modes = ["baseline"] + [m for m in dict.fromkeys(_MODES.value) if m != "baseline"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"error: unknown mode{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    batch = _BATCH.value or cfg.train.global_batch
    seq_len = _SEQ.value or cfg.data.seq_len
    m = cfg.model
    device = jax.devices()[0]
    print(
        f"{cfg.scale or '?'}: d={m.d_model} L={m.n_layers} block_layers={m.residual.block_layers} "
        f"batch={batch} seq={seq_len} dtype={m.dtype} remat={m.remat} scan_layers={m.scan_layers} "
        f"device={jax.device_count()} x {device.device_kind} ({device.platform}); "
        f"{_ROUNDS.value} rounds x {_STEPS.value} steps per mode",
        flush=True,
    )
    try:
        results = benchmark(cfg, modes, batch, seq_len, _ROUNDS.value, _STEPS.value)
    except (BenchError, ValueError) as err:
        sys.exit(f"error: {err}")
    except jax.errors.JaxRuntimeError as err:  # e.g. RESOURCE_EXHAUSTED: the step does not fit
        sys.exit(f"error: {str(err).strip().splitlines()[0]}")
    peak_flops = peak_flops_per_device(cfg.train.peak_tflops)
    peak_flops = peak_flops and peak_flops * jax.device_count()  # None: unknown device, MFU "-"
    print(table(results, batch * seq_len, peak_flops))
    peak = device_peak_bytes()
    if peak is not None:
        print(f"device memory peak of the whole benchmark (all modes' states alive): {peak / 2**30:.2f} GiB")


def cli() -> None:
    """The command line (`python -m deltares.bench`, `deltares-bench`); flags only here, so modules
    import side by side."""
    global _CONFIG, _BATCH, _SEQ, _ROUNDS, _STEPS, _MODES
    from deltares import command_line
    from deltares.common.domains import AT_LEAST_1, define_number

    _CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, e.g. experiments/tiny.py (or by name: tiny).")
    integer = functools.partial(define_number, flags.DEFINE_integer)
    _BATCH = integer("batch", None, "Sequences per step (default: config.train.global_batch).", AT_LEAST_1)
    _SEQ = integer("seq_len", None, "Tokens per sequence (default: config.data.seq_len).", AT_LEAST_1)
    _ROUNDS = integer("rounds", 5, "Interleaved timing rounds.", AT_LEAST_1)
    _STEPS = integer("steps", 4, "Timed steps per mode per round.", AT_LEAST_1)
    _MODES = flags.DEFINE_list("modes", list(MODES), "Modes to time (baseline is always included).")
    command_line.run(main, config_fields=field_names)


if __name__ == "__main__":
    cli()
