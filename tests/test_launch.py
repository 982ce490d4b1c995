"""launch/tpu.sh, launch/gpu.sh, launch/slurm.sh and launch/gpu_bench.py: the commands they print
(--dry-run) and run.

No cloud, cluster or GPU needed: the real (non-dry) paths run against a fake `gcloud` or `sbatch`
on PATH, or a fake venv `python`, that log their arguments. The SLURM job script itself runs on a
real SLURM in tests/test_slurm.py (and its command line as 2 processes in tests/test_multihost.py);
here only what needs none: its options, its checks and the submission. With `FAKE_HOME` the fake
`gcloud` also runs each `ssh --command` in that directory, as one worker would: the
detached start, the log and pid files and `--stop` run for real there, with a fake
trainer that saves and exits on SIGTERM.
"""

import glob
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "launch", "tpu.sh")
GPU = os.path.join(ROOT, "launch", "gpu.sh")
GPU_BENCH = os.path.join(ROOT, "launch", "gpu_bench.py")
SLURM = os.path.join(ROOT, "launch", "slurm.sh")
BASH = shutil.which("bash")
SEP = "\x1f"  # the fakes join their arguments with this


def jax_pin():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        return next(line.split("==")[1].strip() for line in f if line.startswith("jax=="))


TPU_ARGS = ["--name", "run1", "--zone", "us-east5-a", "--type", "v5p-8",
            "--config", "experiments/s7b6.py:delta_block", "--workdir", "gs://bucket/run"]
OVERRIDES = ["--config.train.steps=10", "--config.data.dataset=/data/my corpus", "--config.note=it's \"quoted\" $HOME"]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTARES_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def path_without_gcloud(tmp_path_factory):
    """A PATH with every executable of the current one except gcloud."""
    bindir = tmp_path_factory.mktemp("bin")
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src, dst = os.path.join(d, name), bindir / name
            if name != "gcloud" and not dst.exists() and os.path.isfile(src) and os.access(src, os.X_OK):
                dst.symlink_to(src)
    return str(bindir)


def run(script, args, env=None, cwd=ROOT):
    """The script's result; a run that holds its output open (a trainer not detached) times out."""
    return subprocess.run([BASH, script, *args], capture_output=True, text=True, env=env or clean_env(), cwd=cwd,
                          timeout=60)


def commands(stdout):
    """The printed commands of a --dry-run, each as an argv list."""
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def find(cmds, *words):
    found = [c for c in cmds if all(w in c for w in words)]
    assert len(found) == 1, (words, cmds)
    return found[0]


def opt(argv, name):
    return argv[argv.index(name) + 1]


def train_argv(command):
    """The argv of `python -m deltares.train ...` inside the remote start command (its `bash -c` script)."""
    words = shlex.split(command)
    inner = shlex.split(words[words.index("-c") + 1])
    return inner[inner.index("-m") + 1:]


def check_one_line_error(res, *needles):
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0]
    assert "+ " not in res.stdout


# ---------------------------------------------------------------- tpu.sh --dry-run


def test_tpu_dry_run_prints_every_step(path_without_gcloud):
    res = run(TPU, ["--dry-run", *TPU_ARGS, "--", *OVERRIDES], env=clean_env(PATH=path_without_gcloud))
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    assert all(c[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] for c in cmds if c[0] == "gcloud")

    describe = find(cmds, "describe")
    assert describe[5] == "run1" and opt(describe, "--zone") == "us-east5-a"
    create = find(cmds, "create")
    assert create[5] == "run1" and opt(create, "--zone") == "us-east5-a"
    assert opt(create, "--accelerator-type") == "v5p-8" and opt(create, "--version") == "v2-alpha-tpuv5"
    assert "--spot" not in create and "--project" not in create

    scp = find(cmds, "scp")
    assert "--worker=all" in scp and opt(scp, "--zone") == "us-east5-a"
    assert scp[5].endswith(".tgz") and scp[6] == "run1:deltares.tgz"

    ssh = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
    assert len(ssh) == 2
    for c in ssh:
        assert c[5] == "run1" and "--worker=all" in c and opt(c, "--zone") == "us-east5-a"
        subprocess.run([BASH, "-n", "-c", opt(c, "--command")], check=True)  # valid shell
    install, train = (opt(c, "--command") for c in ssh)
    assert "tar -xzf deltares.tgz -C deltares" in install
    assert "pip install -q -r deltares/requirements.txt" in install
    assert f"jax[tpu]=={jax_pin()}" in shlex.split(install.replace(";", " ; "))
    assert train_argv(train) == ["deltares.train", "--config", "experiments/s7b6.py:delta_block",
                                 "--workdir", "gs://bucket/run", *OVERRIDES]
    assert "; cd deltares; setsid nohup bash -c " in train  # detached from the SSH session
    assert train.endswith(" >> ../deltares-logs/run1.log 2>&1 < /dev/null &")
    words = shlex.split(train)
    assert words[words.index("-c") + 1].startswith(
        "echo $$ > ../deltares-logs/run1.pid; exec ../deltares-venv/bin/python -m deltares.train ")
    # The order: create/describe, copy, install, train.
    order = [cmds.index(c) for c in (describe, create, scp, ssh[0], ssh[1])]
    assert order == sorted(order)


def test_tpu_settings_from_env_and_equals_flags(path_without_gcloud):
    env = clean_env(PATH=path_without_gcloud, DELTARES_TPU_NAME="envname", DELTARES_TPU_ZONE="europe-west4-a",
                    DELTARES_TPU_TYPE="v6e-16", DELTARES_CONFIG="experiments/s220m.py:delta",
                    DELTARES_WORKDIR="/mnt/runs/a", DELTARES_TPU_PROJECT="proj")
    res = run(TPU, ["--dry-run", "--zone=us-central2-b", "--spot"], env=env)
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    create = find(cmds, "create")
    assert create[5] == "envname" and opt(create, "--zone") == "us-central2-b"  # flag beats env
    assert opt(create, "--version") == "v2-alpha-tpuv6e" and "--spot" in create
    for c in cmds:
        if c[0] == "gcloud":
            assert opt(c, "--project") == "proj"
    train = opt([c for c in cmds if "ssh" in c][-1], "--command")
    assert train_argv(train) == ["deltares.train", "--config", "experiments/s220m.py:delta", "--workdir", "/mnt/runs/a"]


@pytest.mark.parametrize("tpu_type,version", [("v5litepod-8", "v2-alpha-tpuv5-lite"), ("v4-32", "tpu-ubuntu2204-base")])
def test_tpu_default_runtime_version(tpu_type, version):
    args = [a if a != "v5p-8" else tpu_type for a in TPU_ARGS]
    res = run(TPU, ["--dry-run", *args])
    assert res.returncode == 0, res.stderr
    assert opt(find(commands(res.stdout), "create"), "--version") == version


def test_tpu_unknown_type_needs_version():
    args = [a if a != "v5p-8" else "v9z-8" for a in TPU_ARGS]
    check_one_line_error(run(TPU, ["--dry-run", *args]), "--version")
    res = run(TPU, ["--dry-run", *args, "--version", "my-runtime"])
    assert res.returncode == 0, res.stderr
    assert opt(find(commands(res.stdout), "create"), "--version") == "my-runtime"


