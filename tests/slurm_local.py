"""A SLURM cluster on this machine, for tests/test_slurm.py and for trying `launch/slurm.sh` on a laptop
(docs/guides/scaling-out.md, "Try it on one machine"). As root, from the checkout:

    python -m tests.slurm_local start /tmp/deltares-slurm
    export SLURM_CONF=/tmp/deltares-slurm/slurm.conf
    python -m tests.slurm_local stop /tmp/deltares-slurm

`start` writes a `slurm.conf` into the folder (made if missing; every file of the cluster stays in it)
and starts Debian's `munged`, `slurmctld` and one `slurmd` per node, all on localhost: nodes `n1`,
`n2`, ... (`--nodes`, default 2), each with every CPU, its share of half the memory of this machine
and no GPUs. It needs root (slurmd starts each job as the user who submitted it) and the packages
`slurm-wlm` and `munge`; the cgroup plugins are off (tasks are bound to their CPUs by
task/affinity). Partitions: `debug` (the default) and `nograce` hold the jobs to try; a job in
`urgent` preempts them: one in `debug` gets SIGTERM and `--grace` seconds (default 20) before it is
killed, one in `nograce` none, and both are then requeued. The settings that make a cluster of one
machine quick: a requeued job waits `--requeue-delay` seconds (`cred_expire`, default 5; SLURM's is
120), a killed job's processes get `--kill-wait` seconds (default 30) between SIGTERM and SIGKILL.
SLURM checks time limits and sends `--signal`s every 30 seconds, whatever the config. `stop`
cancels every job, waits for them to end and stops the daemons.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo", "munge")
SBIN = ("/usr/sbin", "/sbin")


def find(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path=os.pathsep.join(SBIN))


def unavailable() -> str | None:
    """Why a cluster cannot start here, or None."""
    if sys.platform != "linux":
        return "SLURM runs on Linux only"
    missing = [p for p in (*DAEMONS, *COMMANDS) if find(p) is None]
    if missing:
        return f"{', '.join(missing)} not found: install Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting SLURM's daemons needs root (slurmd starts each job as its user)"
    return None


def free_ports(n: int) -> list[int]:
    """n different ports that nothing listens on now, below the kernel's range of ephemeral ports: no
    connection's own port and no `bind(port 0)` of another test takes them later, so a port chosen now
    is still free for a coordinator that starts minutes later (a requeued job's next attempt)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = random.Random().sample(range(10000, max(ephemeral_low, 10000 + 4 * n)), 4 * n + 200)
    ports = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports between 10000 and {ephemeral_low}")


def memory_mb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemTotal:"))


def config(folder: str, nodes: int, grace: int, requeue_delay: int, kill_wait: int) -> str:
    """slurm.conf of the cluster: every path in `folder`, the cgroup plugins off."""
    ctl, *node_ports = free_ports(1 + nodes)
    names = ",".join(f"n{i + 1}" for i in range(nodes))
    cpus, memory = os.cpu_count() or 1, max(256, memory_mb() // nodes // 2)
    lines = [
        "ClusterName=deltares",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctl}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge.socket,cred_expire={requeue_delay}",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool-%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/affinity",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        f"KillWait={kill_wait}",
        "ReturnToService=2",
        "MinJobAge=3600",  # an ended job stays in `scontrol show job` for an hour (SLURM's default: 300 s)
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        *(f"NodeName=n{i + 1} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory={memory}"
          for i, port in enumerate(node_ports)),
        f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace}",
        f"PartitionName=nograce Nodes={names} MaxTime=INFINITE State=UP PriorityTier=1",
        f"PartitionName=urgent Nodes={names} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
    ]
    return "\n".join(lines) + "\n"


