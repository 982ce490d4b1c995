"""Fit the GPU step-time model (`deltares.training.gpu_step_time`) to train steps measured on a GPU, and state
its error on what the goals measure: each mode's cost over baseline.

    python -m tests.gpu_calibration                      # compile every row, fit, report, estimate the defaults
    python -m tests.gpu_calibration --rows s220m         # only rows and estimates whose name contains s220m
    python -m tests.gpu_calibration --bench runs/gpu_bench   # add a GPU bench's rows (the programs that ran) and refit
    python -m tests.gpu_calibration --cache runs/gpu_calibration   # where each compiled row's kernels are kept

The rows (`ROWS`) are train steps measured with `deltares.bench` on one H200 (2026-12-04, jax 0.11.2, its
CUDA 13 plugin; docs/explanations/performance.md, "Measured on one H200" and "Two-phase grouped routing"):
the experiment, the settings of that day, 8 x 2048 tokens, the median step time. Each is compiled here for
its GPU with XLA's CUDA compiler (jax-cuda12-pjrt, on the CPU), its kernels read from the optimized HLO and
kept in the cache (a row compiles once). `--bench DIR` adds the rows of `launch/gpu_bench.py`'s output
folder: their programs are the optimized HLO the GPU ran (DIR/programs.tar), read, not compiled.

A setting is a group of rows that share one baseline (scale, attention, remat, layout, day and device).
The model's error is measured on whole settings left out: each setting in turn (with any setting that
shares a compiled program with it) is left out, the constants fitted on the other rows (`fit`: least
squares of the relative error; the efficiency of kernels of their own, Triton, on the rows that launch
them), and its rows predicted. So no held-out row's baseline or program was fitted. Reported for every
row: the error on its step time and on its cost over its setting's baseline (overhead: the step less
baseline's step, model against measured). The range of the overhead errors is the band
`gpu_step_time.ratio_band` puts on an estimated ratio. Then the constants fitted on every row (printed as
the `CALIBRATION` to paste) estimate each scale's defaults at 8 x 2048 (`ESTIMATES`, compiled for the H200
and the H100) with their ratio, its band, and the goal called met, missed or undecided until measured.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import json
import os
import sys
import tarfile
import time
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

CACHE_VERSION = 2  # kernels as [bytes, flops, f32, count, routing, own]
SCANNED = {"model.scan_layers": True, "model.residual.impl": "xla"}  # the settings of 2026-12-04
S220M = {**SCANNED, "model.remat": "none", "model.loss_chunk": 0}
S1044M = {**SCANNED, "model.remat": "dots", "model.loss_chunk": 0, "model.attention": "cudnn"}
S533M = {**SCANNED, "model.remat": "dots", "model.loss_chunk": 0, "model.attention": "cudnn"}
# the goals: a mode's step at most this many times baseline's (one H200, 8 x 2048)
GOALS = {("s220m", "delta_block"): 1.10, ("s220m", "delta"): 1.25, ("s1044m", "delta_block"): 1.08,
         ("s1044m", "delta"): 1.30}


@dataclass
class Row:
    name: str
    experiment: str  # experiments/<scale>.py:<mode>, as <scale>:<mode>
    settings: dict  # config overrides
    measured_ms: float | None  # None: an estimate only
    setting: str  # rows of one setting share their baseline (the row of mode baseline)
    gpu: str = "h200"
    note: str = ""
    result: dict = field(default_factory=dict)  # the program's kernels (compile_row or a bench's HLO)

    @property
    def mode(self) -> str:
        return self.experiment.split(":")[1]

    @property
    def scale(self) -> str:
        return self.experiment.split(":")[0]


def _rows() -> list[Row]:
    rows = []
    # s220m, its defaults of 2026-12-04 (one layer scan, no remat, the plain loss): attention x routing.
    table = {
        ("xla", "xla"): (158.0, 187.4, 246.2),
        ("xla", "pallas_gpu"): (157.6, 181.5, 225.6),
        ("cudnn", "xla"): (72.0, 100.5, 159.5),
        ("cudnn", "pallas_gpu"): (72.2, 95.4, 139.6),
    }
    for (attention, impl), times in table.items():
        for mode, ms in zip(("baseline", "delta_block", "delta"), times):
            if mode == "baseline" and impl == "pallas_gpu":
                continue  # the same program as with impl xla
            rows.append(Row(f"s220m {mode} attn={attention} routing={impl}", f"s220m:{mode}",
                            {**S220M, "model.attention": attention, "model.residual.impl": impl}, ms,
                            setting=f"h200 2026-12-04 s220m scanned attn={attention}"))
    # s220m under remat full in groups of 4 layers, and baseline under remat dots (cuDNN attention)
    g4 = {**SCANNED, "model.remat": "full", "model.loss_chunk": 0, "model.attention": "cudnn",
          "model.residual.group_layers": 4}
    for mode, ms in (("baseline", 70.6), ("delta_block", 89.8), ("delta", 96.0)):
        rows.append(Row(f"s220m {mode} remat=full groups=4", f"s220m:{mode}", g4, ms,
                        setting="h200 2026-12-04 s220m scanned remat=full groups=4"))
    rows.append(Row("s220m baseline remat=dots", "s220m:baseline",
                    {**SCANNED, "model.remat": "dots", "model.loss_chunk": 0, "model.attention": "cudnn"}, 66.4,
                    setting="h200 2026-12-04 s220m scanned remat=dots"))
    # s533m, its defaults of that day, cuDNN attention
    for mode, groups, ms in (("baseline", 0, 147.5), ("delta_block", 0, 205.1), ("delta", 4, 247.9),
                             ("delta", 0, 603.1), ("delta_block", 4, 215.2)):
        rows.append(Row(f"s533m {mode} groups={groups}", f"s533m:{mode}",
                        {**S533M, "model.residual.group_layers": groups}, ms, setting="h200 2026-12-04 s533m scanned"))
    # s1044m, its defaults of that day (scanned, remat dots), cuDNN attention
    for mode, extra, ms in (("baseline", {}, 270.8),
                            ("delta_block", {"model.residual.group_layers": 0}, 401.6),
                            ("delta", {"model.residual.group_layers": 4}, 512.3),
                            ("full_attnres", {"model.residual.group_layers": 4}, 526.5),
                            ("delta", {"model.residual.group_layers": 0}, 1397.6),
                            ("full_attnres", {"model.residual.group_layers": 0}, 918.7),
                            ("delta", {"model.residual.group_layers": 0, "model.residual.scan_segments": 12}, 955.2)):
        tag = " ".join(f"{k.split('.')[-1]}={v}" for k, v in extra.items())
        rows.append(Row(f"s1044m {mode} {tag}".strip(), f"s1044m:{mode}", {**S1044M, **extra}, ms,
                        setting="h200 2026-12-04 s1044m scanned"))
    return rows


def _estimates() -> list[Row]:
    """Each scale's defaults (layers unrolled, cuDNN attention, "auto" routing) at 8 x 2048, and the same with
    XLA's routing (s220m) or the Triton kernel (s1044m `delta_block`), on one H200 and one H100: estimated only."""
    rows = []
    for gpu in ("h200", "h100"):
        for scale, variants in (("s220m", (("baseline", "auto"), ("delta_block", "auto"), ("delta_block", "xla"),
                                           ("delta", "auto"), ("delta", "xla"))),
                                ("s1044m", (("baseline", "auto"), ("delta_block", "auto"),
                                            ("delta_block", "pallas_gpu"), ("delta", "auto")))):
            for mode, impl in variants:
                rows.append(Row(f"{gpu} {scale} {mode} routing={impl} (defaults)", f"{scale}:{mode}",
                                {"model.residual.impl": impl}, None, setting=f"{gpu} {scale} defaults", gpu=gpu))
    return rows