@pytest.mark.parametrize("action,worker", [("--logs", "--worker=0"), ("--stop", "--worker=all")])
def test_tpu_logs_and_stop_need_only_name_and_zone(action, worker, path_without_gcloud):
    res = run(TPU, ["--dry-run", "--name", "run1", "--zone", "us-east5-a", "--project", "p", action],
              env=clean_env(PATH=path_without_gcloud))
    assert res.returncode == 0, res.stderr
    (cmd,) = commands(res.stdout)  # no create, copy or install
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "run1"] and worker in cmd
    assert opt(cmd, "--zone") == "us-east5-a" and opt(cmd, "--project") == "p"
    remote = opt(cmd, "--command")
    subprocess.run([BASH, "-n", "-c", remote], check=True)
    if action == "--logs":
        assert remote == "tail -n 200 -F deltares-logs/run1.log"
    else:
        assert "kill -TERM $pid" in remote and "deltares-logs/run1.pid" in remote
    check_one_line_error(run(TPU, ["--dry-run", "--name", "run1", action]), "missing", "--zone")
    check_one_line_error(run(TPU, ["--dry-run", "--name", "run1", "--zone", "z", "--logs", "--stop"]), "exclude")


@pytest.mark.parametrize("flag", ["--name", "--zone", "--type", "--config", "--workdir"])
def test_tpu_missing_setting_is_a_one_line_error(flag):
    i = TPU_ARGS.index(flag)
    args = TPU_ARGS[:i] + TPU_ARGS[i + 2:]
    res = run(TPU, ["--dry-run", *args])
    check_one_line_error(res, "missing", flag)
    assert res.returncode == 2


def test_tpu_bad_arguments():
    check_one_line_error(run(TPU, ["--dry-run", *TPU_ARGS, "--zone"]), "--zone needs a value")
    check_one_line_error(run(TPU, ["--dry-run", *TPU_ARGS, "--bogus"]), "--bogus")
    args = [a if a != "experiments/s7b6.py:delta_block" else "experiments/nope.py:x" for a in TPU_ARGS]
    check_one_line_error(run(TPU, ["--dry-run", *args]), "experiments/nope.py")
    assert run(TPU, ["--help"]).returncode == 0


def test_tpu_without_gcloud_is_a_clear_error(path_without_gcloud):
    res = run(TPU, TPU_ARGS, env=clean_env(PATH=path_without_gcloud))
    check_one_line_error(res, "gcloud not found")


# ---------------------------------------------------------------- tpu.sh with a fake gcloud

FAKE_GCLOUD = f"""#!/usr/bin/env bash
{{ printf '%s{SEP}' "$@"; echo; }} >> "$FAKE_LOG"
[[ $4 != "${{FAKE_FAIL:-}}" ]] || exit 1
case "$4" in
  describe) [[ -n ${{FAKE_STATE:-}} ]] || exit 1; echo "$FAKE_STATE" ;;
  scp) cp "$5" "$FAKE_TARBALL"; [[ -z ${{FAKE_HOME:-}} ]] || cp "$5" "$FAKE_HOME/deltares.tgz" ;;
  ssh) [[ -z ${{FAKE_HOME:-}} ]] || {{ cd "$FAKE_HOME" && HOME=$FAKE_HOME bash -c "${{@: -1}}"; }} ;;
esac
"""
# The venv of a fake worker: pip does nothing; "python" is a trainer that logs, then saves and
# exits 0 on SIGTERM.
FAKE_PIP = "#!/bin/sh\n"
FAKE_TRAINER = """#!/usr/bin/env bash
trap 'echo "fake trainer: SIGTERM, saved"; exit 0' TERM
echo "fake trainer in $PWD: $*"
while :; do sleep 0.05; done
"""


@pytest.fixture
def fake_gcloud(tmp_path, path_without_gcloud):
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "gcloud").write_text(FAKE_GCLOUD)
    (bindir / "gcloud").chmod(0o755)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    log, tarball = tmp_path / "gcloud.log", tmp_path / "copied.tgz"

    def launch(*args, state="", fail="none", home=""):
        env = clean_env(PATH=f"{bindir}{os.pathsep}{path_without_gcloud}", FAKE_LOG=str(log),
                        FAKE_TARBALL=str(tarball), FAKE_STATE=state, FAKE_FAIL=fail, TMPDIR=str(tmpdir),
                        FAKE_HOME=str(home))
        res = run(TPU, list(args), env=env, cwd=str(tmp_path))
        calls = [line.split(SEP)[:-1] for line in log.read_text().splitlines()] if log.exists() else []
        assert not os.listdir(tmpdir), "the tarball was not cleaned up"
        return res, calls

    launch.tarball = tarball
    return launch


def test_tpu_creates_copies_installs_and_trains(fake_gcloud):
    res, calls = fake_gcloud(*TPU_ARGS, "--spot", "--", *OVERRIDES)
    assert res.returncode == 0, res.stderr
    assert [c[3] for c in calls] == ["describe", "create", "scp", "ssh", "ssh"]
    assert calls[0] == ["compute", "tpus", "tpu-vm", "describe", "run1", "--zone", "us-east5-a", "--format=value(state)"]
    assert calls[1] == ["compute", "tpus", "tpu-vm", "create", "run1", "--zone", "us-east5-a",
                        "--accelerator-type", "v5p-8", "--version", "v2-alpha-tpuv5", "--spot"]
    assert calls[2][5:] == ["run1:deltares.tgz", "--zone", "us-east5-a", "--worker=all"]
    for c in calls[3:]:
        assert c[4:9] == ["run1", "--zone", "us-east5-a", "--worker=all", "--command"] and len(c) == 10
    assert f"jax[tpu]=={jax_pin()}" in calls[3][9]
    assert train_argv(calls[4][9]) == ["deltares.train", "--config", "experiments/s7b6.py:delta_block",
                                       "--workdir", "gs://bucket/run", *OVERRIDES]

    with tarfile.open(fake_gcloud.tarball) as tar:
        names = set(tar.getnames())
    assert {"requirements.txt", "deltares/train.py", "experiments/s7b6.py", "launch/tpu.sh"} <= names
    assert not any(n.startswith((".git/", "runs/")) or "__pycache__" in n for n in names)


def test_tpu_reuses_a_ready_tpu(fake_gcloud):
    res, calls = fake_gcloud(*TPU_ARGS, state="READY")
    assert res.returncode == 0, res.stderr
    assert [c[3] for c in calls] == ["describe", "scp", "ssh", "ssh"]
    assert "reusing" in res.stderr


def test_tpu_refuses_a_tpu_that_is_not_ready(fake_gcloud):
    res, calls = fake_gcloud(*TPU_ARGS, state="PREEMPTED")
    check_one_line_error(res, "PREEMPTED", "run1")
    assert [c[3] for c in calls] == ["describe"]


@pytest.mark.parametrize("step", ["create", "scp", "ssh"])
def test_tpu_stops_at_a_failing_gcloud_step(fake_gcloud, step):
    res, calls = fake_gcloud(*TPU_ARGS, fail=step)
    assert res.returncode != 0
    assert calls[-1][3] == step and [c[3] for c in calls].count("ssh") <= 1


