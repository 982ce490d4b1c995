"""Compare finished runs: one markdown table of validation perplexity by scale and mode, laid out like
the paper's (PAPER_RESULTS.md), then one row per run.

    python -m deltares.compare runs/*
    python -m deltares.compare runs/tiny_baseline runs/tiny_delta_block --out results.md

Everything comes from each workdir: the config saved with its newest checkpoint
(mode, scale, shapes) and its `metrics.jsonl`: tokens seen and the last
validation loss, perplexity and bits per byte (the trainer evaluates on the
run's held-out split at every `eval_every` and at the last step), the median
training throughput over the logged windows, and the largest `peak_bytes`
(device high-water mark, or the compiled step's footprint on a CPU).
"""

from __future__ import annotations

import os
import statistics
import sys

from absl import flags

from deltares.analyze import AnalysisError
from deltares.training.metrics import read_metrics
from deltares.training.checkpoint import load_checkpoint

# The paper's column order and names (PAPER_RESULTS.md, first table).
PAPER_COLUMNS = {
    "baseline": "Baseline",
    "block_attnres": "AttnRes (block)",
    "full_attnres": "Full AttnRes",
    "delta_block": "Delta Block",
    "delta": "Delta AttnRes",
}


def run_summary(path: str) -> dict:
    """The figures of one run (see the module docstring); AnalysisError / FileNotFoundError for a bad run."""
    ckpt = load_checkpoint(path, want_state=False)
    cfg = ckpt.config
    try:
        model, data, train = cfg["model"], cfg["data"], cfg["train"]
        mode = model["residual"]["mode"]
    except (KeyError, TypeError):
        raise AnalysisError(f"{path}: the checkpoint's saved config has no model.residual.mode") from None
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
    return dict(
        run=os.path.basename(os.path.normpath(ckpt.workdir)),
        workdir=ckpt.workdir,
        scale=cfg["scale"] or "?",
        d_model=model["d_model"],
        n_layers=model["n_layers"],
        mode=mode,
        block_layers=model["residual"]["block_layers"] if mode in ("block_attnres", "delta_block") else None,
        step=last.get("step", ckpt.step),
        checkpoint_step=ckpt.step,
        tokens_seen=last.get("tokens_seen", last.get("step", ckpt.step) * tokens_per_step),
        val_step=evals[-1]["step"] if evals else None,
        val_loss=evals[-1]["val_loss"] if evals else None,
        val_ppl=evals[-1]["val_ppl"] if evals else None,
        val_bpb=evals[-1]["val_bpb"] if evals else None,
        tokens_per_s=statistics.median(rates) if rates else None,
        peak_bytes=max(peaks) if peaks else None,
    )


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


def markdown(summaries: list[dict]) -> str:
    """The paper-style table (rows: scales, columns: modes, cells: validation perplexity; runs sharing a
    cell are listed with their names) and the per-run table."""
    modes = [m for m in PAPER_COLUMNS if any(s["mode"] == m for s in summaries)]
    scales = list(dict.fromkeys(scale_label(s) for s in summaries))
    lines = ["| scale | " + " | ".join(PAPER_COLUMNS[m] for m in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for scale in scales:
        cells = []
        for mode in modes:
            here = [s for s in summaries if scale_label(s) == scale and s["mode"] == mode]
            if len(here) == 1:
                cells.append(_num(here[0]["val_ppl"], ".2f"))
            else:
                cells.append(" / ".join(f"{_num(s['val_ppl'], '.2f')} ({s['run']})" for s in here) or "-")
        lines.append(f"| {scale} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | mode | scale | step | tokens seen | val PPL | bits/byte | tokens/s | peak memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        mode = s["mode"] + (f", B={s['block_layers']}" if s["block_layers"] else "")
        val = _num(s["val_ppl"], ".2f") + ("" if s["val_step"] in (None, s["step"]) else f" (step {s['val_step']})")
        lines.append(
            f"| {s['run']} | {mode} | {scale_label(s)} | {s['step']} | {_tokens(s['tokens_seen'])} | {val} | "
            f"{_num(s['val_bpb'], '.4f')} | {_num(s['tokens_per_s'], ',.0f')} | {_bytes(s['peak_bytes'])} |"
        )
    return "\n".join(lines)


def compare(paths: list[str]) -> str:
    if not paths:
        raise AnalysisError("no run given: python -m deltares.compare runs/*")
    return markdown([run_summary(p) for p in paths])


def main(argv):
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    try:
        table = compare(argv[1:])
    except (AnalysisError, FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(table)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(table + "\n")


def cli() -> None:
    """The command line (`python -m deltares.compare`, `deltares-compare`); flags only here, so modules
    import side by side."""
    global _OUT
    _OUT = flags.DEFINE_string("out", None, "Also write the table to this markdown file.")
    from deltares import entry

    entry.run(main)


if __name__ == "__main__":
    cli()
