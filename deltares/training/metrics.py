"""Training metrics: model FLOPs and MFU, the writers for metrics.jsonl and TensorBoard, and the profiler.

MFU counts model FLOPs the standard way (PaLM, appendix B): per token,
6 x (matmul parameters) for the forward and backward passes, where the matmul
parameters are every layer weight plus the LM head (tied or not; the embedding
lookup is not a matmul), plus 12 x L x n_heads x head_dim x seq_len for the
attention scores and values (causal masking is not discounted). Routing and
norms are elementwise and not counted; recomputation under remat is not counted.
MFU = model FLOPs per second / (devices x peak FLOPs per device); `null` where the
device's peak is unknown.

`metrics.jsonl` is strict JSON: non-finite numbers are written as `null`. A local run
appends to it. A run on a bucket, whose objects cannot be appended to, writes each log
as a new part, `metrics.jsonl.d/part-NNNNNN.jsonl` (and each TensorBoard flush as a new
event file), so writing costs what is written; closing the writer joins the parts into
`metrics.jsonl` once. `read_metrics` joins whatever is there, in order.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading

import jax
from etils import epath

from deltares.data import paths

# Dense bf16 peak FLOP/s per chip, by the exact `device_kind` jax reports (no substring
# matching: an unknown kind has no MFU). Sources of the kinds:
# - TPU: libtpu 0.0.42.1's compile-only topologies (`deltares.aot.topology_devices`) report
#   v4 "TPU v4", v5e "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite", tpu7x "TPU7x" (v4 and v5p
#   one megacore device per chip, TPU7x one device per TensorCore, two per chip). Peaks: Google
#   Cloud's TPU pages (v4 275, v5e 197, v5p 459, v6e 918, TPU7x 2307 TFLOP/s per chip).
# - NVIDIA: the CUDA device name. jax's tests/pallas/gpu_info_test.py lists "NVIDIA A100-SXM4-40GB",
#   "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (SXM) and "NVIDIA H100
#   PCIe"; XLA's GPU specs (xla/backends/gpu/target_config/specs/) name "NVIDIA H100 PCIe" and
#   "NVIDIA H200 141GB HBM3e"; "NVIDIA A100-PCIE-40GB", "NVIDIA H100 NVL", "NVIDIA H200" (what this
#   project's H200 machine reports through CUDA) and "NVIDIA H200 NVL" are the names nvidia-smi
#   prints. Peaks: NVIDIA's datasheets, dense (half the with-sparsity figure).
PEAK_FLOPS_PER_CHIP = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU7x": 2307e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989.5e12,
    "NVIDIA H100 PCIe": 756.5e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.5e12,
    "NVIDIA H200 141GB HBM3e": 989.5e12,
    "NVIDIA H200 NVL": 835.5e12,
}
DEVICES_PER_CHIP = {"TPU7x": 2}
NOMINAL_CPU_FLOPS_PER_CORE = 50e9  # float32, for a rough CPU MFU only

METRICS = "metrics.jsonl"
PARTS = "metrics.jsonl.d"  # a bucket run's parts, one object per log
TRUNCATE = "truncate_after_step"  # a part line that drops the records after a resumed step
_PART_RE = re.compile(r"^part-(\d+)\.jsonl$")
_warned_kinds: set[str] = set()


def matmul_params(model_cfg) -> int:
    D, L = model_cfg.d_model, model_cfg.n_layers
    attn = D * model_cfg.head_dim * (2 * model_cfg.n_heads + 2 * model_cfg.n_kv_heads)
    mlp = 3 * D * model_cfg.d_ff
    return L * (attn + mlp) + D * model_cfg.vocab_size


def model_flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), as in the module docstring."""
    attention = 12 * model_cfg.n_layers * model_cfg.n_heads * model_cfg.head_dim * seq_len
    return 6 * matmul_params(model_cfg) + attention


def peak_flops_of(device_kind: str) -> float | None:
    """The bf16 peak of one JAX device of `device_kind`, or None for a kind not in the table."""
    if device_kind not in PEAK_FLOPS_PER_CHIP:
        return None
    return PEAK_FLOPS_PER_CHIP[device_kind] / DEVICES_PER_CHIP.get(device_kind, 1)