ROWS = _rows()
ESTIMATES = _estimates()


def config_of(row: Row):
    scale, mode = row.experiment.split(":")
    cfg = importlib.import_module(f"experiments.{scale}").get_config(mode)
    for key, value in row.settings.items():
        *path, last = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    cfg.train.global_batch, cfg.train.micro_batches, cfg.data.seq_len = 8, 1, 2048
    return cfg


# --------------------------------------------------------------------------- a row's program


def kernels_of(hlo_text: str, n_layers: int) -> dict:
    """A program's kernels as the fit reads them: [bytes, flops, f32, count, routing, own] each, and its kinds."""
    from deltares.training.gpu_step_time import is_routing, kind_of, program_kernels

    ks = program_kernels(hlo_text)
    kernels = [[k.bytes, k.flops, int(k.f32), k.count, int(is_routing(k)), int(bool(k.own))] for k in ks]
    return dict(version=CACHE_VERSION, n_layers=n_layers, kernels=kernels, kinds=[kind_of(k) for k in ks],
                program=hashlib.sha1(json.dumps(kernels).encode()).hexdigest()[:16])


def compile_row(row: Row) -> dict:
    """The kernels of the row's train step compiled for its GPU (`kernels_of`), and the compile's seconds."""
    import jax
    import jax.numpy as jnp

    from deltares.training.compile_only import check_config, step_mesh, train_step
    from deltares.training.gpu_aot import gpu_devices

    cfg = config_of(row)
    check_config(cfg)
    mesh = step_mesh(cfg, gpu_devices(row.gpu), row.gpu, None)
    step, state, batch_sharding = train_step(cfg, mesh)
    batch = jax.ShapeDtypeStruct((8, 2049), jnp.int32, sharding=batch_sharding)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    out = kernels_of(compiled.as_text(), cfg.model.n_layers)
    out["compile_s"] = round(time.perf_counter() - start, 1)
    return out


