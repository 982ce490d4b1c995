"""Fit the GPU step-time model (`deltares.training.gpu_step_time`) to the train steps measured on one H200.

    python -m tests.gpu_calibration                      # compile every row for the H200, fit, report
    python -m tests.gpu_calibration --rows s220m         # only rows whose name contains s220m
    python -m tests.gpu_calibration --cache runs/gpu_calibration   # where each row's kernels are kept

Each row is a train step measured with `deltares.bench` on one H200 (2026-12-04, jax 0.11.2, its
CUDA 13 plugin; docs/explanations/performance.md, "Measured on one H200" and "Two-phase grouped
routing"): the experiment, the settings of that day, 8 x 2048 tokens, and the median step time.
The step is compiled here for the H200 with XLA's CUDA compiler (jax-cuda12-pjrt, on the CPU), its
kernels read from the HLO and kept in the cache (a row compiles once). The model's three
constants are fitted on the rows marked `fit` (least squares of the relative error) and the error
of every other row is reported: the held-out error is the model's test. Prints the constants to
paste into `CALIBRATION`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

GPU = "h200"
SCANNED = {"model.scan_layers": True, "model.residual.impl": "xla"}  # the settings of 2026-12-04
S220M = {**SCANNED, "model.remat": "none", "model.loss_chunk": 0}
S1044M = {**SCANNED, "model.remat": "dots", "model.loss_chunk": 0, "model.attention": "cudnn"}
S533M = {**SCANNED, "model.remat": "dots", "model.loss_chunk": 0, "model.attention": "cudnn"}


@dataclass
class Row:
    name: str
    experiment: str  # experiments/<scale>.py:<mode>
    settings: dict
    measured_ms: float
    fit: bool  # used in the fit (else held out)
    note: str = ""
    result: dict = field(default_factory=dict)


def _rows() -> list[Row]:
    rows = []
    # s220m, its defaults of 2026-12-04 (one layer scan, no remat, the plain loss): attention x routing.
    # Fitted on the cuDNN attention rows with XLA routing and the xla attention rows with XLA routing;
    # the Triton-kernel rows are held out.
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
                            fit=impl == "xla" and mode != "delta"))
    # s220m under remat full in groups of 4 layers, and baseline under remat dots (cuDNN attention)
    g4 = {**SCANNED, "model.remat": "full", "model.loss_chunk": 0, "model.attention": "cudnn",
          "model.residual.group_layers": 4}
    for mode, ms in (("baseline", 70.6), ("delta_block", 89.8), ("delta", 96.0)):
        rows.append(Row(f"s220m {mode} remat=full groups=4", f"s220m:{mode}", g4, ms, fit=False))
    rows.append(Row("s220m baseline remat=dots", "s220m:baseline",
                    {**SCANNED, "model.remat": "dots", "model.loss_chunk": 0, "model.attention": "cudnn"}, 66.4,
                    fit=False))
    # s533m, its defaults of that day, cuDNN attention
    for mode, groups, ms in (("baseline", 0, 147.5), ("delta_block", 0, 205.1), ("delta", 4, 247.9),
                             ("delta", 0, 603.1), ("delta_block", 4, 215.2)):
        rows.append(Row(f"s533m {mode} groups={groups}", f"s533m:{mode}",
                        {**S533M, "model.residual.group_layers": groups}, ms, fit=mode == "baseline"))
    # s1044m, its defaults of that day (scanned, remat dots), cuDNN attention
    for mode, extra, ms, fit in (("baseline", {}, 270.8, True),
                                 ("delta_block", {"model.residual.group_layers": 0}, 401.6, True),
                                 ("delta", {"model.residual.group_layers": 4}, 512.3, False),
                                 ("full_attnres", {"model.residual.group_layers": 4}, 526.5, False),
                                 ("delta", {"model.residual.group_layers": 0}, 1397.6, False),
                                 ("full_attnres", {"model.residual.group_layers": 0}, 918.7, False),
                                 ("delta", {"model.residual.group_layers": 0, "model.residual.scan_segments": 12},
                                  955.2, False)):
        tag = " ".join(f"{k.split('.')[-1]}={v}" for k, v in extra.items())
        rows.append(Row(f"s1044m {mode} {tag}".strip(), f"s1044m:{mode}", {**S1044M, **extra}, ms, fit=fit))
    return rows


ROWS = _rows()


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


def compile_row(row: Row) -> dict:
    """The kernels of the row's train step compiled for the H200: (bytes, flops, f32, count, routing) each."""
    import jax
    import jax.numpy as jnp

    from deltares.training.compile_only import check_config, step_mesh, train_step
    from deltares.training.gpu_aot import gpu_devices
    from deltares.training.gpu_step_time import is_routing, kind_of, program_kernels

    cfg = config_of(row)
    check_config(cfg)
    mesh = step_mesh(cfg, gpu_devices(GPU), GPU, None)
    step, state, batch_sharding = train_step(cfg, mesh)
    batch = jax.ShapeDtypeStruct((8, 2049), jnp.int32, sharding=batch_sharding)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    ks = program_kernels(compiled.as_text())
    return dict(n_layers=cfg.model.n_layers, compile_s=round(time.perf_counter() - start, 1),
                kernels=[[k.bytes, k.flops, int(k.f32), k.count, int(is_routing(k))] for k in ks],
                kinds=[kind_of(k) for k in ks])