def peak_flops_per_device(override_tflops: float = 0.0) -> float | None:
    """The bf16 peak of one device: `override_tflops` if set, else by exact `device_kind`
    (a nominal figure on CPU); None, with one warning per process, for an unknown kind."""
    if override_tflops:
        return override_tflops * 1e12
    device = jax.devices()[0]
    if device.platform == "cpu":
        return NOMINAL_CPU_FLOPS_PER_CORE * (os.cpu_count() or 1)
    kind = device.device_kind
    if (peak := peak_flops_of(kind)) is not None:
        return peak
    if kind not in _warned_kinds:
        _warned_kinds.add(kind)
        print(
            f"warning: no peak FLOPs known for device kind {kind!r}: mfu is null "
            "(set config.train.peak_tflops to the per-device peak)",
            file=sys.stderr,
            flush=True,
        )
    return None


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """`flops` done in `seconds` as a fraction of `peak_flops` (all devices); None where either is unknown."""
    if not peak_flops or not math.isfinite(seconds) or seconds <= 0:
        return None
    return flops / seconds / peak_flops


def strict(value):
    """`value` with every non-finite float (NaN, inf) replaced by None, in lists and dicts too:
    what `json.dumps(..., allow_nan=False)` accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def _line(record: dict) -> str:
    return json.dumps(strict(record), allow_nan=False) + "\n"


def _parts(workdir) -> list[epath.Path]:
    """The part files of `workdir`, in the order they were written."""
    directory = epath.Path(workdir) / PARTS
    if not directory.exists():
        return []
    numbered = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _PART_RE.match(p.name))]
    return [p for _, p in sorted(numbered)]


def _apply(records: list[dict], text: str) -> list[dict]:
    """`records` followed by the lines of `text`: a record whose step is not after the last one
    replaces the records from its step on (a resumed run rewriting steps), a truncation line drops
    those after its step, and lines cut short by a crash are skipped."""
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if TRUNCATE in record:
            records = [r for r in records if r["step"] <= record[TRUNCATE]]
        elif isinstance(record.get("step"), int):
            if records and records[-1]["step"] >= record["step"]:
                records = [r for r in records if r["step"] < record["step"]]
            records.append(record)
    return records


def read_metrics(workdir: str) -> list[dict]:
    """The records of `<workdir>/metrics.jsonl` followed by those of its parts (a run on a bucket
    that has not closed its writer), in step order; [] if there are none."""
    path = epath.Path(workdir) / METRICS
    records = _apply([], path.read_text()) if path.exists() else []
    for part in _parts(workdir):
        records = _apply(records, part.read_text())
    return records


class _BucketEventFile:
    """A TensorBoard event file on a bucket, through epath: each flush writes what was written
    since the last one as a new object `<path>.part-NNNNN` (bucket objects cannot be appended
    to; TensorBoard reads every event file of a directory, in name order), and close joins the
    parts into `<path>`."""

    def __init__(self, path: str):
        self.path, self.buffer, self.parts, self.lock = epath.Path(path), bytearray(), [], threading.Lock()

    def write(self, data: bytes) -> None:
        with self.lock:
            self.buffer += data

    def flush(self) -> None:
        with self.lock:
            if self.buffer:
                part = self.path.with_name(f"{self.path.name}.part-{len(self.parts):05d}")
                part.write_bytes(bytes(self.buffer))
                self.parts.append(part)
                self.buffer = bytearray()

    def close(self) -> None:
        self.flush()
        with self.lock:
            if self.parts:
                self.path.write_bytes(b"".join(p.read_bytes() for p in self.parts))
                for part in self.parts:  # oldest first: a crash here leaves a readable suffix
                    part.unlink()
                self.parts = []


class _BucketEventFiles:
    """tensorboardX writer factory for bucket URLs, so events reach buckets the way every other
    file of a run does (gcsfs) instead of through tensorboardX's own GCS client."""

    def open(self, path: str) -> _BucketEventFile:
        return _BucketEventFile(path)

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