def load_rows(rows: list[Row], cache: str) -> None:
    """Each row's kernels, from the cache or compiled (then kept there)."""
    todo = [r for r in rows if not r.result]
    for i, row in enumerate(todo):
        path = os.path.join(cache, row.name.replace(" ", "_").replace("=", "-").replace("(", "").replace(")", "")
                            + ".json")
        try:
            with open(path) as f:
                row.result = json.load(f)
            if row.result.get("version") == CACHE_VERSION:
                continue
            print(f"warning: {path} is of an older format; compiling the row again", file=sys.stderr)
        except FileNotFoundError:
            pass
        except ValueError:  # a damaged cache file: compiled again
            print(f"warning: {path} is not a row's kernels; compiling the row again", file=sys.stderr)
        print(f"[{i + 1}/{len(todo)}] compiling {row.name} for the {row.gpu} ...", file=sys.stderr, flush=True)
        row.result = compile_row(row)
        with open(path + ".tmp", "w") as f:
            json.dump(row.result, f)
        os.replace(path + ".tmp", path)


# --------------------------------------------------------------------------- a bench's rows


class BenchError(ValueError):
    """A bench folder that cannot be read; the message says what."""


def bench_rows(folder: str) -> list[Row]:
    """The measured rows of a `launch/gpu_bench.py` output folder: each mode that finished, with the program it
    ran (its optimized HLO in programs.tar, or programs-N.tar), in the bench's setting tagged with the folder's GPU, date and
    commit. A program timed twice in one setting (the profile stage's steps) counts once, the longer timing.
    Rows run with XLA flags of their own (command buffers off) are another runtime's times of the same
    program: `Row.note` says so, and `main` prices them apart, out of the fit."""
    from deltares.training.gpu_aot import parse_gpu

    try:
        with open(os.path.join(folder, "env.json")) as f:
            env = json.load(f)
        with open(os.path.join(folder, "rows.jsonl")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        tars = [tarfile.open(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
                if name.startswith("programs") and name.endswith(".tar")]
    except (OSError, ValueError, tarfile.TarError) as err:
        raise BenchError(f"--bench {folder}: not a GPU bench's output ({err})") from None
    if not tars:
        raise BenchError(f"--bench {folder}: not a GPU bench's output (no programs.tar)")
    gpu = "h200" if "H200" in env.get("gpu", "") + env.get("device_kind", "") else "h100"
    parse_gpu(gpu)
    tag = f"{gpu} {env.get('date', '?').split()[0]} {env.get('commit', '?')}"
    kept: dict[tuple, tuple[int, Row]] = {}
    members = {name: tar for tar in tars for name in tar.getnames()}
    for line in lines:
        if line.get("what") != "timing" or line.get("program") not in members:
            continue  # skipped, cut, failed, a profile, or its program missing
        text = gzip.decompress(members[line["program"]].extractfile(line["program"]).read()).decode()
        row = Row(f"bench {tag} {line['stage']} {line['mode']}", f"{line['scale']}:{line['mode']}",
                  {}, float(line["median_ms"]), setting=f"bench {tag} {line['setting']}", gpu=gpu,
                  note=f"XLA_FLAGS {line['xla_flags']}" if line.get("xla_flags") else "")
        row.result = kernels_of(text, int(line["n_layers"]))
        key = (row.setting, row.result["program"])
        if key not in kept or len(line["step_ms"]) > kept[key][0]:
            kept[key] = (len(line["step_ms"]), row)
    for tar in tars:
        tar.close()
    return [row for _, row in kept.values()]


# --------------------------------------------------------------------------- the model and its fit


@dataclass
class Fit:
    bw: float
    fl: float
    launch: float
    kernel_bw: float | None  # None: no row launches a kernel of its own (priced as XLA's)


def _arrays(results: list[dict], bandwidths: list[float]) -> dict:
    """The kernels of several programs as one set of columns, each kernel with its program's index."""
    ks = [np.array(r["kernels"], dtype=np.float64).reshape(-1, 6) for r in results]
    k = np.concatenate(ks)
    index = np.concatenate([np.full(len(x), i) for i, x in enumerate(ks)])
    bandwidth = np.array(bandwidths, dtype=np.float64)[index]
    return dict(bytes=k[:, 0], flops=k[:, 1], f32=k[:, 2].astype(bool), count=k[:, 3], own=k[:, 5].astype(bool),
                bandwidth=bandwidth, index=index, n=len(ks))


def _parts(a: dict, bw: float, fl: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per program: (seconds of XLA's kernels, launches, bytes of kernels of their own / bandwidth)."""
    from deltares.training.gpu_step_time import PEAK_BF16, PEAK_TF32

    peak = np.where(a["f32"], PEAK_TF32, PEAK_BF16)
    per = np.maximum(a["bytes"] / (a["bandwidth"] * bw), a["flops"] / (peak * fl))
    assert not (a["flops"] * a["own"]).any(), "kernels of their own are priced by their bytes"

    def total(x):
        return np.bincount(a["index"], weights=x, minlength=a["n"])

    return (total(per * a["count"] * ~a["own"]), total(a["count"]),
            total(a["bytes"] * a["count"] * a["own"] / a["bandwidth"]))


def predict(result: dict, fit: Fit, bandwidth: float, routing_only: bool = False) -> float:
    """The model's step time of one program (as gpu_step_time.price sums it), or of its routing's kernels."""
    if routing_only:
        result = dict(result, kernels=[k for k in result["kernels"] if k[4]] or [[0.0, 0.0, 0, 0, 1, 0]])
    xla, n, own = (float(x[0]) for x in _parts(_arrays([result], [bandwidth]), fit.bw, fit.fl))
    return xla + fit.launch * n + own / (fit.kernel_bw or fit.bw)


def launches(result: dict) -> tuple[int, int, float]:
    """(launches, routing launches, bytes accessed) of one run of a program."""
    k = np.array(result["kernels"], dtype=np.float64).reshape(-1, 6)
    return int(k[:, 3].sum()), int((k[:, 3] * k[:, 4]).sum()), float((k[:, 0] * k[:, 3]).sum())


def fit(rows: list[Row], bandwidths: dict[str, float]) -> Fit:
    """The constants of least relative squared error over `rows`: XLA's kernels' two efficiencies on a grid
    (0.05 apart, then 0.01 apart around the best), at each point the launch cost (at least 0) and the inverse
    efficiency of kernels of their own (at least 1) solved in closed form."""
    measured = np.array([r.measured_ms / 1e3 for r in rows])
    arrays = _arrays([r.result for r in rows], [bandwidths[r.gpu] for r in rows])

    def solve(bw: float, fl: float) -> tuple[float, float, float]:
        base, n, own = _parts(arrays, bw, fl)
        target = (measured - base) / measured
        columns = np.stack([n / measured, own / measured], axis=1)
        has_own = bool(own.any())
        best = None
        # the least squares with c >= 0 and u >= 1: the free solution, or one with a bound held
        for fixed in ((None, None), (0.0, None), (None, 1.0), (0.0, 1.0)):
            if not has_own:
                fixed = (fixed[0], 0.0)
            values = list(fixed)
            free = [i for i, v in enumerate(values) if v is None]
            rest = target - sum(columns[:, i] * v for i, v in enumerate(values) if v is not None)
            if free:
                for i, v in zip(free, np.linalg.lstsq(columns[:, free], rest, rcond=None)[0]):
                    values[i] = float(v)
            c, u = values
            if c < 0 or (has_own and u < 1):
                continue
            err = float(np.sum((base + c * n + u * own - measured) ** 2 / measured**2))
            if best is None or err < best[0]:
                best = (err, c, u)
        err, c, u = best
        return err, c, (1.0 / u if has_own else 0.0)

    def search(bws, fls):
        return min((solve(b, f) + (b, f) for b in bws for f in fls), key=lambda t: t[0])

    _, _, _, bw, fl = search(np.arange(0.30, 1.001, 0.05), np.arange(0.20, 1.001, 0.05))
    _, c, k, bw, fl = search(np.clip(np.arange(bw - 0.05, bw + 0.051, 0.01), 0.1, 1.0),
                             np.clip(np.arange(fl - 0.05, fl + 0.051, 0.01), 0.1, 1.0))
    return Fit(round(float(bw), 2), round(float(fl), 2), c, round(k, 3) if k else None)


def programs_shared(rows: list[Row]) -> list[set[str]]:
    """The settings of `rows` joined where two settings hold the same program: the units left out together."""
    groups: list[tuple[set[str], set[str]]] = []  # (settings, programs)
    for r in rows:
        settings, programs = {r.setting}, {r.result["program"]}
        for g in [g for g in groups if r.setting in g[0] or r.result["program"] in g[1]]:
            groups.remove(g)
            settings |= g[0]
            programs |= g[1]
        groups.append((settings, programs))
    return [g[0] for g in groups]


def folds(rows: list[Row]) -> list[tuple[list[Row], list[Row]]]:
    """(fitted, held out) for each unit of `programs_shared`: a whole setting held out, every other row fitted."""
    out = []
    for unit in programs_shared(rows):
        held = [r for r in rows if r.setting in unit]
        out.append(([r for r in rows if r.setting not in unit], held))
    return out


def baseline_of(row: Row, rows: list[Row]) -> Row | None:
    """The baseline row of `row`'s setting (None for baseline itself, or a setting without one)."""
    if row.mode == "baseline":
        return None
    return next((r for r in rows if r.setting == row.setting and r.mode == "baseline"), None)


def cross_validate(rows: list[Row], bandwidths: dict[str, float]) -> dict[str, dict]:
    """{row name: held-out figures}: each row predicted by the constants fitted without its setting; with its
    baseline (predicted by the same constants) the model's and the measured cost over baseline."""
    out = {}
    for fitted, held in folds(rows):
        if not fitted:
            continue
        f = fit(fitted, bandwidths)
        model = {r.name: predict(r.result, f, bandwidths[r.gpu]) * 1e3 for r in held}
        for r in held:
            item = dict(model_ms=model[r.name], error=model[r.name] / r.measured_ms - 1, fit=f)
            base = baseline_of(r, held)
            if base is not None:
                measured = r.measured_ms - base.measured_ms
                item.update(measured_overhead_ms=measured, model_overhead_ms=model[r.name] - model[base.name],
                            overhead_error=(model[r.name] - model[base.name]) / measured - 1)
            out[r.name] = item
    return out


# --------------------------------------------------------------------------- the report


def report(rows: list[Row], estimates: list[Row], bandwidths: dict[str, float]) -> dict:
    """The fit on every row, the held-out errors and the band, the estimates (see the module doc)."""
    from deltares.training.gpu_step_time import Calibration, ratio_band, verdict

    final = fit(rows, bandwidths)
    held = cross_validate(rows, bandwidths)
    step_errors = [abs(h["error"]) for h in held.values()]
    overhead = [h["overhead_error"] for h in held.values() if "overhead_error" in h]
    band = (min(overhead), max(overhead)) if overhead else (0.0, 0.0)
    cal = Calibration(final.bw, final.fl, final.launch, final.kernel_bw, band)
    out = dict(fit=final, band=band, held=held, step_errors=step_errors, overhead_errors=overhead, estimates=[])
    for e in estimates:
        seconds = predict(e.result, final, bandwidths[e.gpu])
        n, routing, accessed = launches(e.result)
        sublayers = 2 * e.result["n_layers"]
        item = dict(name=e.name, gpu=e.gpu, scale=e.scale, mode=e.mode, setting=e.setting, ms=seconds * 1e3,
                    per_sublayer=n / sublayers, routing_per_sublayer=routing / sublayers,
                    routing_ms=predict(e.result, final, bandwidths[e.gpu], routing_only=True) * 1e3,
                    gib_accessed=accessed / 2**30)
        base = baseline_of(e, estimates)
        if base is not None:
            item.update(ratio_band(seconds, predict(base.result, final, bandwidths[base.gpu]), cal))
            goal = GOALS.get((e.scale, e.mode))
            if goal:
                item.update(goal=goal, verdict=verdict(item["low"], item["high"], goal))
        out["estimates"].append(item)
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def print_report(rows: list[Row], r: dict) -> None:
    f = r["fit"]
    kernel = f"{f.kernel_bw:.3f}" if f.kernel_bw else "None"
    print(f"fitted on all {len(rows)} rows: bw_efficiency={f.bw:.2f} flops_efficiency={f.fl:.2f} "
          f"launch_seconds={f.launch * 1e6:.2f}e-6 kernel_bw_efficiency={kernel}")
    print()
    print("each setting held out in turn (the constants fitted on the other settings' rows):")
    print("| row | setting | measured ms | model ms | error | overhead measured ms | overhead model ms | overhead error "
          "| launches | routing launches |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        h = r["held"].get(row.name)
        if h is None:
            continue
        n, routing, _ = launches(row.result)
        ovh = (f"{h['measured_overhead_ms']:.1f} | {h['model_overhead_ms']:.1f} | {_pct(h['overhead_error'])}"
               if "overhead_error" in h else "| |")
        print(f"| {row.name} | {row.setting} | {row.measured_ms:.1f} | {h['model_ms']:.1f} | {_pct(h['error'])} | {ovh} "
              f"| {n} | {routing} |")
    steps, ovh = r["step_errors"], r["overhead_errors"]
    if steps:
        print(f"held out, step time: {len(steps)} rows, mean |error| {100 * np.mean(steps):.1f}%, "
              f"max {100 * np.max(steps):.1f}%")
    if ovh:
        within = sum(abs(e) <= 0.15 for e in ovh)
        print(f"held out, cost over baseline: {len(ovh)} rows, mean |error| {100 * np.mean(np.abs(ovh)):.1f}%, "
              f"{within} within 15%, from {_pct(min(ovh))} to {_pct(max(ovh))}")
        lo, hi = r["band"]
        print(f"band on overhead: the measured cost over baseline is the model's / (1 + error), error in "
              f"[{_pct(lo)}, {_pct(hi)}]: the model's cost times {1 / (1 + hi):.2f} to {1 / (1 + lo):.2f}")
    if r["estimates"]:
        print()
        print("each scale's defaults at 8 x 2048, estimated (constants fitted on every row):")
        print("| estimate | ms per step | vs baseline | band | goal | verdict | launches per sublayer | "
              "routing launches per sublayer | routing ms | GiB accessed |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for e in r["estimates"]:
            ratio = f"{e['ratio']:.3f}x | {e['low']:.3f}-{e['high']:.3f}x" if "ratio" in e else "| "
            goal = f"{e['goal']:.2f}x | {e['verdict']}" if "goal" in e else "| "
            print(f"| {e['name']} | {e['ms']:.1f} | {ratio} | {goal} | {e['per_sublayer']:.1f} | "
                  f"{e['routing_per_sublayer']:.1f} | {e['routing_ms']:.1f} | {e['gib_accessed']:.0f} |")
    print()
    lo, hi = r["band"]
    print(f"CALIBRATION = Calibration(bw_efficiency={f.bw:.2f}, flops_efficiency={f.fl:.2f}, "
          f"launch_seconds={f.launch:.3g}, kernel_bw_efficiency={kernel}, overhead_error=({lo:.3f}, {hi:.3f}))")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="", help="only rows and estimates whose name contains this")
    parser.add_argument("--cache", default=os.path.join("runs", "gpu_calibration"),
                        help="where each row's kernels are kept (default runs/gpu_calibration)")
    parser.add_argument("--bench", action="append", default=[],
                        help="a launch/gpu_bench.py output folder whose rows join the fit (repeatable)")
    parser.add_argument("--no-estimates", action="store_true", help="fit and report only: compile no estimate")
    parser.add_argument("--json", default="", help="also write the rows, the fit and the estimates to this file")
    args = parser.parse_args(argv)
    from deltares.training.gpu_step_time import CALIBRATION, bandwidth_of

    try:
        os.makedirs(args.cache, exist_ok=True)
        extra = [row for folder in args.bench for row in bench_rows(folder)]
    except OSError as err:
        print(f"error: --cache {args.cache}: {err.strerror}", file=sys.stderr)
        return 2
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [r for r in ROWS + extra if args.rows in r.name and not r.note]
    estimates = [] if args.no_estimates else [r for r in ESTIMATES if args.rows in r.name]
    if not rows:
        print("error: no row to fit among those chosen", file=sys.stderr)
        return 2
    load_rows(rows + estimates, args.cache)
    bandwidths = {g: bandwidth_of(g) for g in {r.gpu for r in rows + estimates + extra}}
    if extra:  # the programs that ran, priced with the constants shipped, before any refit
        shipped = Fit(CALIBRATION.bw_efficiency, CALIBRATION.flops_efficiency, CALIBRATION.launch_seconds,
                      CALIBRATION.kernel_bw_efficiency)
        print("the bench's programs, priced with the constants shipped (gpu_step_time.CALIBRATION):")
        print("| row | measured ms | model ms | error |")
        print("|---|---|---|---|")
        for r in extra:
            model = predict(r.result, shipped, bandwidths[r.gpu]) * 1e3
            print(f"| {r.name}{' (' + r.note + ': not fitted)' if r.note else ''} | {r.measured_ms:.1f} | "
                  f"{model:.1f} | {_pct(model / r.measured_ms - 1)} |")
        print()
    result = report(rows, estimates, bandwidths)
    print_report(rows, result)
    if args.json:
        f = result["fit"]
        with open(args.json, "w") as out:
            json.dump(dict(fit=dict(bw_efficiency=f.bw, flops_efficiency=f.fl, launch_seconds=f.launch,
                                    kernel_bw_efficiency=f.kernel_bw, overhead_error=list(result["band"])),
                           rows=[dict(name=r.name, setting=r.setting, measured_ms=r.measured_ms,
                                      fitted_ms=predict(r.result, f, bandwidths[r.gpu]) * 1e3,
                                      **{k: v for k, v in result["held"].get(r.name, {}).items() if k != "fit"})
                                 for r in rows],
                           estimates=result["estimates"]), out, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("error: interrupted; the rows compiled so far are kept in the cache", file=sys.stderr)
        sys.exit(130)
