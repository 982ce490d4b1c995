#!/usr/bin/env python3
"""The GPU measurements of docs/explanations/performance.md on one local NVIDIA GPU, planned for a short window.

    launch/gpu_bench.py --out runs/gpu_bench --budget 540                 # the first call: s220m
    launch/gpu_bench.py --out runs/gpu_bench --call s1044m --budget 540   # the second: s1044m baseline and delta
    launch/gpu_bench.py --dry-run --budget 540                            # the plan of every stage, on any machine

Each mode of each stage runs in a process of its own (`python -m deltares.bench ... --sequential --nobaseline`,
one mode), so a mode cut short loses only itself and frees the device for the next. Before a mode starts, its
time is estimated (`Stage.compile_s` and `Stage.run_s`, or what an earlier call measured, with a compile the
persistent cache already holds counted as `CACHED_COMPILE_S`); a mode that would not finish in the seconds
left of `--budget` is skipped, not started, and one that runs past them is stopped. Everything goes to one
folder, `--out` (4 files, or a few more tars, so a caller can point it at a folder whose files are copied back):

- env.json, written first: the GPU and its driver (nvidia-smi), Python, jax, jaxlib and the CUDA plugin, the
  commit (`--commit`, else git's), the date, the XLA flags and memory fraction in force;
- rows.jsonl: one JSON object per mode as it finishes (`deltares.bench --jsonl`'s, with its stage, setting
  and program), or saying why a mode was skipped, cut or failed;
- programs.tar: each timed program's optimized HLO (STAGE.MODE.hlo.gz, the program the row names) and each
  profile's trace (STAGE.MODE.trace.json.gz), rewritten whole after each mode (past 15 MiB the next ones go
  to programs-2.tar, and so on);
- bench.log: every process's output.

`python -m tests.gpu_calibration --bench OUT` prices the saved programs with the GPU step-time model, on a
CPU, and refits the model with the rows. JAX's persistent compilation cache and XLA's autotuning cache live
in `--cache` (default .jax-cache/gpu_bench, ignored by git), with the seconds each mode took: a second call
on the same machine loads the programs instead of compiling them and plans with the measured times. The
device may use `XLA_PYTHON_CLIENT_MEM_FRACTION` of its memory (0.92 unless set): one process holds one mode.
Standard library only: it runs under any Python 3.9+, the stages under `--python`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_bench.py"
STARTUP_S = 25.0  # a process's start: imports, the device, the train state
CACHED_COMPILE_S = 15.0  # a program loaded from the persistent compilation cache
MARGIN_S = 5.0  # left for writing the files after the last mode
MEM_FRACTION = "0.92"
STEP = ("--batch", "8", "--seq_len", "2048")  # the TPU estimates' per-chip load: 8 sequences of 2048 tokens
SCANNED_S220M = ("--config.model.scan_layers=True", "--config.model.remat=none", "--config.model.loss_chunk=0")
SCANNED_S1044M = ("--config.model.scan_layers=True", "--config.model.residual.impl=xla")
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


@dataclasses.dataclass(frozen=True)
class Stage:
    """A measurement: a `deltares.bench` run of each mode (`config` set) or one other command (`command`)."""

    name: str
    setting: str  # the rows of one setting share one baseline (the bench's mode "baseline" of that setting)
    modes: tuple = ()
    config: str = ""
    overrides: tuple = ()
    xla_flags: str = ""  # added to XLA_FLAGS
    rounds: int = 3
    steps: int = 3
    profile_steps: int = 0
    command: tuple = ()  # instead of deltares.bench: this command, once ("{python}" is --python)
    compile_s: float = 0.0  # a mode's compile when the cache does not hold it (a guess until measured)
    run_s: float = 0.0  # the rest of a mode: start, state, warm-up, timed steps, profile

    def argv(self, mode: str | None, python: str, jsonl: str = "", save_dir: str = "") -> list[str]:
        if self.command:
            return [python if a == "{python}" else a for a in self.command]
        argv = [python, "-m", "deltares.bench", "--config", self.config, "--modes", mode, "--nobaseline",
                "--sequential", *STEP, "--rounds", str(self.rounds), "--steps", str(self.steps)]
        if self.profile_steps:
            argv += ["--profile_steps", str(self.profile_steps)]
        if jsonl:
            argv += ["--jsonl", jsonl, "--save_dir", save_dir]
        return argv + list(self.overrides)

    def program(self, mode: str | None) -> str:
        """What makes the compiled program (a mode's config and XLA flags): equal keys, one compile."""
        return json.dumps([self.config, mode, sorted(self.overrides), self.xla_flags, self.command])

    def units(self) -> list:
        return list(self.modes) if self.modes else [None]


def _bench(name, setting, config, modes, *overrides, **kw) -> Stage:
    return Stage(name, setting, tuple(modes), config, tuple(overrides), **kw)


S220M = "experiments/s220m.py"
S1044M = "experiments/s1044m.py"
# In the order that settles most first. compile_s: first guesses (XLA's CUDA compiler on a 2-core CPU took 12 to
# 60 s for s220m's unrolled steps, 62 to 284 s for s1044m's); every call records what each mode took, in --cache.
STAGES = (
    # s220m at its defaults: layers unrolled, cuDNN attention, "auto" routing (the Triton kernel per sublayer)
    _bench("s220m_defaults", "s220m defaults", S220M, ("baseline", "delta_block", "delta"), compile_s=45, run_s=20),
    # the same programs (loaded from the cache), 2 more steps traced: each kernel's time
    _bench("s220m_profile", "s220m defaults", S220M, ("baseline", "delta_block"), rounds=1, steps=2, profile_steps=2,
           compile_s=45, run_s=35),
    # XLA's routing (baseline's program is the defaults')
    _bench("s220m_xla", "s220m defaults", S220M, ("delta_block", "delta"), "--config.model.residual.impl=xla",
           compile_s=45, run_s=20),
    # one scanned baseline at the settings of 2026-12-04 (cuDNN attention): continuity with that day's rows
    _bench("s220m_scanned", "s220m scanned attn=cudnn", S220M, ("baseline",), *SCANNED_S220M,
           "--config.model.attention=cudnn", "--config.model.residual.impl=xla", compile_s=30, run_s=20),
    # every kernel launched on its own: what XLA's command buffers (CUDA graphs) save
    _bench("s220m_no_command_buffers", "s220m defaults, command buffers off", S220M, ("baseline", "delta"),
           xla_flags=NO_COMMAND_BUFFERS, compile_s=45, run_s=20),
    # s1044m at its defaults (remat dots; delta two-phase in groups of 6 layers), as a call of its own
    _bench("s1044m_defaults", "s1044m defaults", S1044M, ("baseline", "delta"), rounds=2, steps=2,
           compile_s=200, run_s=30),
    _bench("s1044m_delta_block", "s1044m defaults", S1044M, ("delta_block",), rounds=2, steps=2,
           compile_s=200, run_s=30),
    # the routing kernel against XLA's and the copy bandwidth; the GPU kernel and cuDNN tests on the device
    Stage("kernel", "kernel", command=("{python}", "-m", "kernels_pallas.depth_route.bench", "--train_layers", "0"),
          run_s=90),
    Stage("tests", "tests", command=("env", "JAX_PLATFORMS=cuda", "{python}", "-m", "pytest", "-q", "-p",
                                     "no:cacheprovider", "tests/test_depth_route_kernel.py",
                                     "tests/test_prefix_kernel.py", "tests/test_attention.py", "-k",
                                     "pallas_gpu or cudnn"), run_s=150),
    # the stages of 2026-12-04: layers scanned (no remat at s220m; remat dots, cuDNN at s1044m)
    _bench("s220m_xla_attention", "s220m scanned attn=xla", S220M, ("baseline", "delta_block", "delta"), *SCANNED_S220M,
           "--config.model.attention=xla", "--config.model.residual.impl=xla", compile_s=30, run_s=25),
    _bench("s220m_xla_attention_kernel", "s220m scanned attn=xla", S220M, ("delta_block", "delta"), *SCANNED_S220M,
           "--config.model.attention=xla", "--config.model.residual.impl=pallas_gpu", compile_s=30, run_s=25),
    _bench("s220m_cudnn", "s220m scanned attn=cudnn", S220M, ("delta_block", "delta"), *SCANNED_S220M,
           "--config.model.attention=cudnn", "--config.model.residual.impl=xla", compile_s=30, run_s=25),
    _bench("s220m_cudnn_kernel", "s220m scanned attn=cudnn", S220M, ("delta_block", "delta"), *SCANNED_S220M,
           "--config.model.attention=cudnn", "--config.model.residual.impl=pallas_gpu", compile_s=30, run_s=25),
    _bench("s1044m_scanned", "s1044m scanned", S1044M, ("baseline", "delta_block", "delta", "full_attnres"),
           *SCANNED_S1044M,
           "--config.model.residual.group_layers=0", rounds=2, steps=2, compile_s=60, run_s=30),
    _bench("s1044m_grouped", "s1044m scanned", S1044M, ("delta", "full_attnres"), *SCANNED_S1044M,
           "--config.model.residual.group_layers=4", rounds=2, steps=2, compile_s=60, run_s=30),
    _bench("s1044m_segments", "s1044m scanned", S1044M, ("delta",), *SCANNED_S1044M,
           "--config.model.residual.group_layers=0", "--config.model.residual.scan_segments=12", rounds=2, steps=2,
           compile_s=60, run_s=40),
)
BY_NAME = {s.name: s for s in STAGES}
CALLS = {
    "s220m": ("s220m_defaults", "s220m_profile", "s220m_xla", "s220m_scanned", "s220m_no_command_buffers"),
    "s1044m": ("s1044m_defaults", "s1044m_delta_block", "kernel"),
    "extras": ("kernel", "tests"),
    "scanned": ("s220m_xla_attention", "s220m_xla_attention_kernel", "s220m_scanned", "s220m_cudnn",
                "s220m_cudnn_kernel", "s1044m_scanned", "s1044m_grouped", "s1044m_segments"),
}


class BenchError(Exception):
    """A bad argument or an unusable folder; the message says what."""


# --------------------------------------------------------------------------- the plan


def load_times(cache: str) -> dict:
    """{program key: {"wall": seconds, "compile_s": seconds, "finished": when}} of the modes earlier calls ran
    with this cache."""
    try:
        with open(os.path.join(cache, "times.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save_times(cache: str, times: dict) -> None:
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, "times.json")
    with open(path + ".tmp", "w") as f:
        json.dump(times, f, indent=1)
    os.replace(path + ".tmp", path)


def estimate(stage: Stage, mode: str | None, times: dict, compiled: set) -> float:
    """Seconds a mode is expected to take: what an earlier call measured, else the stage's guesses; the compile
    of a program compiled earlier (in this call or one before, with this cache) is a load from the cache, which
    takes CACHED_COMPILE_S or the compile's own time, whichever is less."""
    key = stage.program(mode)
    known = times.get(key)
    if stage.command:
        return known["wall"] if known else stage.run_s
    compile_s = known.get("compile_s", 0.0) if known else stage.compile_s
    rest = max(known["wall"] - compile_s, 0.0) if known else STARTUP_S + stage.run_s
    cached = key in compiled or known is not None
    return rest + (min(CACHED_COMPILE_S, compile_s) if cached else compile_s)


def plan(stages: list[Stage], budget: float, times: dict, resume: bool = False) -> list[dict]:
    """Each mode of each stage with its estimate, when it would start, and whether it would run, be skipped
    within `budget` seconds (0: no limit) or, with `resume`, is done already, if every mode took its estimate."""
    out, now, compiled = [], 0.0, set()
    for stage in stages:
        for mode in stage.units():
            seconds = estimate(stage, mode, times, compiled)
            done = resume and not stage.command and bool(times.get(stage.program(mode), {}).get("finished"))
            runs = not done and (not budget or now + seconds <= budget - MARGIN_S)
            out.append(dict(stage=stage, mode=mode, seconds=seconds, start=now, runs=runs, done=done))
            if runs:
                now += seconds
                compiled.add(stage.program(mode))
    return out


def stages_of(call: str, names: str) -> list[Stage]:
    if names:
        chosen = [n for n in names.split(",") if n]
        if not chosen:
            raise BenchError("--stages is empty")
        unknown = [n for n in chosen if n not in BY_NAME]
        if unknown:
            raise BenchError(f"unknown stage '{unknown[0]}' (choose from: {', '.join(BY_NAME)})")
        return [BY_NAME[n] for n in chosen]
    return [BY_NAME[n] for n in CALLS[call]]


# --------------------------------------------------------------------------- running


def stage_env(stage: Stage, cache: str, base: dict) -> dict:
    env = dict(base)
    flags = [env.get("XLA_FLAGS", ""), stage.xla_flags]
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache, "jax")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def base_env(cache: str) -> dict:
    """The environment of every stage: the caller's, XLA's autotuning results kept in the cache."""
    env = dict(os.environ)
    autotune = f"--xla_gpu_per_fusion_autotune_cache_dir={os.path.join(cache, 'autotune')}"
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), autotune) if f)
    return env


