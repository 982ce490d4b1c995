"""Faults a careful user causes, each ending in one `error:` line or a clean recovery, never a traceback
or lost work: damaged checkpoints (fallback to the newest usable step, the damaged one moved aside,
never deleted), config.train.resume_step, checkpoint writes that fail in the background, run
directories that cannot hold a run, token data the model cannot read, and a table of bad command
lines. The one-trainer-per-workdir lock is tested in tests/test_workdir.py and, with real trainers,
in tests/test_train.py's resume tests. `python tests/faults.py` runs every fault as a benchmark table.
"""

import json
import os
import random
import resource
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from debug_runs import (
    RESUME_OVERRIDES, STEPS, assert_clean_error, assert_each_fails_cleanly, checkpoint_steps, config_with, describe,
    module_cmd, read_metrics, run, train_cmd, tree_digest,
)
from deltares.data.dataset import TokenData
from deltares.data.documents import DataError
from deltares.eval import evaluate_checkpoint
from deltares.train import TrainError, train
from deltares.training.checkpoint import CheckpointError, _cause, load_checkpoint
from jax_cache import ENV, ROOT


# ----------------------------------------------------------------------------- damage to a checkpoint


def largest_data_file(step_dir):
    files = []
    for dirpath, _, names in os.walk(os.path.join(step_dir, "state")):
        files += [os.path.join(dirpath, n) for n in names if "/d/" in os.path.join(dirpath, n) + "/"]
    return max(files, key=os.path.getsize)


def truncate_array_file(step_dir):
    path = largest_data_file(step_dir)
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGE = {  # what the issue lists: each gave a 160-line traceback and blocked every later run
    "truncated_array_file": (truncate_array_file, "cut short"),
    "missing_METADATA": (lambda d: os.remove(os.path.join(d, "state", "_METADATA")), "state/_METADATA is missing"),
    "missing_state": (lambda d: shutil.rmtree(os.path.join(d, "state")), "state/ is missing"),
    "empty_config": (lambda d: open(os.path.join(d, "config", "metadata"), "w").close(), "config/metadata is not"),
    # orbax reads it with the metadata; garbled, it hid every parameter (a TypeError in eval)
    "garbled_sharding": (lambda d: open(os.path.join(d, "state", "_sharding"), "wb").write(b"\x93garbled"),
                         "state/_sharding is not readable JSON"),
}


@pytest.fixture
def finished(reference, tmp_path):
    """A copy of the finished reference run (checkpoints 24, 28, 30)."""
    workdir = str(tmp_path / "run")
    shutil.copytree(reference["workdir"], workdir)
    assert checkpoint_steps(workdir) == [24, 28, 30]
    return workdir


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_step_is_moved_aside_and_the_run_resumes_from_the_previous(
        damage, finished, builtin_dataset, reference, capsys):
    hurt, reason = DAMAGE[damage]
    step30 = os.path.join(finished, "checkpoints", "30")
    hurt(step30)
    damaged = tree_digest(step30)
    result = train(config_with(builtin_dataset, **RESUME_OVERRIDES), finished)
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if line.startswith("warning: skipped checkpoint step 30")]
    assert len(skipped) == 1 and reason in skipped[0] and "checkpoints_aside" in skipped[0], err
    assert f"resumed {finished} from step 28" in err
    aside = os.path.join(finished, "checkpoints_aside", "30")
    assert reason in open(os.path.join(aside, "REASON")).read()
    assert {k: v for k, v in tree_digest(aside).items() if k != "REASON"} == damaged  # moved, not changed or deleted
    assert checkpoint_steps(finished) == [24, 28, 30] and result["step"] == STEPS
    records = read_metrics(finished)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {r["step"]: r["loss"] for r in records} == reference["loss"]  # steps 29, 30 retrained identically
    assert not os.path.exists(os.path.join(finished, "LOCK"))
    train(config_with(builtin_dataset, **RESUME_OVERRIDES), finished)  # the next run is not held up by it
    assert "warning" not in capsys.readouterr().err