class Cluster:
    """The cluster whose files are in `folder`: `env` is the environment its commands need (SLURM_CONF)."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        self.conf = os.path.join(self.folder, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def nodes(self) -> list[str]:
        with open(self.conf) as f:
            return [line.split()[0].split("=")[1] for line in f if line.startswith("NodeName=")]

    def run(self, *command: str, check: bool = True) -> str:
        """A SLURM command's stdout (stderr in the error when it fails)."""
        res = subprocess.run([find(command[0]) or command[0], *command[1:]], capture_output=True, text=True,
                             env=self.env, timeout=60)
        if check and res.returncode:
            raise RuntimeError(f"{' '.join(command)}: exit {res.returncode}: {res.stderr.strip()}")
        return res.stdout

    def start(self, nodes: int = 2, grace: int = 20, requeue_delay: int = 5, kill_wait: int = 30,
              timeout: float = 60) -> "Cluster":
        """Writes the config and starts the daemons; returns when every node is idle."""
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        os.makedirs(os.path.join(self.folder, "state"), exist_ok=True)
        if self.pids():
            raise RuntimeError(f"a cluster of {self.folder} runs already: stop it first")
        os.chmod(self.folder, 0o755)  # munged wants its socket reachable by everyone (--force: the parents too)
        key = os.path.join(self.folder, "munge.key")
        if not os.path.exists(key):
            with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(os.urandom(128))
        with open(self.conf, "w") as f:
            f.write(config(self.folder, nodes, grace, requeue_delay, kill_wait))
        d = self.folder
        try:
            self._daemon(find("munged"), "--force", f"--key-file={key}", f"--socket={d}/munge.socket",
                         f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed")
            self._daemon(find("slurmctld"), "-f", self.conf, "-c")
            for node in self.nodes():
                self._daemon(find("slurmd"), "-f", self.conf, "-N", node)
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _daemon(self, *command: str) -> None:
        res = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)
        if res.returncode:
            said = res.stderr.strip() or res.stdout.strip()
            raise RuntimeError(f"{os.path.basename(command[0])} did not start: {said} (its log is in {self.folder})")

    def wait_idle(self, timeout: float) -> None:
        deadline, states = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            if states and all(line.split()[1] == "idle" for line in states.splitlines()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes are not idle after {timeout:.0f}s: {states.strip() or 'no answer'}")

    def pids(self) -> dict[str, int]:
        """{pid file: pid} of this cluster's daemons that run (a stale pid file's pid, now another
        process's, is not one: its command line does not name this folder)."""
        out = {}
        for name in sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else ():
            if name.endswith(".pid"):
                try:
                    with open(os.path.join(self.folder, name)) as f:
                        pid = int(f.read().split()[0])
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        command = f.read().decode(errors="replace")
                except (OSError, ValueError, IndexError):
                    continue
                if self.folder + "/" in command:
                    out[name] = pid
        return out

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def stop(self, timeout: float = 60) -> None:
        """Cancels every job, waits for them to end, then stops slurmd, slurmctld and munged."""
        pids = self.pids()
        if "slurmctld.pid" in pids:
            self.run("scancel", "--user", str(os.getuid()), check=False)
            self.run("scancel", "--state", "PENDING", check=False)
            deadline = time.monotonic() + timeout
            while self.jobs() and time.monotonic() < deadline:
                self.run("scancel", "--full", *self.jobs(), check=False)
                time.sleep(0.5)
        _terminate(list(pids.values()))


def _terminate(pids: list[int], timeout: float = 20) -> None:
    """SIGTERM to `pids` (daemons, not our children), SIGKILL to those still there after `timeout`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.slurm_local", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("folder", help="where the config, state and logs of the cluster go")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--grace", type=int, default=20, help="seconds a preempted job of partition debug gets")
    parser.add_argument("--requeue-delay", type=int, default=5, help="seconds a requeued job waits (cred_expire)")
    parser.add_argument("--kill-wait", type=int, default=30, help="seconds between SIGTERM and SIGKILL (KillWait)")
    args = parser.parse_args(argv)
    cluster = Cluster(args.folder)
    try:
        if args.action == "start":
            cluster.start(args.nodes, args.grace, args.requeue_delay, args.kill_wait)
            print(f"SLURM runs: {', '.join(cluster.nodes())} on localhost. Now:\nexport SLURM_CONF={cluster.conf}")
        else:
            cluster.stop()
    except RuntimeError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
