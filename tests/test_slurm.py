"""launch/slurm.sh on a real SLURM: Debian's slurm-wlm started on this machine with the SLURM guide's
commands (`python -m tests.slurm_local start|stop`: munged, slurmctld and four slurmd as nodes n1-n4
on localhost, every file in a temporary folder); the jobs the launcher writes are submitted with the
real `sbatch` and run by the real `srun`, on the CPU (`--gpus-per-node 0`).

One scenario for the module, all jobs at once, each way a job can end triggered by the test with
SLURM's own commands once an attempt is under way:

- trainers (`debug`, the uninterrupted `reference` run's settings; tests/multihost_worker.py records
  their saves and sleeps a little per step so that the run is still going):
  - on n1, one trainer: a preemption with a grace time (a job in the `urgent` partition), the time
    limit (shortened with `scontrol update TimeLimit` so that `--signal`'s USR1 comes at SLURM's next
    30-second check instead of minutes later), `scontrol requeue`, then the run's end;
  - on n2 and n3, one JAX cluster of two trainers (`--nodes 2`): `scancel --signal=TERM`, a node
    failure (`scontrol update State=DOWN`), then the run's end.
  Each stop saves one step (the same on both trainers), the job is back in the queue (requeued by
  itself, or by SLURM) and resumes from it, the losses of the whole run are the reference's, and the
  finished run is not requeued.
- probes on n4, whose `python` is a stand-in that reports, exits as told, and exits 75 on SIGTERM
  (as a trainer that saved): the resource options, a plain `scancel` (cancelled, not requeued), a
  preemption without a grace time (SLURM requeues), and the exit statuses the job script requeues
  or does not.

Needs root and slurm-wlm: skipped otherwise, unless DELTARES_REQUIRE_SLURM=1 (set by .ci/run), which
makes a machine that cannot start SLURM a failure.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import slurm_local
from debug_runs import STEPS, read_metrics
from jax_cache import ENV, ROOT

REASON = slurm_local.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None and os.environ.get("DELTARES_REQUIRE_SLURM") != "1",
                                reason=f"no SLURM here: {REASON}")

SLURM = os.path.join(ROOT, "launch", "slurm.sh")
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
SAVE_BEFORE, TIME = 300, 10  # --time in minutes; `scontrol update TimeLimit=5` makes the signal due at once
DEADLINE = 600  # seconds for the whole scenario
MIN_NEW_STEPS = 2  # steps an attempt trains past its resume step before the test stops it
LOSS_ATOL = 1e-5  # two processes (gloo's sums) against one; one process against one: equal
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")
# The probes' trainer: answers SIGTERM from before it reports (its report lets the test signal it), then on a
# restart finishes; otherwise exits $PROBE_EXIT, or with `wait`
# runs until SIGTERM, on which it exits 75 (a trainer that saved).
PROBE = """trap 'echo "probe: SIGTERM"; exit 75' TERM
echo "probe $* cpus=$(nproc) restart=${SLURM_RESTART_COUNT:-0}"
[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0
[ "$PROBE_EXIT" = wait ] || exit "$PROBE_EXIT"
sleep 300 & wait $!
"""


def job_env(**extra) -> dict:
    env = {k: v for k, v in ENV.items()
           if not k.startswith(("SLURM_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE",
                                "DELTARES_"))}
    return {**env, **extra}


def fake_venv(path, body: str) -> str:
    os.makedirs(os.path.join(path, "bin"), exist_ok=True)
    with open(os.path.join(path, "bin", "python"), "w") as f:
        f.write("#!/bin/sh\n" + body)
    os.chmod(os.path.join(path, "bin", "python"), 0o755)
    return str(path)


class Job:
    """One job that launch/slurm.sh wrote and submitted (its files under `out`), and the events that stop
    its attempts: each fires once the attempt is under way (`ready`); its after-action, if any, runs
    once the job is back in the queue."""

    def __init__(self, cluster, name, out, args, env, events=(), processes=1):
        self.cluster, self.name, self.out, self.events, self.processes = cluster, name, str(out), events, processes
        os.makedirs(self.out, exist_ok=True)
        res = subprocess.run(["bash", SLURM, "--job-name", name, "--logs", self.out, "--gpus-per-node", "0", *args],
                             capture_output=True, text=True, env={**env, "SLURM_CONF": cluster.conf}, cwd=ROOT,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        self.id = re.search(r"submitted job (\d+)", res.stdout).group(1)
        self.workdir = args[args.index("--workdir") + 1]
        self.fired, self.resumed_from, self.stopping, self.final = [], 0, False, None
        self.timeline = [(time.monotonic(), "submitted")]

    def state(self, states: dict | None = None) -> dict:
        """The job's fields in `scontrol show job` (from `states`, all jobs' fields, when given)."""
        if self.final is not None:
            return self.final
        state = (states or job_states(self.cluster, self.id)).get(self.id, {})
        if state.get("JobState") in ENDED:
            self.final = state
        return state

    def restarts(self, state=None) -> int:
        return int((state or self.state()).get("Restarts", 0))

    def log(self) -> str:
        path = os.path.join(self.out, f"{self.name}-{self.id}.log")
        return open(path).read() if os.path.exists(path) else ""

    def tail(self, chars: int = 6000) -> str:
        """The log's end for an assertion's message, without the Python thread dumps of an aborted trainer
        (they fill it and push out the line that says why it aborted), after every `error:` line in it."""
        log = re.sub(r"(?m)^(Thread 0x[0-9a-f]+|Current thread 0x[0-9a-f]+) .*\n(^ +File .*\n)*\n?", "", self.log())
        log = re.sub(r"(?m)^Extension modules: .*\n", "", log)
        errors = "".join(f"{line}\n" for line in log.splitlines() if line.startswith("error:"))  # cut off by a long tail
        return f"the log's error lines:\n{errors}...\n{log[-chars:]}" if errors else log[-chars:]

    def attempts(self) -> list[str]:
        """The job log split at each start of the job script."""
        return re.split(r"(?m)^(?=deltares: job \d+, restart \d+)", self.log())[1:]

    def logged(self) -> int:
        path = os.path.join(self.workdir, "metrics.jsonl")
        return open(path).read().count("\n") if os.path.exists(path) else 0

    def ready(self, restarts: int) -> bool:
        if self.processes == 0:  # a probe: its stand-in has started
            return f"restart={restarts}\n" in self.log()
        return self.logged() >= self.resumed_from + MIN_NEW_STEPS

    def step(self, state: dict) -> None:
        restarts, status = self.restarts(state), state.get("JobState")
        if self.stopping and status == "PENDING" and restarts == len(self.fired):
            self.stopping = False
            self.timeline.append((time.monotonic(), "pending"))
            self.resumed_from = self.logged()  # the stopped attempt's metrics end at the step it saved
            after = self.events[restarts - 1][1]
            if after is not None:
                after(self.cluster, self)
        elif (not self.stopping and status == "RUNNING" and restarts == len(self.fired) < len(self.events)
              and self.ready(restarts)):
            event = self.events[restarts][0]
            self.fired.append((event.__name__, self.logged()))
            self.timeline.append((time.monotonic(), f"{event.__name__} at step {self.logged()}"))
            self.stopping = True
            event(self.cluster, self)

    def records(self) -> list[list[dict]]:
        """Per attempt, each trainer process's record (tests/multihost_worker.py)."""
        out = []
        for restart in range(self.restarts() + 1):
            out.append([])
            for p in range(self.processes):
                path = os.path.join(self.out, f"rec-{p}-{restart}.json")
                assert os.path.exists(path), f"process {p} of restart {restart} left no record:\n{self.tail()}"
                with open(path) as f:
                    out[-1].append(json.load(f))
        return out