def test_readers_skip_a_damaged_step_and_change_nothing(finished, builtin_dataset, capsys):
    truncate_array_file(os.path.join(finished, "checkpoints", "30"))
    before = tree_digest(finished)
    loaded = load_checkpoint(finished)
    assert loaded.step == 28
    assert "warning: skipped checkpoint step 30" in capsys.readouterr().err
    assert evaluate_checkpoint(finished, str(builtin_dataset), batch=4, max_batches=1)["step"] == 28
    from deltares.interop.inference import load_model

    assert load_model(finished).step == 28
    with pytest.raises(CheckpointError, match="checkpoint step .*30 is damaged: data file"):
        load_checkpoint(os.path.join(finished, "checkpoints", "30"))  # named by hand: no fallback
    assert tree_digest(finished) == before


def test_damaged_only_step_is_a_clear_error_and_nothing_moves(finished, builtin_dataset):
    for step in (24, 28):
        shutil.rmtree(os.path.join(finished, "checkpoints", str(step)))
    os.remove(os.path.join(finished, "checkpoints", "30", "state", "_METADATA"))
    before = tree_digest(finished)
    with pytest.raises(TrainError, match=r"no usable checkpoint .*step 30: state/_METADATA is missing.*nothing was "
                                         r"moved or deleted"):
        train(config_with(builtin_dataset, **RESUME_OVERRIDES), finished)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_checkpoint(finished)
    assert tree_digest(finished) == before


def test_resume_step_picks_a_step_and_sets_the_newer_ones_aside(finished, builtin_dataset, reference, capsys):
    cfg = config_with(builtin_dataset, **RESUME_OVERRIDES)
    cfg.train.resume_step = 5
    with pytest.raises(TrainError, match="resume_step=5: .* has no step 5 .*24, 28, 30"):
        train(cfg, finished)
    cfg.train.resume_step = 24
    result = train(cfg, finished)
    assert f"resumed {finished} from step 24" in capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(finished, "checkpoints_aside"))) == ["28", "30"]
    assert result["step"] == STEPS and checkpoint_steps(finished) == [24, 28, 30]
    records = read_metrics(finished)
    assert {r["step"]: r["loss"] for r in records} == reference["loss"]


# ----------------------------------------------------------------------------- writes that fail


@pytest.mark.parametrize("message", [
    "INTERNAL: Error writing local file \"/r/d/0\": File too large [os_error_code='27'] [source_locations='a.cc:1']",
    "INTERNAL: Error writing [tensorstore_spec='{\"create\":true}'] [os_error_code='27'] [source_locations='a.cc:1']",
])
def test_storage_failure_is_the_operating_systems_words(message):
    """tensorstore's payloads come in either order (the second, under load in CI, once gave "(true}']
    (errno 27))"): the cause is the errno's own words."""
    assert _cause(RuntimeError(message)) == "File too large (errno 27)"
    assert _cause(OSError("disk quota")) == "OSError: disk quota"


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the subprocess's resource limit is set after fork
def test_background_save_failure_stops_the_run_with_one_line(tmp_path, builtin_dataset, reference):
    """Every file written is capped at 100 KB (RLIMIT_FSIZE), so the first checkpoint's arrays cannot be
    written: orbax fails in its background thread; the trainer reports it as one line, keeps no metrics
    record that no checkpoint holds, and a later run (without the cap) trains from scratch identically."""
    workdir = tmp_path / "run"
    cap = 100_000

    def capped():
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

    cmd = train_cmd(workdir, f"--config.data.dataset={builtin_dataset}",
                    *(f"--config.train.{k}={v}" for k, v in RESUME_OVERRIDES.items()))
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240, preexec_fn=capped)
    line = assert_clean_error(proc, "saving step 4 failed (File too large", "no checkpoint was saved before it")
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, line
    assert checkpoint_steps(str(workdir)) == [] and read_metrics(str(workdir)) == []
    assert not (workdir / "LOCK").exists()
    train(config_with(builtin_dataset, **RESUME_OVERRIDES), str(workdir))
    assert {r["step"]: r["loss"] for r in read_metrics(str(workdir))} == reference["loss"]


