"""Weights & Biases logging of a run (`config.train.wandb`; off unless `project` is set).

Logs the records of `metrics.jsonl` (lists as one key per index, `routing_entropy/003`, as in
TensorBoard) at their steps, and the run's config once, when the W&B run is created. The run
id is kept in `<workdir>/wandb_run_id`, so a resumed run continues the same W&B run. Only
process 0 logs. `wandb` is an optional requirement, imported only when enabled; W&B's own files
go to `<workdir>/wandb` (a bucket workdir: the local cache). `mode="offline"` (or
`WANDB_MODE=offline`) writes the run locally, for `wandb sync` later.
"""

from __future__ import annotations

import hashlib
import os
import uuid

import jax
from etils import epath

from deltares.data import paths

RUN_ID_FILE = "wandb_run_id"
INSTALL = "pip install wandb==0.31.0 (the optional W&B requirement of requirements.txt)"


class TrackerError(RuntimeError):
    """W&B is asked for but cannot be used; the message says why."""


def flatten(record: dict) -> dict:
    """`record` with each list replaced by one key per index (`key/000`, ...)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, list):
            out.update({f"{key}/{i:03d}": v for i, v in enumerate(value)})
        elif key != "step":
            out[key] = value
    return out


class WandbTracker:
    """`log(step, record)` and `close()` for `MetricsWriter`, on a W&B run."""

    def __init__(self, settings, workdir: str, config: dict, through: str | None = None):
        try:
            import wandb
        except ImportError:
            raise TrackerError(f"config.train.wandb.project is set but wandb is not installed: {INSTALL}") from None
        id_path = epath.Path(through or workdir) / RUN_ID_FILE  # through the run directory held open
        resumed = id_path.exists()
        run_id = id_path.read_text().strip() if resumed else uuid.uuid4().hex[:12]
        if not resumed:
            id_path.write_text(run_id + "\n")
        local = workdir
        if paths.is_remote(workdir):
            local = os.path.join(paths.cache_dir(), "wandb", hashlib.sha256(workdir.encode()).hexdigest()[:16])
        os.makedirs(local, exist_ok=True)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity or None,
            name=settings.name or os.path.basename(workdir.rstrip("/")),
            mode=settings.mode or None,  # None: WANDB_MODE, else online
            dir=local,
            id=run_id,
            resume="allow",
            config=None if resumed else config,
        )

    def log(self, step: int, record: dict) -> None:
        self.run.log(flatten(record), step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(settings, workdir: str, config: dict, through: str | None = None) -> WandbTracker | None:
    """The W&B tracker of `config.train.wandb` on process 0, or None (off, or another process). The run id
    file is written through `through` (see deltares.training.workdir.WorkdirLock.through); W&B's own
    process writes `<workdir>/wandb` by its name."""
    if not settings.project or jax.process_index() != 0:
        return None
    return WandbTracker(settings, workdir, config, through)