def trainer_alive(pid):
    """True while `pid` is a running trainer (a zombie, where no init reaps it, has no command line)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"deltares.train" in f.read()
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_tpu_training_is_detached_logged_and_stopped_on_a_fake_worker(fake_gcloud, tmp_path):
    home = tmp_path / "home"
    (home / "deltares-venv" / "bin").mkdir(parents=True)
    for name, text in (("pip", FAKE_PIP), ("python", FAKE_TRAINER)):
        (home / "deltares-venv" / "bin" / name).write_text(text)
        (home / "deltares-venv" / "bin" / name).chmod(0o755)
    log, pidfile = home / "deltares-logs" / "run1.log", home / "deltares-logs" / "run1.pid"
    res, _ = fake_gcloud(*TPU_ARGS, "--", *OVERRIDES, state="READY", home=home)
    try:
        assert res.returncode == 0, res.stderr
        assert "--logs" in res.stderr and "--stop" in res.stderr
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip())  # written by the detached shell
        pid = int(pidfile.read_text())
        # The trainer outlives the SSH command, in a session of its own, deaf to the hangup. (Waited for:
        # while the shell that wrote the pid file execs into the trainer, /proc/PID/cmdline can read empty.)
        wait_until(lambda: trainer_alive(pid))
        assert os.getsid(pid) == pid
        wait_until(lambda: "fake trainer in" in log.read_text())
        os.kill(pid, signal.SIGHUP)
        time.sleep(0.3)
        assert trainer_alive(pid)
        assert (home / "deltares" / "deltares" / "train.py").exists()
        text = log.read_text()
        assert "launch/tpu.sh start" in text.splitlines()[0]
        assert f"fake trainer in {home / 'deltares'}: -m deltares.train --config experiments/s7b6.py:delta_block" in text
        assert text.rstrip().endswith(" ".join(OVERRIDES))

        # A second launch refuses to unpack under the running trainer.
        res, _ = fake_gcloud(*TPU_ARGS, state="READY", home=home)
        assert res.returncode != 0 and f"training is still running (pid {pid})" in res.stderr
        assert trainer_alive(pid)

        # --stop: SIGTERM, then waits until the trainer has saved and exited.
        res, _ = fake_gcloud("--name", "run1", "--zone", "us-east5-a", "--stop", home=home)
        assert res.returncode == 0, res.stderr
        assert f"SIGTERM to {pid}" in res.stdout and res.stdout.rstrip().endswith("stopped")
        assert not trainer_alive(pid)
        assert log.read_text().rstrip().endswith("fake trainer: SIGTERM, saved")
        res, _ = fake_gcloud("--name", "run1", "--zone", "us-east5-a", "--stop", home=home)
        assert res.returncode == 0 and "no training running" in res.stdout
    finally:  # a failed test must not leave a trainer behind: the detached trainer leads its own session
        deadline = time.monotonic() + 5
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pidfile.exists() and (pid := int(pidfile.read_text() or 0)):
            try:
                if os.getsid(pid) == pid:  # that session, not a recycled pid
                    os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


FAKE_CURL = """#!/usr/bin/env bash
case "${@: -1}" in
  */agent-worker-number) echo 2 ;;
  */worker-network-endpoints) echo "unknown:unknown:10.0.0.1,unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3,unknown:unknown:10.0.0.4" ;;
  *) exit 22 ;;
esac
"""


def test_tpu_prepare_runs_each_workers_share_detached(fake_gcloud, tmp_path):
    """--prepare: every worker runs deltares.data.prepare with the flags after `--` and its own
    --shard / --num_shards from the metadata server (here a fake curl: worker 2 of 4)."""
    home = tmp_path / "home"
    (home / "deltares-venv" / "bin").mkdir(parents=True)
    for name, text in (("pip", FAKE_PIP), ("python", '#!/bin/sh\necho "fake prepare in $PWD: $*"\n')):
        (home / "deltares-venv" / "bin" / name).write_text(text)
        (home / "deltares-venv" / "bin" / name).chmod(0o755)
    (tmp_path / "fakebin" / "curl").write_text(FAKE_CURL)
    (tmp_path / "fakebin" / "curl").chmod(0o755)
    flags = ["--source", "gs://b/corpus/*.txt.gz", "--tokenizer", "gpt2", "--out", "gs://b/data"]
    res, calls = fake_gcloud("--name", "run1", "--zone", "us-east5-a", "--type", "v5p-32", "--prepare", "--",
                             *flags, state="READY", home=home)
    assert res.returncode == 0, res.stderr
    assert [c[3] for c in calls] == ["describe", "scp", "ssh", "ssh"]
    assert "--worker=all" in calls[-1]
    log = home / "deltares-logs" / "run1-prepare.log"
    wait_until(lambda: log.exists() and "fake prepare in" in log.read_text())
    assert "launch/tpu.sh prepare" in log.read_text().splitlines()[0]
    assert log.read_text().splitlines()[-1] == (
        f"fake prepare in {home / 'deltares'}: -m deltares.data.prepare {' '.join(flags)} --shard 2 --num_shards 4")
    check_one_line_error(run(TPU, ["--dry-run", "--name", "run1", "--zone", "z", "--prepare"]), "--type")


# ---------------------------------------------------------------- gpu.sh

GPU_ARGS = ["--config", "experiments/s220m.py:delta_block", "--workdir", "runs/x"]


def test_gpu_dry_run_prints_every_step(tmp_path):
    venv = str(tmp_path / "venv")
    res = run(GPU, ["--dry-run", *GPU_ARGS, "--venv", venv, "--", *OVERRIDES], cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    py = f"{venv}/bin/python"
    assert cmds[0] == ["cd", ROOT]
    assert cmds[1] == ["python3", "-m", "venv", venv]
    assert [py, "-m", "pip", "install", "-q", "-r", "requirements.txt"] in cmds
    assert [py, "-m", "pip", "install", "-q", f"jax[cuda12]=={jax_pin()}"] in cmds
    check = find(cmds, "-c")
    assert check[:2] == ["env", py] and "jax.devices()" in check[-2] and check[-1] == "0"  # JAX sees any number
    assert cmds[-1] == ["env", py, "-m", "deltares.train", "--config", "experiments/s220m.py:delta_block",
                        "--workdir", str(tmp_path / "runs" / "x"), *OVERRIDES]  # from where it was started


def test_gpu_options(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)
    res = run(GPU, ["--dry-run", *GPU_ARGS, f"--venv={venv}", "--cuda", "13"])
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    assert not any("venv" in c for c in cmds)  # reused
    assert f"jax[cuda13]=={jax_pin()}" in cmds[-3]
    assert cmds[-2][0] == "env" and cmds[-2][-1] == "0" and cmds[-1][:2] == ["env", str(venv / "bin" / "python")]
    for gpus, visible, count in (("4", "0,1,2,3", "4"), ("1,3,6", "1,3,6", "3"), ("5,", "5", "1")):
        cmds = commands(run(GPU, ["--dry-run", *GPU_ARGS, f"--venv={venv}", "--gpus", gpus]).stdout)
        assert cmds[-2][:2] == cmds[-1][:2] == ["env", f"CUDA_VISIBLE_DEVICES={visible}"]
        assert cmds[-2][-1] == count  # the number of GPUs the check wants JAX to see
    res = run(GPU, ["--dry-run", *GPU_ARGS, f"--venv={venv}", "--skip-install"])
    assert not any("pip" in c for c in commands(res.stdout))
    env = clean_env(DELTARES_CONFIG="experiments/tiny.py:delta", DELTARES_WORKDIR="runs/y", DELTARES_VENV=str(venv))
    res = run(GPU, ["--dry-run"], env=env)
    assert commands(res.stdout)[-1][-4:] == ["--config", "experiments/tiny.py:delta", "--workdir", "runs/y"]


@pytest.mark.parametrize("args,needle", [
    (GPU_ARGS[2:], "--config"),
    (GPU_ARGS[:2], "--workdir"),
    ([*GPU_ARGS, "--cuda", "11"], "--cuda"),
    ([*GPU_ARGS, "--gpus"], "--gpus needs a value"),
    ([*GPU_ARGS, "--gpus", "0"], "--gpus must be all, a number of GPUs or a list of IDs"),
    ([*GPU_ARGS, "--gpus", "1-3"], "not '1-3'"),
    ([*GPU_ARGS, "--gpus", "-1"], "not '-1'"), ([*GPU_ARGS, "--gpus", "nan"], "not 'nan'"),
    ([*GPU_ARGS, "--gpus", "99999999999"], "give a number from 1 to 256"),
    (["--config", "experiments/nope.py:x", "--workdir", "w"], "experiments/nope.py"),
])
def test_gpu_bad_settings_are_one_line_errors(args, needle):
    check_one_line_error(run(GPU, ["--dry-run", *args]), needle)


FAKE_PYTHON = f"""#!/usr/bin/env bash
{{ printf '%s{SEP}' "$PWD" "${{CUDA_VISIBLE_DEVICES:-}}" "$@"; echo; }} >> "$FAKE_LOG"
[[ "$*" != *jax.devices* || -z ${{FAKE_NO_GPU:-}} ]]
"""


@pytest.mark.parametrize("no_gpu", [False, True])
def test_gpu_real_run_with_a_fake_venv(tmp_path, no_gpu):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    log = tmp_path / "python.log"
    env = clean_env(FAKE_LOG=str(log), FAKE_NO_GPU="1" if no_gpu else "")
    res = run(GPU, [*GPU_ARGS, "--venv", str(venv), "--gpus", "1", "--", "--config.train.steps=3"], env=env,
              cwd=str(tmp_path))
    calls = [line.split(SEP)[:-1] for line in log.read_text().splitlines()]
    assert all(c[0] == ROOT for c in calls)  # run from the repository root
    assert calls[0][2] == "-c" and "version_info" in calls[0][3]
    assert calls[1][2:] == ["-m", "pip", "install", "-q", "-U", "pip"]
    assert calls[2][2:] == ["-m", "pip", "install", "-q", "-r", "requirements.txt"]
    assert calls[3][2:] == ["-m", "pip", "install", "-q", f"jax[cuda12]=={jax_pin()}"]
    assert calls[4][1] == "0" and "jax.devices()" in calls[4][3]
    if no_gpu:
        assert res.returncode != 0 and len(calls) == 5
    else:
        assert res.returncode == 0, res.stderr
        assert calls[5][1:] == ["0", "-m", "deltares.train", *GPU_ARGS[:3], str(tmp_path / "runs" / "x"),
                                "--config.train.steps=3"]


FAKE_JAX = """__version__ = "fake"
class Device:
    def __init__(self, platform):
        self.platform = platform