def predict(result: dict, bw_eff: float, fl_eff: float, launch_s: float, bandwidth: float) -> float:
    """The model's step time of one row's kernels (as gpu_step_time.price sums them)."""
    from deltares.training.gpu_step_time import PEAK_BF16, PEAK_TF32

    k = np.array(result["kernels"], dtype=np.float64).reshape(-1, 5)
    bytes_, flops, f32, count = k[:, 0], k[:, 1], k[:, 2].astype(bool), k[:, 3]
    peak = np.where(f32, PEAK_TF32, PEAK_BF16)
    per = np.maximum(bytes_ / (bandwidth * bw_eff), flops / (peak * fl_eff)) + launch_s
    return float((per * count).sum())


def fit(rows: list[Row], bandwidth: float) -> tuple[float, float, float]:
    """The constants of least relative squared error over `rows`: the two efficiencies on a grid (0.05
    apart, then 0.01 apart around the best), the launch cost solved in closed form at each point (at least 0)."""
    measured = np.array([r.measured_ms / 1e3 for r in rows])
    launches = np.array([np.array(r.result["kernels"], dtype=np.float64).reshape(-1, 5)[:, 3].sum() for r in rows])
    w = launches / measured

    def error(bw: float, fl: float) -> tuple[float, float]:
        base = np.array([predict(r.result, bw, fl, 0.0, bandwidth) for r in rows])
        c = max(float(np.sum(w * (measured - base) / measured) / np.sum(w * w)), 0.0)
        return float(np.sum(((base + c * launches - measured) / measured) ** 2)), c

    def search(bws, fls):
        return min((error(b, f) + (b, f) for b in bws for f in fls), key=lambda t: t[0])

    _, _, bw, fl = search(np.arange(0.30, 1.001, 0.05), np.arange(0.20, 1.001, 0.05))
    _, c, bw, fl = search(np.clip(np.arange(bw - 0.05, bw + 0.051, 0.01), 0.1, 1.0),
                          np.clip(np.arange(fl - 0.05, fl + 0.051, 0.01), 0.1, 1.0))
    return round(float(bw), 2), round(float(fl), 2), c


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    parser.add_argument("--cache", default=os.path.join("runs", "gpu_calibration"),
                        help="where each row's kernels are kept (default runs/gpu_calibration)")
    parser.add_argument("--json", default="", help="also write the rows and the fit to this file")
    args = parser.parse_args(argv)
    from deltares.training.gpu_step_time import bandwidth_of

    try:
        os.makedirs(args.cache, exist_ok=True)
    except OSError as err:
        print(f"error: --cache {args.cache}: {err.strerror}", file=sys.stderr)
        return 2
    rows = [r for r in ROWS if args.rows in r.name]
    for i, row in enumerate(rows):
        path = os.path.join(args.cache, row.name.replace(" ", "_").replace("=", "-") + ".json")
        try:
            with open(path) as f:
                row.result = json.load(f)
            continue
        except FileNotFoundError:
            pass
        except ValueError:  # a damaged cache file: compiled again
            print(f"warning: {path} is not a row's kernels; compiling the row again", file=sys.stderr)
        print(f"[{i + 1}/{len(rows)}] compiling {row.name} for the {GPU} ...", file=sys.stderr, flush=True)
        row.result = compile_row(row)
        with open(path + ".tmp", "w") as f:
            json.dump(row.result, f)
        os.replace(path + ".tmp", path)
    bandwidth = bandwidth_of(GPU)
    fitted = [r for r in rows if r.fit]
    if not fitted:
        print("error: no row to fit among those chosen", file=sys.stderr)
        return 2
    bw, fl, c = fit(fitted, bandwidth)
    print(f"fitted on {len(fitted)} rows: bw_efficiency={bw:.2f} flops_efficiency={fl:.2f} "
          f"launch_seconds={c * 1e6:.2f}e-6")
    print(f"| row | fit or held out | measured ms | model ms | error | launches | routing launches |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for r in rows:
        model = predict(r.result, bw, fl, c, bandwidth) * 1e3
        err = model / r.measured_ms - 1
        k = np.array(r.result["kernels"], dtype=np.float64).reshape(-1, 5)
        launches, routing = int(k[:, 3].sum()), int((k[:, 3] * k[:, 4]).sum())
        if not r.fit:
            errors.append(abs(err))
        print(f"| {r.name} | {'fit' if r.fit else 'held out'} | {r.measured_ms:.1f} | {model:.1f} | {100 * err:+.1f}% "
              f"| {launches} | {routing} |")
    if errors:
        print(f"held out: {len(errors)} rows, mean |error| {100 * np.mean(errors):.1f}%, "
              f"max {100 * np.max(errors):.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(fit=dict(bw_efficiency=bw, flops_efficiency=fl, launch_seconds=c),
                           rows=[dict(name=r.name, measured_ms=r.measured_ms, fit=r.fit,
                                      model_ms=predict(r.result, bw, fl, c, bandwidth) * 1e3) for r in rows]), f)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("error: interrupted; the rows compiled so far are kept in the cache", file=sys.stderr)
        sys.exit(130)
