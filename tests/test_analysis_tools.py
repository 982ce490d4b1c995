"""The analysis tools on small trained `debug` runs: `deltares.analyze` (routing statistics and figures),
`deltares.compare` (the results table) and `deltares.bench` (throughput and memory per mode), and their
one-line errors for bad input.

Three runs of the debug recipe (30 steps; delta_block, full_attnres, baseline) are trained once for the
module. Compiled executables are cached on disk as in test_train.py (`DELTARES_TEST_JAX_CACHE`); with the
debug recipe unchanged, the train steps are the ones test_train.py and the benchmark compile.
"""

import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys

import jax
import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from deltares.analyze import AnalysisError, Run, analyze, analyze_run, source_names
from deltares.training.checkpoint import load_checkpoint
from deltares.compare import compare
from deltares.data.dataset import TokenData, eval_batches
from deltares.data.prepare import prepare
from deltares.eval import evaluate_checkpoint
from deltares.nn.model import Transformer
from deltares.training.steps import make_stats_step
from deltares.train import train

from jax_cache import ENV, ROOT
MODES = ("delta_block", "full_attnres", "baseline")
STEPS, BATCH, EVAL_BATCHES = 30, 4, 2  # the debug recipe
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def debug_config(mode):
    import importlib.util

    spec = importlib.util.spec_from_file_location("debug_experiment", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def describe(proc):
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def assert_clean_error(proc, *words):
    """Non-zero exit; stderr is one line `error: ...` containing `words`, no traceback."""
    assert proc.returncode not in (0, None), describe(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(proc)
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "dataset"
    prepare("builtin", "bytes", str(out), val_fraction=0.05, progress=False)
    return str(out)


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory):
    """{mode: workdir} of three finished runs of the debug recipe."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for mode in MODES:
        cfg = debug_config(mode)
        cfg.data.dataset = dataset
        assert (cfg.train.steps, cfg.train.global_batch, cfg.train.eval_batches) == (STEPS, BATCH, EVAL_BATCHES)
        out[mode] = str(root / f"debug_{mode}")
        train(cfg, out[mode])
    return out


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
        assert image.size[0] > 100 and image.size[1] > 100


# ----------------------------------------------------------------------------- analyze


def test_analyze_json_figures_and_model_stats(runs, dataset, tmp_path):
    out = tmp_path / "analysis"
    report = analyze([runs[m] for m in MODES], out=str(out), batch=BATCH, max_batches=2)
    saved = json.loads((out / "routing.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert {"runs", "figures", "batch", "max_batches"} <= saved.keys()
    for name in ("heatmap_debug_delta_block", "heatmap_debug_full_attnres", "max_weight_depth", "curves"):
        assert os.path.getsize(saved["figures"][name]) > 1000
        assert_png(saved["figures"][name])
    assert "heatmap_debug_baseline" not in saved["figures"]  # nothing routed
    assert sorted(os.listdir(out)) == sorted(
        ["routing.json", "heatmap_debug_delta_block.png", "heatmap_debug_full_attnres.png", "max_weight_depth.png",
         "curves.png"])

    by_mode = {r["mode"]: r for r in saved["runs"]}
    assert by_mode["baseline"]["routed_sublayers"] == 0 and by_mode["baseline"]["sublayers"] == []
    batches = eval_batches(TokenData(dataset).tokens("val"), 32, BATCH, 2)
    for mode in ("delta_block", "full_attnres"):
        r = by_mode[mode]
        assert r["step"] == STEPS and r["tokens"] == 2 * BATCH * 32 and r["data"].endswith(os.path.join("dataset", "val"))
        # 3 layers: 6 sublayers, plus the output router of the Kimi mode
        assert [s["name"] for s in r["sublayers"]] == [f"L{j // 2}.{('attn', 'mlp')[j % 2]}" for j in range(6)] + (
            ["final"] if mode == "full_attnres" else [])
        for s in r["sublayers"]:
            assert {"index", "name", "routed", "n_sources", "sources", "weights", "max_weight", "entropy"} <= s.keys()
            assert len(s["sources"]) == len(s["weights"]) == s["n_sources"]
            assert sum(s["weights"]) == pytest.approx(1.0, abs=1e-5)
            mw, ent = s["max_weight"], s["entropy"]
            assert 1 / s["n_sources"] - 1e-6 <= mw["min"] <= mw["q25"] <= mw["median"] <= mw["q75"] <= mw["max"] <= 1 + 1e-6
            assert mw["min"] <= mw["mean"] <= mw["max"]
            assert -1e-6 <= ent["min"] <= ent["mean"] <= ent["max"] <= math.log(s["n_sources"]) + 1e-5
            assert s["routed"] == (s["n_sources"] > 1)
        assert r["routed_sublayers"] == sum(s["routed"] and s["name"] != "final" for s in r["sublayers"])
        assert 0 < r["mean_max_weight"] <= 1

        # independent check: the model's own batch-mean statistics (return_stats) on the same batches
        ckpt = load_checkpoint(runs[mode])
        stats_step = jax.jit(make_stats_step(Transformer(ml_collections.ConfigDict(ckpt.config).model)))
        stats = [jax.device_get(stats_step(ckpt.state["params"], jnp.asarray(b))) for b in batches]
        for s in r["sublayers"][:6]:
            j = s["index"]
            if not s["routed"]:
                continue
            np.testing.assert_allclose(s["slot_weights"], np.mean([st["weights"][j] for st in stats], axis=0), atol=1e-5)
            assert s["max_weight"]["mean"] == pytest.approx(np.mean([st["max_weight"][j] for st in stats]), abs=1e-5)
            assert s["entropy"]["mean"] == pytest.approx(np.mean([st["entropy"][j] for st in stats]), abs=1e-4)

    # source names (debug: 3 layers, block_layers=2, so blocks {0, 1} and {2})
    block = {s["name"]: s["sources"] for s in by_mode["delta_block"]["sublayers"]}
    assert block["L0.mlp"] == ["e", "partial"] and block["L1.mlp"] == ["e", "partial"]
    assert block["L2.attn"] == ["e", "c0"] and block["L2.mlp"] == ["e", "c0", "partial"]
    full = {s["name"]: s["sources"] for s in by_mode["full_attnres"]["sublayers"]}
    assert full["L0.attn"] == ["e"] and full["L2.mlp"] == ["e", "v0", "v1", "v2", "v3", "v4"]
    assert full["final"] == ["e", "v0", "v1", "v2", "v3", "v4", "v5"]


def test_the_mixing_modes_weights_by_depth_and_their_comparison(dataset, tmp_path):
    """analyze reports each mixing mode's own weights by depth (hyper: every sublayer's read weights over the 4
    streams, which start at stream j mod 4; denseformer with dilation 2: each layer's average over the outputs it
    reads, which starts at its own), with figures; compare labels the modes with their settings."""
    workdirs = []
    for arg in ("hyper", "denseformer,dilation=2"):
        cfg = debug_config(arg)
        cfg.data.dataset = dataset
        cfg.train.update(steps=2, eval_every=2, checkpoint_every=2, stats_every=0)
        workdirs.append(str(tmp_path / arg.split(",")[0]))
        train(cfg, workdirs[-1])
    report = analyze(workdirs, out=str(tmp_path / "analysis"), batch=BATCH, max_batches=2)
    hyper, dense = report["runs"]
    assert hyper["slots"] == ["r0", "r1", "r2", "r3"] and hyper["routed_sublayers"] == 6
    for j, row in enumerate(hyper["sublayers"]):  # two steps move the weights little from their start
        assert row["sources"] == ["r0", "r1", "r2", "r3"]
        np.testing.assert_allclose(row["weights"], np.eye(4)[j % 4], atol=0.05)
    assert dense["slots"] == ["e", "x1", "x2", "x3"]
    averaging = [row for row in dense["sublayers"] if row["sources"]]
    assert [row["name"] for row in averaging] == ["L0.mlp", "L1.mlp", "L2.mlp"]
    assert [row["sources"] for row in averaging] == [["x1"], ["e", "x2"], ["x1", "x3"]]  # l - j even
    for layer, row in enumerate(averaging, start=1):
        np.testing.assert_allclose(row["weights"][-1], 1.0, atol=0.05)  # its own output
    for name in ("heatmap_hyper", "heatmap_denseformer", "max_weight_depth"):
        assert_png(report["figures"][name])
    table = compare(workdirs)
    assert "| hyper | hyper, R=4 |" in table and "| denseformer | denseformer, dilation 2 |" in table, table


def test_source_names_of_every_mode():
    cfg = debug_config("delta").model
    assert source_names(cfg, 3) == ["e", "v0", "v1", "v2", None, None, None]
    cfg = debug_config("block_attnres,block_layers=1").model
    assert source_names(cfg, 2) == ["e", "c0", None, None]  # layer 1 opens block 1: no partial yet
    assert source_names(cfg, 3) == ["e", "c0", "partial", None]
    assert source_names(cfg, None) == ["e", "c0", "c1", "c2"]  # the output router reads the completed blocks


def test_null_source_is_reported():
    """A converted model's null source (config.model.residual.null_source) is one more source, `null`; at
    initialisation (zero query) every routing is uniform over the real sources and the null source."""
    cfg = debug_config("delta_block")
    cfg.model.residual.null_source = True
    tokens_BT = np.arange(2 * 33, dtype=np.int32).reshape(2, 33) % 257
    params = nn.meta.unbox(jax.jit(Transformer(cfg.model).init)(jax.random.key(0), tokens_BT[:, :-1])["params"])
    result = analyze_run(Run("init", "/nowhere", 0, cfg, params), [tokens_BT])
    routed = [s for s in result["sublayers"] if s["routed"]]
    assert [s["name"] for s in routed] == ["L0.mlp", "L1.attn", "L1.mlp", "L2.attn", "L2.mlp"]
    for s in result["sublayers"]:
        assert s["sources"][-1] == "null" and s["n_sources"] == len(s["sources"])
        np.testing.assert_allclose(s["weights"], 1 / s["n_sources"], rtol=1e-5)
        assert s["max_weight"]["mean"] == pytest.approx(1 / s["n_sources"], rel=1e-5)
        assert s["entropy"]["mean"] == pytest.approx(math.log(s["n_sources"]), rel=1e-5)


def test_analyze_cli_checkpoint_and_text_file(runs, tmp_path):
    """A step directory as --checkpoint, a plain text file as --data, the default --out (under the first
    --workdir: absl does not keep the order of different flags, so workdirs come before checkpoints)."""
    text = tmp_path / "text.txt"
    text.write_text("Call me Ishmael. Some years ago, never mind how long precisely, having little money. " * 40)
    step_dir = os.path.join(runs["delta_block"], "checkpoints", str(STEPS))
    proc = run("deltares.analyze", "--checkpoint", step_dir, "--workdir", runs["full_attnres"], "--data", str(text),
               "--batch", str(BATCH), "--max_batches", "2")  # the shapes of the in-process test
    assert proc.returncode == 0, describe(proc)
    out = os.path.join(runs["full_attnres"], "analysis")
    assert re.search(r"^\| debug_delta_block \| delta_block \| 30 \| 256 \| 5 \| 0\.\d+ \|", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\| debug_full_attnres \| full_attnres \| 30 \| ", proc.stdout, re.M), proc.stdout
    report = json.loads(open(os.path.join(out, "routing.json")).read())
    assert [(r["name"], r["data"]) for r in report["runs"]] == [("debug_full_attnres", str(text)),
                                                                ("debug_delta_block", str(text))]
    for name in ("heatmap_debug_delta_block.png", "heatmap_debug_full_attnres.png", "max_weight_depth.png", "curves.png"):
        assert_png(os.path.join(out, name))
    shutil.rmtree(out)


# ----------------------------------------------------------------------------- compare


def test_compare_table_matches_eval(runs, dataset, tmp_path):
    out = tmp_path / "results.md"
    proc = run("deltares.compare", *(runs[m] for m in MODES), "--out", str(out))
    assert proc.returncode == 0, describe(proc)
    assert out.read_text().strip() == proc.stdout.strip() == compare([runs[m] for m in MODES])
    lines = proc.stdout.splitlines()
    assert lines[0] == "| scale | Baseline | Full AttnRes | Delta Block |"  # the paper's column order
    paper_row = lines[2].split(" | ")
    assert paper_row[0] == "| debug (d32, L3)"
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("debug_"):
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(f"debug_{m}" for m in MODES)
    for mode in MODES:
        name, shown_mode, scale, step, tokens, ppl, bpb, tok_s, peak = rows[f"debug_{mode}"]
        assert shown_mode.split(",")[0] == mode and scale == "debug (d32, L3)" and step == str(STEPS)
        assert tokens == f"{STEPS * BATCH * 32 / 1000:.3g}K"
        # independent: deltares.eval on the trainer's validation set (batches of 4, at most 2)
        want = evaluate_checkpoint(runs[mode], dataset, batch=BATCH, max_batches=EVAL_BATCHES)
        assert float(ppl) == pytest.approx(want["val_ppl"], abs=0.006)
        assert float(bpb) == pytest.approx(want["val_bpb"], abs=6e-5)
        assert float(tok_s.replace(",", "")) > 0
        assert re.fullmatch(r"[\d.]+ (B|KiB|MiB|GiB)", peak), peak  # train.py records peak_bytes
        assert f" {ppl} " in lines[2]  # the same perplexity in the paper-style row


# ----------------------------------------------------------------------------- bench


def test_bench_rows_per_mode(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    proc = run("deltares.bench", "--config", os.path.join(ROOT, "experiments", "debug.py"), "--steps", "1",
               "--rounds", "1", "--modes", "delta_block,baseline", "--jsonl", str(jsonl))
    assert proc.returncode == 0, describe(proc)
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in MODES:
            rows[cells[0]] = cells
    assert list(rows) == ["baseline", "delta_block"]  # baseline first, each mode once
    assert rows["baseline"][3] == "1.000x" and rows["baseline"][8] == "1.00x"
    for cells in rows.values():
        ms, tok_s, ratio, mfu, compile_s, args_mib, temp_mib = cells[1:8]
        assert float(ms) > 0 and float(tok_s.replace(",", "")) > 0 and ratio.endswith("x") and mfu.endswith("%")
        assert float(compile_s) >= 0 and float(args_mib) > 0 and float(temp_mib) > 0
    assert "batch=4 seq=32" in proc.stdout  # the config's batch and length by default
    recorded = [json.loads(line) for line in jsonl.read_text().splitlines()]  # each printed row, as JSON
    assert [r["mode"] for r in recorded] == ["baseline", "delta_block"] and {r["what"] for r in recorded} == {"timing"}
    for r in recorded:
        assert f"{r['median_ms']:.1f}" == rows[r["mode"]][1] and f"{r['compile_s']:.1f}" == rows[r["mode"]][5]
        assert (r["scale"], r["n_layers"], r["tokens_per_step"], r["hlo"]) == ("debug", 3, 4 * 32, None)
        assert len(r["step_ms"]) == 1 and r["device_kind"] == "cpu"


def test_bench_one_mode_at_a_time_keeps_each_program(tmp_path, monkeypatch):
    """--sequential: a mode's figures are known (and recorded) before the next mode is compiled, and its state
    is dropped first; --save_dir keeps each compiled program's optimized HLO, which the GPU model's reader
    parses; --profile_steps adds the profiled kernels (none on a CPU: no GPU streams) and keeps the trace."""
    from deltares import bench
    from deltares.training import hlo_kernels

    events = []
    prepare = bench._prepare
    monkeypatch.setattr(bench, "_prepare", lambda cfg, *a: events.append(("compile", cfg.model.residual.mode))
                        or prepare(cfg, *a))
    cfg = debug_config("delta_block")
    results = bench.benchmark(cfg, ["baseline", "delta_block"], 2, 16, 1, 2, sequential=True,
                              save_dir=str(tmp_path), profile_steps=1,
                              on_mode=lambda mode, r: events.append(("figures", mode, r.kernels is not None)))
    assert events == [("compile", "baseline"), ("figures", "baseline", False), ("figures", "baseline", True),
                      ("compile", "delta_block"), ("figures", "delta_block", False), ("figures", "delta_block", True)]
    assert [len(r.step_s) for r in results.values()] == [2, 2] and results["delta_block"].kernels == []
    for mode in ("baseline", "delta_block"):
        with gzip.open(tmp_path / f"{mode}.hlo.gz", "rt") as f:
            module = hlo_kernels.parse_module(f.read())
        assert module.entry and len(module.computations) > 1
        assert (tmp_path / f"{mode}.trace.json.gz").stat().st_size > 0
    assert bench.modes_to_time(["delta", "baseline", "delta"]) == ["baseline", "delta"]
    assert bench.modes_to_time(["delta"], baseline=False) == ["delta"]
    assert bench.modes_to_time(["baseline"], baseline=False) == ["baseline"]
    with pytest.raises(bench.BenchError, match="--nobaseline needs --modes"):
        bench.modes_to_time([], baseline=False)


def test_profile_kernels_sum_each_gpu_kernel_per_step():
    """A trace in the profiler's form: kernels on a GPU's streams, named by their HLO instruction where the
    trace says; the derived lines (XLA Ops) and the host are not counted twice."""
    from deltares.bench import profile_kernels

    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "XLA Ops"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "fusion.3", "dur": 500.0},
        *[{"ph": "X", "pid": 2, "tid": 7, "name": "loop_add_fusion_3", "dur": 10.0, "args": {"hlo_op": "fusion.3"}}
          for _ in range(4)],
        {"ph": "X", "pid": 2, "tid": 7, "name": "sm90_xmma_gemm", "dur": 30.0},
        {"ph": "X", "pid": 2, "tid": 9, "name": "fusion.3", "dur": 40.0},
    ]}
    assert profile_kernels(trace, steps=2) == [["fusion.3", 2.0, 20.0], ["sm90_xmma_gemm", 0.5, 15.0]]
    assert profile_kernels({"traceEvents": trace["traceEvents"][:1]}) == []


# ----------------------------------------------------------------------------- bad input


def _copy_with_config(workdir, dest, section, key, value):
    shutil.copytree(workdir, dest)
    path = os.path.join(dest, "checkpoints", str(STEPS), "config", "metadata")
    config = json.loads(open(path).read())
    config[section][key] = value
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dest)


def test_bad_input_is_one_line(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_clean_error(run("deltares.analyze", "--workdir", str(empty)), "no checkpoint", str(empty))
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        compare([runs["baseline"], str(empty)])

    no_metrics = tmp_path / "no_metrics"
    shutil.copytree(runs["baseline"], no_metrics)
    os.remove(no_metrics / "metrics.jsonl")
    assert_clean_error(run("deltares.compare", str(no_metrics)), "no metrics.jsonl", str(no_metrics))

    other_model = _copy_with_config(runs["delta_block"], tmp_path / "other_model", "model", "d_model", 48)
    assert_clean_error(run("deltares.analyze", "--workdir", other_model, "--out", str(tmp_path / "x")),
                       "does not match its saved config", "embed")
    assert not (tmp_path / "x").exists()
    other_batch = _copy_with_config(runs["delta_block"], tmp_path / "other_batch", "train", "global_batch", 8)
    with pytest.raises(AnalysisError, match="does not match the checkpoint's config"):
        compare([other_batch])

    assert_clean_error(run("deltares.bench", "--config", os.path.join(ROOT, "experiments", "debug.py"), "--modes",
                           "baseline,deltaa"), "unknown mode deltaa", "delta_block")


def test_analyze_rewrites_its_own_files_and_keeps_the_others(runs, tmp_path):
    """--out may hold other tools' files (the reproduction study keeps compare's depth figure beside the
    routing figures): analyze replaces its own files, each whole, and nothing else."""
    out = tmp_path / "figures"
    out.mkdir()
    (out / "routing.json").write_text("{}")  # an earlier analysis
    (out / "depth_ppl.png").write_bytes(PNG_SIGNATURE + b"compare's")
    analyze([runs["delta_block"]], out=str(out), batch=BATCH, max_batches=1)
    assert sorted(os.listdir(out)) == ["curves.png", "depth_ppl.png", "heatmap_debug_delta_block.png",
                                       "max_weight_depth.png", "routing.json"]  # no temporary file left
    assert (out / "depth_ppl.png").read_bytes() == PNG_SIGNATURE + b"compare's"
    assert json.loads((out / "routing.json").read_text())["runs"][0]["name"] == "debug_delta_block"


def test_report_paths_relative_below_the_working_directory(runs, tmp_path, tmp_path_factory, monkeypatch):
    """routing.json keeps no machine path for what lies below the working directory (the docs and
    the runs a study commits), and leaves a path elsewhere as it is."""
    from deltares.analyze import _local

    base = tmp_path_factory.getbasetemp()  # holds the runs, their data and tmp_path
    monkeypatch.chdir(base)
    analyze([runs["delta_block"]], out=str(tmp_path / "analysis"), batch=BATCH, max_batches=1)
    saved = json.loads((tmp_path / "analysis" / "routing.json").read_text())
    (run,) = saved["runs"]
    assert run["workdir"] == os.path.relpath(runs["delta_block"], base)
    assert run["data"].endswith("val") and not os.path.isabs(run["data"]) and os.path.isdir(run["data"])
    assert saved["out"] == os.path.relpath(tmp_path / "analysis", base)
    assert all(not os.path.isabs(p) and os.path.isfile(p) for p in saved["figures"].values()), saved["figures"]

    monkeypatch.chdir(tmp_path)
    assert _local(str(tmp_path / "runs" / "a")) == os.path.join("runs", "a")
    assert _local("runs/a") == os.path.join("runs", "a")
    elsewhere = os.path.join(os.path.dirname(str(tmp_path)), "other", "val")
    assert _local(elsewhere) == elsewhere


def test_an_output_file_named_like_a_folder_is_refused_and_leaves_nothing(tmp_path):
    """`--out results/` (a folder) is one line saying so, not the rename's errno and a temporary name."""
    from deltares.data.paths import write_text_atomic

    with pytest.raises(IsADirectoryError, match=f"^{tmp_path} is a folder; give the name of a file to write$"):
        write_text_atomic(str(tmp_path), "table")
    assert os.listdir(tmp_path) == []