def devices():
    import os
    return [Device(os.environ["FAKE_PLATFORM"])] * int(os.environ["FAKE_DEVICES"])
"""


@pytest.mark.parametrize("platform, devices, gpus, error", [
    ("gpu", 8, "all", None), ("gpu", 4, "4", None), ("gpu", 2, "0,3", None),
    ("gpu", 8, "4", "JAX sees 8 GPUs, not the 4 of --gpus"), ("cpu", 1, "all", "JAX sees no GPU"),
])
def test_gpu_check_wants_the_gpus_asked_for(tmp_path, platform, devices, gpus, error):
    """The check command as printed, run with a stand-in `jax` that has DEVICES devices of PLATFORM."""
    (tmp_path / "jax.py").write_text(FAKE_JAX)
    cmds = commands(run(GPU, ["--dry-run", *GPU_ARGS, "--skip-install", "--gpus", gpus]).stdout)
    check = find(cmds, "-c")
    env = clean_env(PYTHONPATH=str(tmp_path), FAKE_PLATFORM=platform, FAKE_DEVICES=str(devices))
    res = subprocess.run([sys.executable, *check[check.index("-c"):]], env=env, capture_output=True, text=True)
    if error is None:
        assert res.returncode == 0 and f"fake {devices} devices" in res.stdout, res.stderr
    else:
        assert res.returncode == 1 and res.stderr.strip() == f"gpu.sh: error: {error}" + (
            "" if platform == "gpu" else " (driver? --cuda 12/13?)")


# ---------------------------------------------------------------- every launcher: paths and flags


def launched_train(script, args, cwd, env):
    """The argv of the trainer a --dry-run of `script` starts (for tpu.sh, inside the remote command)."""
    res = run(script, ["--dry-run", *args], env=env, cwd=str(cwd))
    assert res.returncode == 0, res.stderr
    if script == TPU:
        return train_argv(opt([c for c in commands(res.stdout) if "ssh" in c][-1], "--command"))
    if script == SLURM:
        (line,) = [line for line in res.stdout.splitlines() if line.startswith("srun ")]
        words = shlex.split(line)[:-1]
    else:
        words = commands(res.stdout)[-1]
    return words[words.index("-m") - 1:]


SCRIPTS = {"tpu.sh": (TPU, TPU_ARGS[:6]), "gpu.sh": (GPU, ["--skip-install"]), "slurm.sh": (SLURM, [])}


@pytest.mark.parametrize("name", SCRIPTS)
def test_paths_are_taken_from_where_the_launcher_starts(name, tmp_path, path_without_gcloud):
    """--config (and for gpu.sh and slurm.sh --workdir and --venv): relative to the current directory, not
    the checkout; `~` expanded (the shell leaves `--venv=~/x` alone); absolute as given; a shipped
    experiment by name from anywhere. Inside the checkout a path is written relative to it (the trainer
    runs there, on a TPU worker too)."""
    script, base = SCRIPTS[name]
    here, home = tmp_path / "here", tmp_path / "home"
    (here / "sub").mkdir(parents=True)
    (home / "exp").mkdir(parents=True)
    (here / "sub" / "my.py").write_text("# an experiment\n")
    (home / "exp" / "h.py").write_text("# another\n")
    env = clean_env(HOME=str(home), PATH=path_without_gcloud)
    local = script != TPU  # tpu.sh's workdir is a path on the workers, passed on as given
    for config, workdir, venv, want_config, want_workdir, want_py in [
        ("sub/my.py:delta", "runs/x", "v", f"{here}/sub/my.py:delta", f"{here}/runs/x", f"{here}/v/bin/python"),
        ("~/exp/h.py:delta", "~/w", "~/v", f"{home}/exp/h.py:delta", f"{home}/w", f"{home}/v/bin/python"),
        (f"{here}/sub/../sub/my.py", "gs://b/r", f"{ROOT}/.venv-x", f"{here}/sub/my.py", "gs://b/r",
         f"{ROOT}/.venv-x/bin/python"),
        ("tiny:delta", "../w", "./v", "experiments/tiny.py:delta", f"{tmp_path}/w", f"{here}/v/bin/python"),
        ("experiments/tiny.py:delta", f"{ROOT}/runs/y", "v", "experiments/tiny.py:delta", "runs/y", None),
        (f"{ROOT}/experiments/tiny.py", "w", "v", "experiments/tiny.py", f"{here}/w", None),
    ]:
        args = [*base, f"--config={config}", "--workdir", workdir, *([f"--venv={venv}"] if local else [])]
        argv = launched_train(script, args, here, env)
        if script == TPU and not want_config.startswith("experiments/"):  # copied with the checkout
            want_config = f".launch/{want_config.rsplit('/', 1)[1]}"
        assert argv[argv.index("--config") + 1] == want_config, (config, argv)
        assert argv[argv.index("--workdir") + 1] == (want_workdir if local else workdir), (workdir, argv)
        if local and want_py:
            assert os.path.join(ROOT, argv[0]) == want_py, (venv, argv)  # run from the checkout
    for config, needle in (("nope.py:x", f"--config nope.py: no such file (a relative path is taken from {here})"),
                           ("sub", "--config sub: is a folder"), ("~nobody_here/x.py", "no user 'nobody_here'")):
        check_one_line_error(run(script, ["--dry-run", *base, "--config", config, "--workdir", "w"], env=env,
                                 cwd=str(here)), needle)


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("flag", ["--workdir=/other", "--workdir", "-workdir=x", "--config", "--config=tiny:x"])
def test_flags_the_launcher_sets_are_refused_after_the_separator(name, flag, path_without_gcloud):
    script, base = SCRIPTS[name]
    args = ["--dry-run", *base, "--config", "tiny:delta", "--workdir", "/w", "--", "--config.train.steps=3", flag,
            "x"]
    res = run(script, args, env=clean_env(PATH=path_without_gcloud))
    check_one_line_error(res, f"{flag.split('=')[0]} after -- repeats a flag that {name} sets")
    res = run(script, [*args[:-2], "--config.workdir_note=x"], env=clean_env(PATH=path_without_gcloud))
    assert res.returncode == 0, res.stderr  # an override whose name merely starts alike passes


def test_slurm_refuses_the_exit_status_it_sets_after_the_separator(path_without_gcloud):
    """The job script requeues on the trainers' --stopped_exit_code: another one after -- is refused."""
    script, base = SCRIPTS["slurm.sh"]
    for flag in ("--stopped_exit_code=0", "--stopped_exit_code", "-stopped_exit_code=3"):
        res = run(script, ["--dry-run", *base, "--config", "tiny:delta", "--workdir", "/w", "--", flag, "1"],
                  env=clean_env(PATH=path_without_gcloud))
        check_one_line_error(res, f"{flag.split('=')[0]} after -- repeats a flag that slurm.sh sets")