class Log:
    """bench.log, and the lines worth reading on the console (not XLA's and absl's log lines)."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    def say(self, line: str, console: bool = True) -> None:
        self.file.write(line + "\n")
        if console and not (len(line) > 1 and line[0] in "WIE" and line[1:5].isdigit()):
            print(line, flush=True)


def run_process(argv: list[str], env: dict, limit: float, log: Log) -> tuple[int | None, float]:
    """(exit status, None when stopped at `limit` seconds; seconds taken), its output logged line by line."""
    start = time.monotonic()
    # a process group of its own (in this session, so whatever ends this script's session ends it too)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", preexec_fn=os.setpgrp)
    reader = threading.Thread(target=lambda: [log.say(line.rstrip("\n")) for line in proc.stdout], daemon=True)
    reader.start()
    rc = None
    try:
        rc = proc.wait(timeout=limit if limit > 0 else None)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # past its time, or this script interrupted: the mode and its children end
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    return rc, time.monotonic() - start


TAR_LIMIT = 15 * 2**20  # a programs tar is kept under 16 MiB (a file copied back from a device may be no larger)


def add_to_tar(out: str, files: dict[str, str]) -> str:
    """The files ({member: path}) added to OUT/programs.tar, or where that would pass TAR_LIMIT to the next of
    programs-2.tar, programs-3.tar, ...; each written whole (a copy renamed), never half written. Its name."""
    size = sum(os.path.getsize(p) for p in files.values())
    n = 1
    while True:
        tar_path = os.path.join(out, "programs.tar" if n == 1 else f"programs-{n}.tar")
        if not os.path.exists(tar_path) or os.path.getsize(tar_path) + size <= TAR_LIMIT:
            break
        n += 1
    tmp = tar_path + ".tmp"
    if os.path.exists(tar_path):
        shutil.copyfile(tar_path, tmp)
    with tarfile.open(tmp, "a" if os.path.exists(tmp) else "w") as tar:
        for member, path in files.items():
            tar.add(path, arcname=member)
    os.replace(tmp, tar_path)
    return tar_path


def append_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


PROBE = """import json, sys, importlib.metadata as m
def version(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return None
import jax
d = jax.devices()[0]
names = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt", "flax",
         "optax", "ml-collections")
