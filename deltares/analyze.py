"""Routing statistics of trained runs over a validation sample, with figures.

    python -m deltares.analyze --workdir runs/tiny_delta_block --workdir runs/tiny_block_attnres
    python -m deltares.analyze --checkpoint runs/x/checkpoints/200 --data some_text.txt --out /tmp/an

For every run (the newest checkpoint of a workdir, or one step directory) and every
sublayer j it reads the per-token softmax weights of the sublayer's depth router on
`--max_batches` batches of held-out text (the run's own validation split unless
`--data` names a prepared dataset directory, or any source `deltares.data.prepare --source` takes,
with `--text_field` for records) and reports:

- `max_weight`: the largest weight of each token; mean and quartiles over all tokens,
- `entropy`: of each token's weights (nats); mean and quartiles,
- `weights`: the mean weight of every source the sublayer reads, by name: `e` (the
  embedding) and `v0, v1, ..` (sublayer deltas) in the per-sublayer modes; `e`,
  `c0, c1, ..` (completed blocks) and `partial` (the current block's partial sum) in
  the block modes; `null` for a null source when the model has one.

The mixing modes report their own weights by depth the same way: `hyper` and `mhc` each sublayer's
read weights over the streams `r0, r1, ..`; `denseformer` each averaging layer's weights over the
embedding `e` and the layer outputs `x1, x2, ..` (on the layer's last sublayer). Those weights need
not be positive nor sum to 1: `max_weight` is the largest |weight|, `entropy` that of |weight|
normalised to sum to 1, and their quartiles are over the batches' means (from the model's own
statistics), not over tokens.

The quartiles are exact, over every token of the sample: the weights are taken
per token from the model's own routers (flax `capture_intermediates` on the
layers unrolled, same parameters), not from the batch means the trainer logs.
Kimi modes also report the output router (`final`). Writes into `--out`
(default `<first run>/analysis`): `routing.json`, `heatmap_<run>.png` (sublayer x
source mean weight), `max_weight_depth.png` (max weight against depth, all runs,
with the paper's 0.2 / 0.6 marks) and `curves.png` (training and validation loss
of all runs, from their `metrics.jsonl`). Each file is written beside its name and renamed
into place when whole; other files in `--out` are left as they are.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags

from deltares.training.checkpoint import load_checkpoint
from deltares.nn.config import BLOCK_MODES, HYPER_MODES, MIXING_MODES, REPLACEMENT_MODES
from deltares.data.dataset import TokenData, data_units, eval_batches, prepared_folder, source_tokens
from deltares.data.documents import SOURCE_HELP, DataError
from deltares.common.outputs import OutputError, check_output
from deltares.data.paths import write_file_whole, write_text_atomic
from deltares.data.run_data import check_trained_tokenizer, run_dataset_path
from deltares.interop.inference import check_params
from deltares.nn.layers import DepthRouter
from deltares.training.metrics import read_metrics
from deltares.nn.model import Transformer
from deltares.nn.residual import plan_for
from deltares.nn.stack import with_layer_layout

# Routing sharpness reported by the Delta AttnRes paper (PAPER_RESULTS.md): deep-layer max weight
# over cumulative sources (Kimi AttnRes) and over deltas.
PAPER_MAX_WEIGHT = {"cumulative sources (paper)": 0.2, "delta sources (paper)": 0.6}


class AnalysisError(ValueError):
    """Bad input to an analysis tool; the message says what and where."""


# ----------------------------------------------------------------------------- runs and data


class Run(NamedTuple):
    name: str
    workdir: str
    step: int
    config: ml_collections.ConfigDict
    params: dict
    dataset: dict | None = None  # the record of the data it was trained on (None: older checkpoints)


def load_run(path: str) -> Run:
    """The newest checkpoint of a workdir (or one step directory), parameters checked against its config."""
    ckpt = load_checkpoint(path)  # FileNotFoundError when there is none
    cfg = ml_collections.ConfigDict(ckpt.config)
    try:
        check_params(ckpt.state["params"], cfg.model)
    except (ValueError, KeyError, AttributeError) as err:
        raise AnalysisError(f"{path}: {err}") from None
    return Run(run_name(ckpt.workdir), ckpt.workdir, ckpt.step, cfg, ckpt.state["params"], ckpt.dataset)


def _local(path: str) -> str:
    """`path` relative to the working directory when it lies below it (no machine path in a report
    kept with the runs or the docs), else as it is."""
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel == ".." or rel.startswith(".." + os.sep) else rel


def run_name(workdir: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(workdir))) or "run"


def held_out_tokens(run: Run, data: str | None, units: list[dict] | None = None,
                    text_field: str = "text") -> tuple[np.ndarray, str]:
    """Tokens to analyse: `data` (a prepared dataset's validation split, or the documents of `units`, the
    source `data` names: deltares.data.dataset.data_units), else the run's own validation split. Returns the
    tokens and a description of where they come from. Data of another tokenizer than the checkpoint was
    trained with is refused, as deltares.eval does."""
    config = run.config.to_dict()
    own = run_dataset_path(config, run.workdir)
    dataset = TokenData(data if data is not None and units is None else own)
    check_trained_tokenizer(dataset, run.dataset, config, run.workdir, run.step)
    if data is None or units is None:
        tokens, source = dataset.tokens("val"), os.path.join(dataset.path, "val")
    else:  # a source of documents, read and tokenized as deltares.eval does
        tokens, _ = source_tokens(units, dataset.tokenizer(), text_field)
        source = data
    vocab = int(tokens.max()) + 1 if len(tokens) else 0
    if vocab > run.config.model.vocab_size:
        raise DataError(f"{source} has token ids up to {vocab - 1}, beyond the vocabulary of {run.name} "
                        f"({run.config.model.vocab_size})")
    return tokens, source


# ----------------------------------------------------------------------------- sources and routers


def sublayer_name(j: int) -> str:
    return f"L{j // 2}.{'attn' if j % 2 == 0 else 'mlp'}"


def slot_labels(model_cfg) -> list[str]:
    """Column label of every buffer slot: `e, v0 ..` (per-sublayer modes), `e, c0 ..` (block modes), the
    streams `r0 ..` (hyper, mhc) or `e, x1 ..` (denseformer: the layers' outputs)."""
    plan = plan_for(model_cfg)
    if plan.mode in HYPER_MODES:
        return [f"r{k}" for k in range(plan.n_slots)]
    if plan.mode == "denseformer":
        return ["e"] + [f"x{k}" for k in range(1, plan.n_slots)]
    kind = "c" if plan.mode in BLOCK_MODES else "v"
    return ["e"] + [f"{kind}{k}" for k in range(plan.n_slots - 1)]


def source_names(model_cfg, j: int | None) -> list[str | None]:
    """Name of what sublayer j (None: the Kimi output router) reads in each slot; None for slots it
    does not read. In the block modes the slot of j's own block holds its partial sum."""
    plan = plan_for(model_cfg)
    labels = slot_labels(model_cfg)
    read = plan.final_read if j is None else plan.read[j]
    names = [label if r else None for label, r in zip(labels, read)]
    if j is not None and plan.mode in BLOCK_MODES:
        own = (j // 2) // model_cfg.residual.block_layers + 1
        if own < plan.n_slots and read[own]:
            names[own] = "partial"
    return names


def unrolled(model_cfg, params) -> tuple[Transformer, dict]:
    """The same model with its layers unrolled and without remat (so flax can capture every router's
    output), and its parameters: a scanned stack `layers` [L, ...] becomes `layers_0 .. layers_{L-1}`."""
    cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    cfg.scan_layers, cfg.remat = False, "none"
    cfg.residual.impl = "xla"  # the fused kernel returns no weights
    return Transformer(cfg), with_layer_layout(params, scanned=False)


def make_weights_step(model: Transformer, with_final: bool, with_null: bool = False):
    """(params, batch) -> per-token routing figures of every sublayer (and the output router):
    `sum_JS` weight summed over tokens per slot (a last extra slot holds the null source's weight,
    the rest of 1 after the real sources; zero without `with_null`), `max_JN` and `entropy_JN` per token."""
    n_layers, n_slots = model.config.n_layers, plan_for(model.config).n_slots

    def step(params, tokens_BT):
        _, captured = model.apply(
            {"params": params},
            tokens_BT[:, :-1],
            capture_intermediates=lambda module, method: isinstance(module, DepthRouter) and method == "__call__",
            mutable=["intermediates"],
        )
        found = captured.get("intermediates", {})
        names = [(f"layers_{layer}", f"{kind}_router") for layer in range(n_layers) for kind in ("attn", "mlp")]
        if with_final:
            names.append(("final_router", None))
        weights = []
        for outer, inner in names:
            node = found.get(outer, {})
            node = node.get(inner, {}) if inner else node
            if "__call__" not in node:
                where = f"{outer}/{inner}" if inner else outer
                raise AnalysisError(f"the model produced no routing weights for {where}; deltares.analyze does not "
                                    "know this model's layout")
            w_SBT = node["__call__"][0][1].astype(jnp.float32)
            # unrolled routers see only the slots up to the last they read (deltares.nn.depth)
            weights.append(jnp.pad(w_SBT, ((0, n_slots - w_SBT.shape[0]), (0, 0), (0, 0))))
        w_JSBT = jnp.stack(weights)
        null_JBT = jnp.clip(1.0 - w_JSBT.sum(axis=1), 0.0, 1.0) * with_null
        w_JSBT = jnp.concatenate([w_JSBT, null_JBT[:, None]], axis=1)
        J = w_JSBT.shape[0]
        plogp = jnp.where(w_JSBT > 0, w_JSBT * jnp.log(jnp.where(w_JSBT > 0, w_JSBT, 1.0)), 0.0)
        return dict(
            sum_JS=w_JSBT.sum(axis=(2, 3)),
            max_JN=w_JSBT.max(axis=1).reshape(J, -1),
            entropy_JN=(-plogp.sum(axis=1)).reshape(J, -1),
        )

    return step


def _spread(values: np.ndarray) -> dict:
    q25, q50, q75 = np.percentile(values, [25, 50, 75])
    return {"mean": float(values.mean()), "q25": float(q25), "median": float(q50), "q75": float(q75),
            "min": float(values.min()), "max": float(values.max())}


def analyze_run(run: Run, batches: list[np.ndarray]) -> dict:
    """Routing statistics of one run on `batches` (see the module docstring); JSON-ready."""
    cfg = run.config.model
    plan = plan_for(cfg)
    mode = plan.mode
    result = dict(
        name=run.name, workdir=run.workdir, step=run.step, scale=run.config.scale, mode=mode,
        n_layers=cfg.n_layers, block_layers=cfg.residual.block_layers, d_model=cfg.d_model,
        tokens=int(sum(b[:, 1:].size for b in batches)), slots=slot_labels(cfg), sublayers=[],
    )
    if plan.mode in MIXING_MODES:
        return _summarise(result, cfg, plan, *_mixing_weights(run, batches), with_final=False, has_null=False)
    if not plan.uses_sources:
        result.update(routed_sublayers=0, mean_max_weight=None, deep_max_weight=None, mean_entropy=None)
        return result
    with_final = mode in REPLACEMENT_MODES
    has_null = cfg.residual.null_source
    model, params = unrolled(cfg, run.params)
    step = jax.jit(make_weights_step(model, with_final, has_null))
    sums, maxes, entropies = 0.0, [], []
    for batch in batches:
        out = jax.device_get(step(params, jnp.asarray(batch)))
        sums = sums + out["sum_JS"].astype(np.float64)
        maxes.append(out["max_JN"])
        entropies.append(out["entropy_JN"])
    n_tokens = result["tokens"]
    mean_JS = sums / n_tokens
    max_JN, entropy_JN = np.concatenate(maxes, axis=1), np.concatenate(entropies, axis=1)
    return _summarise(result, cfg, plan, mean_JS, max_JN, entropy_JN, with_final, has_null)


def _mixing_weights(run: Run, batches: list[np.ndarray]):
    """The mixing modes' weights (hyper, mhc: each sublayer's read weights over the streams; denseformer:
    each averaging layer's weights over the layer outputs) from the model's own statistics, per batch:
    (mean weight per slot [J, S + 1] (the last a null column, 0), and the max |weight| and entropy of
    |weight| / sum |weight| [J, batches]: their spread is over batches, not tokens)."""
    model = Transformer(run.config.model)
    step = jax.jit(lambda params, tokens_BT: model.apply({"params": params}, tokens_BT[:, :-1], return_stats=True)[1])
    per = [jax.device_get(step(run.params, jnp.asarray(batch))) for batch in batches]
    mean_JS = np.mean([p["weights"] for p in per], axis=0).astype(np.float64)
    mean_JS = np.concatenate([mean_JS, np.zeros((mean_JS.shape[0], 1))], axis=1)
    return (mean_JS, np.stack([p["max_weight"] for p in per], axis=1),
            np.stack([p["entropy"] for p in per], axis=1))


def _summarise(result: dict, cfg, plan, mean_JS, max_JN, entropy_JN, with_final: bool, has_null: bool) -> dict:
    """`analyze_run`'s per-sublayer rows and summary from the weights' means and spreads."""
    rows = list(range(2 * cfg.n_layers)) + ([None] if with_final else [])
    for row, j in enumerate(rows):
        names = source_names(cfg, j)
        read = [k for k, n in enumerate(names) if n is not None]
        n_sources = len(read) + int(has_null)
        sources = [names[k] for k in read] + (["null"] if has_null else [])
        weights = [float(mean_JS[row, k]) for k in read] + ([float(mean_JS[row, -1])] if has_null else [])
        # the model's definition: a sublayer with one real source does not route (a null source aside)
        routed = bool(plan.routed[j]) if j is not None else len(read) > 1
        result["sublayers"].append(dict(
            index=j if j is not None else 2 * cfg.n_layers,
            name=sublayer_name(j) if j is not None else "final",
            routed=routed,
            n_sources=n_sources,
            sources=sources,
            weights=weights,
            source_slots=read + ([len(names)] if has_null else []),  # buffer slot of each source (null: after the last)
            slot_weights=[float(w) for w in mean_JS[row, :-1]],
            max_weight=_spread(max_JN[row]),
            entropy=_spread(entropy_JN[row]),
            max_entropy=math.log(n_sources) if n_sources else 0.0,
        ))
    routed = [s for s in result["sublayers"] if s["routed"] and s["name"] != "final"]
    deep = [s for s in routed if s["index"] >= cfg.n_layers]  # the second half of the depth
    result.update(
        routed_sublayers=len(routed),
        mean_max_weight=float(np.mean([s["max_weight"]["mean"] for s in routed])) if routed else None,
        deep_max_weight=float(np.mean([s["max_weight"]["mean"] for s in deep])) if deep else None,
        mean_entropy=float(np.mean([s["entropy"]["mean"] for s in routed])) if routed else None,
    )
    return result


# ----------------------------------------------------------------------------- metrics and figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heatmap(result: dict, path: str) -> None:
    """Sublayer x source mean routing weight of one run; cells a sublayer does not read are blank,
    cells holding the current block's partial sum are marked `p`."""
    plt = _pyplot()
    rows = [s for s in result["sublayers"] if s["routed"]]
    labels = list(result["slots"]) + (["null"] if any("null" in s["sources"] for s in rows) else [])
    grid = np.full((len(rows), len(labels)), np.nan)
    partial = []
    for r, s in enumerate(rows):
        for name, k, weight in zip(s["sources"], s["source_slots"], s["weights"]):
            grid[r, k] = weight
            if name == "partial":
                partial.append((r, k))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * len(labels) + 2.5), max(3.0, 0.32 * len(rows) + 1.5)))
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(labels)), labels, rotation=90 if len(labels) > 16 else 0)
    ax.set_yticks(range(len(rows)), [s["name"] for s in rows], fontsize=7 if len(rows) > 24 else 9)
    if len(labels) <= 16 and len(rows) <= 40:
        for r in range(len(rows)):
            for k in range(len(labels)):
                if not np.isnan(grid[r, k]):
                    text = f"{grid[r, k]:.2f}" + ("\np" if (r, k) in partial else "")
                    ax.text(k, r, text, ha="center", va="center", fontsize=6, color="w" if grid[r, k] < 0.6 else "k")
    ax.set_xlabel("source (p: the current block's partial sum)" if partial else "source")
    ax.set_ylabel("routed sublayer")
    ax.set_title(f"{result['name']}: mean routing weight ({result['mode']}, step {result['step']})", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def save_figure(fig, path: str) -> None:
    """`fig` into `path` (the format its extension names) through a file beside it and a rename, so a figure
    is never half written; other files in its folder are left as they are."""
    fmt = os.path.splitext(path)[1][1:] or None
    write_file_whole(path, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))