@pytest.mark.parametrize("flag", ["--shard=1", "--num_shards", "-shard"])
def test_tpu_prepare_refuses_the_share_flags_it_sets(flag):
    res = run(TPU, ["--dry-run", "--name", "n", "--zone", "z", "--type", "v5p-16", "--prepare", "--", "--source",
                    "a.txt", flag, "2"])
    check_one_line_error(res, f"{flag.split('=')[0]} after -- repeats a flag that tpu.sh sets")


def test_tpu_copies_a_config_from_outside_the_checkout(fake_gcloud, tmp_path):
    """An experiment file the checkout's copy would not hold (outside it, or ignored by git) travels in the
    tarball as .launch/FILE, and the workers train with that."""
    (tmp_path / "mine.py").write_text("# my experiment\n")
    res, calls = fake_gcloud(*TPU_ARGS[:6], "--config", "mine.py:delta", "--workdir", "gs://b/r", state="READY")
    assert res.returncode == 0, res.stderr
    assert train_argv(calls[-1][9])[:3] == ["deltares.train", "--config", ".launch/mine.py:delta"]
    with tarfile.open(fake_gcloud.tarball) as tar:
        assert tar.extractfile(".launch/mine.py").read() == b"# my experiment\n"
        assert "experiments/tiny.py" in tar.getnames()


# ---------------------------------------------------------------- slurm.sh

SLURM_ARGS = ["--config", "experiments/s7b6.py:delta_block", "--workdir", "/shared/runs/s7b6"]


def slurm_job(args, env=None):
    """(the job script, its #SBATCH options, the srun line's words, the printed commands) of a --dry-run."""
    res = run(SLURM, ["--dry-run", *args], env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ") and line.endswith(".sbatch:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("+ mkdir"))
    script = "\n".join(lines[start + 1:end]) + "\n"
    subprocess.run([BASH, "-n", "-c", script], check=True)  # valid shell
    options = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    (srun,) = [shlex.split(line) for line in script.splitlines() if line.startswith("srun ")]
    return script, options, srun, commands(res.stdout)


def test_slurm_dry_run_prints_the_job_and_the_submission(tmp_path):
    venv = tmp_path / "venv"
    script, options, srun, cmds = slurm_job([
        *SLURM_ARGS, "--nodes", "4", "--gpus-per-node", "8", "--time", "24:00:00", "--partition", "gpu",
        "--account=lab", "--sbatch=--qos=high", "--sbatch", "--constraint=h100", "--venv", str(venv), "--requeue",
        "--save-before", "600", "--job-name", "s7b6", "--", *OVERRIDES])
    assert script.startswith("#!/bin/bash\n")
    assert options == [
        "--job-name=s7b6", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive", "--mem=0",
        "--time=24:00:00", "--partition=gpu", "--account=lab", f"--chdir={ROOT}", "--output=runs/slurm/s7b6-%j.log",
        "--open-mode=append", "--signal=B:USR1@600", "--requeue", "--qos=high", "--constraint=h100"]
    assert srun == ["srun", "--kill-on-bad-exit=1", "env", "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
                    f"{venv}/bin/python", "-m", "deltares.train", *SLURM_ARGS, "--stopped_exit_code=75", *OVERRIDES, "&"]
    assert 'scancel --signal=TERM "$SLURM_JOB_ID"' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert not re.search(r"\bkill -", script)  # SIGTERM to srun would kill the trainers unsaved
    assert cmds == [["cd", ROOT], ["mkdir", "-p", "runs/slurm"], ["sbatch", "--parsable", "runs/slurm/s7b6.sbatch"]]


def test_slurm_defaults_cpu_nodes_resources_container_and_env(tmp_path):
    env = clean_env(DELTARES_CONFIG="experiments/tiny.py:delta", DELTARES_WORKDIR="runs/y")
    script, options, srun, _ = slurm_job([], env=env)
    assert options == ["--job-name=deltares", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive",
                       "--mem=0", f"--chdir={ROOT}", "--output=runs/slurm/deltares-%j.log", "--open-mode=append",
                       "--signal=B:USR1@300", "--requeue"]
    assert srun[-10:] == ["JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7", f"{ROOT}/.venv/bin/python", "-m", "deltares.train",
                          "--config", "experiments/tiny.py:delta", "--workdir", "runs/y", "--stopped_exit_code=75", "&"]
    # nodes without GPUs, set CPUs and memory, no requeue
    script, options, srun, _ = slurm_job([*SLURM_ARGS, "--gpus-per-node", "0", "--cpus-per-node", "16", "--mem=64G",
                                          "--no-requeue"])
    assert not [o for o in options if o.startswith(("--gpus", "--exclusive"))]
    assert options[3:5] == ["--cpus-per-task=16", "--mem=64G"] and options[-1] == "--no-requeue"
    assert srun[:5] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=16", "env", "JAX_PLATFORMS=cpu"]
    assert "scontrol requeue \"$SLURM_JOB_ID\"" not in script and "submit this job again to resume" in script
    _, _, srun, _ = slurm_job([*SLURM_ARGS, "--container", "nvcr.io/nvidia/jax:25.04", "--mounts", "/data:/data",
                               "--gpus-per-node", "2"])
    assert srun[:5] == ["srun", "--kill-on-bad-exit=1", "--container-image=nvcr.io/nvidia/jax:25.04",
                        f"--container-mounts={ROOT}:{ROOT},/shared/runs:/shared/runs,/data:/data",
                        f"--container-workdir={ROOT}"]
    assert srun[5:9] == ["env", "JAX_LOCAL_DEVICE_IDS=0,1", "python3", "-m"]  # the image's python


