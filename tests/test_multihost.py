"""Multi-host for real on one machine: `deltares.train` as 2 processes x 4 CPU devices joined by
`jax.distributed`, training `debug` on an fsdp=8 mesh, against the same config as one process with
8 devices. The 2 processes run the command line of the SLURM job that `launch/slurm.sh` writes for
2 nodes of 4 devices (its `srun` step), each with the variables SLURM gives a task (`SLURM_JOB_ID`,
`SLURM_STEP_NODELIST`, `SLURM_NTASKS`, `SLURM_PROCID`, ...), so jax's SLURM detection joins them
(a local coordinator port from `JAX_COORDINATOR_PORT`; gloo collectives across the processes).

One scenario, run once for the module: the single-process reference runs STEPS steps; the
2-process run gets SIGTERM on process 1 only after its first steps, so that both processes
save one agreed step (jax's preemption sync point) and exit 75 (the job's `--stopped_exit_code`, on
which it requeues itself); the same command restarted on
both resumes from that checkpoint to STEPS (a requeued job), setting aside a damaged newer step
planted before it, and saves every step keeping one (process 0 removes a step while process 1 goes on).
A third launch has one process's save fail, a fourth one process's read of a batch: both stop at once. `tests/multihost_worker.py` records
each process's batches and saves. Every wait has a deadline: a hung collective fails the test.
The whole job (the signal before the time limit, the requeue) runs on a real SLURM in
tests/test_slurm.py. The single process joins a cluster of one named by `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (the way off SLURM and Cloud TPU).
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from deltares.data.dataset import TokenData
from deltares.data.prepare import prepare
from deltares.training.metrics import read_metrics
from deltares.train import TrainError, initialize_distributed

import slurm_local
from jax_cache import ENV, ROOT

WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
SLURM = os.path.join(ROOT, "launch", "slurm.sh")
STEPS, SEQ, BATCH, PROCESSES, STATS_EVERY = 20, 32, 8, 2, 5
SIGNAL_AFTER = 2  # steps process 0 has logged when process 1 gets SIGTERM
FAIL_SAVE = 8  # the step whose save fails on process 1 only (the step before it saved well)
FAIL_READ = 6  # the step whose batch process 1 alone cannot read (saves every 4 steps)
READ_ERROR = "reading the dataset failed: gs://bucket/data/train-00003.bin: 503 Service Unavailable"
STEP_SLEEP = 0.1  # seconds per step (worker hook): the notice reaches the sync point well before STEPS
LOSS_ATOL = 1e-5  # float32: gloo sums in another order than one process does (measured: up to 4.8e-7)
TIMEOUT = 240  # seconds for one run of all processes
DAMAGED = 1000  # a damaged step planted before the restart
ANOTHER = "error: another process of this run could not read its data or store its work (its error says why)"
KEEP_ONE = ["--config.train.checkpoint_every=1", "--config.train.keep_last=1"]
OVERRIDES = [
    f"--config.data.seq_len={SEQ}", f"--config.train.global_batch={BATCH}", f"--config.train.steps={STEPS}",
    "--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.tensor=1",
    "--config.train.log_every=1", "--config.train.checkpoint_every=1000", f"--config.train.stats_every={STATS_EVERY}",
]


def process_env(devices: int, record: str, sleep: float, **extra) -> dict:
    env = {k: v for k, v in ENV.items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "SLURM_"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        DELTARES_TEST_RECORD=record,
        DELTARES_TEST_STEP_SLEEP=str(sleep),
        **extra,
    )
    return env


def slurm_task_env(i: int, port: int) -> dict:
    """What SLURM sets for task `i` of a job step of PROCESSES nodes, one task each (node names: this
    machine), and the coordinator port (jax's default derives it from the job id)."""
    return dict(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost", SLURM_STEP_NODELIST="localhost",
                SLURM_NNODES=str(PROCESSES), SLURM_STEP_NUM_NODES=str(PROCESSES), SLURM_NTASKS=str(PROCESSES),
                SLURM_PROCID=str(i), SLURM_NODEID=str(i), SLURM_LOCALID="0", JAX_COORDINATOR_PORT=str(port))


def slurm_step(tmp, dataset, workdir) -> list[str]:
    """The trainer's command line of the job `launch/slurm.sh --dry-run` prints for PROCESSES nodes of
    8 / PROCESSES devices: its `srun` line without srun and srun's options, the venv's python (a
    stand-in that runs this one) given the recording worker in place of `-m deltares.train`."""
    venv = os.path.join(tmp, "venv")
    if not os.path.exists(venv):
        os.makedirs(os.path.join(venv, "bin"))
        with open(os.path.join(venv, "bin", "python"), "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        os.chmod(os.path.join(venv, "bin", "python"), 0o755)
    job = subprocess.run(
        ["bash", SLURM, "--dry-run", "--nodes", str(PROCESSES), "--gpus-per-node", str(8 // PROCESSES), "--venv", venv,
         "--config", "experiments/debug.py", "--workdir", str(workdir), "--", f"--config.data.dataset={dataset}",
         *OVERRIDES], capture_output=True, text=True, check=True).stdout
    (line,) = [line for line in job.splitlines() if line.startswith("srun ")]
    words = shlex.split(line)
    assert words[-1] == "&"
    words = words[1:-1]
    while words[0].startswith("--"):  # srun's options
        words.pop(0)
    m = words.index("-m")
    assert words[:2] == ["env", f"JAX_LOCAL_DEVICE_IDS={','.join(map(str, range(8 // PROCESSES)))}"]
    assert words[m - 1] == os.path.join(venv, "bin", "python") and words[m + 1] == "deltares.train"
    return [*words[:m], WORKER, *words[m + 2:]]


class Run:
    """The processes of one launch of the trainer on `workdir`; output and records under `out`."""

    def __init__(self, dataset, workdir, out, processes, tmp, overrides=(), **extra_env):
        os.makedirs(out, exist_ok=True)
        self.workdir, self.out, self.deadline = str(workdir), str(out), time.monotonic() + TIMEOUT
        if processes == 1:
            cmd = [sys.executable, WORKER, "--config", os.path.join(ROOT, "experiments", "debug.py"),
                   "--workdir", self.workdir, f"--config.data.dataset={dataset}", *OVERRIDES, *overrides]
        else:
            cmd = [*slurm_step(tmp, dataset, workdir), *overrides]
        (port,) = slurm_local.free_ports(1)
        self.procs = []
        for i in range(processes):
            cluster = slurm_task_env(i, port) if processes > 1 else dict(  # a cluster of one, by jax's own variables
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")
            env = process_env(8 // processes, self.path(i, "record"), STEP_SLEEP if processes > 1 else 0, **cluster,
                              **extra_env)
            with open(self.path(i, "stdout"), "w") as stdout, open(self.path(i, "stderr"), "w") as stderr:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr))

    def path(self, i, what):
        return os.path.join(self.out, f"{i}.{what}")

    def text(self, i, what):
        with open(self.path(i, what)) as f:
            return f.read()

    def describe(self):
        return "\n".join(f"--- process {i} rc={p.returncode}\n{self.text(i, 'stdout')[-2000:]}\n"
                         f"{self.text(i, 'stderr')[-3000:]}" for i, p in enumerate(self.procs))

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def logged_steps(self) -> int:
        """Complete lines of metrics.jsonl (process 0 may be writing the next one)."""
        path = os.path.join(self.workdir, "metrics.jsonl")
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return f.read().count("\n")

    def wait_for_logged_steps(self, n):
        while self.logged_steps() < n:
            if time.monotonic() > self.deadline or any(p.poll() is not None for p in self.procs):
                self.kill()
                pytest.fail(f"no {n} logged steps while all processes ran\n{self.describe()}")
            time.sleep(0.1)

    def finish(self, exit_code=0):
        """Waits for every process (killing all at the deadline), which must exit `exit_code`; returns their records."""
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"the processes did not finish within {TIMEOUT}s (a hung collective?)\n{self.describe()}")
        for i, p in enumerate(self.procs):
            assert p.returncode == exit_code, self.describe()
        out = []
        for i in range(len(self.procs)):
            with open(self.path(i, "record") + ".json") as f:
                out.append({**json.load(f), "rows": np.load(self.path(i, "record") + ".npy")})
        return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    dataset = tmp / "dataset"
    prepare("builtin", "bytes", str(dataset), val_fraction=0.05, progress=False)
    started, runs = time.monotonic(), []
    try:
        single = Run(dataset, tmp / "single", tmp / "single-out", 1, tmp)
        first = Run(dataset, tmp / "multi", tmp / "first-out", PROCESSES, tmp)  # all at once: mostly waiting
        # process 1 alone sees its save of FAIL_SAVE fail (the disk full where it writes)
        failing = Run(dataset, tmp / "failing", tmp / "failing-out", PROCESSES, tmp,
                      [f"--config.train.checkpoint_every={FAIL_SAVE // 2}"], DELTARES_TEST_FAIL_SAVE=f"1:{FAIL_SAVE}")
        # process 1 alone cannot read its rows of step FAIL_READ (a bucket that stops answering)
        unread = Run(dataset, tmp / "unread", tmp / "unread-out", PROCESSES, tmp,
                     ["--config.train.checkpoint_every=4"], DELTARES_TEST_FAIL_READ=f"1:{FAIL_READ}",
                     DELTARES_TEST_READ_ERROR=READ_ERROR)
        runs += [single, first, failing, unread]
        first.wait_for_logged_steps(SIGNAL_AFTER)
        first.procs[1].send_signal(signal.SIGTERM)
        first_records = first.finish(exit_code=75)
        checkpoints_after_first = checkpoint_steps(first.workdir)
        metrics_after_first = read_metrics(first.workdir)
        # a damaged step newer than the saved one, which both processes must agree to set aside
        (saved,) = checkpoints_after_first
        damaged = os.path.join(first.workdir, "checkpoints", str(DAMAGED))
        shutil.copytree(os.path.join(first.workdir, "checkpoints", str(saved)), damaged)
        os.remove(os.path.join(damaged, "state", "_METADATA"))
        # a save every step, the one before it removed: process 0 removes steps while process 1 checks its own
        second = Run(dataset, tmp / "multi", tmp / "second-out", PROCESSES, tmp, KEEP_ONE)
        runs.append(second)
        second_records = second.finish()
        single_records = single.finish()
        failing_records = failing.finish(exit_code=1)
        unread_records = unread.finish(exit_code=1)
    finally:
        for run in runs:
            run.kill()
    print(f"multihost scenario: {time.monotonic() - started:.1f}s")
    return dict(
        dataset=TokenData(str(dataset)), single=single, first=first, second=second,
        ref=single_records[0], first_records=first_records, second_records=second_records,
        checkpoints_after_first=checkpoints_after_first, metrics_after_first=metrics_after_first,
        failing=failing, failing_records=failing_records, unread=unread, unread_records=unread_records,
    )


@pytest.mark.parametrize("env", [
    dict(JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0"),
    dict(JAX_COORDINATOR_ADDRESS="127.0.0.1:1234", JAX_NUM_PROCESSES="two", JAX_PROCESS_ID="0"),
])
def test_an_incomplete_cluster_environment_is_a_clear_error(monkeypatch, env):
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrainError, match="set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        initialize_distributed()


def test_a_slurm_step_of_one_task_is_one_process_on_every_local_device(monkeypatch):
    """jax's SLURM detection would hand it the GPU numbered SLURM_LOCALID only: no cluster is started."""
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in slurm_task_env(0, 1234).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    initialize_distributed()
    assert calls == []
    monkeypatch.setenv("SLURM_NTASKS", "2")  # two tasks: jax's detection joins them
    initialize_distributed()
    assert calls == [((), {})]


def window_indices(data: TokenData, rows_SBT: np.ndarray) -> np.ndarray:
    """The training-window index of every row (windows of SEQ + 1 tokens every SEQ tokens)."""
    tokens = np.asarray(data.tokens("train"))
    windows = {}
    for i in range((len(tokens) - 1) // SEQ):
        windows.setdefault(tokens[i * SEQ : i * SEQ + SEQ + 1].tobytes(), []).append(i)
    out = np.empty(rows_SBT.shape[:2], np.int64)
    for s, b in np.ndindex(*out.shape):
        found = windows[rows_SBT[s, b].astype(tokens.dtype).tobytes()]
        assert len(found) == 1, "a row that two windows share cannot identify its window"
        out[s, b] = found[0]
    return out


def checkpoint_steps(workdir) -> list[int]:
    return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def saved_step(scenario) -> int:
    saves = {tuple(r["saves"]) for r in scenario["first_records"]}
    assert len(saves) == 1, f"the processes saved different steps: {saves}"
    (steps,) = saves
    assert len(steps) == 1, steps
    return steps[0]


def test_slurm_variables_join_the_two_processes_and_jax_variables_the_reference(scenario):
    for records in (scenario["first_records"], scenario["second_records"]):
        assert [r["process"] for r in records] == [[0, PROCESSES], [1, PROCESSES]]
    assert scenario["ref"]["process"] == [0, 1]
    assert all(r["distributed"] for r in (scenario["ref"], *scenario["first_records"], *scenario["second_records"]))


def test_sigterm_to_one_process_saves_the_same_step_on_both_and_exits_75(scenario):
    step = saved_step(scenario)  # finish() asserted exit code 75 (the SLURM job's --stopped_exit_code) for both
    assert SIGNAL_AFTER <= step < STEPS
    assert [r["steps"] for r in scenario["first_records"]] == [step] * PROCESSES  # each ran exactly to it
    assert scenario["checkpoints_after_first"] == [step]
    assert f"SIGTERM: saved step {step} " in scenario["first"].text(0, "stdout")


def test_each_process_reads_its_own_rows_of_every_global_batch(scenario):
    data, step = scenario["dataset"], saved_step(scenario)
    ref = window_indices(data, scenario["ref"]["rows"])
    assert ref.shape == (STEPS, BATCH)
    for records, steps in ((scenario["first_records"], range(0, step)), (scenario["second_records"], range(step, STEPS))):
        local = [window_indices(data, r["rows"]) for r in records]
        for p in local:
            assert p.shape == (len(steps), BATCH // PROCESSES)
        for k, s in enumerate(steps):
            assert not set(local[0][k]) & set(local[1][k]), f"step {s + 1}: both processes read a row"
            assert sorted(np.concatenate([p[k] for p in local])) == sorted(ref[s]), f"step {s + 1}"


def test_losses_equal_the_single_process_run_before_and_after_the_resume(scenario):
    step = saved_step(scenario)
    ref = {r["step"]: r["loss"] for r in read_metrics(scenario["single"].workdir)}
    first = {r["step"]: r["loss"] for r in scenario["metrics_after_first"]}
    final = {r["step"]: r["loss"] for r in read_metrics(scenario["second"].workdir)}
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert sorted(first) == list(range(1, step + 1))
    assert sorted(final) == list(range(1, STEPS + 1))
    for got in (first, final):
        steps = sorted(got)
        np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=0, atol=LOSS_ATOL)
    assert all(final[s] == first[s] for s in first)  # the resumed run kept the first run's records


def test_routing_statistics_equal_the_single_process_run(scenario):
    """The statistics step sees the global batch too (not process 0's rows as if they were all)."""
    ref = {r["step"]: r for r in read_metrics(scenario["single"].workdir)}
    got = [r for r in read_metrics(scenario["second"].workdir) if "routing_max_weight" in r]
    assert [r["step"] for r in got] == list(range(STATS_EVERY, STEPS + 1, STATS_EVERY))
    for r in got:
        for key in ("routing_max_weight", "routing_entropy"):  # rounded to 4 decimals: one unit apart at most
            np.testing.assert_allclose(r[key], ref[r["step"]][key], rtol=0, atol=1.2e-4, err_msg=f"{key} {r['step']}")


def test_restart_restores_the_checkpoint_on_both_processes_and_finishes(scenario):
    """... saving every step (KEEP_ONE): process 0 removes each older step while process 1 goes on."""
    step = saved_step(scenario)
    for r in scenario["second_records"]:
        assert r["saves"] == list(range(step + 1, STEPS + 1)) and r["steps"] == STEPS - step
    assert checkpoint_steps(scenario["second"].workdir) == [STEPS]
    assert f"resumed {scenario['second'].workdir} from step {step}" in scenario["second"].text(0, "stderr")


def test_a_damaged_newest_step_is_set_aside_once_and_both_processes_resume_before_it(scenario):
    workdir = scenario["second"].workdir
    assert os.listdir(os.path.join(workdir, "checkpoints_aside")) == [str(DAMAGED)]
    assert "state/_METADATA is missing" in open(os.path.join(workdir, "checkpoints_aside", str(DAMAGED), "REASON")).read()
    assert f"warning: skipped checkpoint step {DAMAGED} of {workdir}/checkpoints" in scenario["second"].text(0, "stderr")


def test_a_save_that_fails_on_one_process_stops_every_process_at_once(scenario):
    """finish() asserted exit status 1 for both well before jax's shutdown timeout (300 s): the process
    that saw the failure does not leave the others waiting in the next collective."""
    run, records = scenario["failing"], scenario["failing_records"]
    errors = [[line for line in run.text(i, "stderr").splitlines() if line.startswith("error:")] for i in range(PROCESSES)]
    assert errors[1] == [f"error: saving step {FAIL_SAVE} failed (OSError: [Errno 28] No space left on device); "
                         f"the previous checkpoint, step {FAIL_SAVE // 2}, is intact in {run.workdir}/checkpoints"], errors
    assert errors[0] == [ANOTHER], errors
    assert [r["saves"] for r in records] == [[FAIL_SAVE // 2, FAIL_SAVE]] * PROCESSES
    # both stopped at the first agreed check after the failed save, the next step's
    assert [r["steps"] for r in records] == [FAIL_SAVE + 1] * PROCESSES
    assert "Traceback" not in run.text(0, "stderr") + run.text(1, "stderr")


def test_a_read_that_fails_on_one_process_stops_every_process_at_the_next_check(scenario):
    """The process whose read failed steps on blank rows to the next agreed check (the same step: every
    step is logged), so that the other is not left waiting in the step's collectives; both stop there,
    before any save of a step trained on those rows, and keep no metrics record past the last checkpoint."""
    run, records = scenario["unread"], scenario["unread_records"]
    errors = [[line for line in run.text(i, "stderr").splitlines() if line.startswith("error:")] for i in range(PROCESSES)]
    assert errors[1] == [f"error: reading the training data for step {FAIL_READ} failed (DataError: {READ_ERROR}). "
                         f"The last good checkpoint is step 4 in {run.workdir}/checkpoints"], errors
    assert errors[0] == [ANOTHER], errors
    assert [r["steps"] for r in records] == [FAIL_READ, FAIL_READ - 1]  # batches read: process 1 missed one
    assert [r["saves"] for r in records] == [[4]] * PROCESSES
    assert checkpoint_steps(run.workdir) == [4]
    assert [r["step"] for r in read_metrics(run.workdir)] == [1, 2, 3, 4]
    assert "Traceback" not in run.text(0, "stderr") + run.text(1, "stderr")


GLOO_WORDS = re.compile(r"\[Gloo\]|Rank|is|connected|to|peer|ranks\.|ranks|Expected|number|of|:|\d+")


def test_progress_and_summaries_on_process_0_only(scenario):
    bar = re.compile(r"train:\s+\d+%\|")
    for run, summary in ((scenario["first"], "SIGTERM: saved step"), (scenario["second"], f"step {STEPS}: validation loss")):
        assert bar.search(run.text(0, "stderr")) and summary in run.text(0, "stdout")
        assert not bar.search(run.text(1, "stderr")), run.text(1, "stderr")[-2000:]
        # gloo's own connection lines are on every process, written piece by piece by several threads at once, so
        # they can be cut and interleaved anywhere between pieces: whatever is left without gloo's words is ours
        ours = GLOO_WORDS.sub("", run.text(1, "stdout")).split()
        assert ours == [], run.text(1, "stdout")[-2000:]
        assert "resumed" not in run.text(1, "stderr")