def plot_max_weight(results: list[dict], path: str) -> None:
    """Mean per-token max weight (line) and its interquartile range (band) against depth, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        rows = [s for s in result["sublayers"] if s["routed"] and s["name"] != "final"]
        if not rows:
            continue
        x = [s["index"] for s in rows]
        mean = [s["max_weight"]["mean"] for s in rows]
        line, = ax.plot(x, mean, marker="o", markersize=3, label=f"{result['name']} ({result['mode']})")
        ax.fill_between(x, [s["max_weight"]["q25"] for s in rows], [s["max_weight"]["q75"] for s in rows],
                        color=line.get_color(), alpha=0.15)
    for (label, value), style in zip(PAPER_MAX_WEIGHT.items(), (":", "--")):
        ax.axhline(value, color="grey", linestyle=style, linewidth=1, label=label)
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("sublayer j (2l: attention of layer l, 2l+1: its MLP)")
    ax.set_ylabel("max routing weight per token")
    ax.set_title("routing sharpness against depth (line: mean, band: quartiles)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_curves(runs: list[tuple[str, list[dict]]], path: str) -> None:
    """Training loss (mean over each logging window) and validation loss against tokens seen."""
    plt = _pyplot()
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs:
        x_key = "tokens_seen" if all("tokens_seen" in r for r in records) else "step"
        train = [(r[x_key], r.get("loss_mean", r.get("loss"))) for r in records if "loss" in r]
        val = [(r[x_key], r["val_loss"]) for r in records if "val_loss" in r]
        color = None
        if train:
            color = train_ax.plot(*zip(*train), label=name, linewidth=1)[0].get_color()
        if val:
            val_ax.plot(*zip(*val), marker="o", markersize=3, label=name, color=color)
    from matplotlib.ticker import EngFormatter  # noqa: PLC0415 - with pyplot, only when plotting

    for ax, title in ((train_ax, "training loss"), (val_ax, "validation loss")):
        ax.xaxis.set_major_formatter(EngFormatter())  # 200k, 1M rather than 1000000
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# ----------------------------------------------------------------------------- the tool


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def analyze(paths: list[str], out: str | None = None, data: str | None = None, batch: int = 8,
            max_batches: int = 8, *, text_field: str = "text", hf_config: str | None = None,
            hf_split: str = "train") -> dict:
    """Analyses every run in `paths`, writes `routing.json` and the figures into `out`; returns the JSON."""
    if not paths:
        raise AnalysisError("no run given: pass --workdir (or --checkpoint) at least once")
    if batch < 1 or max_batches < 1:
        raise AnalysisError("--batch and --max_batches must be positive")
    units = None if data is None or prepared_folder(data) else data_units(
        data, text_field=text_field, hf_config=hf_config, hf_split=hf_split)
    data_inputs = [] if data is None else [prepared_folder(data)] if units is None else [
        u["path"] for u in units if os.path.isabs(u["path"])]
    if out:
        out = check_analysis_out(out, paths, data_inputs)
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    runs = [r._replace(name=f"{r.name}_{i}") if names.count(r.name) > 1 else r for i, r in enumerate(runs)]
    out = out or check_analysis_out(os.path.join(runs[0].workdir, "analysis"), paths, data_inputs)
    results = []
    for run in runs:
        tokens, source = held_out_tokens(run, data, units, text_field)
        batches = eval_batches(tokens, run.config.data.seq_len, batch, max_batches)
        result = analyze_run(run, batches)
        result["data"] = source
        results.append(result)
    os.makedirs(out, exist_ok=True)
    figures = {}
    for result in results:
        if result["routed_sublayers"]:
            figures[f"heatmap_{result['name']}"] = path = os.path.join(out, f"heatmap_{result['name']}.png")
            plot_heatmap(result, path)
    if any(r["routed_sublayers"] for r in results):
        figures["max_weight_depth"] = os.path.join(out, "max_weight_depth.png")
        plot_max_weight(results, figures["max_weight_depth"])
    curves = []
    for run in runs:
        records = read_metrics(run.workdir)
        if records:
            curves.append((run.name, records))
        else:
            warn(f"no metrics.jsonl in {run.workdir}: {run.name} has no loss curves")
    if curves:
        figures["curves"] = os.path.join(out, "curves.png")
        plot_curves(curves, figures["curves"])
    for result in results:
        result["workdir"], result["data"] = _local(result["workdir"]), _local(result["data"])
    report = dict(out=_local(out), batch=batch, max_batches=max_batches, runs=results,
                  figures={k: _local(v) for k, v in figures.items()})
    write_text_atomic(os.path.join(out, "routing.json"), json.dumps(report, indent=1))
    return report


def check_analysis_out(out: str, paths: list[str], data_inputs: list[str] | None = None) -> str:
    """The folder analyze writes into (a link's target), checked before anything is written
    (deltares.common.outputs): never a run, a dataset or a folder of one (but a new folder directly in a
    run, such as the default `<run>/analysis`), nor an input (the runs, the files or dataset `--data`
    reads); AnalysisError saying why not."""
    try:
        return check_output(out, writes="files", inputs=list(paths) + list(data_inputs or ()))
    except OutputError as err:
        raise AnalysisError(str(err)) from None


def summary_table(report: dict) -> str:
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    lines = ["| run | mode | step | tokens | routed sublayers | mean max weight | deep max weight | mean entropy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['name']} | {r['mode']} | {r['step']} | {r['tokens']:,} | {r['routed_sublayers']} | "
                     f"{fmt(r['mean_max_weight'])} | {fmt(r['deep_max_weight'])} | {fmt(r['mean_entropy'])} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; pass runs with --workdir or --checkpoint")
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    paths = list(_WORKDIR.value or []) + list(_CHECKPOINT.value or [])
    try:
        report = analyze(paths, _OUT.value, _DATA.value, _BATCH.value, _MAX_BATCHES.value, text_field=_TEXT_FIELD.value,
                         hf_config=_HF_CONFIG.value, hf_split=_HF_SPLIT.value)
    except (AnalysisError, DataError, FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(summary_table(report))
    print(f"wrote routing.json and {len(report['figures'])} figures into {report['out']}")


def cli() -> None:
    """The command line (`python -m deltares.analyze`, `deltares-analyze`); flags only here, so modules
    import side by side."""
    global _WORKDIR, _CHECKPOINT, _DATA, _OUT, _BATCH, _MAX_BATCHES, _TEXT_FIELD, _HF_CONFIG, _HF_SPLIT
    from deltares import command_line
    from deltares.common.domains import AT_LEAST_1, define_number

    _WORKDIR = flags.DEFINE_multi_string("workdir", None, "A run directory (newest checkpoint); repeat for more runs.")
    _CHECKPOINT = flags.DEFINE_multi_string("checkpoint", None, "A workdir or one checkpoint step directory; repeatable.")
    _DATA = flags.DEFINE_string("data", None, "A prepared dataset directory, or any source prepare's --source takes "
                                "(default: each run's own validation split).")
    _TEXT_FIELD = flags.DEFINE_string("text_field", "text", SOURCE_HELP["text_field"])
    _HF_CONFIG = flags.DEFINE_string("hf_config", None, SOURCE_HELP["hf_config"])
    _HF_SPLIT = flags.DEFINE_string("hf_split", "train", SOURCE_HELP["hf_split"])
    _OUT = flags.DEFINE_string("out", None, "Output directory (default: <first run>/analysis).")
    _BATCH = define_number(flags.DEFINE_integer, "batch", 8, "Sequences per batch.", AT_LEAST_1)
    _MAX_BATCHES = define_number(flags.DEFINE_integer, "max_batches", 8,
                                              "Batches of the validation sample.", AT_LEAST_1)
    command_line.run(main)


if __name__ == "__main__":
    cli()