def job_states(cluster, *ids) -> dict:
    """{job id: its fields} of `scontrol show job` (every job without ids)."""
    out = {}
    for line in cluster.run("scontrol", "show", "job", "-o", *ids, check=False).splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in fields:
            out[fields["JobId"]] = fields
    return out


def preempt(cluster, job):
    node = job.state()["NodeList"]
    job.preemptor = cluster.run("sbatch", "--parsable", "--partition=urgent", f"--nodelist={node}", "--exclusive",
                                "--output=/dev/null", "--wrap=true").strip()


def time_limit(cluster, job):
    cluster.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={SAVE_BEFORE // 60}")


def restore_time_limit(cluster, job):
    cluster.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={TIME}")


def requeue(cluster, job):
    cluster.run("scontrol", "requeue", job.id)


def scancel_term(cluster, job):
    cluster.run("scancel", "--signal=TERM", job.id)


def scancel(cluster, job):
    cluster.run("scancel", job.id)


def node_failure(cluster, job):
    cluster.run("scontrol", "update", "NodeName=n3", "State=DOWN", "Reason=deltares-test")


def node_back(cluster, job):
    """n3 comes back once the stopped attempt's trainers are gone: they end by themselves after their save
    (n3's too: here the failed node is this machine, so its trainer lives on); one still there after a minute
    is killed, as the node's reboot would. A stale trainer must not reach the next attempt's coordinator."""
    deadline = time.monotonic() + 60
    while job_processes(job.id) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in job_processes(job.id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if "down" in cluster.run("sinfo", "-h", "-n", "n3", "-o", "%t"):
        cluster.run("scontrol", "update", "NodeName=n3", "State=RESUME")


def job_processes(job_id: str) -> list[int]:
    """The processes of job `job_id`'s tasks (SLURM_JOB_ID in their environment), on any node."""
    want = f"SLURM_JOB_ID={job_id}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster of the SLURM guide's commands, with four nodes."""
    folder = str(tmp_path_factory.mktemp("slurm"))
    start = subprocess.run([sys.executable, "-m", "tests.slurm_local", "start", folder, "--nodes", "4"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    cluster = slurm_local.Cluster(folder)
    try:
        assert start.returncode == 0, start.stderr
        assert start.stdout.splitlines()[-1] == f"export SLURM_CONF={cluster.conf}"
        yield cluster
    finally:
        stop = subprocess.run([sys.executable, "-m", "tests.slurm_local", "stop", folder], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0 and not cluster.pids(), stop.stderr


@pytest.fixture(scope="module")
def scenario(cluster, builtin_dataset, reference, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jobs")
    venv = fake_venv(tmp / "venv", f'if [ "$1" = -m ] && [ "$2" = deltares.train ]; then shift 2; exec '
                                   f'{sys.executable} {WORKER} "$@"; fi\nexec {sys.executable} "$@"\n')
    probe_venv = fake_venv(tmp / "probe-venv", PROBE)
    overrides = ["--", f"--config.data.dataset={builtin_dataset}", "--config.train.log_every=1",
                 "--config.train.checkpoint_every=4"]

    def trainers(name, args, sleep, events, processes=1, **env):
        return Job(cluster, name, tmp / name, [
            "--venv", venv, "--config", "experiments/debug.py", "--workdir", str(tmp / name / "run"), *args,
            *overrides], job_env(DELTARES_TEST_RECORD=str(tmp / name / "rec-{process}-{restart}"),
                                 DELTARES_TEST_STEP_SLEEP=sleep, **env), events, processes)

    def probe(name, args, exit_code, events=()):
        return Job(cluster, name, tmp / name, [
            "--venv", probe_venv, "--config", "experiments/debug.py", "--workdir", str(tmp / name / "run"),
            "--sbatch=--nodelist=n4", *args], job_env(PROBE_EXIT=str(exit_code)), events, processes=0)

    started = time.monotonic()
    jobs = [
        # restart 2 waits for SLURM's next time-limit check (up to 30 s): slow steps, so that it stops within
        # the run's 30; the last attempt: none
        trainers("single", ["--time", str(TIME), "--save-before", str(SAVE_BEFORE), "--sbatch=--nodelist=n1"],
                 "0.3,0.3,3,0", [(preempt, None), (requeue, None), (time_limit, restore_time_limit)]),
        # the nodes' names do not resolve here: the coordinator's address is given
        trainers("cluster", ["--nodes", "2", "--sbatch=--nodelist=n2,n3"], "0.3,0.3,0",
                 [(scancel_term, None), (node_failure, node_back)], processes=2,
                 JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{slurm_local.free_ports(1)[0]}"),
        probe("resources", ["--cpus-per-node", "1", "--mem", "100M"], 0),
        probe("stopped", [], 75),
        probe("no-requeue", ["--no-requeue"], 75),
        probe("failed", [], 1),
        probe("cancelled", [], "wait", [(scancel, None)]),
        probe("nograce", ["--partition", "nograce"], "wait", [(preempt, None)]),
    ]
    try:
        while True:
            every = job_states(cluster)
            states = {job.name: job.state(every) for job in jobs}
            if all(s.get("JobState") in ENDED for s in states.values()):
                break
            assert time.monotonic() - started < DEADLINE, f"the jobs did not end in {DEADLINE}s: {states}"
            for job in jobs:
                job.step(states[job.name])
            time.sleep(0.5)
    except BaseException:
        for job in jobs:
            print(f"--- job {job.name} {job.id}: {job.state()}\n{job.tail()}")
        raise
    print(f"slurm scenario: {time.monotonic() - started:.1f}s")
    for job in jobs[:2]:
        print(job.name, ", ".join(f"{t - started:.0f}s {what}" for t, what in job.timeline))
    return dict(jobs={job.name: job for job in jobs}, reference=reference, cluster=cluster)


def check_stops_and_resumes(job) -> list[int]:
    """Each stopped attempt saved one step (the same on every process) that the next resumed from; returns them."""
    attempts = job.attempts()
    assert len(attempts) == len(job.fired) + 1, job.tail()
    records = job.records()
    assert len(records) == len(attempts), job.tail()
    stops = []
    for k, (attempt, procs) in enumerate(zip(attempts, records)):
        assert [p["process"] for p in procs] == [[i, job.processes] for i in range(job.processes)]
        assert len({tuple(p["saves"]) for p in procs}) == 1, f"attempt {k}: the processes saved different steps"
        saves, said = procs[0]["saves"], [int(s) for s in re.findall(r"SIGTERM: saved step (\d+) ", attempt)]
        if k < len(job.fired):
            assert said == [saves[-1]] and job.fired[k][1] <= saves[-1] < STEPS, (k, saves, said, job.fired)
            stops.append(saves[-1])
        else:
            assert said == [] and saves[-1] == STEPS
        if k:
            assert f"resumed {job.workdir} from step {stops[k - 1]}\n" in attempt
    return stops


def losses(job) -> dict:
    records = read_metrics(job.workdir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return {r["step"]: r["loss"] for r in records}


def test_a_finished_run_ends_the_job_and_is_not_requeued(scenario):
    for name in ("single", "cluster"):
        job = scenario["jobs"][name]
        state = job.state()
        assert (state["JobState"], state["ExitCode"], job.restarts(state)) == ("COMPLETED", "0:0", len(job.fired)), \
            job.tail()
        assert job.attempts()[-1].rstrip().endswith("deltares: the run is finished")
        assert job.log().count("the run is finished") == 1


def test_preemption_with_a_grace_time_saves_and_the_job_requeues_itself(scenario):
    job = scenario["jobs"]["single"]
    first = job.attempts()[0]
    assert "DUE TO PREEMPTION" not in first  # the trainer saved and the job requeued itself within the grace time
    assert re.search(r"SIGTERM: saved step \d+ .*\n(.*\n)*deltares: the trainers stopped \(exit 75\); "
                     r"requeueing the job", first), first
    preemptor = scenario["cluster"].run("scontrol", "show", "job", "-o", job.preemptor)
    assert "JobState=COMPLETED" in preemptor and "Partition=urgent" in preemptor


def test_the_time_limit_and_a_requeue_save_and_resume_with_the_reference_losses(scenario):
    job = scenario["jobs"]["single"]
    assert len(check_stops_and_resumes(job)) == 3
    _, second, third, _ = job.attempts()
    assert "DUE TO JOB REQUEUE" in second and "requeueing" not in second  # SLURM requeued it
    assert "deltares: the time limit is near: SIGTERM to the trainers" in third
    assert "requeueing the job" in third and "TIME LIMIT" not in third
    assert losses(job) == scenario["reference"]["loss"]


def test_two_nodes_are_one_jax_cluster_and_each_stop_saves_one_agreed_step(scenario):
    job = scenario["jobs"]["cluster"]
    assert len(check_stops_and_resumes(job)) == 2
    for procs in job.records():
        assert all(p["distributed"] for p in procs)
        assert sorted(p["slurm"]["SLURM_NODEID"] for p in procs) == ["0", "1"]


def test_scancel_signal_and_a_node_failure_resume_with_the_reference_losses(scenario):
    job = scenario["jobs"]["cluster"]
    first, second, _ = job.attempts()
    assert "requeueing the job" in first  # scancel --signal=TERM reaches the trainers only: the job requeues itself
    assert "DUE TO NODE FAILURE" in second and "requeueing" not in second  # SLURM requeues it
    got, ref = losses(job), scenario["reference"]["loss"]
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], [ref[s] for s in range(1, STEPS + 1)],
                               rtol=0, atol=LOSS_ATOL)


def tres_of(state: dict) -> dict:
    """The job's resources (TRES=cpu=2,mem=3018M,node=1): counts, memory in megabytes."""
    out = {}
    for key, value in (item.split("=") for item in state["TRES"].split(",")):
        number = re.fullmatch(r"([\d.]+)([KMGT]?)", value)
        scale = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[number.group(2)] if key == "mem" else 1
        out[key] = round(float(number.group(1)) * scale)
    return out


def test_each_trainer_has_all_of_its_nodes_cpus_and_memory_unless_told(scenario):
    cluster = scenario["cluster"]
    memory = int(re.search(r"RealMemory=(\d+)", cluster.run("scontrol", "show", "node", "n1")).group(1))
    for name in ("single", "cluster"):
        job = scenario["jobs"][name]
        for procs in job.records():
            for p in procs:
                assert p["cpus"] == os.cpu_count() and p["slurm"]["SLURM_CPUS_ON_NODE"] == str(os.cpu_count())
        tres = tres_of(job.state())
        assert (tres["cpu"], tres["mem"]) == (os.cpu_count() * job.processes, memory * job.processes), tres
    job = scenario["jobs"]["resources"]  # --cpus-per-node 1 --mem 100M
    assert "probe -m deltares.train" in job.log() and "cpus=1 " in job.log()
    assert (tres_of(job.state())["cpu"], tres_of(job.state())["mem"]) == (1, 100)


@pytest.mark.parametrize("name, state, restarts, exit_code, line", [
    ("stopped", "COMPLETED", 1, 0, "requeueing the job"),  # stopped at a saved step: back in the queue, then finished
    ("no-requeue", "FAILED", 0, 75, "submit this job again to resume"),
    ("failed", "FAILED", 0, 1, None),  # a trainer that failed is not requeued: it would fail again
    ("cancelled", "CANCELLED", 0, None, None),  # scancel: the trainers saved (exit 75), and the job stays cancelled
    ("nograce", "COMPLETED", 1, 0, "DUE TO PREEMPTION"),  # the trainers got SIGTERM (and KillWait); SLURM requeued
])
def test_how_a_job_ends_by_the_trainers_exit_and_slurms_signals(scenario, name, state, restarts, exit_code, line):
    job = scenario["jobs"][name]
    got = job.state()
    assert (got["JobState"], job.restarts(got)) == (state, restarts)
    assert exit_code is None or got["ExitCode"] == f"{exit_code}:0"
    log = job.log()
    if line is None:
        assert "deltares: the trainers stopped" not in log, log
    else:
        assert line in log, log
    if job.events:  # the stand-in got SIGTERM: it said so, or its exit status 75 (its answer to SIGTERM) did
        first = job.attempts()[0]
        assert "probe: SIGTERM" in first or "the trainers stopped (exit 75)" in first, first