@pytest.mark.parametrize("time_, save_before, ok", [
    ("5", "299", True), ("5", "300", False), ("5:00", "300", False), ("0:30", "59", True), ("0:30", "60", False),
    ("1:00:00", "3599", True), ("1-0", "86399", True), ("1-00:00:01", "86400", True), ("2-3:4:5", "500000", False),
    ("unlimited", "999999", True), ("INFINITE", "300", True), ("0", "300", True),
])
def test_slurm_save_before_must_be_less_than_the_time_limit(time_, save_before, ok):
    """SLURM reads --time in minutes (seconds round up to a minute); `0` and `unlimited` have no limit."""
    args = ["--dry-run", *SLURM_ARGS, "--time", time_, "--save-before", save_before]
    if ok:
        assert run(SLURM, args).returncode == 0
    else:
        check_one_line_error(run(SLURM, args), f"--save-before {save_before} is not less than --time {time_} (")


def test_slurm_job_shown_in_the_docs_is_the_one_written():
    """docs/guides/scaling-out.md's excerpt of the job: lines of the job its command prints (the
    checkout at /home/me/deltares)."""
    with open(os.path.join(ROOT, "docs", "guides", "scaling-out.md")) as f:
        page = f.read().split("## GPU clusters (SLURM)", 1)[1]
    command = page.split("```bash\n", 1)[1].split("\n```", 1)[0].replace("\\\n", " ")
    shown = page.split("```text\n", 1)[1].split("\n```", 1)[0].splitlines()
    script, _, _, _ = slurm_job(shlex.split(command)[1:])
    written = script.replace(ROOT, "/home/me/deltares").splitlines()
    assert [line for line in shown if line != "..."] == [line for line in written if line in shown]
    assert len(shown) > 10 and shown[-1].startswith("srun ")


@pytest.mark.parametrize("args, needle", [
    (SLURM_ARGS[2:], "--config"), ([*SLURM_ARGS, "--nodes", "0"], "--nodes must be a positive whole number"),
    ([*SLURM_ARGS, "--gpus-per-node", "x"], "--gpus-per-node must be"), ([*SLURM_ARGS, "--save-before", "5m"],
    "--save-before must be"), ([*SLURM_ARGS, "--mounts", "/a:/a"], "--mounts needs --container"),
    ([*SLURM_ARGS, "--job-name", "a b"], "--job-name may hold"), ([*SLURM_ARGS, "--sbatch"], "--sbatch needs a value"),
    ([*SLURM_ARGS, "--gpus", "8"], "unknown argument '--gpus'"),
    ([*SLURM_ARGS, "--nodes", "99999999999"], "below 1000000"), ([*SLURM_ARGS, "--save-before", "nan"],
    "--save-before must be"), ([*SLURM_ARGS, "--gpus-per-node", "-1"], "--gpus-per-node must be"),
    ([*SLURM_ARGS, "--cpus-per-node", "0"], "--cpus-per-node must be"), ([*SLURM_ARGS, "--mem", "lots"], "--mem must be"),
    ([*SLURM_ARGS, "--mem", "0"], "--mem must be"), ([*SLURM_ARGS, "--time", "1h"], "--time must be as sbatch takes it"),
    ([*SLURM_ARGS, "--time", "-5"], "--time must be"), ([*SLURM_ARGS, "--save-before", "0"], "--save-before must be"),
])
def test_slurm_bad_settings_are_one_line_errors(args, needle):
    check_one_line_error(run(SLURM, ["--dry-run", *args]), needle)


