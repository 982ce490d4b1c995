"""`deltares.compare` over groups of seeds (`--group`): mean, sample std, standard error, the difference
against the baseline group and its significance, the depth figure, the JSON report, bad input.

The runs are fake workdirs written by the trainer's own writers (`MetricsWriter` for metrics.jsonl,
`Checkpointer.save` with `config_json` for the saved config; a one-parameter state), so compare reads
exactly what a run leaves, with perplexities chosen here. One test trains two real seeds of the debug
recipe for a few steps.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from deltares.analyze import AnalysisError
from deltares.compare import (compare, depth_figure, depth_series, expand_paths, group_name, group_runs,
                              grouped_markdown, plot_depth)
from deltares.train import config_json, train
from deltares.training.checkpoint import Checkpointer
from deltares.training.metrics import MetricsWriter

from jax_cache import ENV, ROOT

STEPS, BATCH, SEQ = 20, 4, 32  # the fake runs' length; the debug recipe's batch and sequence length


def debug_config(mode):
    spec = importlib.util.spec_from_file_location("debug_experiment", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def fake_run(root, name, mode, seed, ppl, n_layers=3, d_model=32, steps=STEPS, last_step=None, dataset="builtin",
             **optim):
    """A workdir as the trainer leaves it: metrics.jsonl with validations at steps/2 and `last_step`
    (default: `steps`; the final one has perplexity `ppl`) and a checkpoint at `last_step` holding the config."""
    cfg = debug_config(mode)
    cfg.seed, cfg.train.steps, cfg.model.n_layers, cfg.model.d_model = seed, steps, n_layers, d_model
    cfg.data.dataset = dataset
    for key, value in optim.items():
        cfg.optim[key] = value
    last_step = steps if last_step is None else last_step
    workdir = os.path.join(root, name)
    writer = MetricsWriter(workdir)
    for step, value in ((steps // 2, 2 * ppl), (last_step, ppl)):
        loss = math.log(value)
        writer.write(step, {"loss": loss, "loss_mean": loss, "tokens_per_s": 1000.0, "tokens_seen": step * BATCH * SEQ,
                            "val_loss": loss, "val_ppl": value, "val_bpb": loss / math.log(2), "peak_bytes": 2**20})
    writer.close()
    ckpt = Checkpointer(workdir, async_save=False)
    ckpt.save(last_step, {"params": {"w": np.zeros(2, np.float32)}}, {"position": 0}, config_json(cfg))
    ckpt.wait()
    ckpt.close()
    return workdir


# final validation perplexities of the fake study: {run name: (mode, seed, ppl, n_layers)}
STUDY = {
    "baseline_s0": ("baseline", 0, 40.0, 3), "baseline_s1": ("baseline", 1, 41.5, 3), "baseline_s2": ("baseline", 2, 39.8, 3),
    "delta_block_s0": ("delta_block", 0, 36.0, 3), "delta_block_s1": ("delta_block", 1, 36.9, 3),
    "delta_block_s2": ("delta_block", 2, 35.7, 3),
    "delta_s0": ("delta", 0, 40.9, 3), "delta_s1": ("delta", 1, 38.2, 3), "delta_s2": ("delta", 2, 43.0, 3),
    "full_attnres_s0": ("full_attnres", 0, 30.0, 3),  # one seed only
    "deep6_baseline_s0": ("baseline", 0, 33.0, 6), "deep6_baseline_s1": ("baseline", 1, 34.0, 6),
    "deep6_delta_s0": ("delta", 0, 31.0, 6), "deep6_delta_s1": ("delta", 1, 31.6, 6),
}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("study"))
    for name, (mode, seed, ppl, n_layers) in STUDY.items():
        fake_run(root, name, mode, seed, ppl, n_layers=n_layers)
    # one seed of delta_block that stopped early (last validation and checkpoint at step 10 of 20)
    fake_run(root, "delta_block_s3", "delta_block", 3, 20.0, last_step=STEPS // 2)
    return root


def by_group(report):
    return {g["group"]: g for g in report["groups"]}


def hand_stats(values):
    a = np.array(values)
    std = a.std(ddof=1)
    return a.mean(), std, std / np.sqrt(len(a))


def test_group_names():
    assert group_name("delta_block_s0") == group_name("delta_block_s12") == "delta_block"
    assert group_name("delta_block_b3_s1") == "delta_block_b3"
    assert group_name("baseline") == "baseline"  # no seed suffix: a group of its own
    assert group_name("s1_delta_s1") == "s1_delta"  # only the suffix
    assert group_name("lr10_seed2_delta", r"_seed\d+") == "lr10_delta"


def test_stats_and_significance_match_numpy(study):
    report = group_runs([os.path.join(study, n) for n in sorted(os.listdir(study))])
    groups = by_group(report)
    assert sorted(groups) == ["baseline", "deep6_baseline", "deep6_delta", "delta", "delta_block", "full_attnres"]
    base = [STUDY[f"baseline_s{i}"][2] for i in range(3)]
    b_mean, b_std, b_se = hand_stats(base)
    g = groups["baseline"]
    assert g["n"] == 3 and g["runs"] == ["baseline_s0", "baseline_s1", "baseline_s2"] and g["seeds"] == [0, 1, 2]
    assert g["val_ppl"]["mean"] == pytest.approx(b_mean) and g["val_ppl"]["std"] == pytest.approx(b_std)
    assert g["val_ppl"]["se"] == pytest.approx(b_se)
    assert g["val_loss"]["mean"] == pytest.approx(np.mean(np.log(base)))
    assert g["val_bpb"]["std"] == pytest.approx(np.std(np.log(base) / np.log(2), ddof=1))
    assert g["baseline"] is None and g["vs_baseline"] is None  # the reference itself

    for name, significant in (("delta_block", True), ("delta", False)):
        values = [STUDY[f"{name}_s{i}"][2] for i in range(3)]
        mean, std, se = hand_stats(values)
        g = groups[name]
        assert g["n"] == 3 and g["val_ppl"]["mean"] == pytest.approx(mean) and g["val_ppl"]["std"] == pytest.approx(std)
        d = g["vs_baseline"]["val_ppl"]
        assert g["baseline"] == "baseline"
        assert d["diff"] == pytest.approx(mean - b_mean) and d["rel"] == pytest.approx((mean - b_mean) / b_mean)
        assert d["se"] == pytest.approx(np.sqrt(se**2 + b_se**2))
        assert d["significant"] is bool(abs(mean - b_mean) > 2 * np.sqrt(se**2 + b_se**2)) is significant

    # the early stop is excluded, not averaged: reported in the group and in the report
    assert groups["delta_block"]["excluded"] == ["delta_block_s3"]
    assert [(e["run"], e["group"]) for e in report["excluded"]] == [("delta_block_s3", "delta_block")]
    assert "step 10" in report["excluded"][0]["reason"] and "steps=20" in report["excluded"][0]["reason"]

    # n = 1: no std, no standard error, no significance; the difference is still there
    one = groups["full_attnres"]
    assert one["n"] == 1 and one["val_ppl"]["std"] is None and one["val_ppl"]["se"] is None
    assert one["vs_baseline"]["val_ppl"]["diff"] == pytest.approx(30.0 - b_mean)
    assert one["vs_baseline"]["val_ppl"]["significant"] is None

    # the deep runs are set against the baseline of their own depth
    assert groups["deep6_delta"]["baseline"] == "deep6_baseline"
    assert groups["deep6_delta"]["vs_baseline"]["val_ppl"]["diff"] == pytest.approx(31.3 - 33.5)

    text = grouped_markdown(report)
    lines = text.splitlines()
    assert lines[0] == "| scale | Baseline | Full AttnRes | Delta Block | Delta AttnRes |"
    assert lines[2] == (f"| debug (d32, L3) | {b_mean:.2f} ± {b_std:.2f} | 30.00 ± n/a | "
                        f"{np.mean([36.0, 36.9, 35.7]):.2f} ± {np.std([36.0, 36.9, 35.7], ddof=1):.2f} | "
                        f"{np.mean([40.9, 38.2, 43.0]):.2f} ± {np.std([40.9, 38.2, 43.0], ddof=1):.2f} |")
    assert lines[3].startswith("| debug (d32, L6) | 33.50 ± 0.71 | - | - | 31.30 ± 0.42 |")
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("|").split(" | ")] for line in lines) if c}
    assert rows["delta_block"][3] == "3 (+1 excluded)" and rows["delta_block"][6] == "baseline"
    assert rows["delta_block"][9] == "yes" and rows["delta"][9] == "no" and rows["full_attnres"][9] == "n/a"
    assert rows["full_attnres"][5] == "n/a" and rows["full_attnres"][4] == "30.00 ± n/a"
    assert "Excluded (no final validation): delta_block_s3 (" in text
    assert "| delta_block_s3 | delta_block, B=2 |" in text  # still in the per-run table, with its step


def test_depth_figure_and_sidecar(study, tmp_path):
    report = group_runs([os.path.join(study, n) for n in sorted(os.listdir(study))])
    series = depth_series(report)
    # one line per mode; those with both depths have both points, x in layers
    assert [(s["mode"], s["x"]) for s in series] == [
        ("baseline", [3, 6]), ("full_attnres", [3]), ("delta_block", [3]), ("delta", [3, 6])]
    delta = series[-1]
    assert delta["groups"] == ["delta", "deep6_delta"] and delta["label"] == "delta"
    assert delta["mean"] == pytest.approx([np.mean([40.9, 38.2, 43.0]), np.mean([31.0, 31.6])])
    assert delta["std"] == pytest.approx([np.std([40.9, 38.2, 43.0], ddof=1), np.std([31.0, 31.6], ddof=1)])
    assert series[1]["std"] == [None]

    fig = depth_figure(series)
    ax = fig.axes[0]
    assert [c.get_label() for c in ax.containers] == ["baseline", "full_attnres", "delta_block", "delta"]
    lines = [c.lines[0] for c in ax.containers]  # the data line of each errorbar
    assert [list(line.get_xdata()) for line in lines] == [[3, 6], [3], [3], [3, 6]]
    assert list(lines[3].get_ydata()) == pytest.approx(delta["mean"])
    import matplotlib.pyplot as plt

    plt.close(fig)

    path = tmp_path / "figs" / "depth.png"
    assert plot_depth(report, str(path)) == series
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    side = json.loads((tmp_path / "figs" / "depth.json").read_text())
    assert side["series"] == json.loads(json.dumps(series)) and side["x"] == "model.n_layers"


def test_mixed_configs_and_bad_input(study, tmp_path):
    root = str(tmp_path)
    fake_run(root, "delta_s0", "delta", 0, 40.0)
    fake_run(root, "delta_s1", "delta", 1, 41.0, n_layers=6)
    with pytest.raises(AnalysisError, match=r"group delta mixes configs: the runs delta_s0, delta_s1 differ in "
                                            r"model\.n_layers \(delta_s0: 3, delta_s1: 6\)"):
        group_runs([os.path.join(root, "delta_s0"), os.path.join(root, "delta_s1")])
    fake_run(root, "x_s0", "delta", 0, 40.0)
    fake_run(root, "x_s1", "delta_block", 1, 41.0)
    with pytest.raises(AnalysisError, match=r"group x mixes configs: .*model\.residual\.mode \(x_s0: \"delta\", "
                                            r"x_s1: \"delta_block\"\)"):
        group_runs([os.path.join(root, "x_s0"), os.path.join(root, "x_s1")])
    fake_run(root, "y_s0", "delta", 0, 40.0)
    fake_run(root, "y_s1", "delta", 1, 41.0, steps=30)
    with pytest.raises(AnalysisError, match=r"differ in train\.steps \(y_s0: 20, y_s1: 30\)"):
        group_runs([os.path.join(root, "y_s0"), os.path.join(root, "y_s1")])
    fake_run(root, "w_s0", "delta", 0, 40.0)
    fake_run(root, "w_s1", "delta", 0, 41.0)
    with pytest.raises(AnalysisError, match="the runs w_s0, w_s1 have the same seed 0"):
        group_runs([os.path.join(root, "w_s0"), os.path.join(root, "w_s1")])
    # a routing learning rate is a different group's business: here, the same baseline for both
    fake_run(root, "lr10_s0", "delta", 0, 40.0, routing_lr=0.03)
    report = group_runs([os.path.join(study, "baseline_s0"), os.path.join(study, "baseline_s1"),
                         os.path.join(root, "lr10_s0"), os.path.join(root, "delta_s0")])
    assert {g["group"]: g["baseline"] for g in report["groups"]} == {"baseline": None, "lr10": "baseline",
                                                                     "delta": "baseline"}
    assert "| lr10 | delta, routing LR 0.03 |" in grouped_markdown(report)
    assert "| delta | delta | debug (d32, L3) |" in grouped_markdown(report)  # no routing LR set: none shown
    # one dataset directory, spelt absolute in one run's config and relative in another's: one dataset,
    # reported by its relative path (no machine path in a report)
    data = tmp_path / "data"
    data.mkdir()
    fake_run(root, "abs_s0", "delta", 0, 40.0, dataset=str(data))
    fake_run(root, "abs_s1", "delta", 1, 41.0, dataset=os.path.relpath(data))
    fake_run(root, "absbase_s0", "baseline", 0, 45.0, dataset=os.path.relpath(data))
    report = group_runs([os.path.join(root, "abs_s0"), os.path.join(root, "abs_s1"), os.path.join(root, "absbase_s0")])
    assert by_group(report)["abs"]["n"] == 2 and by_group(report)["abs"]["baseline"] == "absbase"
    assert by_group(report)["abs"]["config"]["data.dataset"] == os.path.relpath(data)
    assert [os.path.isabs(r["workdir"]) for r in report["runs"]] == [False] * 3  # run directories too

    with pytest.raises(AnalysisError, match=r"no run matches .*/nothing_s\*"):
        expand_paths([os.path.join(study, "nothing_s*")])
    assert expand_paths([os.path.join(study, "delta_s*")]) == [os.path.join(study, f"delta_s{i}") for i in range(3)]
    with pytest.raises(AnalysisError, match="no run given"):
        group_runs([])
    with pytest.raises(AnalysisError, match="--baseline nope: no such group"):
        group_runs([os.path.join(study, "delta_s0")], baseline=["nope"])
    with pytest.raises(AnalysisError, match="no complete run"):
        group_runs([os.path.join(study, "delta_block_s3")])
    # a final validation that was not finite (written as null) is excluded too
    fake_run(root, "delta_s3", "delta", 3, math.inf)
    report = group_runs([os.path.join(study, "delta_s0"), os.path.join(root, "delta_s3")])
    assert [(e["run"], e["reason"]) for e in report["excluded"]] == [
        ("delta_s3", "the final validation perplexity (step 20) is not finite")]
    assert by_group(report)["delta"]["n"] == 1
    # a workdir with metrics but no checkpoint yet is excluded; a directory with neither is an error
    started = tmp_path / "delta_s2"
    writer = MetricsWriter(str(started))
    writer.write(5, {"loss": 3.0, "tokens_seen": 5 * BATCH * SEQ})
    writer.close()
    report = group_runs([os.path.join(study, "delta_s0"), str(started)])
    assert report["excluded"] == [dict(run="delta_s2", workdir=str(started), group="delta", reason="no checkpoint yet")]
    assert by_group(report)["delta"]["excluded"] == ["delta_s2"] and by_group(report)["delta"]["n"] == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        group_runs([str(tmp_path / "empty")])
    # the ungrouped table is unchanged by the new fields of run_summary
    assert compare([os.path.join(study, "baseline_s0")]).splitlines()[2] == "| debug (d32, L3) | 40.00 |"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "deltares.compare", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=240)


def test_command_line(study, tmp_path):
    out, js, fig = tmp_path / "groups.md", tmp_path / "groups.json", tmp_path / "depth.png"
    proc = run_cli(os.path.join(study, "delta_block_s*"), os.path.join(study, "baseline_s*"), "--out", str(out),
                   "--json", str(js), "--depth_figure", str(fig))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text().strip() == proc.stdout.strip()
    assert proc.stdout.splitlines()[0] == "| scale | Baseline | Delta Block |"
    assert "warning: delta_block_s3 excluded from group delta_block" in proc.stderr
    report = json.loads(js.read_text())
    assert [g["group"] for g in report["groups"]] == ["baseline", "delta_block"]  # the paper's order
    assert report["groups"][1]["vs_baseline"]["val_ppl"]["significant"] is True
    assert fig.exists() and (tmp_path / "depth.json").exists()

    proc = run_cli(os.path.join(study, "delta_s0"), os.path.join(str(tmp_path), "none_s*"), "--group")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: no run matches"), proc.stderr


def test_real_debug_runs(tmp_path):
    """Two seeds of the debug recipe, 4 steps each, as the trainer writes them: one group of two."""
    workdirs = []
    for seed in (0, 1):
        cfg = debug_config("delta_block")
        cfg.seed, cfg.data.dataset = seed, "builtin"
        cfg.train.steps = cfg.train.eval_every = cfg.train.checkpoint_every = cfg.train.log_every = 4
        cfg.train.eval_batches, cfg.train.stats_every = 1, 0
        workdirs.append(str(tmp_path / f"debug_delta_block_s{seed}"))
        result = train(cfg, workdirs[-1])
        assert result["step"] == 4
    report = group_runs(workdirs)
    (g,) = report["groups"]
    assert g["group"] == "debug_delta_block" and g["n"] == 2 and g["seeds"] == [0, 1] and not report["excluded"]
    ppl = [json.loads(open(os.path.join(w, "metrics.jsonl")).read().splitlines()[-1])["val_ppl"] for w in workdirs]
    assert ppl[0] != ppl[1]  # the seed changed the run
    assert g["val_ppl"]["mean"] == pytest.approx(np.mean(ppl)) and g["val_ppl"]["std"] == pytest.approx(np.std(ppl, ddof=1))


def test_a_run_still_being_written_is_marked_and_left_out_of_its_group(tmp_path):
    """A run whose lock names a live trainer is marked (running) in the table, said on stderr, and left
    out of its group's mean; once its trainer is gone (a stale lock) it counts like any other."""
    from deltares.training.workdir import WorkdirLock

    root = str(tmp_path)
    runs = [fake_run(root, f"delta_s{seed}", "delta", seed, 40.0 + seed) for seed in range(3)]
    lock = WorkdirLock(runs[2], log=lambda message: None)
    lock.acquire()  # this process is the live trainer of delta_s2
    try:
        assert "| delta_s2 (running) |" in compare(runs) and "| delta_s0 |" in compare(runs)
        group = by_group(group_runs(runs))["delta"]
        assert group["runs"] == ["delta_s0", "delta_s1"] and group["n"] == 2
        proc = subprocess.run([sys.executable, "-m", "deltares.compare", *runs], cwd=ROOT, env=ENV, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and "| delta_s2 (running) |" in proc.stdout
        assert f"warning: delta_s2 is still being written (process {os.getpid()} on" in proc.stderr
    finally:
        lock.release()
    assert by_group(group_runs(runs))["delta"]["n"] == 3
    with open(os.path.join(runs[2], "LOCK"), "w") as f:  # left by a trainer that died
        json.dump({"host": __import__("socket").gethostname(), "pid": 2**22 + 7, "started": "then"}, f)
    assert "(running)" not in compare(runs) and by_group(group_runs(runs))["delta"]["n"] == 3
