"""Interrupts at any moment (issue 41): SIGINT and SIGTERM sent to real commands when they have reached a
phase (their first imports, the run directory locked, the first compile of the training loop, a
checkpoint being read and scored) end each with one `error: interrupted ...` line and exit code 130
or 143, or, inside the training loop, with the step it saved; never a traceback or a segmentation
fault, and nothing left that a rerun would trip on. Each signal is sent once the process shows
that it got there (its signal mask, a file, a line, a file it holds open, a FIFO opened), not after a sleep.

Prepare's worker processes (issue 48): a Ctrl-C (SIGINT to the whole process group, as a terminal
sends it) while they start or while they tokenize is the parent's one line, with no worker's traceback
and no leaked-resource warning of multiprocessing's resource tracker; killing the parent, SIGKILL
included, ends them at once.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from debug_runs import PROGRESS, checkpoint_steps, describe, module_cmd, read_metrics, train_cmd, tree_digest
from jax_cache import ENV, ROOT

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
TIMEOUT = 180
COPIES = 16  # of the built-in corpus that prepare tokenizes when it is stopped


class Started:
    """A command running in the background, its output collected as it comes (to wait for a phase)."""

    def __init__(self, cmd, **popen):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
        self.out, self.err = bytearray(), bytearray()
        self.readers = [threading.Thread(target=self._collect, args=(s, b), daemon=True)
                        for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _collect(stream, into: bytearray) -> None:
        while chunk := os.read(stream.fileno(), 4096):
            into.extend(chunk)

    def stderr(self) -> str:
        return bytes(self.err).decode(errors="replace")

    def wait_for(self, reached, what: str) -> None:
        """Returns once `reached()`; fails if the command ends first or takes longer than TIMEOUT."""
        deadline = time.monotonic() + TIMEOUT
        while not reached():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"never reached {what}:\n{describe(self.finish())}")
            time.sleep(0.002)

    def interrupt(self, sig) -> subprocess.CompletedProcess:
        self.proc.send_signal(sig)
        return self.finish()

    def finish(self) -> subprocess.CompletedProcess:
        self.proc.wait(timeout=TIMEOUT)
        for reader in self.readers:
            reader.join()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           bytes(self.out).decode(errors="replace"), self.stderr())


def handles_sigterm(pid: int) -> bool:
    """Whether process `pid` catches SIGTERM (Python does not by default: deltares' handler is in)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def reads(pid: int, path: str) -> bool:
    """Whether process `pid` holds a file under `path` open (token data: its reader keeps the files open)."""
    root = os.path.realpath(path) + os.sep
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(root) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # the process ended, or a descriptor closed while listed
        return False


def assert_interrupted(proc, sig, doing: str = "") -> str:
    """Exit code 128 + the signal, no traceback, and stderr is one line `error: interrupted by ...` (progress
    bars aside); returns it."""
    assert proc.returncode == EXIT[sig], describe(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, describe(proc)
    lines = [line for line in re.split(r"[\r\n]+", proc.stderr) if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted by {sig.name} while {doing}"), describe(proc)
    return lines[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from deltares.data.prepare import prepare

    out = tmp_path_factory.mktemp("interrupts") / "dataset"
    prepare("builtin", "bytes", str(out), val_fraction=0.05, progress=False)
    return str(out)


def train_in(workdir, dataset, *extra):
    return train_cmd(workdir, f"--config.data.dataset={dataset}", "--config.train.steps=4", "--config.train.log_every=1",
                     *extra)


@pytest.fixture(scope="module")
def stopped_in_compile(dataset, tmp_path_factory):
    """A run sent SIGINT once its loop began (its progress bar shown): inside the first step's compile."""
    workdir = str(tmp_path_factory.mktemp("compile") / "run")
    started = Started(train_in(workdir, dataset))
    started.wait_for(lambda: "train:" in started.stderr(), "the training loop")
    return workdir, started.interrupt(signal.SIGINT)


def test_sigint_during_the_first_imports_leaves_no_run_directory(dataset, tmp_path):
    workdir = str(tmp_path / "run")
    started = Started(train_in(workdir, dataset))
    started.wait_for(lambda: handles_sigterm(started.proc.pid), "the handler")
    assert_interrupted(started.interrupt(signal.SIGINT), signal.SIGINT, "starting; nothing was written")
    assert not os.path.exists(workdir)


def test_sigterm_once_the_run_directory_is_locked_removes_it_again(dataset, tmp_path):
    """Between the lock and the loop: opening the data, building the step, initialising the model."""
    workdir = str(tmp_path / "run")
    started = Started(train_in(workdir, dataset))
    started.wait_for(lambda: os.path.exists(os.path.join(workdir, "LOCK")), "the lock")
    line = assert_interrupted(started.interrupt(signal.SIGTERM), signal.SIGTERM)
    assert line.endswith("; nothing was saved"), line
    assert not os.path.exists(workdir)  # the lock released, the new run directory removed


def test_sigint_during_the_first_compile_saves_step_one(stopped_in_compile):
    workdir, proc = stopped_in_compile
    assert proc.returncode == 0, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    assert f"SIGINT: saved step 1 to {workdir}/checkpoints" in proc.stdout, describe(proc)
    assert checkpoint_steps(workdir) == [1] and not os.path.exists(os.path.join(workdir, "LOCK"))


def test_sigterm_while_resuming_changes_nothing_and_the_rerun_resumes(stopped_in_compile, dataset, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(stopped_in_compile[0], workdir)
    before = tree_digest(workdir)
    started = Started(train_in(workdir, dataset))
    started.wait_for(lambda: os.path.exists(os.path.join(workdir, "LOCK")), "the lock")
    assert_interrupted(started.interrupt(signal.SIGTERM), signal.SIGTERM)
    assert tree_digest(workdir) == before  # no lock left, no checkpoint or record changed

    rerun = subprocess.run(train_in(workdir, dataset), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert rerun.returncode == 0 and f"resumed {workdir} from step 1" in rerun.stderr, describe(rerun)
    assert "warning" not in rerun.stderr, describe(rerun)  # no stale lock taken over
    assert [r["step"] for r in read_metrics(workdir)] == [1, 2, 3, 4]


def test_sigint_while_eval_scores(stopped_in_compile, dataset):
    started = Started(module_cmd("deltares.eval", "--checkpoint", stopped_in_compile[0], "--data", dataset))
    started.wait_for(lambda: reads(started.proc.pid, dataset), "the validation tokens")
    assert_interrupted(started.interrupt(signal.SIGINT), signal.SIGINT)


def test_sigterm_while_generate_loads_and_compiles(stopped_in_compile, tmp_path):
    prompts = str(tmp_path / "prompts.txt")
    os.mkfifo(prompts)
    started = Started(module_cmd("deltares.generate", "--checkpoint", stopped_in_compile[0], "--prompt_file", prompts,
                                 "--max_new_tokens", "64"))
    fifo = None

    def opened() -> bool:  # the prompt file is opened by generate's main, after its flags are parsed
        nonlocal fifo
        try:
            fifo = os.open(prompts, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            return False
        return True

    started.wait_for(opened, "the prompt file")
    os.write(fifo, b"Call me Ishmael.\n")
    os.close(fifo)
    assert_interrupted(started.interrupt(signal.SIGTERM), signal.SIGTERM, "running")


def test_sigint_during_prepare_imports(tmp_path):
    out = str(tmp_path / "data")
    started = Started(module_cmd("deltares.data.prepare", "--source", "builtin", "--tokenizer", "bytes", "--out", out))
    started.wait_for(lambda: handles_sigterm(started.proc.pid), "the handler")
    assert_interrupted(started.interrupt(signal.SIGINT), signal.SIGINT, "starting")
    assert not os.path.exists(out)


def test_sigterm_while_prepare_tokenizes_and_the_rerun_completes(dataset, tmp_path):
    """Sixteen copies of the built-in corpus, sixteen units (a second of work or more): stopped once its
    progress bar shows, prepared whole by the rerun."""
    import json

    from deltares.data.documents import builtin_path

    for i in range(COPIES):
        shutil.copy(builtin_path(), tmp_path / f"{i}.txt.gz")
    out = str(tmp_path / "data")
    cmd = module_cmd("deltares.data.prepare", "--source", str(tmp_path / "*.txt.gz"), "--tokenizer", "bytes",
                     "--val_fraction", "0.05", "--out", out)
    started = Started(cmd)
    started.wait_for(lambda: f"/{COPIES} [" in started.stderr(), "tokenizing")
    assert_interrupted(started.interrupt(signal.SIGTERM), signal.SIGTERM)

    rerun = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert rerun.returncode == 0, describe(rerun)
    one = json.load(open(os.path.join(dataset, "meta.json")))["splits"]
    every = json.load(open(os.path.join(out, "meta.json")))["splits"]
    assert {s: every[s]["tokens"] for s in one} == {s: COPIES * one[s]["tokens"] for s in one}


def test_a_program_importing_deltares_keeps_its_own_signal_handling():
    """Only a process started as a tool handles interrupts the tools' way: importing deltares leaves the
    program's handlers as they were (Python's own, or SIG_IGN where the parent ignored SIGINT, as a
    shell does for a background job)."""
    code = ("import signal; before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT); "
            "import deltares.train; "
            "print(signal.getsignal(signal.SIGTERM) is before[0], signal.getsignal(signal.SIGINT) is before[1])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.stdout.split() == ["True", "True"], describe(proc)


# ----------------------------------------------------------------------------- prepare's worker processes


def signal_set(pid: int, field: str) -> int:
    """A signal set of process `pid` (`SigBlk`, `SigIgn`, ...) as a bit mask; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1], 16) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


SIGINT_BIT = 1 << (signal.SIGINT - 1)


def workers_of(pid: int) -> list[int]:
    """The worker processes that process `pid` spawned (multiprocessing's, not its resource tracker)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
    except OSError:
        return []
    found = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(int(child))
        except OSError:
            pass
    return found


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:")) not in ("Z", "X")
    except (OSError, StopIteration):
        return False


def gone_soon(pids, seconds=3.0) -> list[int]:
    """The processes of `pids` still running `seconds` from now (or as soon as none is)."""
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [pid for pid in pids if running(pid)]


@pytest.fixture(scope="module")
def long_units(tmp_path_factory):
    """Two text files of three copies of the built-in corpus each: one unit each, seconds of GPT-2 work."""
    import gzip

    from deltares.data.documents import builtin_path

    folder = tmp_path_factory.mktemp("long_units")
    with gzip.open(builtin_path(), "rt", encoding="utf-8") as f:
        text = f.read()
    for i in range(2):
        (folder / f"book{i}.txt").write_text(text * 3, encoding="utf-8")
    return str(folder / "*.txt")


def prepare_with_workers(source, out):
    return module_cmd("deltares.data.prepare", "--source", source, "--tokenizer", "gpt2", "--out", out, "--workers", "2")


@pytest.mark.parametrize("moment", ["starting", "tokenizing"])
def test_ctrl_c_while_prepare_workers_start_or_work_is_one_line(long_units, tmp_path, moment):
    """`starting`: a worker spawned and still importing (SIGINT not yet ignored); `tokenizing`: both
    workers set up (SIGINT ignored), each in its unit."""
    out = str(tmp_path / "data")
    started = Started(prepare_with_workers(long_units, out), start_new_session=True)
    pid = started.proc.pid

    def reached():
        workers = workers_of(pid)
        if moment == "starting":
            return any(not signal_set(w, "SigIgn") & SIGINT_BIT for w in workers)
        return len(workers) == 2 and all(signal_set(w, "SigIgn") & SIGINT_BIT for w in workers)

    started.wait_for(reached, f"workers {moment}")
    workers = workers_of(pid)
    os.killpg(pid, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the group
    proc = started.finish()
    assert_interrupted(proc, signal.SIGINT, f"preparing {out}")
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, describe(proc)
    assert gone_soon(workers) == []
    assert not os.path.exists(out + ".lock")  # released: the rerun takes over nothing


def test_killing_prepare_ends_its_workers(long_units, tmp_path):
    """SIGKILL to the parent while both workers are seconds into their units: they end at once (they would
    otherwise tokenize on, and write, with nobody to use it)."""
    out = str(tmp_path / "data")
    started = Started(prepare_with_workers(long_units, out))
    pid = started.proc.pid
    started.wait_for(lambda: len(workers_of(pid)) == 2 and all(
        signal_set(w, "SigIgn") & SIGINT_BIT for w in workers_of(pid)), "both workers set up")
    workers = workers_of(pid)
    started.proc.kill()
    started.finish()
    assert gone_soon(workers) == []
    assert not os.path.isdir(os.path.join(out, "ledger")) or os.listdir(os.path.join(out, "ledger")) == []
