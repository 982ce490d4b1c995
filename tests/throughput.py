"""The throughput a run logs against the clock around its loop.

    python -m tests.throughput                                   # the debug scale, 60 steps
    python -m tests.throughput --config experiments/tiny.py:delta_block --steps 60   # the README's demo model

Trains in a temporary run directory, stamps the wall-clock time at which each metrics record is
written, and for every logging window that neither follows a checkpoint save nor ends in an
evaluation compares the logged `tokens_per_s` with the rate between the two writes (the steps in
between, and one record's logging). The trainer's window runs from the end of the previous one to
the moment its steps have run, less evaluations, routing statistics, peak memory and saves, so the
two clocks differ by little more than the timing of one record. `tests/test_train.py` runs
`measure` on the debug scale and fails outside [0.5x, 1.5x]; the benchmark's goal is within 10%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jax_cache import ROOT  # noqa: E402


def measure(cfg, workdir: str) -> list[dict]:
    """Trains `cfg` in `workdir`; one row per clean window: {step, steps, logged, measured, ratio}
    (tokens per second logged for the window ending at `step`, and measured around it)."""
    from deltares.train import train
    from deltares.training.metrics import MetricsWriter, read_metrics

    stamps, write = {}, MetricsWriter.write

    def stamped(self, step, record):
        write(self, step, record)
        stamps[step] = time.perf_counter()

    with mock.patch.object(MetricsWriter, "write", stamped):
        train(cfg, workdir)
    t, tokens = cfg.train, cfg.train.global_batch * cfg.data.seq_len
    records = {r["step"]: r for r in read_metrics(workdir)}
    steps = sorted(stamps)
    rows = []
    for a, b in zip(steps, steps[1:]):
        if a % t.checkpoint_every == 0 or b % t.eval_every == 0 or b == t.steps or (
                t.stats_every and b % t.stats_every == 0):
            continue  # a save after `a`, or an evaluation before `b`'s record: not in the logged window
        measured = (b - a) * tokens / (stamps[b] - stamps[a])
        logged = records[b]["tokens_per_s"]
        rows.append(dict(step=b, steps=b - a, logged=logged, measured=measured, ratio=logged / measured))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "experiments", "debug.py"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log_every", type=int, default=10)
    args = parser.parse_args()
    import importlib.util

    path, _, arg = args.config.partition(":")
    spec = importlib.util.spec_from_file_location("experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config(arg) if arg else module.get_config()
    if not cfg.data.dataset:
        cfg.data.dataset = "builtin"
    cfg.train.update(steps=args.steps, log_every=args.log_every, eval_every=args.steps, checkpoint_every=args.steps,
                     stats_every=0)
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(cfg, workdir)
    for r in rows:
        print(f"step {r['step']}: logged {r['logged']:,.0f} tokens/s, measured {r['measured']:,.0f} "
              f"over {r['steps']} steps: {r['ratio']:.3f}x")
    ratios = [r["ratio"] for r in rows]
    print(f"{cfg.scale} {cfg.model.residual.mode}, {len(rows)} windows of {args.log_every} steps: logged/measured "
          f"median {statistics.median(ratios):.3f}x, max {max(ratios):.3f}x")


if __name__ == "__main__":
    main()
