"""`deltares.training.metrics` and `deltares.training.wandb_tracker`: the peak-FLOPs table against the device kinds libtpu
reports, MFU null for an unknown device, strict-JSON `metrics.jsonl`, bucket writes that cost what
they append (counted on a fake `gs://` filesystem), resume truncation with parts, W&B in offline
mode, and the trainer's profiler and W&B wiring on the `debug` experiment."""

import glob
import gzip
import importlib
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import time

import jax
import pytest

from deltares.training import metrics
from deltares import train as train_module
from deltares.training.metrics import PEAK_FLOPS_PER_CHIP, MetricsWriter, mfu, peak_flops_per_device, read_metrics
from deltares.train import TrainError, check_train_config, train
from deltares.training.wandb_tracker import TrackerError, WandbTracker, flatten, open_tracker

from event_files import event_scalars
from jax_cache import ENV, ROOT

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
needs_wandb = pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (requirements.txt)")
needs_libtpu = pytest.mark.skipif(not importlib.util.find_spec("libtpu"), reason="libtpu is not installed")


def _no_constant(name):
    raise ValueError(f"not strict JSON: {name}")


def strict_lines(path):
    """Every line of `path` parsed by a parser that rejects NaN and Infinity."""
    with open(path) as f:
        return [json.loads(line, parse_constant=_no_constant) for line in f]


