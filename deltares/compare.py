r"""Compare finished runs: one markdown table of validation perplexity by scale and mode, laid out like
the paper's (PAPER_RESULTS.md), then one row per run.

    python -m deltares.compare runs/*
    python -m deltares.compare runs/tiny_baseline runs/tiny_delta_block --out results.md

Everything comes from each workdir: the config saved with its newest checkpoint
(mode, scale, shapes) and its `metrics.jsonl`: tokens seen and the last
validation loss, perplexity and bits per byte (the trainer evaluates on the
run's held-out split at every `eval_every` and at the last step), the median
training throughput over the logged windows, and the largest `peak_bytes`
(device high-water mark, or the compiled step's footprint on a CPU).

Groups of seeds (`--group`; `--seed_pattern`, `--baseline`, `--json` and `--depth_figure` imply it):

    python -m deltares.compare runs/seeds/* --group --out seeds.md
    python -m deltares.compare 'runs/seeds/delta_block_s*' runs/seeds/baseline_s0 --json groups.json
    python -m deltares.compare runs/deep/* --depth_figure depth_ppl.png --seed_pattern '_seed\d+$'

Runs whose names are equal once the first match of `--seed_pattern` (a Python regular expression,
default `_s\d+$`: `delta_block_s0`, `delta_block_s1` -> group `delta_block`) is removed form one
group; a name it does not match is a group of its own. The runs of a group must differ in the seed
and nothing else that changes training or its final evaluation: every field of the saved configs
is compared except `seed` and the execution settings of IGNORED_FIELDS (mesh, logging, checkpoint
and profiling cadence, scan/remat/kernel choices); a field that differs is an error naming it and
the runs (a dataset directory is compared by its real path, so the same data spelt relative or absolute
is one dataset). Two runs of one group with the same seed are an error too. A quoted pattern (as above)
is expanded here; one that matches nothing is an error.

A run is complete when its last validation is at its config's `train.steps` and finite; the
others (and a workdir with metrics but no checkpoint yet) are listed as excluded and not averaged.
For each group and each of validation perplexity, loss and bits per byte: n (complete runs), the mean, the sample
standard deviation (ddof=1; `n/a` for one run) and the standard error std/sqrt(n). Each group is
set against its baseline: the group of mode `baseline` (or of the names given by `--baseline`)
whose config matches it in every compared field outside `model.residual` and `optim.routing_lr`;
the difference of means is called significant when |diff| > 2 sqrt(se^2 + se_baseline^2) (`n/a`
when either group has one run). Printed: the paper-style table with `mean ± std` cells, the group
table, the excluded runs, then the per-run table. `--json` writes all of it; `--depth_figure`
plots the validation perplexity of the groups against `model.n_layers` (mean, ±1 std bars), one
line per mode (per series: groups alike in every compared field but the depth and, where that
keeps one group per depth, `model.residual.block_layers`), and writes its data beside it
(`<figure>.json`).

`--out`, `--json` and `--depth_figure` are checked before any run is read: an existing file is replaced
only with `--overwrite` (through a file beside it and a rename, a link's target), and a file of a run
or a dataset never.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics
import sys

from absl import flags

from deltares.analyze import AnalysisError, save_figure
from deltares.common.outputs import OutputError, check_output
from deltares.data.paths import write_text_atomic
from deltares.training.metrics import read_metrics
from deltares.training.checkpoint import load_checkpoint
from deltares.training.experiment import flat_fields
from deltares.training.workdir import WorkdirLock

# The paper's column order and names (PAPER_RESULTS.md, first table).
PAPER_COLUMNS = {
    "baseline": "Baseline",
    "block_attnres": "AttnRes (block)",
    "full_attnres": "Full AttnRes",
    "delta_block": "Delta Block",
    "delta": "Delta AttnRes",
    "hyper": "Hyper-connections",
    "mhc": "mHC",
    "denseformer": "DenseFormer",
}


def run_summary(path: str) -> dict:
    """The figures of one run (see the module docstring); AnalysisError / FileNotFoundError for a bad run."""
    return _load_run(path)[0]


def _load_run(path: str) -> tuple[dict, dict]:
    """(run_summary, the saved config) of one run."""
    ckpt = load_checkpoint(path, want_state=False)
    cfg = ckpt.config
    try:
        model, data, train = cfg["model"], cfg["data"], cfg["train"]
        mode = model["residual"]["mode"]
    except (KeyError, TypeError):
        raise AnalysisError(f"{path}: the checkpoint's saved config has no model.residual.mode") from None
    data["dataset"] = dataset_name(data.get("dataset"))
    records = read_metrics(ckpt.workdir)
    if not records:
        raise AnalysisError(f"no metrics.jsonl (or an empty one) in {ckpt.workdir}")
    tokens_per_step = train["global_batch"] * data["seq_len"]
    at_checkpoint = [r for r in records if r.get("step") == ckpt.step and "tokens_seen" in r]
    if at_checkpoint and at_checkpoint[-1]["tokens_seen"] != ckpt.step * tokens_per_step:
        raise AnalysisError(
            f"{ckpt.workdir}: metrics.jsonl does not match the checkpoint's config (step {ckpt.step} saw "
            f"{at_checkpoint[-1]['tokens_seen']} tokens, the config's batch x seq_len gives {ckpt.step * tokens_per_step})"
        )
    last = records[-1]
    evals = [r for r in records if "val_ppl" in r]
    rates = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), (int, float))]
    peaks = [r["peak_bytes"] for r in records if isinstance(r.get("peak_bytes"), (int, float))]
    summary = dict(
        run=os.path.basename(os.path.normpath(ckpt.workdir)),
        workdir=os.path.relpath(ckpt.workdir),  # as given: no machine path in a report
        scale=cfg["scale"] or "?",
        d_model=model["d_model"],
        n_layers=model["n_layers"],
        mode=mode,
        block_layers=model["residual"]["block_layers"] if mode in ("block_attnres", "delta_block") else None,
        mixing=_mixing_label(model["residual"]),
        step=last.get("step", ckpt.step),
        checkpoint_step=ckpt.step,
        tokens_seen=last.get("tokens_seen", last.get("step", ckpt.step) * tokens_per_step),
        val_step=evals[-1]["step"] if evals else None,
        val_loss=evals[-1]["val_loss"] if evals else None,
        val_ppl=evals[-1]["val_ppl"] if evals else None,
        val_bpb=evals[-1]["val_bpb"] if evals else None,
        tokens_per_s=statistics.median(rates) if rates else None,
        peak_bytes=max(peaks) if peaks else None,
        routing_lr=(cfg.get("optim") or {}).get("routing_lr"),
        seed=cfg["seed"],
        train_steps=train["steps"],
        running=still_written(ckpt.workdir),
    )
    return summary, cfg


def still_written(workdir: str) -> str | None:
    """The trainer still writing `workdir` (its lock's live holder), or None for a run that is not running."""
    try:
        return WorkdirLock(workdir).live_holder()
    except OSError:
        return None


def dataset_name(path):
    """A saved `data.dataset` as compare sees it: a directory that exists (from here) by its real path,
    relative to the working directory, so `/home/me/runs/data` and `runs/data` are one dataset and no
    machine path reaches a report; anything else (`builtin`, a path not found here) as saved."""
    if not isinstance(path, str) or not os.path.isdir(path):
        return path
    return os.path.relpath(os.path.realpath(path))


def _tokens(n) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _num(x, fmt) -> str:
    return "-" if x is None else format(x, fmt)


def scale_label(s: dict) -> str:
    return f"{s['scale']} (d{s['d_model']}, L{s['n_layers']})"


def paper_table(items: list[dict], scale_of, cell_of, name_of) -> list[str]:
    """The paper's layout: rows scales (`scale_of(item)`), columns modes, cells `cell_of(item)`;
    items sharing a cell are listed with their names (`name_of`)."""
    modes = [m for m in PAPER_COLUMNS if any(i["mode"] == m for i in items)]
    lines = ["| scale | " + " | ".join(PAPER_COLUMNS[m] for m in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for scale in dict.fromkeys(scale_of(i) for i in items):
        cells = []
        for mode in modes:
            here = [i for i in items if scale_of(i) == scale and i["mode"] == mode]
            if len(here) == 1:
                cells.append(cell_of(here[0]))
            else:
                cells.append(" / ".join(f"{cell_of(i)} ({name_of(i)})" for i in here) or "-")
        lines.append(f"| {scale} | " + " | ".join(cells) + " |")
    return lines


def markdown(summaries: list[dict]) -> str:
    """The paper-style table (rows: scales, columns: modes, cells: validation perplexity; runs sharing a
    cell are listed with their names) and the per-run table."""
    lines = paper_table(summaries, scale_label, lambda s: _num(s["val_ppl"], ".2f"), lambda s: s["run"])
    return "\n".join(lines + [""] + run_table(summaries))


def _mixing_label(residual: dict) -> str | None:
    """The mixing modes' settings in a label: `R=4` (hyper: `, static` without dynamic weights), `dilation 2,
    period 2` (denseformer, where not 1); None in the routing modes. Configs saved before a field existed
    have its default."""
    mode = residual["mode"]
    if mode in ("hyper", "mhc"):
        return f"R={residual.get('streams', 4)}" + ("" if residual.get("dynamic", True) or mode == "mhc" else ", static")
    if mode == "denseformer":
        parts = [f"{key} {residual.get(key, 1)}" for key in ("dilation", "period") if residual.get(key, 1) != 1]
        return ", ".join(parts) or None
    return None


def mode_label(item: dict) -> str:
    """A run's or group's mode, with its block size in the block modes, the mixing modes' settings, and its
    routing LR where set."""
    lr = item.get("routing_lr")
    return (item["mode"] + (f", B={item['block_layers']}" if item["block_layers"] else "")
            + (f", {item['mixing']}" if item.get("mixing") else "")
            + ("" if lr is None else f", routing LR {lr:g}"))


def run_table(summaries: list[dict]) -> list[str]:
    """The per-run table: one row per run."""
    lines = [
        "| run | mode | scale | step | tokens seen | val PPL | bits/byte | tokens/s | peak memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        val = _num(s["val_ppl"], ".2f") + ("" if s["val_step"] in (None, s["step"]) else f" (step {s['val_step']})")
        lines.append(
            f"| {s['run']}{' (running)' if s.get('running') else ''} | {mode_label(s)} | {scale_label(s)} | {s['step']} | {_tokens(s['tokens_seen'])} | {val} | "
            f"{_num(s['val_bpb'], '.4f')} | {_num(s['tokens_per_s'], ',.0f')} | {_bytes(s['peak_bytes'])} |"
        )
    return lines


# ----------------------------------------------------------------------------- groups of seeds

SEED_PATTERN = r"_s\d+$"
QUANTITIES = ("val_ppl", "val_loss", "val_bpb")
# Saved-config fields that may differ inside a group: the seed, and execution settings that change
# neither what is trained nor its final evaluation (a prefix ending in "." covers a whole section).
IGNORED_FIELDS = (
    "seed", "force", "mesh.", "data.prefetch", "train.log_every", "train.eval_every", "train.stats_every",
    "train.checkpoint_every", "train.keep_last", "train.keep_every", "train.resume_step", "train.peak_tflops", "train.profile_steps",
    "train.profile_all_processes", "train.wandb.", "model.scan_layers", "model.scan_unroll", "model.remat",
    "model.loss_chunk", "model.residual.impl", "model.residual.interpret",
)
# Fields that may differ between a group and its baseline (the routing itself).
ROUTING_FIELDS = ("model.residual.", "optim.routing_lr")


def _matches(field: str, prefixes) -> bool:
    return any(field == p or (p.endswith(".") and field.startswith(p)) for p in prefixes)


def compared_fields(config: dict) -> dict:
    """The flattened config (`model.n_layers`: 6, ...) without IGNORED_FIELDS: what a group's runs share."""
    return {k: v for k, v in flat_fields(config).items() if not _matches(k, IGNORED_FIELDS)}


def _key(fields: dict, drop=()) -> str:
    return json.dumps({k: v for k, v in fields.items() if not _matches(k, drop)}, sort_keys=True)


def group_name(run: str, seed_pattern: str = SEED_PATTERN) -> str:
    """The group of a run name: the name without the first match of `seed_pattern` (all of it if nothing is left)."""
    return re.sub(seed_pattern, "", run, count=1) or run


def expand_paths(paths: list[str]) -> list[str]:
    """`paths` with each one that does not exist and holds a glob character expanded (sorted);
    AnalysisError for a pattern that matches nothing."""
    out = []
    for path in paths:
        if not os.path.exists(path) and glob.has_magic(path):
            found = sorted(glob.glob(path))
            if not found:
                raise AnalysisError(f"no run matches {path}")
            out += found
        else:
            out.append(path)
    return out


def stats(values: list[float]) -> dict:
    """n, mean, sample std (ddof=1), standard error std/sqrt(n); std and se None for one value."""
    n = len(values)
    if any(v is None for v in values):  # a quantity a run did not record (or not finite): not averaged
        return dict(n=n, mean=None, std=None, se=None, values=list(values))
    mean = statistics.fmean(values) if n else None
    std = statistics.stdev(values) if n > 1 else None
    return dict(n=n, mean=mean, std=std, se=None if std is None else std / math.sqrt(n), values=list(values))


def difference(a: dict, b: dict) -> dict:
    """a - b (stats of two groups) and whether it exceeds 2 x the combined standard error sqrt(se_a^2 + se_b^2)."""
    if a["mean"] is None or b["mean"] is None:
        return dict(diff=None, rel=None, se=None, significant=None)
    diff = a["mean"] - b["mean"]
    se = None if a["se"] is None or b["se"] is None else math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    return dict(diff=diff, rel=diff / b["mean"] if b["mean"] else None, se=se,
                significant=None if se is None else abs(diff) > 2 * se)


def _is_incomplete(path: str) -> bool:
    """A workdir that has logged metrics but has no checkpoint yet (a run in progress or one that died early)."""
    return os.path.isdir(path) and bool(read_metrics(path))


def group_runs(paths: list[str], seed_pattern: str = SEED_PATTERN, baseline: list[str] | None = None) -> dict:
    """The grouped report of `paths` (see the module docstring): {"groups", "excluded", "runs",
    "seed_pattern"}; AnalysisError for no runs, a bad pattern, a group mixing configs or seeds."""
    paths = expand_paths(paths)
    if not paths:
        raise AnalysisError("no run given: python -m deltares.compare runs/* --group")
    try:
        re.compile(seed_pattern)
    except re.error as err:
        raise AnalysisError(f"--seed_pattern {seed_pattern!r} is not a regular expression: {err}") from None
    loaded, excluded = _load_runs(paths, seed_pattern)
    by_group: dict[str, list] = {}
    for summary, fields in loaded:
        by_group.setdefault(group_name(summary["run"], seed_pattern), []).append((summary, fields))
    groups = []
    for name, members in by_group.items():
        _check_group(name, members)
        groups.append(_group(name, members, excluded))
    order, scales = list(PAPER_COLUMNS), list(dict.fromkeys(g["scale_label"] for g in groups))
    groups.sort(key=lambda g: (scales.index(g["scale_label"]),
                               order.index(g["mode"]) if g["mode"] in order else len(order), g["group"]))
    _set_baselines(groups, baseline)
    if not any(g["n"] for g in groups):
        raise AnalysisError("no complete run (a final validation at config.train.steps) among the runs given: "
                            + ", ".join(e["run"] for e in excluded))
    return dict(seed_pattern=seed_pattern, groups=groups, excluded=excluded, runs=[s for s, _ in loaded])


def _load_runs(paths: list[str], seed_pattern: str) -> tuple[list, list]:
    """([(summary, compared config fields)] of the runs of `paths`, [runs excluded for having no
    checkpoint yet]); AnalysisError for two runs of one name."""
    loaded, excluded = [], []
    for path in paths:
        try:
            summary, config = _load_run(path)
        except FileNotFoundError:
            if not _is_incomplete(path):
                raise
            name = os.path.basename(os.path.normpath(path))
            excluded.append(dict(run=name, workdir=path, group=group_name(name, seed_pattern),
                                 reason="no checkpoint yet"))
            continue
        loaded.append((summary, compared_fields(config)))
    names = [s["run"] for s, _ in loaded]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise AnalysisError(f"runs of the same name given twice: {', '.join(twice)}")
    return loaded, excluded


def _group(name: str, members: list, excluded: list) -> dict:
    """Group `name`'s report over its complete runs; the others are appended to `excluded` with the reason."""
    done = []
    for summary, _ in members:
        if summary["running"]:
            excluded.append(dict(run=summary["run"], workdir=summary["workdir"], group=name,
                                 reason=f"still being written ({summary['running']})"))
        elif summary["val_step"] is None or summary["val_step"] != summary["train_steps"]:
            last = "no validation" if summary["val_step"] is None else f"last validation at step {summary['val_step']}"
            excluded.append(dict(run=summary["run"], workdir=summary["workdir"], group=name,
                                 reason=f"{last}, config.train.steps={summary['train_steps']}"))
        elif summary["val_ppl"] is None:
            excluded.append(dict(run=summary["run"], workdir=summary["workdir"], group=name,
                                 reason=f"the final validation perplexity (step {summary['val_step']}) is not finite"))
        else:
            done.append(summary)
    first, fields = members[0]
    return dict(
        group=name, mode=first["mode"], scale=first["scale"], scale_label=scale_label(first),
        d_model=first["d_model"], n_layers=first["n_layers"], block_layers=first["block_layers"],
        mixing=first.get("mixing"), routing_lr=first["routing_lr"],
        steps=first["train_steps"], runs=[s["run"] for s in done], seeds=[s["seed"] for s in done],
        excluded=[e["run"] for e in excluded if e["group"] == name], n=len(done),
        **{q: stats([s[q] for s in done]) for q in QUANTITIES},
        config=fields,
    )


def _check_group(name: str, members: list) -> None:
    """AnalysisError naming the runs and the field where the runs of group `name` differ, or share a seed."""
    fields = sorted({k for _, f in members for k in f})
    differ = [k for k in fields if len({json.dumps(f.get(k, "<unset>")) for _, f in members}) > 1]
    if differ:
        shown = []
        for k in differ[:4]:
            values = ", ".join(f"{s['run']}: {json.dumps(f.get(k, '<unset>'))}" for s, f in members)
            shown.append(f"{k} ({values})")
        more = f" and {len(differ) - 4} more fields" if len(differ) > 4 else ""
        raise AnalysisError(
            f"group {name} mixes configs: the runs {', '.join(s['run'] for s, _ in members)} differ in "
            + "; ".join(shown) + more + " (a group's runs may differ in the seed only; see --seed_pattern)")
    seeds: dict = {}
    for summary, _ in members:
        seeds.setdefault(summary["seed"], []).append(summary["run"])
    same = {seed: runs for seed, runs in seeds.items() if len(runs) > 1}
    if same:
        seed, runs = next(iter(same.items()))
        raise AnalysisError(f"group {name}: the runs {', '.join(runs)} have the same seed {seed} and config "
                            "(one run twice, not independent samples)")


def _set_baselines(groups: list[dict], names: list[str] | None) -> None:
    """Each group's `baseline` (the name of its reference group, or None) and `vs_baseline` (per quantity)."""
    if names:
        unknown = [n for n in names if n not in {g["group"] for g in groups}]
        if unknown:
            raise AnalysisError(f"--baseline {', '.join(unknown)}: no such group (groups: "
                                f"{', '.join(g['group'] for g in groups)})")
        references = [g for g in groups if g["group"] in names]
    else:
        references = [g for g in groups if g["mode"] == "baseline"]
    for g in groups:
        setting = _key(g["config"], ROUTING_FIELDS)
        candidates = [r for r in references if _key(r["config"], ROUTING_FIELDS) == setting]
        if len(candidates) > 1 and g not in candidates:
            raise AnalysisError(
                f"group {g['group']} has several baseline groups of the same setting: "
                f"{', '.join(r['group'] for r in candidates)}; name the one to use with --baseline")
        ref = candidates[0] if len(candidates) == 1 and candidates[0] is not g and candidates[0]["n"] else None
        g["baseline"] = ref and ref["group"]
        g["vs_baseline"] = (
            {q: difference(g[q], ref[q]) for q in QUANTITIES} if ref is not None and g["n"] else None)


def _mean_std(s: dict, fmt: str) -> str:
    if not s["n"] or s["mean"] is None:
        return "-"
    return f"{format(s['mean'], fmt)} ± {'n/a' if s['std'] is None else format(s['std'], fmt)}"


def _significance(d: dict | None) -> str:
    if d is None or d["significant"] is None:
        return "n/a"
    return "yes" if d["significant"] else "no"


def grouped_markdown(report: dict) -> str:
    """The paper-style table of groups (cells `mean ± std` of the validation perplexity), the group
    table (n, standard error, difference against the baseline group and its significance), the
    excluded runs, and the per-run table."""
    groups = [g for g in report["groups"] if g["n"]]
    lines = paper_table(groups, lambda g: g["scale_label"], lambda g: _mean_std(g["val_ppl"], ".2f"),
                        lambda g: g["group"])
    lines += [
        "",
        "| group | mode | scale | n | val PPL (mean ± std) | SE | vs | Δ PPL | 2 SE of Δ | \\|Δ\\| > 2 SE | bits/byte |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        mode = mode_label(g)
        d = g["vs_baseline"] and g["vs_baseline"]["val_ppl"]
        if d is not None and d["diff"] is None:
            d = None
        delta = "-" if d is None else f"{d['diff']:+.2f} ({d['rel']:+.1%})"
        two_se = "-" if d is None else ("n/a" if d["se"] is None else f"{2 * d['se']:.2f}")
        n = str(g["n"]) + (f" (+{len(g['excluded'])} excluded)" if g["excluded"] else "")
        lines.append(
            f"| {g['group']} | {mode} | {g['scale_label']} | {n} | {_mean_std(g['val_ppl'], '.2f')} | "
            f"{_num(g['val_ppl']['se'], '.2f') if g['n'] > 1 else 'n/a'} | {g['baseline'] or '-'} | {delta} | "
            f"{two_se} | {'-' if d is None else _significance(d)} | {_mean_std(g['val_bpb'], '.4f')} |"
        )
    if report["excluded"]:
        lines += ["", "Excluded (no final validation): " + "; ".join(
            f"{e['run']} ({e['reason']})" for e in report["excluded"]) + "."]
    if report["runs"]:
        lines += [""] + run_table(report["runs"])
    return "\n".join(lines)


# ----------------------------------------------------------------------------- depth figure


def depth_series(report: dict) -> list[dict]:
    """The lines of the depth figure: groups (with complete runs) alike in every compared field but
    `model.n_layers` (and `model.residual.block_layers`, where leaving it out keeps one group per depth),
    each {label, mode, x (depths), mean, std, groups}, in the paper's mode order."""
    fields = {g["group"]: g["config"] for g in report["groups"]}
    buckets: dict[str, list] = {}
    for g in (g for g in report["groups"] if g["n"] and g["val_ppl"]["mean"] is not None):
        buckets.setdefault(_key(fields[g["group"]], ("model.n_layers", "model.residual.block_layers")), []).append(g)

    def one_per_depth(members):
        return len({g["n_layers"] for g in members}) == len(members)

    series = []
    for members in buckets.values():
        if one_per_depth(members):
            series.append(members)
            continue
        split: dict[str, list] = {}
        for g in members:
            split.setdefault(_key(fields[g["group"]], ("model.n_layers",)), []).append(g)
        for part in split.values():  # groups of the same config under different names: a line each
            series += [part] if one_per_depth(part) else [[g] for g in part]
    out = []
    for members in series:
        members = sorted(members, key=lambda g: g["n_layers"])
        out.append(dict(mode=members[0]["mode"], x=[g["n_layers"] for g in members],
                        mean=[g["val_ppl"]["mean"] for g in members], std=[g["val_ppl"]["std"] for g in members],
                        groups=[g["group"] for g in members], _fields=fields[members[0]["group"]]))
    order = list(PAPER_COLUMNS)
    out.sort(key=lambda s: (order.index(s["mode"]) if s["mode"] in order else len(order), s["groups"][0]))
    for s in out:  # the label: the mode, plus the fields that tell apart the lines of one mode
        same_mode = [t for t in out if t["mode"] == s["mode"]]
        differ = sorted({k for t in same_mode for k in t["_fields"]
                         if k != "model.n_layers" and len({json.dumps(u["_fields"].get(k)) for u in same_mode}) > 1})
        extra = ", ".join(f"{k.split('.')[-1]}={s['_fields'].get(k)}" for k in differ[:3]) + (", ..." if differ[3:] else "")
        s["label"] = s["mode"] + (f" ({extra})" if extra else "")
    labels = [s["label"] for s in out]
    for s in out:
        if labels.count(s["label"]) > 1:
            s["label"] += f" [{s['groups'][0]}]"
    for s in out:
        del s["_fields"]
    return out


def depth_figure(series: list[dict]):
    """The matplotlib figure of `depth_series`: validation perplexity (mean, ±1 std bars) against the number of layers."""
    from deltares.analyze import _pyplot  # noqa: PLC0415 - matplotlib only when plotting

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in series:
        yerr = [0.0 if v is None else v for v in s["std"]]
        ax.errorbar(s["x"], s["mean"], yerr=yerr, marker="o", markersize=4, capsize=3, label=s["label"])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("layers (config.model.n_layers)")
    ax.set_ylabel("validation perplexity")
    ax.set_title("validation perplexity against depth (mean over seeds, bars: ±1 std)", fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_depth(report: dict, path: str) -> list[dict]:
    """Writes the depth figure to `path` and its data (the series) to `<path without extension>.json`; returns the series."""
    series = depth_series(report)
    if not series:
        raise AnalysisError("no complete run to plot against depth")
    fig = depth_figure(series)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    save_figure(fig, path)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.close(fig)
    write_text_atomic(os.path.splitext(path)[0] + ".json",
                      json.dumps(dict(figure=path, x="model.n_layers", y="val_ppl", series=series), indent=1))
    return series


def compare(paths: list[str]) -> str:
    return compare_summaries([run_summary(p) for p in paths])


def compare_summaries(summaries: list[dict]) -> str:
    if not summaries:
        raise AnalysisError("no run given: python -m deltares.compare runs/*")
    return markdown(summaries)


def check_outputs(runs: list[str], outputs: dict, overwrite: bool) -> dict:
    """The files compare is to write ({flag: path}, e.g. {"--out": "results.md"}; a figure's data file
    beside it), each checked before any run is read (deltares.common.outputs: never a file of a run or a
    dataset, an existing file only with `overwrite`); {flag: the path to write}. AnalysisError saying why not."""
    if "--depth_figure" in outputs:
        outputs["--depth_figure data"] = os.path.splitext(outputs["--depth_figure"])[0] + ".json"
    checked = {}
    try:
        for flag, path in outputs.items():
            checked[flag] = check_output(path, writes="file", inputs=runs, flag=flag.split()[0], overwrite=overwrite)
    except OutputError as err:
        raise AnalysisError(str(err)) from None
    for flag, path in checked.items():
        other = next((f for f, p in checked.items() if p == path and f != flag), None)
        if other is not None:
            raise AnalysisError(f"{flag} and {other} name the same file {outputs[flag]}; give each its own")
    return checked


def main(argv):
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    grouping = _GROUP.value or _JSON.value or _DEPTH_FIGURE.value or _BASELINE.value or flags.FLAGS["seed_pattern"].present
    wanted = {"--out": _OUT.value, "--json": _JSON.value if grouping else None, "--depth_figure": _DEPTH_FIGURE.value}
    try:
        runs = expand_paths(argv[1:])
        outputs = check_outputs(runs, {flag: path for flag, path in wanted.items() if path}, _OVERWRITE.value)
        if grouping:
            report = group_runs(runs, _SEED_PATTERN.value, _BASELINE.value)
            table = grouped_markdown(report)
            for e in report["excluded"]:
                print(f"warning: {e['run']} excluded from group {e['group']}: {e['reason']}", file=sys.stderr)
            if "--depth_figure" in outputs:
                plot_depth(report, outputs["--depth_figure"])
        else:
            summaries = [run_summary(p) for p in runs]
            table = compare_summaries(summaries)
            for s in summaries:
                if s["running"]:
                    print(f"warning: {s['run']} is still being written ({s['running']}): its figures are of step "
                          f"{s['step']}, marked (running)", file=sys.stderr)
    except (AnalysisError, FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(table)
    if "--out" in outputs:
        write_text_atomic(outputs["--out"], table + "\n")
    if "--json" in outputs:
        write_text_atomic(outputs["--json"], json.dumps(report, indent=1))


def cli() -> None:
    """The command line (`python -m deltares.compare`, `deltares-compare`); flags only here, so modules
    import side by side."""
    global _OUT, _GROUP, _SEED_PATTERN, _BASELINE, _JSON, _DEPTH_FIGURE, _OVERWRITE
    _OUT = flags.DEFINE_string("out", None, "Also write the table to this markdown file.")
    _OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the files that --out, --json and --depth_figure "
                                   "name when they exist (never a file of a run or a dataset).")
    _GROUP = flags.DEFINE_bool("group", False, "Group runs by name (--seed_pattern): mean ± std per group, "
                               "each against its baseline group.")
    _SEED_PATTERN = flags.DEFINE_string("seed_pattern", SEED_PATTERN, "A run's group is its name without the first "
                                        "match of this regular expression (implies --group).")
    _BASELINE = flags.DEFINE_list("baseline", None, "The reference groups (default: the groups of mode baseline; "
                                  "implies --group).")
    _JSON = flags.DEFINE_string("json", None, "Write the grouped report to this JSON file (implies --group).")
    _DEPTH_FIGURE = flags.DEFINE_string("depth_figure", None, "Write the figure of validation perplexity against depth "
                                        "per mode to this file, its data beside it as .json (implies --group).")
    from deltares import command_line

    command_line.run(main)


if __name__ == "__main__":
    cli()