BUCKET_DOWN = "reading the dataset failed: gs://bucket/data/train-00003.bin: 503 Service Unavailable"


def before_batch(monkeypatch, at: int, action) -> None:
    """Runs `action` as the training pipeline reads the batch of step `at` (the validation batches are
    read first, then the pipeline's in order: one thread)."""
    from deltares.data.dataset import Windows

    read, calls = Windows.batch, []

    def batch(self, indices):
        calls.append(1)
        if len(calls) == 1 + at:
            action()
        return read(self, indices)

    monkeypatch.setattr(Windows, "batch", batch)


def bucket_down():
    raise DataError(BUCKET_DOWN)


@pytest.mark.parametrize("fail_at", [7, 1])
def test_a_data_read_that_fails_saves_the_step_the_run_stands_at_and_it_resumes_exactly(
        fail_at, tmp_path, builtin_dataset, reference, monkeypatch):
    """The read of step `fail_at`'s batch fails inside the data pipeline (as a bucket's read does): the
    run saves the step it stands at (6, between the saves of 4 and 8; none before the first step) and
    stops with one line; the same command then reads that batch and trains on to the reference's losses."""
    before_batch(monkeypatch, fail_at, bucket_down)
    workdir = str(tmp_path / "run")
    cfg = config_with(builtin_dataset, **RESUME_OVERRIDES)
    with pytest.raises(TrainError) as err:
        train(cfg, workdir)
    kept = (f"Saved step {fail_at - 1} to {workdir}/checkpoints; rerun the same command to resume" if fail_at > 1
            else f"No checkpoint was saved yet in {workdir}/checkpoints")
    assert str(err.value) == f"reading the training data for step {fail_at} failed (DataError: {BUCKET_DOWN}). {kept}"
    if fail_at > 1:
        assert checkpoint_steps(workdir) == [4, fail_at - 1]
        assert [r["step"] for r in read_metrics(workdir)] == list(range(1, fail_at))
    else:  # nothing was trained: no checkpoint, no metrics
        assert checkpoint_steps(workdir) == [] and not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    monkeypatch.undo()
    train(cfg, workdir)
    assert {r["step"]: r["loss"] for r in read_metrics(workdir)} == reference["loss"]


def test_a_token_file_cut_short_while_the_run_reads_it_stops_the_run_with_its_step_saved(
        tmp_path, builtin_dataset, monkeypatch):
    """The training split's files are cut to nothing as step 5's batch is read (read through a memory
    map, this ended the process with SIGBUS): one line naming the file, step 4 saved."""
    dataset = str(tmp_path / "data")
    shutil.copytree(builtin_dataset, dataset)
    train_files = [os.path.join(dataset, name + ".bin") for name, _ in TokenData(dataset).meta["splits"]["train"]["shards"]]

    def cut():
        for path in train_files:
            os.truncate(path, 0)

    before_batch(monkeypatch, 5, cut)
    workdir = str(tmp_path / "run")
    with pytest.raises(TrainError) as err:
        train(config_with(dataset, **{**RESUME_OVERRIDES, "checkpoint_every": 3}), workdir)
    assert str(err.value).startswith("reading the training data for step 5 failed (DataError: ")
    assert "is cut short (changed while it was read?)" in str(err.value) and str(err.value).endswith(
        f"Saved step 4 to {workdir}/checkpoints; rerun the same command to resume"), err.value
    assert any(path in str(err.value) for path in train_files), err.value
    assert checkpoint_steps(workdir) == [3, 4]


def vanished(*args, **kwargs):
    raise FileNotFoundError(2, "No such file or directory", "checkpoints/12")