class MetricsWriter:
    """Writes one strict-JSON object per logged step to `<workdir>/metrics.jsonl` (a bucket:
    one part per log, joined at close; see the module docstring), mirrors numbers to TensorBoard
    event files in `<workdir>/tensorboard` and passes each record to `tracker` (`log(step, record)`,
    `close()`), if any. Resuming from `resume_step` drops the records logged after it. In a job
    of several processes only process 0 writes."""

    def __init__(self, workdir: str, resume_step: int | None = None, tracker=None):
        self.active = jax.process_index() == 0
        self.tracker = tracker
        if not self.active:
            return
        self.workdir, self.remote = workdir, paths.is_remote(workdir)
        self.path = epath.Path(workdir) / METRICS
        parts = _parts(workdir)
        self.next_part = int(_PART_RE.match(parts[-1].name).group(1)) + 1 if parts else 0
        if self.remote:
            (epath.Path(workdir) / PARTS).mkdir(parents=True, exist_ok=True)
        if resume_step is not None or parts:
            self.truncate_after(resume_step)
        from tensorboardX import SummaryWriter, record_writer

        for prefix in paths.BUCKET_PREFIXES:
            record_writer.register_writer_factory(prefix, _BucketEventFiles())
        self.tb = SummaryWriter(paths.join(workdir, "tensorboard"))

    def truncate_after(self, step: int | None) -> None:
        """Drops the records of steps after `step` (None: all of them): a resumed run rewrites them, and
        a run that stops because a save failed keeps none that no checkpoint holds."""
        if not self.active:
            return
        step = 0 if step is None else step
        records = read_metrics(self.workdir)
        later = any(r["step"] > step for r in records)
        if self.remote:
            if later:  # one small object instead of rewriting what is there
                self._write_part({TRUNCATE: step})
            return
        parts = _parts(self.workdir)
        if later or parts or self.path.exists():  # local: rewritten once, so that appends follow whole lines
            kept = self.path.with_name(f"{METRICS}.{os.getpid()}.tmp")  # replaced whole: a kill cuts nothing short
            kept.write_text("".join(_line(r) for r in records if r["step"] <= step))
            os.replace(kept, self.path)
            for part in parts:
                part.unlink()

    def _write_part(self, record: dict) -> None:
        (epath.Path(self.workdir) / PARTS / f"part-{self.next_part:06d}.jsonl").write_text(_line(record))
        self.next_part += 1

    def write(self, step: int, record: dict) -> None:
        record = strict({"step": step, **record})
        if self.active:
            if self.remote:
                self._write_part(record)
            else:
                with self.path.open("a") as f:
                    f.write(_line(record))
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":  # None (unknown) is skipped
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, list):
                    for i, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            self.tb.add_scalar(f"{key}/{i:03d}", v, step)
            self.tb.flush()
        if self.tracker is not None:
            self.tracker.log(step, record)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        if not self.active:
            return
        self.tb.close()
        parts = _parts(self.workdir)
        if parts:  # join the parts once; removed oldest first, so a crash here leaves them readable
            self.path.write_text("".join(_line(r) for r in read_metrics(self.workdir)))
            for part in parts:
                part.unlink()


class Profiler:
    """A `jax.profiler` trace of the train steps `start <= step < end` (`train.profile_steps`,
    steps counted from 1) into `<workdir>/profile`: TensorBoard's profile plugin layout
    (`plugins/profile/<time>/<host>.xplane.pb`) plus a Perfetto trace (`perfetto_trace.json.gz`).
    Process 0 only, unless `all_processes` (then `<workdir>/profile/process_<i>`). A bucket
    workdir's trace is written to the local cache and copied to the bucket when it stops."""

    def __init__(self, workdir: str, steps=(), all_processes: bool = False):
        index = jax.process_index()
        self.start, self.end = tuple(steps) if steps else (0, 0)
        if not (all_processes or index == 0):
            self.start = self.end = 0
        self.target = paths.join(workdir, "profile", *([f"process_{index}"] if all_processes else []))
        self.local = self.target
        if paths.is_remote(workdir):
            key = self.target.replace("://", "/").strip("/")
            self.local = os.path.join(paths.cache_dir(), "profile", key)
        self.active = False

    def before(self, step: int) -> None:
        """Called before train step `step` runs: starts the trace at the first step in range."""
        if not self.active and self.start <= step < self.end:
            jax.profiler.start_trace(self.local, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs) -> None:
        """Called after train step `step` was dispatched: stops the trace after the last one."""
        if self.active and step + 1 >= self.end:
            self.stop(outputs)

    def stop(self, outputs=None) -> None:
        if not self.active:
            return
        jax.block_until_ready(outputs)  # the traced steps' device work ends inside the trace
        jax.profiler.stop_trace()
        self.active = False
        if self.local != self.target:
            for root, _, files in os.walk(self.local):
                for name in files:
                    source = os.path.join(root, name)
                    target = epath.Path(self.target) / os.path.relpath(source, self.local)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(open(source, "rb").read())
