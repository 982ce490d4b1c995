"""The run directory's lock and layout checks (`deltares.training.workdir`), without training: one
holder at a time, the holder named, stale locks taken over (a dead process on this host, a stopped
heartbeat from another), released locks gone; unusable run directories refused before anything is
written. The trainer's use of both is tested end to end in tests/test_train.py and tests/test_faults.py."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from deltares.common import lock as lock_module
from deltares.training.workdir import LOCK, WorkdirError, WorkdirLock, check_workdir


def messages():
    out = []
    return out, out.append


def write_lock(path, **fields):
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": lock_module._process_start(os.getpid()),
              "started": "2026-01-01 00:00:00", "heartbeat": time.time(), "token": "x", "command": "test"}
    record.update(fields)
    (path / LOCK).write_text(json.dumps(record))
    return record


def dead_pid():
    """The id of a process that has ended (and was not reused within this test)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_one_holder_then_released(tmp_path):
    first = WorkdirLock(str(tmp_path))
    first.acquire()
    holder = json.loads((tmp_path / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
    with pytest.raises(WorkdirError) as err:
        WorkdirLock(str(tmp_path)).acquire()  # this very process holds it, and it is alive
    assert f"process {os.getpid()} on {socket.gethostname()}" in str(err.value) and "\n" not in str(err.value)
    assert first.held()
    first.release()
    assert not (tmp_path / LOCK).exists()
    with WorkdirLock(str(tmp_path)) as again:  # a run after the first ended
        assert again.held()
    assert not (tmp_path / LOCK).exists()


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    write_lock(tmp_path, pid=dead_pid())
    said, log = messages()
    lock = WorkdirLock(str(tmp_path), log=log)
    lock.acquire()
    assert lock.held() and json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and said[0].startswith("warning: took over the lock") and "no longer running" in said[0]
    lock.release()


def test_reused_process_id_is_not_the_holder(tmp_path):
    """The holder's id now belongs to a process started later (here: this one): the lock is stale."""
    write_lock(tmp_path, pid_start="1")
    said, log = messages()
    with WorkdirLock(str(tmp_path), log=log):
        assert "no longer running" in said[0]


def test_lock_from_another_host(tmp_path):
    write_lock(tmp_path, host="elsewhere", heartbeat=time.time() - 5)
    with pytest.raises(WorkdirError, match="elsewhere"):
        WorkdirLock(str(tmp_path)).acquire()
    write_lock(tmp_path, host="elsewhere", heartbeat=time.time() - lock_module.STALE_AFTER_S - 5)
    said, log = messages()
    with WorkdirLock(str(tmp_path), log=log):
        assert "heartbeat stopped" in said[0]


def test_heartbeat_is_refreshed(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)  # the lock of deltares.common.lock
    with WorkdirLock(str(tmp_path)):
        first = json.loads((tmp_path / LOCK).read_text())["heartbeat"]
        time.sleep(0.3)
        assert json.loads((tmp_path / LOCK).read_text())["heartbeat"] > first


def test_lock_being_written_is_respected(tmp_path):
    (tmp_path / LOCK).write_text("")  # created, not yet written: a trainer starting
    with pytest.raises(WorkdirError, match="a trainer that is starting"):
        WorkdirLock(str(tmp_path)).acquire()


def test_release_leaves_a_lock_taken_over_by_another(tmp_path):
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    other = write_lock(tmp_path, pid=1, token="other")
    assert not lock.held()
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text()) == other


def test_lock_on_a_bucket(fake_bucket):
    url = "gs://runs/locked"
    os.makedirs(os.path.join(fake_bucket.root, "runs", "locked"))
    with WorkdirLock(url) as lock:
        assert lock.held()
        assert os.path.exists(os.path.join(fake_bucket.root, "runs", "locked", LOCK))
        with pytest.raises(WorkdirError, match="in use by another trainer"):
            WorkdirLock(url).acquire()
    assert not os.path.exists(os.path.join(fake_bucket.root, "runs", "locked", LOCK))


@pytest.mark.parametrize("name,kind", [("checkpoints", "file"), ("tensorboard", "file"), ("metrics.jsonl", "dir"),
                                       (LOCK, "dir")])
def test_wrong_type_in_the_run_directory(tmp_path, name, kind):
    path = tmp_path / name
    path.mkdir() if kind == "dir" else path.write_text("x")
    with pytest.raises(WorkdirError, match=f"{name} is a {'folder' if kind == 'dir' else 'file'} where"):
        check_workdir(str(tmp_path))


def test_run_directory_that_is_a_file(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(WorkdirError, match="is a file"):
        check_workdir(str(tmp_path / "run" / "sub"))


def test_check_leaves_a_new_run_directory_as_it_was(tmp_path):
    check_workdir(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path) == []
    (tmp_path / "c").mkdir()
    check_workdir(str(tmp_path / "c"))
    assert os.listdir(tmp_path / "c") == []


def test_a_moved_or_deleted_run_directory_is_named_as_such(tmp_path):
    """The cause a run stops for: the directory moved (and where to), deleted, or the lock taken over;
    a removed lock file is made again with a warning. A moved directory's lock is released where it is."""
    said, log = messages()
    run = tmp_path / "run"
    lock = WorkdirLock(str(run), log=log)
    run.mkdir()
    lock.acquire()
    assert lock.problem() is None
    (run / LOCK).unlink()
    assert lock.problem() is None and lock.held() and said == [f"warning: the lock file {run / LOCK} was removed "
                                                               "during the run; made it again"]
    write_lock(run, token="another trainer's")
    assert "was taken over by another trainer (process" in lock.problem()
    (run / LOCK).write_text(json.dumps(lock.record))
    os.rename(run, tmp_path / "moved")
    assert lock.problem() == (f"the run directory {run} was moved to {tmp_path / 'moved'} during the run; stopped "
                              f"without saving there: rerun with --workdir {tmp_path / 'moved'} to resume it")
    lock.release()
    assert not (tmp_path / "moved" / LOCK).exists()  # released where the directory is now

    run.mkdir()
    lock = WorkdirLock(str(run), log=log)
    lock.acquire()
    (run / LOCK).unlink()
    run.rmdir()
    assert lock.problem().startswith(f"the run directory {run} was deleted during the run")
    run.mkdir()  # another directory of the same name is not the run's
    assert lock.problem().startswith(f"the run directory {run} was deleted during the run")
    lock.release()


def tree(root):
    """{relative path: file bytes, or None for a folder} of everything under `root`."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(folder, name), root)] = None
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return out


def other_run(path):
    """A folder that holds another run, put where the run directory was."""
    (path / "checkpoints" / "4").mkdir(parents=True)
    (path / "checkpoints" / "4" / "state").write_text("another run's")
    (path / "metrics.jsonl").write_text('{"step": 4}\n')
    return tree(path)


@pytest.mark.parametrize("how", ["moved", "deleted", "link repointed"])
def test_a_run_directory_is_written_through_the_directory_held_open(tmp_path, how):
    """Everything the run writes goes through `through` and the lock through the directory held open, so
    a folder put at its path afterwards (another run) gets nothing: no lock, no files, no folders. Moved,
    the writes follow the directory; deleted, they fail; a link on the path repointed, they stay where
    the run is. `problem` names each."""
    said, log = messages()
    (tmp_path / "A").mkdir()
    os.symlink(tmp_path / "A", tmp_path / "link")
    workdir = tmp_path / "link" / "run"
    workdir.mkdir()
    lock = WorkdirLock(str(workdir), log=log)
    lock.acquire()
    through = lock.through
    assert through != str(workdir) and os.path.samefile(through, workdir)  # Linux: /proc/self/fd/N
    if how == "moved":
        os.rename(workdir, tmp_path / "moved")
        where = tmp_path / "moved"
        want = (f"the run directory {workdir} was moved to {where} during the run; stopped without saving there: "
                f"rerun with --workdir {where} to resume it")
        os.mkdir(workdir)
    elif how == "deleted":
        os.remove(workdir / LOCK)
        workdir.rmdir()
        where, want = None, f"the run directory {workdir} was deleted during the run; stopped (nothing more can be saved)"
        os.mkdir(workdir)
    else:
        (tmp_path / "B" / "run").mkdir(parents=True)
        os.symlink(tmp_path / "B", tmp_path / "link.new")
        os.replace(tmp_path / "link.new", tmp_path / "link")
        where = tmp_path / "A" / "run"
        want = (f"{workdir} no longer leads to the run directory (a link on the path changed during the run; the run "
                f"is in {where}); stopped without saving there: rerun with --workdir {where} to resume it")
    before = other_run(workdir)
    assert lock.problem() == want
    lock.record["heartbeat"] += 1
    if where is None:
        with pytest.raises(FileNotFoundError):
            lock._write(lock.record)
        with pytest.raises(FileNotFoundError):
            os.makedirs(os.path.join(through, "checkpoints", "8.orbax-checkpoint-tmp-1"))
    else:
        lock._write(lock.record)  # the heartbeat
        os.makedirs(os.path.join(through, "checkpoints", "8.orbax-checkpoint-tmp-1"))
        assert json.loads((where / LOCK).read_text()) == lock.record
        assert (where / "checkpoints" / "8.orbax-checkpoint-tmp-1").is_dir()
    lock.release()
    assert tree(workdir) == before  # byte for byte, and no folder added
    assert said == [] and (where is None or not (where / LOCK).exists())  # released where the run is


@pytest.mark.parametrize("files, what", [
    (["meta.json", "train.bin"], "a dataset"),
    (["config.json", "model.safetensors", "tokenizer.json"], "a Hugging Face model"),
    (["notes.txt", "results.csv"], "2 entries (notes.txt, results.csv)"),
])
def test_a_folder_holding_something_else_is_not_a_run_directory(tmp_path, files, what):
    for name in files:
        (tmp_path / name).write_text("x")
    with pytest.raises(WorkdirError, match=rf"holds {re.escape(what)}, not a run; use a new or empty --workdir"):
        check_workdir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(files)


def test_a_run_and_its_first_folders_are_run_directories(tmp_path):
    check_workdir(str(tmp_path))  # empty
    (tmp_path / "dataset").mkdir()  # the built-in corpus, prepared into a new run directory
    (tmp_path / "tensorboard").mkdir()
    check_workdir(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "notes.txt").write_text("a run with a note beside it")
    check_workdir(str(tmp_path))