def test_only_process_0_reads_or_removes_the_steps_no_longer_kept(tmp_path, monkeypatch):
    """With several processes, process 0 removes the old steps after a save; another process that listed
    the step folders then saw one vanish under its read (FileNotFoundError in CI's two-node SLURM job:
    that process stopped alone and the other waited in the next collective until jax's shutdown timeout).
    Here every listing fails so: the poll of another process reads nothing, removes nothing, and succeeds."""
    import jax
    import orbax.checkpoint as ocp
    from deltares.training.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path), keep_last=1)
    monkeypatch.setattr(ocp.utils, "checkpoint_steps", vanished)
    monkeypatch.setattr(ckpt.manager, "reload", vanished)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    ckpt.pending = 12  # a save of step 12 that ended well on this process
    ckpt.poll()
    assert ckpt.durable == 12 and not ckpt.failed


def test_any_failure_while_checking_the_checkpoints_is_a_reason_every_process_can_agree_on(tmp_path):
    """What a check of the storage raises becomes the reason the run stops (shared with the other
    processes), not an exception that ends this process alone."""
    from deltares.train import _save_problem, _storage_problem
    from deltares.training.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path))
    ckpt.poll = ckpt.wait = vanished
    reason = (f"checking the checkpoints in {tmp_path}/checkpoints failed "
              "(FileNotFoundError: [Errno 2] No such file or directory: 'checkpoints/12')")
    assert _storage_problem(ckpt, None, every_process=True) == reason
    assert _save_problem(ckpt, wait=True) == reason


@pytest.mark.parametrize("name,kind", [("checkpoints", "file"), ("metrics.jsonl", "dir")])
def test_run_directory_of_the_wrong_shape_is_refused_before_compiling(tmp_path, builtin_dataset, name, kind,
                                                                       monkeypatch):
    import deltares.train as train_module

    def never(*args):
        raise AssertionError("the train step was built before the run directory was checked")

    monkeypatch.setattr(train_module, "sharded_train_step", never)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / name).mkdir() if kind == "dir" else (workdir / name).write_text("x")
    before = tree_digest(workdir)
    with pytest.raises(TrainError, match=f"{name} is a {'folder' if kind == 'dir' else 'file'} where the run keeps"):
        train(config_with(builtin_dataset), str(workdir))
    assert tree_digest(workdir) == before and sorted(os.listdir(workdir)) == [name]


def read_only_command(directory, cmd):
    """`cmd` in a process that sees `directory` read-only (a read-only bind mount in a mount namespace of
    its own when run as root, where permissions do not stop writes; else the directory's mode)."""
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        return cmd
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("root without mount namespaces: no way to make a directory read-only")
    script = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, str(directory), *cmd]


def test_read_only_run_directory_is_refused_before_compiling(finished, builtin_dataset):
    before = tree_digest(finished)
    cmd = read_only_command(finished, train_cmd(finished, f"--config.data.dataset={builtin_dataset}"))
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    os.chmod(finished, 0o755)
    assert_clean_error(proc, "cannot write to", finished)
    assert "train:" not in proc.stderr  # no progress bar: nothing was compiled or run
    assert tree_digest(finished) == before


# ----------------------------------------------------------------------------- token data


def copy_dataset(dataset, tmp_path, name="data"):
    out = tmp_path / name
    shutil.copytree(dataset, out)
    return out


def edit_meta(dataset, **changes):
    meta = json.loads((dataset / "meta.json").read_text())
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    (dataset / "meta.json").write_text(json.dumps(meta))


def shard(dataset, split):
    """The token file of a split of a one-unit dataset (the built-in corpus is one unit)."""
    return dataset / split / "00000.bin"