def debug_config(**train_fields):
    spec = importlib.util.spec_from_file_location("debug_experiment", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config("delta_block")
    cfg.train.update(train_fields)
    return cfg



# ----------------------------------------------------------------------------- peak FLOPs and MFU


@needs_libtpu
def test_peak_table_has_the_device_kinds_libtpu_reports():
    """The TPU keys are exactly what libtpu's compile-only topologies call v4, v5e, v5p, v6e and tpu7x."""
    script = (
        "import json, os\nfrom deltares.aot import topology_devices\n"
        "for name in ['v4:2x2x1', 'v5e:2x2', 'v5p:2x2x1', 'v6e:2x2', 'tpu7x:2x2x1']:\n"
        "    os.environ.pop('TPU_ACCELERATOR_TYPE', None)\n"
        "    d = topology_devices(name)\n"
        "    chips = len({tuple(x.coords) for x in d})\n"
        "    print(json.dumps([name.split(':')[0], d[0].device_kind, len(d) // chips]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = {}
    for line in proc.stdout.splitlines():
        generation, kind, per_chip = json.loads(line)
        kinds[generation] = (kind, per_chip)
    assert kinds == {
        "v4": ("TPU v4", 1),
        "v5e": ("TPU v5 lite", 1),
        "v5p": ("TPU v5", 1),
        "v6e": ("TPU v6 lite", 1),
        "tpu7x": ("TPU7x", 2),
    }
    for kind, per_chip in kinds.values():
        assert kind in PEAK_FLOPS_PER_CHIP
        assert metrics.DEVICES_PER_CHIP.get(kind, 1) == per_chip


class FakeDevice:
    platform = "tpu"

    def __init__(self, kind):
        self.device_kind = kind


def test_peak_flops_is_an_exact_lookup_and_unknown_kinds_warn_once(monkeypatch, capsys):
    monkeypatch.setattr(metrics, "_warned_kinds", set())
    for kind, per_device in [("TPU v5", 459e12), ("TPU v5 lite", 197e12), ("TPU7x", 2307e12 / 2),
                             ("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 PCIe", 756.5e12),
                             ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H200", 989.5e12)]:
        monkeypatch.setattr(jax, "devices", lambda kind=kind: [FakeDevice(kind)])
        assert peak_flops_per_device() == per_device
    assert capsys.readouterr().err == ""
    for kind in ("TPU v5p", "NVIDIA H100", "TPU v9", "TPU v9"):  # near misses are unknown too
        monkeypatch.setattr(jax, "devices", lambda kind=kind: [FakeDevice(kind)])
        assert peak_flops_per_device() is None
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 3 and all("mfu is null" in w for w in warnings)  # one per kind per process
    assert peak_flops_per_device(override_tflops=100.0) == 100e12
    assert mfu(2e12, 2.0, None) is None and mfu(2e12, float("nan"), 1e12) is None
    assert mfu(2e12, 2.0, 4e12) == 0.25


# ----------------------------------------------------------------------------- metrics.jsonl and TensorBoard


def test_records_are_strict_json_and_unknowns_skip_tensorboard(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"loss": 2.5, "mfu": None, "step_time_s": float("nan"), "tokens_per_s": float("inf"),
                     "routing_entropy": [0.5, float("nan"), 1.5]})
    writer.write(2, {"loss": 2.0, "mfu": 0.25, "step_time_s": 0.1, "tokens_per_s": 10.0, "routing_entropy": [1.0, 2.0, 3.0]})
    writer.close()
    lines = strict_lines(tmp_path / "metrics.jsonl")
    assert lines[0] == {"step": 1, "loss": 2.5, "mfu": None, "step_time_s": None, "tokens_per_s": None,
                        "routing_entropy": [0.5, None, 1.5]}
    assert lines[1]["mfu"] == 0.25
    scalars = event_scalars(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents*")))
    assert ("mfu", 2) in scalars and ("mfu", 1) not in scalars and ("step_time_s", 1) not in scalars
    assert ("routing_entropy/001", 1) not in scalars and scalars[("routing_entropy/002", 1)] == 1.5


def test_local_resume_drops_later_records_and_appends(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        writer.write(step, {"loss": float(step)})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss"')  # cut short by a crash
    writer = MetricsWriter(str(tmp_path), resume_step=3)
    writer.write(4, {"loss": 40.0})
    writer.close()
    assert [(r["step"], r["loss"]) for r in strict_lines(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


RECORD = {"loss": 1.25, "lr": 3e-4, "mfu": None, "routing_entropy": [0.5] * 6}


def bytes_for(fake_bucket, url, logs):
    """Bytes written to the bucket by `logs` writes of RECORD (the writer opened before counting)."""
    writer = MetricsWriter(url)
    before = fake_bucket.written
    for step in range(1, logs + 1):
        writer.write(step, RECORD)
    during = fake_bucket.written - before
    writer.close()
    return during, fake_bucket.written - before


def test_bucket_writes_cost_what_they_append(fake_bucket):
    """N logs write O(N) bytes to a bucket (metrics parts, one event file per flush, one join at
    close), where rewriting whole objects at each log wrote O(N^2)."""
    short, short_total = bytes_for(fake_bucket, "gs://runs/short", 25)
    long, long_total = bytes_for(fake_bucket, "gs://runs/long", 100)
    assert 3.5 < long / short < 4.5 and 3.5 < long_total / short_total < 4.5  # quadratic would be ~16
    line = len(json.dumps({"step": 100, **RECORD}))
    assert long < 100 * (line + 2000)  # each log: its line and its own events, never what came before
    run = os.path.join(fake_bucket.root, "runs", "long")
    assert [r["step"] for r in strict_lines(os.path.join(run, "metrics.jsonl"))] == list(range(1, 101))
    assert not glob.glob(os.path.join(run, "metrics.jsonl.d", "*"))  # joined at close
    events = glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents*"))
    assert len(events) == 1 and {s for t, s in event_scalars(events) if t == "loss"} == set(range(1, 101))


def test_bucket_resume_truncates_through_parts(fake_bucket):
    """A run killed before closing leaves parts that read_metrics joins; resuming from an earlier
    checkpoint drops the later records without rewriting them; a crash while joining loses nothing."""
    url, run = "gs://runs/killed", os.path.join(fake_bucket.root, "runs", "killed")
    writer = MetricsWriter(url)
    for step in range(1, 11):
        writer.write(step, {"loss": float(step)})
    writer.tb.close()  # killed: the metrics parts are never joined
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in read_metrics(url)] == list(range(1, 11))
    scalars = event_scalars(glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents*")))
    assert {s for t, s in scalars if t == "loss"} == set(range(1, 11))

    before = fake_bucket.written
    writer = MetricsWriter(url, resume_step=6)
    assert fake_bucket.written - before < 100  # one truncation line, nothing rewritten
    assert [r["step"] for r in read_metrics(url)] == list(range(1, 7))
    for step in range(7, 13):
        writer.write(step, {"loss": 100.0 + step})
    want = [(s, float(s)) for s in range(1, 7)] + [(s, 100.0 + s) for s in range(7, 13)]
    assert [(r["step"], r["loss"]) for r in read_metrics(url)] == want

    # A crash after the join was written but before the parts were removed: the parts replay onto it.
    parts = sorted(glob.glob(os.path.join(run, "metrics.jsonl.d", "part-*.jsonl")))
    saved = {p: open(p).read() for p in parts}
    writer.close()
    assert [(r["step"], r["loss"]) for r in strict_lines(os.path.join(run, "metrics.jsonl"))] == want
    for path, text in list(saved.items())[len(saved) // 2 :]:  # the later half left behind
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write(text)
    assert [(r["step"], r["loss"]) for r in read_metrics(url)] == want


# ----------------------------------------------------------------------------- Weights & Biases


def read_wandb_run(directory):
    """The protobuf records of the offline run file `run-<id>.wandb` in `directory`, parsed with W&B's
    own record schema (its files are LevelDB-style logs: a 7-byte ':W&B' header, then 32 KiB blocks of
    chunks, each with a 7-byte header of CRC, length and kind)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(directory, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, i, chunks, records = 32768, 7, b"", []
    while i + 7 <= len(data):
        left = block - i % block
        if left < 7:
            i += left
            continue
        _, length, kind = struct.unpack("<IHB", data[i : i + 7])
        if i + 7 + length > len(data):  # still being written
            break
        if kind == 0 and length == 0:  # padding to the end of the block
            i += left
            continue
        chunks += data[i + 7 : i + 7 + length]
        i += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_history(directory):
    """[(step, {key: value})] logged in the offline run in `directory`, and its config (or None).
    W&B's service may still be writing the file when `finish()` returns: read until its exit record."""
    deadline = time.monotonic() + 60
    records = read_wandb_run(directory)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"no exit record in {directory}"
        time.sleep(0.2)
        records = read_wandb_run(directory)
    history, config = [], None
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
        elif kind == "run" and record.run.config.update:
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"} or None
    return history, config


def offline_runs(workdir):
    return sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*")))


def offline_run_id(run_dir):
    """The run id in `offline-run-<date>_<time>-<id>[-<n>]` (W&B adds -<n> when a directory of the
    same second and id exists, as a resumed run started within the second does)."""
    return re.fullmatch(r"offline-run-\d+_\d+-(\w+?)(?:-\d+)?", os.path.basename(run_dir)).group(1)


class Settings(dict):
    __getattr__ = dict.get


@needs_wandb
def test_wandb_offline_logs_the_records_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = str(tmp_path)
    settings = Settings(project="deltares-test", mode="offline")
    tracker = open_tracker(settings, workdir, {"seed": 3, "train": {"steps": 4}})
    records = [{"loss": 2.0, "mfu": None, "routing_entropy": [0.5, 0.25]}, {"loss": 1.5, "mfu": 0.1, "routing_entropy": [0.4, 0.2]}]
    for step, record in enumerate(records, 1):
        tracker.log(step, {"step": step, **record})
    tracker.close()
    run_id = open(tmp_path / "wandb_run_id").read().strip()
    (first,) = offline_runs(workdir)
    assert offline_run_id(first) == run_id
    history, config = wandb_history(first)
    assert history == [(1, {"loss": 2.0, "mfu": None, "routing_entropy/000": 0.5, "routing_entropy/001": 0.25}),
                       (2, {"loss": 1.5, "mfu": 0.1, "routing_entropy/000": 0.4, "routing_entropy/001": 0.2})]
    assert config == {"seed": 3, "train": {"steps": 4}}

    tracker = WandbTracker(settings, workdir, {"seed": 3, "train": {"steps": 4}})  # a resumed run
    tracker.log(3, {"step": 3, "loss": 1.0})
    tracker.close()
    second = [r for r in offline_runs(workdir) if r != first]
    assert len(second) == 1 and offline_run_id(second[0]) == run_id  # the same W&B run
    history, config = wandb_history(second[0])
    assert history == [(3, {"loss": 1.0})] and config is None  # the config is logged once


def test_wandb_is_off_by_default_and_a_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    cfg = debug_config()
    assert cfg.train.wandb.project == "" and open_tracker(cfg.train.wandb, str(tmp_path), {}) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(TrackerError, match=r"wandb is not installed: pip install wandb==0\.31\.0"):
        open_tracker(Settings(project="p"), str(tmp_path), {})
    assert flatten({"step": 1, "a": [1, 2], "b": None}) == {"a/000": 1, "a/001": 2, "b": None}


# ----------------------------------------------------------------------------- the trainer


@pytest.mark.parametrize("steps", [(3, 3), (0, 4), (4,), (1.0, 3), (2, 4, 6)])
def test_bad_profile_steps_are_rejected(steps):
    cfg = debug_config()
    cfg.train.profile_steps = steps
    with pytest.raises(TrainError, match="config.train.profile_steps"):
        check_train_config(cfg)


def test_trainer_profiles_and_logs_strict_json_and_wandb(tmp_path, monkeypatch):
    """The debug experiment with `profile_steps=(3, 5)`, W&B offline and a device of unknown peak:
    the trace of steps 3-4 is in `<workdir>/profile` (TensorBoard's layout, and Perfetto's) and holds
    the train step; metrics.jsonl is strict JSON with `mfu: null`; W&B got the same records."""
    monkeypatch.setattr(train_module, "peak_flops_per_device", lambda override: None)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = debug_config(profile_steps=(3, 5))
    cfg.data.dataset = "builtin"
    if HAVE_WANDB:
        cfg.train.wandb.project = "deltares-test"
    result = train(cfg, str(tmp_path))
    assert result["step"] == cfg.train.steps

    records = strict_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(5, 31, 5))
    assert all(r["mfu"] is None and r["loss"] > 0 for r in records)
    scalars = event_scalars(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents*")))
    assert ("loss", 30) in scalars and not any(tag == "mfu" for tag, _ in scalars)

    (session,) = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*"))
    assert glob.glob(os.path.join(session, "*.xplane.pb"))
    with gzip.open(os.path.join(session, "perfetto_trace.json.gz")) as f:
        events = json.load(f)["traceEvents"]
    calls, end = 0, -1.0  # outermost spans of the jitted train step (its dispatch nests one more)
    for e in sorted((e for e in events if e.get("name") == "PjitFunction(train_step)"), key=lambda e: e["ts"]):
        calls, end = (calls + 1, e["ts"] + e["dur"]) if e["ts"] > end else (calls, max(end, e["ts"] + e["dur"]))
    assert calls == 2  # steps 3 and 4, not the others

    if HAVE_WANDB:
        (run,) = offline_runs(str(tmp_path))
        history, config = wandb_history(run)
        assert [step for step, _ in history] == [r["step"] for r in records]
        assert history[-1][1] == flatten(records[-1])
        assert config["train"]["profile_steps"] == [3, 5] and config["model"]["d_model"] == cfg.model.d_model


def test_profile_of_a_bucket_run_is_copied_to_the_bucket(fake_bucket):
    """The trace is written locally (jax's profiler cannot write to gs://) and copied to the bucket."""
    step_fn = jax.jit(lambda x: x * 2.0)
    x = step_fn(jax.numpy.ones(4))
    profiler = metrics.Profiler("gs://runs/profiled", steps=(2, 3))
    for step in range(1, 5):
        profiler.before(step)
        assert profiler.active == (step == 2)  # steps 2 <= step < 3
        x = step_fn(x)
        profiler.after(step, x)
        assert not profiler.active
    copied = glob.glob(os.path.join(fake_bucket.root, "runs", "profiled", "profile", "plugins", "profile", "*", "*"))
    assert {os.path.basename(p) for p in copied} >= {"perfetto_trace.json.gz"} and any(p.endswith(".xplane.pb") for p in copied)
