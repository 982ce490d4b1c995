"""Training metrics: model FLOPs and MFU, and the writers for metrics.jsonl and TensorBoard.

MFU counts model FLOPs the standard way (PaLM, appendix B): per token,
6 x (matmul parameters) for the forward and backward passes, where the matmul
parameters are every layer weight plus the LM head (tied or not; the embedding
lookup is not a matmul), plus 12 x L x n_heads x head_dim x seq_len for the
attention scores and values (causal masking is not discounted). Routing and
norms are elementwise and not counted; recomputation under remat is not counted.
MFU = model FLOPs per second / (devices x peak FLOPs per device).
"""

from __future__ import annotations

import json
import math
import os

import jax
from etils import epath

from deltares import paths

# Dense bf16 peak FLOPs per device (chip), by substring of `device_kind`.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v6": 918e12,
}
NOMINAL_CPU_FLOPS_PER_CORE = 50e9  # float32, for a rough CPU MFU only


def matmul_params(model_cfg) -> int:
    D, L = model_cfg.d_model, model_cfg.n_layers
    attn = D * model_cfg.head_dim * (2 * model_cfg.n_heads + 2 * model_cfg.n_kv_heads)
    mlp = 3 * D * model_cfg.d_ff
    return L * (attn + mlp) + D * model_cfg.vocab_size


def model_flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), as in the module docstring."""
    attention = 12 * model_cfg.n_layers * model_cfg.n_heads * model_cfg.head_dim * seq_len
    return 6 * matmul_params(model_cfg) + attention


def peak_flops_per_device(override_tflops: float = 0.0) -> float:
    if override_tflops:
        return override_tflops * 1e12
    device = jax.devices()[0]
    if device.platform == "cpu":
        return NOMINAL_CPU_FLOPS_PER_CORE * (os.cpu_count() or 1)
    for key, flops in PEAK_FLOPS.items():
        if key.lower() in device.device_kind.lower():
            return flops
    return math.nan


def read_metrics(workdir: str) -> list[dict]:
    """The records of `<workdir>/metrics.jsonl` (lines cut short by a crash are skipped); [] if absent."""
    path = epath.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


class _BucketEventFile:
    """A TensorBoard event file on a bucket, through epath: buffered, rewritten whole at each flush
    (bucket objects cannot be appended to)."""

    def __init__(self, path: str):
        self.path, self.buffer = epath.Path(path), bytearray()

    def write(self, data: bytes) -> None:
        self.buffer += data

    def flush(self) -> None:
        self.path.write_bytes(bytes(self.buffer))

    def close(self) -> None:
        self.flush()


class _BucketEventFiles:
    """tensorboardX writer factory for bucket URLs, so events reach buckets the way every other
    file of a run does (gcsfs) instead of through tensorboardX's own GCS client."""

    def open(self, path: str) -> _BucketEventFile:
        return _BucketEventFile(path)

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


class MetricsWriter:
    """Appends one JSON object per logged step to `<workdir>/metrics.jsonl` and mirrors
    scalars to TensorBoard event files in `<workdir>/tensorboard`. On a bucket, where
    objects cannot be appended to, the file is rewritten whole at each write. In a job of
    several processes only process 0 writes."""

    def __init__(self, workdir: str, resume_step: int | None = None):
        self.active = jax.process_index() == 0
        if not self.active:
            return
        self.path = epath.Path(workdir) / "metrics.jsonl"
        self.remote = paths.is_remote(workdir)
        # A run resuming from a checkpoint drops the records logged after it.
        self.lines = [json.dumps(r) + "\n" for r in read_metrics(workdir) if resume_step is None or r["step"] <= resume_step]
        if self.path.exists():
            self.path.write_text("".join(self.lines))
        from tensorboardX import SummaryWriter, record_writer

        for prefix in paths.BUCKET_PREFIXES:
            record_writer.register_writer_factory(prefix, _BucketEventFiles())
        self.tb = SummaryWriter(paths.join(workdir, "tensorboard"))

    def write(self, step: int, record: dict) -> None:
        if not self.active:
            return
        record = {"step": step, **record}
        line = json.dumps(record) + "\n"
        self.lines.append(line)
        if self.remote:
            self.path.write_text("".join(self.lines))
        else:
            with self.path.open("a") as f:
                f.write(line)
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                self.tb.add_scalar(key, value, step)
            elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
                for i, v in enumerate(value):
                    self.tb.add_scalar(f"{key}/{i:03d}", v, step)
        self.tb.flush()

    def close(self) -> None:
        if self.active:
            self.tb.close()