def shrink_train(dataset, n_tokens):
    """Other data under the same path: the training split `n_tokens` shorter, meta.json saying so."""
    meta = json.loads((dataset / "meta.json").read_text())
    os.truncate(shard(dataset, "train"), os.path.getsize(shard(dataset, "train")) - 2 * n_tokens)
    meta["splits"]["train"]["tokens"] -= n_tokens
    meta["splits"]["train"]["shards"][0][1] -= n_tokens
    edit_meta(dataset, splits=meta["splits"])


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, builtin_dataset, monkeypatch):
    data = copy_dataset(builtin_dataset, tmp_path)
    assert json.loads((data / "meta.json").read_text())["max_token_id"] == 256  # bytes and end-of-text
    edit_meta(data, max_token_id=300)
    with pytest.raises(DataError, match=f"{data} holds token id 300, outside the model's vocabulary of 257"):
        train(config_with(data), str(tmp_path / "run"))
    # A dataset whose meta.json does not say (written before it recorded the largest id), holding such ids:
    # the train step reports the largest id of every batch, and the run stops at the first log.
    edit_meta(data, max_token_id=None)
    tokens = np.memmap(shard(data, "train"), dtype=np.uint16, mode="r+")
    tokens[::50] = 400
    tokens.flush()
    with pytest.raises(TrainError, match=rf"{data} holds token id 400 \(in the batch of step 1\), outside the "
                                         r"model's vocabulary of 257.*\. No checkpoint was saved yet"):
        train(config_with(data, log_every=2, checkpoint_every=2), str(tmp_path / "run2"))
    assert checkpoint_steps(str(tmp_path / "run2")) == []


def test_eval_refuses_ids_outside_the_vocabulary_and_never_reports_nan(tmp_path, builtin_dataset, reference):
    data = copy_dataset(builtin_dataset, tmp_path)
    edit_meta(data, max_token_id=None)
    tokens = np.memmap(shard(data, "val"), dtype=np.uint16, mode="r+")
    tokens[7] = 999
    tokens.flush()
    with pytest.raises(DataError, match=r"\(its validation split\) holds token id 999, outside the model's "
                                        r"vocabulary of 257"):
        evaluate_checkpoint(reference["workdir"], str(data))


def test_truncated_split_names_its_file(tmp_path, builtin_dataset):
    data = copy_dataset(builtin_dataset, tmp_path)
    with open(shard(data, "train"), "ab") as f:
        f.write(b"\x01")  # an odd number of bytes of uint16 tokens
    with pytest.raises(DataError, match=r"train/00000.bin is cut short or not this dataset's"):
        TokenData(str(data)).tokens("train")
    os.truncate(shard(data, "val"), os.path.getsize(shard(data, "val")) - 2)  # whole tokens, fewer than recorded
    with pytest.raises(DataError, match=r"val/00000.bin is cut short"):
        TokenData(str(data)).tokens("val")


def test_another_tokenizer_of_the_same_size_is_refused(finished, builtin_dataset, tmp_path):
    """The run was trained on the bytes tokenizer; a dataset whose tokenizer differs but has the same
    vocabulary size (here: recorded under another fingerprint) must not resume it or be scored by it:
    not by eval, nor analyze, whether named (`--data DIR`), the run's own (no `--data`), or the tokenizer
    of text (`--data FILE`, tokenized with the run's own dataset's tokenizer)."""
    from deltares.analyze import held_out_tokens, load_run
    from deltares.data.dataset import data_units

    text = tmp_path / "text.txt"
    text.write_text("Call me Ishmael.\n\nSome years ago.\n")
    analyzed = load_run(finished)
    data = copy_dataset(builtin_dataset, tmp_path)
    edit_meta(data, tokenizer_sha256="0" * 64)
    before = tree_digest(finished)
    cfg = config_with(data, **RESUME_OVERRIDES)
    cfg.data.dataset = str(builtin_dataset)  # the same path as the run's, other data under it
    shutil.move(str(builtin_dataset), str(tmp_path / "kept"))
    try:
        shutil.copytree(data, builtin_dataset)
        with pytest.raises(TrainError, match="differs in the tokenizer of the dataset"):
            train(cfg, finished)
        for refused in (lambda: evaluate_checkpoint(finished, str(builtin_dataset)),
                        lambda: evaluate_checkpoint(finished, str(text)),
                        lambda: held_out_tokens(analyzed, str(builtin_dataset)),
                        lambda: held_out_tokens(analyzed, None),
                        lambda: held_out_tokens(analyzed, str(text), data_units(str(text)))):
            with pytest.raises(DataError, match="another tokenizer than the one step 30 was trained with"):
                refused()
        edit_meta(builtin_dataset, tokenizer_sha256=None)  # same tokenizer, other token counts: other data
        shrink_train(builtin_dataset, 100)
        with pytest.raises(TrainError, match="differs in the data under data.dataset"):
            train(cfg, finished)
    finally:
        shutil.rmtree(builtin_dataset)
        shutil.move(str(tmp_path / "kept"), str(builtin_dataset))
    assert tree_digest(finished) == before