print(json.dumps(dict(python=sys.version.split()[0], device_kind=d.device_kind, platform=d.platform,
                      devices=jax.device_count(), packages={p: version(p) for p in names if version(p)})))
"""


def probe(python: str, env: dict) -> tuple[dict | None, str]:
    """(Python, JAX and device as `python` sees them, or None; its error output)."""
    try:
        proc = subprocess.run([python, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, str(err)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
    except (ValueError, IndexError):
        return None, proc.stderr


def record_env(out: str, python: str, env: dict, commit: str, log: Log) -> tuple[dict, dict]:
    """(env.json's content: the GPU, driver, Python and JAX versions, the commit and date, written before any
    stage; the environment the stages run in: without the autotuning cache's flag where XLA does not know it)."""
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                python_cmd=python)
    if not commit:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or "unknown"
        except (OSError, subprocess.TimeoutExpired):
            info["commit"] = "unknown"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = ""
    fields = [p.strip() for p in smi.splitlines()[0].split(",")] if smi else ["none found"]
    info.update(zip(("gpu", "driver", "gpu_memory"), fields + ["", ""]))
    found, errors = probe(python, env)
    if found is None and "Unknown flag in XLA_FLAGS" in errors:  # an XLA without the autotuning cache's flag
        env = dict(os.environ)
        found, errors = probe(python, env)
    if found is None:
        info["probe_error"] = errors.strip().splitlines()[-3:]
    info.update(found or {})
    info.update(xla_flags=env.get("XLA_FLAGS", ""), mem_fraction=env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION))
    with open(os.path.join(out, "env.json"), "w") as f:
        json.dump(info, f, indent=1)
    log.say(f"== environment: {info.get('gpu')} (driver {info.get('driver') or '?'}), {info.get('device_kind', '?')}, "
            f"jax {info.get('packages', {}).get('jax', '?')}, commit {info['commit']}, {info['date']}")
    return info, env