def test_slurm_local_says_why_it_cannot_start(monkeypatch, tmp_path):
    """tests/test_slurm.py skips with this reason (or, with DELTARES_REQUIRE_SLURM=1, fails with it)."""
    import slurm_local

    monkeypatch.setattr(slurm_local, "find", lambda program: None if program in ("slurmd", "munged") else "/bin/true")
    assert slurm_local.unavailable().startswith("munged, slurmd not found: install Debian's slurm-wlm and munge")
    monkeypatch.setattr(slurm_local, "find", lambda program: "/bin/true")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert slurm_local.unavailable() == "starting SLURM's daemons needs root (slurmd starts each job as its user)"
    monkeypatch.undo()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    expected = slurm_local.unavailable()  # this machine's binaries, and no root
    res = subprocess.run([sys.executable, "-c", "import os, runpy, sys; os.geteuid = lambda: 1000; sys.argv[1:] = "
                          f"['start', {str(tmp_path)!r}]; runpy.run_module('tests.slurm_local', run_name='__main__')"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and res.stderr.splitlines() == [f"error: {expected}"], res.stderr
    assert os.listdir(tmp_path) == []  # nothing written


def fake_bin(tmp_path, **scripts):
    """A directory of fake commands (name -> bash body), first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bindir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bindir / name).chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ['PATH']}"


def test_slurm_submits_the_job_it_prints(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "bin" / "python").chmod(0o755)
    args = [*SLURM_ARGS, "--venv", str(venv), "--logs", str(tmp_path / "jobs")]
    path = fake_bin(tmp_path, sbatch=f'echo "$*" > {tmp_path}/sbatch.log; echo "123;cluster"')
    res = run(SLURM, args, env=clean_env(PATH=path))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "sbatch.log").read_text() == f"--parsable {tmp_path}/jobs/deltares.sbatch\n"
    assert f"submitted job 123: {tmp_path}/jobs/deltares.sbatch, log {tmp_path}/jobs/deltares-123.log" in res.stdout
    assert (tmp_path / "jobs" / "deltares.sbatch").read_text() == slurm_job(args)[0]
    path = fake_bin(tmp_path, sbatch='echo "sbatch: error: Invalid account" >&2; exit 1')
    check_one_line_error(run(SLURM, args, env=clean_env(PATH=path)), "sbatch refused", "Invalid account")
    check_one_line_error(run(SLURM, [*SLURM_ARGS, "--venv", str(tmp_path / "none")]), "none/bin/python not found")


# ---------------------------------------------------------------- lint


# ---------------------------------------------------------------- gpu_bench.py

# Runs `deltares.bench`'s own command line on one printed command's arguments, with the benchmark
# replaced by a check of the parsed model config and the modes.
PARSE_BENCH = """if True:
    import sys
    from deltares import bench
    from deltares.nn.config import MODES, validate_model_config

    def check(argv):
        validate_model_config(bench._CONFIG.value.model)
        assert set(bench._MODES.value) <= set(MODES), bench._MODES.value
        assert not bench._BASELINE.value and bench._SEQUENTIAL.value
        model = bench._CONFIG.value.model
        print("parsed", model.attention, model.residual.impl, model.scan_layers, bench._PROFILE_STEPS.value)

    bench.main = check
    sys.argv = ["deltares.bench", *sys.argv[1:]]
    bench.cli()
"""


def load_gpu_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", GPU_BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_py(args, env=None):
    return subprocess.run([sys.executable, GPU_BENCH, *args], capture_output=True, text=True, env=env or clean_env(),
                          cwd=ROOT, timeout=120)


def test_gpu_bench_dry_run_plans_each_call_and_its_flags_parse(tmp_path):
    """--dry-run walks every mode's command with its estimate and start, in the issue's order, and says which
    fit --budget; each stage's flags parse as deltares.bench reads them (one mode per process, sequential)."""
    gb = load_gpu_bench()
    res = run_py(["--dry-run", "--budget", "540", "--cache", str(tmp_path / "cache")])
    assert res.returncode == 0, res.stderr
    plan = [line for line in res.stdout.splitlines() if line.startswith("# s")]
    assert [line.split(":")[0][2:] for line in plan] == [
        "s220m_defaults baseline", "s220m_defaults delta_block", "s220m_defaults delta", "s220m_profile baseline",
        "s220m_profile delta_block", "s220m_xla delta_block", "s220m_xla delta", "s220m_scanned baseline",
        "s220m_no_command_buffers baseline", "s220m_no_command_buffers delta"]
    # the same plan in-process: runs start one after another and end within the budget; the rest is skipped
    steps = gb.plan([gb.BY_NAME[n] for n in gb.CALLS["s220m"]], 540, {})
    ran = [s for s in steps if s["runs"]]
    assert ran and ran[-1]["start"] + ran[-1]["seconds"] <= 540 - gb.MARGIN_S
    assert all(a["start"] + a["seconds"] == b["start"] for a, b in zip(ran, ran[1:]))
    assert f"# {len(ran)} of 10 runs fit" in res.stdout and " skipped, " in res.stdout
    # the profile loads the programs the defaults compiled: a cached compile, not a full one
    est = {(s["stage"].name, s["mode"]): s["seconds"] for s in steps}
    assert est[("s220m_profile", "baseline")] < est[("s220m_defaults", "baseline")]
    # measured times replace the guesses (the compile then a load from the cache)
    key = gb.BY_NAME["s1044m_defaults"].program("delta")
    times = {key: dict(wall=100.0, compile_s=80.0)}
    assert gb.estimate(gb.BY_NAME["s1044m_defaults"], "delta", times, set()) == 20.0 + gb.CACHED_COMPILE_S
    times[key]["compile_s"] = 5.0  # a load takes no longer than the compile did
    assert gb.estimate(gb.BY_NAME["s1044m_defaults"], "delta", times, set()) == 100.0
    assert gb.estimate(gb.BY_NAME["s1044m_defaults"], "delta", {}, set()) == gb.STARTUP_S + 30 + 200
    no_limit = gb.plan([gb.BY_NAME[n] for n in gb.CALLS["s1044m"]], 0, {})
    assert all(s["runs"] for s in no_limit)
    # every stage's overrides name config fields and values the experiment takes (validated as the trainer
    # does), and the richest command line parses as deltares.bench reads it (one mode, sequential)
    import importlib

    from deltares.training.experiment import validate_config

    for stage in gb.STAGES:
        if stage.command:
            continue
        argv = stage.argv(stage.modes[0], "python3", "j.jsonl", "d")
        assert argv[argv.index("--modes") + 1] == stage.modes[0] and "--nobaseline" in argv
        cfg = importlib.import_module(f"experiments.{os.path.basename(stage.config)[:-3]}").get_config(stage.modes[0])
        for override in stage.overrides:
            key, value = override[len("--config."):].split("=")
            *path, last = key.split(".")
            node = cfg
            for part in path:
                node = getattr(node, part)
            old = getattr(node, last)
            setattr(node, last, {"True": True, "False": False}.get(value, value) if isinstance(old, (bool, str))
                    else type(old)(value))
        validate_config(cfg)
    argv = gb.BY_NAME["s220m_cudnn_kernel"].argv("delta", "python3", "j.jsonl", "d")[3:] + ["--profile_steps", "2"]
    proc = subprocess.run([sys.executable, "-c", PARSE_BENCH, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-4:] == ["cudnn", "pallas_gpu", "True", "2"]
    assert gb.BY_NAME["s220m_no_command_buffers"].xla_flags == "--xla_gpu_enable_command_buffer="
    assert "--xla_gpu_enable_command_buffer=" in res.stdout  # said in the plan


FAKE_HLO = """HloModule jit_step, entry_computation_layout={()->()}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %y = f32[1024]{0} copy(%x)
}
"""

# A stand-in for the GPU machine's Python: the environment probe, and deltares.bench writing its row and its
# program as the real one does (the mode "delta" hangs until stopped); each call logged with its environment.
FAKE_BENCH_PYTHON = """#!{python}
import gzip, json, os, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(dict(argv=args, pid=os.getpid(), mem=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                            cache=os.environ.get("JAX_COMPILATION_CACHE_DIR"), flags=os.environ.get("XLA_FLAGS"))) + "\\n")
if args[0] == "-c":
    print(json.dumps(dict(python="3.12", device_kind="NVIDIA H200", platform="gpu", devices=1,
                          packages=dict(jax="0.11.2"))))
    sys.exit(0)
mode = args[args.index("--modes") + 1]
if mode == "delta" and not os.environ.get("FAKE_FAST"):
    print("| compiling forever |", flush=True)
    time.sleep(120)
save = args[args.index("--save_dir") + 1]
with gzip.open(os.path.join(save, mode + ".hlo.gz"), "wt") as f:
    f.write({hlo!r}.replace("1024", str(1000 + len(mode))))  # a program of its own
row = dict(mode=mode, scale="s220m", n_layers=12, median_ms=60.0 + len(mode), step_ms=[60.0] * 9, compile_s=30.0,
           what="timing", hlo=mode + ".hlo.gz")
with open(args[args.index("--jsonl") + 1], "a") as f:
    f.write(json.dumps(row) + "\\n")
print("| " + mode + " | 60.0 |")
"""


def test_gpu_bench_runs_each_mode_in_a_process_within_its_budget(tmp_path):
    """Each mode runs in its own process (memory fraction, compilation cache set) and its row and program are
    kept in OUT as soon as it ends; a mode past the budget is stopped, one that would not fit is skipped, and
    the run ends with one error line naming both. OUT holds four files, and is calibration input. A second
    call with --resume runs only what did not finish, planned with the measured times."""
    from tests import gpu_calibration

    log, fake = tmp_path / "calls.jsonl", tmp_path / "python"
    fake.write_text(FAKE_BENCH_PYTHON.format(python=sys.executable, log=str(log), hlo=FAKE_HLO))
    fake.chmod(0o755)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580.159.04, 143771 MiB'\n")
    smi.chmod(0o755)
    out, cache = tmp_path / "out", tmp_path / "cache"
    gb = load_gpu_bench()
    stages = [gb.BY_NAME["s220m_defaults"], gb.BY_NAME["s220m_xla"]]
    # known times: every mode about 1 s, so a budget of 12 s fits the plan but not a mode that hangs
    gb.save_times(str(cache), {s.program(m): dict(wall=1.0, compile_s=0.0) for s in stages for m in s.modes})
    env = clean_env(PATH=f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    args = ["--stages", "s220m_defaults,s220m_xla", "--out", str(out), "--cache", str(cache), "--python", str(fake),
            "--commit", "abc1234"]
    start = time.monotonic()
    res = run_py(args + ["--budget", "12"], env=env)
    assert time.monotonic() - start < 60
    check_one_line_error(res, "3 of the planned runs did not finish", "s220m_defaults delta (stopped at the budget",
                         "s220m_xla delta_block (skipped)", "s220m_xla delta (skipped)")
    assert sorted(os.listdir(out)) == ["bench.log", "env.json", "programs.tar", "rows.jsonl"]
    info = json.loads((out / "env.json").read_text())
    assert (info["gpu"], info["driver"], info["commit"], info["packages"]) == (
        "NVIDIA H200", "580.159.04", "abc1234", {"jax": "0.11.2"})
    assert "--xla_gpu_per_fusion_autotune_cache_dir=" in info["xla_flags"] and info["mem_fraction"] == "0.92"
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["mode"], "median_ms" in r, r.get("failed", r.get("skipped", ""))[:7]) for r in rows] == [
        ("s220m_defaults", "baseline", True, ""), ("s220m_defaults", "delta_block", True, ""),
        ("s220m_defaults", "delta", False, "stopped"), ("s220m_xla", "delta_block", False, "about 1"),
        ("s220m_xla", "delta", False, "about 1")]
    assert rows[0]["program"] == "s220m_defaults.baseline.hlo.gz" and rows[0]["setting"] == "s220m defaults"
    with tarfile.open(out / "programs.tar") as tar:
        assert sorted(tar.getnames()) == ["s220m_defaults.baseline.hlo.gz", "s220m_defaults.delta_block.hlo.gz"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0]["argv"][0] == "-c"  # the environment first
    benches = [c for c in calls if c["argv"][0] == "-m"]
    assert [c["argv"][c["argv"].index("--modes") + 1] for c in benches] == ["baseline", "delta_block", "delta"]
    for c in benches:
        assert c["argv"][:3] == ["-m", "deltares.bench", "--config"] and "--sequential" in c["argv"]
        assert c["mem"] == "0.92" and c["cache"] == str(cache / "jax")
    assert "| delta_block | 60.0 |" in res.stdout and "| compiling forever |" in res.stdout
    assert "| delta_block | 60.0 |" in (out / "bench.log").read_text()
    times = gb.load_times(str(cache))
    assert times[stages[0].program("baseline")]["compile_s"] == 30.0
    # the bench's output is the calibration's input: two rows of one setting, baseline and delta_block
    bench_rows = gpu_calibration.bench_rows(str(out))
    assert sorted(r.mode for r in bench_rows) == ["baseline", "delta_block"]
    assert {r.setting for r in bench_rows} == {f"bench h200 {info['date'].split()[0]} abc1234 s220m defaults"}
    # a second call resumes: the finished modes are not run again
    out2 = tmp_path / "out2"
    res = run_py(args[:2] + ["--out", str(out2)] + args[4:] + ["--resume"], env=dict(env, FAKE_FAST="1"))
    assert res.returncode == 0, res.stderr
    assert "s220m_defaults baseline: done in an earlier call" in res.stdout
    rows = [json.loads(line) for line in (out2 / "rows.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["mode"]) for r in rows] == [("s220m_defaults", "delta"), ("s220m_xla", "delta_block"),
                                                       ("s220m_xla", "delta")]


def test_gpu_bench_stopped_stops_its_mode(tmp_path):
    """SIGTERM to the script (a caller's time-out) ends the mode running under it, and says so in one line."""
    log, fake = tmp_path / "calls.jsonl", tmp_path / "python"
    fake.write_text(FAKE_BENCH_PYTHON.format(python=sys.executable, log=str(log), hlo=FAKE_HLO))
    fake.chmod(0o755)
    proc = subprocess.Popen([sys.executable, GPU_BENCH, "--stages", "s220m_no_command_buffers", "--out",
                             str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--python", str(fake)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or log.read_text().count("\n") < 3):
        time.sleep(0.1)  # the probe, baseline, then delta (which hangs)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == [err.strip()] and "interrupted" in err
    hung = json.loads(log.read_text().splitlines()[-1])
    assert hung["argv"][hung["argv"].index("--modes") + 1] == "delta"
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(hung["pid"], 0)


def test_gpu_bench_programs_go_to_a_next_tar_past_the_size_limit(tmp_path, monkeypatch):
    gb = load_gpu_bench()
    monkeypatch.setattr(gb, "TAR_LIMIT", 40_000)  # tar pads to records of 10 KiB
    for i in range(3):
        (tmp_path / f"p{i}").write_bytes(os.urandom(12_000))
        gb.add_to_tar(str(tmp_path), {f"s.m{i}.hlo.gz": str(tmp_path / f"p{i}")})
    with tarfile.open(tmp_path / "programs.tar") as a, tarfile.open(tmp_path / "programs-2.tar") as b:
        assert (a.getnames(), b.getnames()) == (["s.m0.hlo.gz", "s.m1.hlo.gz"], ["s.m2.hlo.gz"])
    assert (tmp_path / "programs.tar").stat().st_size <= 40_000 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("args, needle", [
    (["--stages", "s220m_defaults,nope"], "unknown stage 'nope'"), (["--budget", "10m"], "a number of seconds"),
    (["--budget", "-5"], "at least 0"), (["--stages", ","], "--stages is empty"), (["--out"], "expected one argument"),
    (["--fast"], "unrecognized arguments"), (["--call", "s7b6"], "invalid choice"),
])
def test_gpu_bench_bad_arguments_are_one_line_errors(args, needle):
    check_one_line_error(run_py(args + ["--dry-run"]), needle)


def test_gpu_bench_without_a_working_python_records_why(tmp_path):
    """A Python that cannot run (no JAX, say): env.json keeps the probe's error, each mode fails in one line."""
    res = run_py(["--stages", "s220m_scanned", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "c"),
                  "--python", shutil.which("false")])
    check_one_line_error(res, "1 of the planned runs did not finish", "s220m_scanned baseline (exit 1)")
    assert "probe_error" in json.loads((tmp_path / "out" / "env.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert rows == [dict(stage="s220m_scanned", setting="s220m scanned attn=cudnn", mode="baseline", xla_flags="",
                         failed="exit 1", seconds=rows[0]["seconds"])]


def test_gpu_bench_out_that_is_a_file_is_one_line_error(tmp_path):
    (tmp_path / "out").write_text("a file")
    check_one_line_error(run_py(["--out", str(tmp_path / "out"), "--stages", "kernel"]), "is a file")


SHELL_SCRIPTS = sorted(os.path.relpath(p, ROOT) for pattern in ("launch/*.sh", "docs/**/*.sh", ".ci/run")
                       for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (.ci/run installs it)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shellcheck(script):
    """No warning of shellcheck's, the sourced common.sh followed (-x)."""
    proc = subprocess.run(["shellcheck", "-x", "--severity=warning", script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_scripts_are_executable():
    for script in (TPU, GPU, SLURM, GPU_BENCH):
        assert os.stat(script).st_mode & stat.S_IXUSR