# ----------------------------------------------------------------------------- bad command lines


def hf_export_without(tmp_path, field):
    from conftest import TINY_HF

    out = tmp_path / f"no_{field}"
    shutil.copytree(TINY_HF, out)
    config = json.loads((out / "config.json").read_text())
    del config[field]
    (out / "config.json").write_text(json.dumps(config))
    return out


def bad_commands(tmp_path, finished, builtin_dataset):
    """(name, command, words the error line must hold, extra environment)."""
    debug = os.path.join(ROOT, "experiments", "debug.py")
    new = tmp_path / "new_run"
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    no_heads = hf_export_without(tmp_path, "num_attention_heads")
    only_step = tmp_path / "only_step"
    shutil.copytree(finished, only_step)
    for step in (24, 28):
        shutil.rmtree(only_step / "checkpoints" / str(step))
    truncate_array_file(str(only_step / "checkpoints" / "30"))
    dataset_link = tmp_path / "dataset_link"
    os.symlink(builtin_dataset, dataset_link)
    two_devices = {"XLA_FLAGS": (ENV.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()}
    train_new = ["deltares.train", "--config", debug, "--workdir", str(new), f"--config.data.dataset={builtin_dataset}"]
    return [
        ("unknown field", [*train_new, "--config.train.nonexistent_field=3"],
         ["--config.train.nonexistent_field", "no such config field"], {}),
        ("unknown section", [*train_new, "--config.trian.steps=3"], ["did you mean --config.train.steps"], {}),
        ("value of the wrong type", [*train_new, "--config.train.steps=abc"], ["--config.train.steps=abc"], {}),
        ("missing experiment file", ["deltares.train", "--config", "experiments/nope.py", "--workdir", str(new)],
         ["nope.py"], {}),
        ("unknown residual mode", ["deltares.train", "--config", debug + ":deltaa", "--workdir", str(new)],
         ["unknown residual mode 'deltaa'"], {}),
        ("no workdir", ["deltares.train", "--config", debug], ["--workdir"], {}),
        ("workdir is a file", ["deltares.train", "--config", debug, "--workdir", str(a_file)], ["is a file"], {}),
        ("workdir holds a dataset", ["deltares.train", "--config", debug, "--workdir", str(builtin_dataset),
                                     f"--config.data.dataset={builtin_dataset}"], ["holds a dataset, not a run"], {}),
        ("batch does not split over the devices", [*train_new, "--config.train.global_batch=3",
                                                   "--config.mesh.fsdp=2"],
         ["global_batch=3 does not split over data x fsdp = 2"], two_devices),
        ("resume_step that does not exist", ["deltares.train", "--config", debug, "--workdir", str(finished),
                                             f"--config.data.dataset={builtin_dataset}",
                                             "--config.train.resume_step=7"],
         ["resume_step=7", "has no step 7"], {}),
        ("only checkpoint damaged (train)", ["deltares.train", "--config", debug, "--workdir", str(only_step),
                                             f"--config.data.dataset={builtin_dataset}"],
         ["no usable checkpoint", "cut short", "nothing was moved"], {}),
        ("only checkpoint damaged (eval)", ["deltares.eval", "--checkpoint", str(only_step), "--data",
                                            str(builtin_dataset)], ["no usable checkpoint"], {}),
        ("eval without --data", ["deltares.eval", "--checkpoint", str(finished)], ["--data"], {}),
        ("eval of no checkpoint", ["deltares.eval", "--checkpoint", str(tmp_path / "none"), "--data",
                                   str(builtin_dataset)], ["no checkpoint"], {}),
        ("convert: export lacks a field", ["deltares.convert", "--hf", str(no_heads), "--out", str(tmp_path / "out")],
         ["num_attention_heads missing"], {}),
        ("generate: export lacks a field", ["deltares.generate", "--checkpoint", str(no_heads), "--prompt", "hi"],
         ["num_attention_heads missing"], {}),
        ("prepare without --out", ["deltares.data.prepare", "--source", "builtin"], ["--out"], {}),
        ("prepare of a glob the shell expanded", ["deltares.data.prepare", "--source", "a.parquet", "b.parquet",
                                                  "--tokenizer", "bytes", "--out", str(tmp_path / "expanded")],
         ["unexpected arguments b.parquet", "quote a glob"], {}),
        ("prepare into a run", ["deltares.data.prepare", "--source", "builtin", "--tokenizer", "bytes", "--out",
                                str(finished)], ["holds a run", "--overwrite"], {}),
        ("prepare: a glob in a list that matches nothing", ["deltares.data.prepare", "--source",
                                                            f"{a_file},{tmp_path}/nothing*.txt", "--tokenizer", "bytes",
                                                            "--out", str(tmp_path / "listed")],
         ["--source", "nothing*.txt' matches no file"], {}),
        ("mixture: a dataset named twice (through a symlink)",
         [*train_new[:-1], f"--config.data.mixture={builtin_dataset}=1,{dataset_link}=1"],
         ["config.data.mixture names", "dataset_link", "name each once"], {}),
    ]


def test_bad_command_lines_fail_with_one_line_and_change_nothing(tmp_path, finished, builtin_dataset):
    cases = bad_commands(tmp_path, finished, builtin_dataset)
    before = tree_digest(tmp_path)
    assert_each_fails_cleanly(cases)
    assert tree_digest(tmp_path) == before  # nothing written or changed (no new run directory either)
    assert not (tmp_path / "new_run").exists()


def test_prompt_longer_than_the_context_is_cut_with_a_warning(reference):
    long_prompt = "Call me Ishmael. " * 20  # 340 byte tokens; the debug model was trained on 32
    proc = run(module_cmd("deltares.generate", "--checkpoint", reference["workdir"], "--prompt", long_prompt,
                          "--max_new_tokens", "4", "--temperature", "0"))
    assert proc.returncode == 0, describe(proc)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: prompt 0 has 340 tokens, more than the model's context of 32 (its training "
                        "sequence length): only its last 32 are used"], proc.stderr
    assert proc.stdout.startswith(long_prompt)