def _interrupted(signum, frame):
    raise KeyboardInterrupt  # the running mode is stopped on the way out (run_process), its rows kept


def run_stages(args, stages: list[Stage]) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    out, cache = args.out, args.cache
    os.makedirs(out, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    log = Log(os.path.join(out, "bench.log"))
    rows = os.path.join(out, "rows.jsonl")
    clock = time.monotonic()
    _, env = record_env(out, args.python, base_env(cache), args.commit, log)
    times = load_times(cache)
    compiled: set = set()
    failed = []
    for stage in stages:
        for mode in stage.units():
            label = f"{stage.name}" + (f" {mode}" if mode else "")
            spent = time.monotonic() - clock
            left = args.budget - spent - MARGIN_S if args.budget else 0.0
            seconds = estimate(stage, mode, times, compiled)
            base = dict(stage=stage.name, setting=stage.setting, mode=mode, xla_flags=stage.xla_flags)
            if args.resume and times.get(stage.program(mode), {}).get("finished") and not stage.command:
                log.say(f"== {label}: done in an earlier call (--resume)")
                continue
            if args.budget and seconds > left:
                log.say(f"== {label}: skipped (about {seconds:.0f} s needed, {max(left, 0):.0f} s of --budget left)")
                append_row(rows, dict(base, skipped=f"about {seconds:.0f} s needed, {max(left, 0):.0f} s left"))
                failed.append(f"{label} (skipped)")
                continue
            with tempfile.TemporaryDirectory(dir=cache) as work:
                jsonl = os.path.join(work, "rows.jsonl")
                argv = stage.argv(mode, args.python, jsonl, work)
                log.say(f"== {label} (at {spent:.0f} s, about {seconds:.0f} s): {shlex.join(argv)}")
                rc, took = run_process(argv, stage_env(stage, cache, env), left, log)
                lines = []
                if os.path.exists(jsonl):
                    with open(jsonl) as f:
                        lines = [json.loads(x) for x in f if x.strip()]
                files = {}
                for line in lines:
                    for kind, key in (("hlo", "program"), ("trace", "trace")):
                        path = os.path.join(work, f"{line['mode']}.{kind}.json.gz" if kind == "trace"
                                            else f"{line['mode']}.hlo.gz")
                        if os.path.exists(path):
                            member = f"{stage.name}.{os.path.basename(path)}"
                            files[member] = path
                            line[key] = member
                    append_row(rows, dict(base, **line))
                if files:
                    add_to_tar(out, files)
                timing = [x for x in lines if x.get("what") == "timing"]
                if stage.command and rc is not None:
                    append_row(rows, dict(base, exit=rc, seconds=round(took, 1)))
                if rc is None or rc != 0 or (not stage.command and not timing):
                    why = f"stopped at the budget after {took:.0f} s" if rc is None else f"exit {rc}"
                    append_row(rows, dict(base, failed=why, seconds=round(took, 1)))
                    failed.append(f"{label} ({why})")
                    log.say(f"== {label}: {why}")
                else:
                    compile_s = timing[0]["compile_s"] if timing else 0.0
                    times[stage.program(mode)] = dict(wall=round(took, 1), compile_s=round(compile_s, 1),
                                                      finished=datetime.datetime.now().isoformat(timespec="seconds"))
                    save_times(cache, times)
                    log.say(f"== {label}: done in {took:.0f} s")
                if rc is not None:
                    compiled.add(stage.program(mode))
    log.say(f"== finished at {time.monotonic() - clock:.0f} s; figures in {out}/rows.jsonl, programs in "
            f"{out}/programs.tar (price them: python -m tests.gpu_calibration --bench {out})")
    if failed:
        print(f"{PROG}: error: {len(failed)} of the planned runs did not finish: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def dry_run(args, stages: list[Stage]) -> int:
    """Every mode's command, estimate, start and whether it fits --budget; nothing runs."""
    times = load_times(args.cache)
    steps = plan(stages, args.budget, times, args.resume)
    budget = f"--budget {args.budget:g} s" if args.budget else "no --budget"
    print(f"# plan: {len(steps)} runs, {budget}, cache {args.cache} ({len(times)} programs measured before)")
    print(f"+ record the environment in {args.out}/env.json (nvidia-smi; {args.python} -c 'import jax; ...')")
    for s in steps:
        stage, mode = s["stage"], s["mode"]
        what = "runs" if s["runs"] else "done in an earlier call" if s["done"] else "skipped"
        flags = f", XLA_FLAGS plus {stage.xla_flags}" if stage.xla_flags else ""
        print(f"# {stage.name}{' ' + mode if mode else ''}: {what}, at {s['start']:.0f} s, about {s['seconds']:.0f} s"
              f"{flags}")
        argv = stage.argv(mode, args.python, f"{args.cache}/tmp/rows.jsonl", f"{args.cache}/tmp")
        print(f"+ {shlex.join(argv)}")
    ran = [s for s in steps if s["runs"]]
    end = ran[-1]["start"] + ran[-1]["seconds"] if ran else 0.0
    print(f"# {len(ran)} of {len(steps)} runs fit, ending at about {end:.0f} s")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage too
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


def parse(argv=None):
    parser = _Parser(prog="launch/gpu_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("DELTARES_BENCH_OUT", "runs/gpu_bench"),
                        help="the folder of every file written (env DELTARES_BENCH_OUT; default runs/gpu_bench)")
    parser.add_argument("--call", default="s220m", choices=sorted(CALLS),
                        help="which stages: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in CALLS.items()))
    parser.add_argument("--stages", default="", help="these stages, in this order, instead of --call's")
    parser.add_argument("--budget", default="0",
                        help="seconds for the whole call: a run that would not finish in what is left is skipped, "
                             "one that runs over is stopped (0: no limit)")
    parser.add_argument("--python", default=os.environ.get("DELTARES_PYTHON", sys.executable),
                        help="the Python with deltares' requirements and a CUDA jax (env DELTARES_PYTHON)")
    parser.add_argument("--cache", default=os.path.join(ROOT, ".jax-cache", "gpu_bench"),
                        help="JAX's compilation cache, XLA's autotuning cache and the measured times")
    parser.add_argument("--commit", default="", help="the commit recorded (default: git's, where the tree has .git)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the modes an earlier call with this --cache finished (their rows came back then)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan: every command and its budget")
    args = parser.parse_args(argv)
    try:
        args.budget = float(args.budget)
    except ValueError:
        parser.exit(2, f"{PROG}: error: --budget must be a number of seconds, not '{args.budget}'\n")
    if args.budget < 0:
        parser.exit(2, f"{PROG}: error: --budget must be at least 0, not {args.budget:g}\n")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    try:
        stages = stages_of(args.call, args.stages)
        if args.dry_run:
            return dry_run(args, stages)
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise BenchError(f"--out {args.out} is a file")
        return run_stages(args, stages)
    except BenchError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"{PROG}: error: {err.filename or ''}: {err.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted; the rows so far are in {args.out}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