# ----------------------------------------------------------------------------- the run directory taken away


def tree(root):
    """{relative path: sha256 of a file, or "dir"} of everything under `root`: files and folders."""
    out = {os.path.relpath(os.path.join(d, n), root): "dir" for d, dirs, _ in os.walk(root) for n in dirs}
    return {**out, **tree_digest(root)}


def take_away(how, workdir, other, tmp_path):
    """Takes the run directory `workdir` away from its path `how`, and puts the run `other` there (but for
    "moved"). Returns where the run is now (None: deleted) and the path whose content must stay `other`'s."""
    if how == "moved":
        os.rename(workdir, tmp_path / "moved")
        return tmp_path / "moved", None
    if how == "deleted":
        while workdir.exists():  # the trainer may be writing into it meanwhile
            shutil.rmtree(workdir, ignore_errors=True)
        os.rename(other, workdir)
        return None, workdir
    if how == "replaced by another run":
        os.rename(workdir, tmp_path / "moved")
        os.rename(other, workdir)
        return tmp_path / "moved", workdir
    os.symlink(other.parent, tmp_path / "link.new")  # a link on the path repointed: link/run is the other run
    os.replace(tmp_path / "link.new", tmp_path / "link")
    return tmp_path / "A" / "run", workdir


TAKEN_AWAY = {"moved": "was moved to", "deleted": "was deleted during the run",
              "replaced by another run": "was moved to", "link repointed": "no longer leads to the run directory"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a failed save's writes, collected
@pytest.mark.parametrize("how", TAKEN_AWAY)
def test_a_run_directory_taken_away_at_a_random_moment_gets_nothing_more(how, tmp_path, builtin_dataset, reference,
                                                                         capsys):
    """Moved, deleted, replaced by another run, or a link on its path repointed while the trainer writes
    (a save in flight or not, at a moment drawn at random: after 0 to 5 logged steps and up to a step more;
    twice): the trainer stops with one line naming what happened, and writes nothing at the old path: the
    run put there is the same byte for byte, with no folder added (a temporary checkpoint folder). Where
    the run went it is whole: no temporary folder, no metrics record after its newest checkpoint. (Moved, a
    rerun there resumes: the first class.)"""
    seed = int(os.environ.get("DELTARES_TEST_SEED", time.time_ns() % 10**6))
    rng = random.Random(f"{how}-{seed}")
    for attempt in range(2):
        root = tmp_path / str(attempt)
        (root / "A").mkdir(parents=True)
        os.symlink(root / "A", root / "link")
        workdir = (root / "link" / "run") if how == "link repointed" else (root / "run")
        other = root / ("B" if how == "link repointed" else "other") / "run"
        shutil.copytree(reference["workdir"], other)
        before = tree(other)
        logged, pause = rng.randint(0, 5), rng.uniform(0, 0.05)
        moment = f"{how}, seed {seed}, attempt {attempt}: after {logged} logged steps and {pause:.3f} s"
        outcome = {}

        def act():
            try:
                metrics = workdir / "metrics.jsonl"
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (workdir / "LOCK").exists():
                    time.sleep(0.001)
                while time.monotonic() < deadline and logged and (
                        not metrics.exists() or metrics.read_text().count("\n") < logged):
                    time.sleep(0.001)
                time.sleep(pause)
                outcome["where"], outcome["kept"] = take_away(how, workdir, other, root)
            except BaseException as err:  # noqa: BLE001 - reported by the test
                outcome["error"] = err

        thread = threading.Thread(target=act)
        thread.start()
        cfg = config_with(builtin_dataset, steps=400, log_every=1, checkpoint_every=1, eval_every=1000, stats_every=0)
        try:
            with pytest.raises(TrainError) as err:
                train(cfg, str(workdir))
        finally:
            thread.join()
        assert "error" not in outcome, (moment, outcome)
        message = str(err.value)
        assert TAKEN_AWAY[how] in message and "\n" not in message, (moment, message)
        assert "Traceback" not in capsys.readouterr().err
        where, kept = outcome["where"], outcome["kept"]
        if kept is not None:
            assert tree(kept) == before, moment  # byte for byte, no folder or file added
        else:
            assert not workdir.exists(), moment
        if where is not None:
            assert f"--workdir {where} to resume" in message, (moment, message)
            names = [n for _, dirs, files in os.walk(where) for n in dirs + files]
            assert not any("tmp" in n for n in names) and "LOCK" not in names, (moment, names)
            steps = checkpoint_steps(where)
            records = read_metrics(where) if (where / "metrics.jsonl").exists() else []
            assert not records or (steps and records[-1]["step"] <= steps[-1]), (moment, steps, records[-1:])
    if how == "moved" and steps:
        again = train(config_with(builtin_dataset, steps=steps[-1] + 2, log_every=1, eval_every=1000,
                                  stats_every=0), str(where))
        assert again["step"] == steps[-1] + 2 and f"resumed {where} from step {steps[-1]}" in capsys.readouterr().err
