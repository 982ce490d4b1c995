"""launch/tpu.sh, launch/gpu.sh, launch/slurm.sh and launch/gpu_bench.sh: the commands they print
(--dry-run) and run.

No cloud, cluster or GPU needed: the real (non-dry) paths run against a fake `gcloud`, `sbatch`,
`srun` or `scontrol` on PATH, or a fake venv `python`, that log their arguments. The SLURM job
script itself runs with a fake `srun` and trainer (its command line runs for real, as 2
processes, in tests/test_multihost.py). With `FAKE_HOME` the fake
`gcloud` also runs each `ssh --command` in that directory, as one worker would: the
detached start, the log and pid files and `--stop` run for real there, with a fake
trainer that saves and exits on SIGTERM.
"""

import concurrent.futures
import os
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
GPU_BENCH = os.path.join(ROOT, "launch", "gpu_bench.sh")
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
        "--account=lab", "--sbatch=--qos=high", "--sbatch", "--exclusive", "--venv", str(venv), "--requeue",
        "--save-before", "600", "--job-name", "s7b6", "--", *OVERRIDES])
    assert script.startswith("#!/bin/bash\n")
    assert options == [
        "--job-name=s7b6", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=24:00:00",
        "--partition=gpu", "--account=lab", f"--chdir={ROOT}", "--output=runs/slurm/s7b6-%j.log", "--open-mode=append",
        "--signal=B:USR1@600", "--requeue", "--qos=high", "--exclusive"]
    assert srun == ["srun", "--kill-on-bad-exit=1", "env", "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
                    f"{venv}/bin/python", "-m", "deltares.train", *SLURM_ARGS, *OVERRIDES, "&"]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert cmds == [["cd", ROOT], ["mkdir", "-p", "runs/slurm"], ["sbatch", "--parsable", "runs/slurm/s7b6.sbatch"]]


def test_slurm_defaults_container_and_env(tmp_path):
    env = clean_env(DELTARES_CONFIG="experiments/tiny.py:delta", DELTARES_WORKDIR="runs/y")
    script, options, srun, _ = slurm_job([], env=env)
    assert options == ["--job-name=deltares", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=8",
                       f"--chdir={ROOT}", "--output=runs/slurm/deltares-%j.log", "--open-mode=append",
                       "--signal=B:USR1@300"]
    assert "scontrol" not in script and "submit this job again to resume" in script
    assert srun[-9:] == ["JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7", f"{ROOT}/.venv/bin/python", "-m", "deltares.train",
                         "--config", "experiments/tiny.py:delta", "--workdir", "runs/y", "&"]
    _, _, srun, _ = slurm_job([*SLURM_ARGS, "--container", "nvcr.io/nvidia/jax:25.04", "--mounts", "/data:/data",
                               "--gpus-per-node", "2"])
    assert srun[:5] == ["srun", "--kill-on-bad-exit=1", "--container-image=nvcr.io/nvidia/jax:25.04",
                        f"--container-mounts={ROOT}:{ROOT},/shared/runs:/shared/runs,/data:/data",
                        f"--container-workdir={ROOT}"]
    assert srun[5:9] == ["env", "JAX_LOCAL_DEVICE_IDS=0,1", "python3", "-m"]  # the image's python


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
])
def test_slurm_bad_settings_are_one_line_errors(args, needle):
    check_one_line_error(run(SLURM, ["--dry-run", *args]), needle)


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


# The job step's stand-ins: srun runs its command (srun's options dropped) and passes SIGTERM on, as the
# real one does to its tasks; the trainer logs its start and its variables, and on SIGTERM "saves" and exits 0.
FAKE_SRUN = """while [[ $1 == --* ]]; do shift; done
"$@" & task=$!
trap 'kill -TERM $task' TERM
wait $task
wait $task
"""
FAKE_STEP_TRAINER = """sleep "$FAKE_TRAIN_SECONDS" & steps=$!
trap 'kill $steps; echo saved >> "$FAKE_LOG"; exit 0' TERM
echo "started $JAX_LOCAL_DEVICE_IDS $*" >> "$FAKE_LOG"
wait $steps
echo finished >> "$FAKE_LOG"
"""


@pytest.mark.parametrize("requeue, signal_, log, requeued", [
    (True, "USR1", ["saved"], True),  # the time limit is near: save, then back to the queue
    (False, "USR1", ["saved"], False),  # the same without --requeue: saved, and the log says to resubmit
    (True, "TERM", ["saved"], False),  # scancel or a preemption: SLURM itself cancels or requeues
    (True, None, ["finished"], False),  # the run reaches its last step
])
def test_slurm_job_saves_before_the_time_limit_and_requeues(tmp_path, requeue, signal_, log, requeued):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/usr/bin/env bash\n" + FAKE_STEP_TRAINER)
    (venv / "bin" / "python").chmod(0o755)
    script = slurm_job([*SLURM_ARGS, "--venv", str(venv), "--gpus-per-node", "2", *(["--requeue"] * requeue)])[0]
    (tmp_path / "job.sbatch").write_text(script)
    fake_log = tmp_path / "trainer.log"
    env = clean_env(PATH=fake_bin(tmp_path, srun=FAKE_SRUN, scontrol=f'echo "$*" >> {tmp_path}/scontrol.log'),
                    FAKE_LOG=str(fake_log), FAKE_TRAIN_SECONDS="0" if signal_ is None else "30", SLURM_JOB_ID="42")
    job = subprocess.Popen([BASH, str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (fake_log.exists() and "started" in fake_log.read_text()):
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        if signal_:
            job.send_signal(getattr(signal, "SIG" + signal_))
        out, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 0, out
    lines = fake_log.read_text().splitlines()
    assert lines[0] == f"started 0,1 -m deltares.train {' '.join(SLURM_ARGS)}" and lines[1:] == log
    assert (tmp_path / "scontrol.log").exists() == requeued
    if requeued:
        assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"
    assert ("submit this job again" in out) == (signal_ == "USR1" and not requeue)


# ---------------------------------------------------------------- lint


# ---------------------------------------------------------------- gpu_bench.sh

# Runs `deltares.bench`'s own command line on one printed command's arguments, with the benchmark
# replaced by a check of the parsed model config and the modes.
PARSE_BENCH = """if True:
    import sys
    from deltares import bench
    from deltares.nn.config import MODES, validate_model_config

    def check(argv):
        validate_model_config(bench._CONFIG.value.model)
        assert set(bench._MODES.value) <= set(MODES), bench._MODES.value
        print("parsed", bench._CONFIG.value.model.attention, bench._CONFIG.value.model.residual.impl)

    bench.main = check
    sys.argv = ["deltares.bench", *sys.argv[1:]]
    bench.cli()
"""


DEFAULT_STAGES = ("s220m_defaults", "s220m_defaults_xla", "kernel", "s1044m_defaults", "s1044m_defaults_xla",
                  "s220m_no_command_buffers", "tests", "estimate")
SCANNED_STAGES = ("s220m", "s220m_kernel", "s220m_cudnn", "s220m_cudnn_kernel", "s1044m", "s1044m_grouped",
                  "s1044m_segments")


def test_gpu_bench_dry_run_prints_every_stage_and_its_flags_parse():
    res = run(GPU_BENCH, ["--dry-run", "--out", "runs/b", "--stages", ",".join(DEFAULT_STAGES + SCANNED_STAGES)])
    assert res.returncode == 0, res.stderr
    cmds = commands(res.stdout)
    assert cmds[:2] == [["cd", ROOT], ["mkdir", "-p", "runs/b"]]
    by_stage = {os.path.basename(c[-2])[:-4]: c[:-3] for c in cmds[2:]}  # each ends: > runs/b/STAGE.txt 2>&1
    assert list(by_stage) == list(DEFAULT_STAGES + SCANNED_STAGES)
    default = commands(run(GPU_BENCH, ["--dry-run", "--out", "runs/b"]).stdout)
    assert [os.path.basename(c[-2])[:-4] for c in default[2:]] == list(DEFAULT_STAGES)
    tests = by_stage["tests"]
    assert tests[:2] == ["env", "JAX_PLATFORMS=cuda"] and tests[-2:] == ["-k", "pallas_gpu or cudnn"]
    assert by_stage["kernel"][:5] == ["python3", "-m", "kernels_pallas.depth_route.bench", "--train_layers", "0"]
    no_buffers = by_stage["s220m_no_command_buffers"]  # the caller's XLA_FLAGS kept, command buffers off
    assert no_buffers[0] == "env" and no_buffers[1].startswith("XLA_FLAGS=")
    assert no_buffers[1].endswith("--xla_gpu_enable_command_buffer=")
    estimate = by_stage["estimate"]
    assert estimate[:4] == ["env", "JAX_PLATFORMS=cpu", "bash", "-c"] and "--gpu h100 --estimate" in estimate[4]
    benches = {name: c[c.index("python3") + 3:] for name, c in by_stage.items() if "deltares.bench" in c}
    assert len(benches) == 12
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = dict(zip(benches, pool.map(
            lambda argv: subprocess.run([sys.executable, "-c", PARSE_BENCH, *argv], cwd=ROOT, capture_output=True,
                                        text=True, timeout=120), benches.values())))
    assert {n: o.returncode for n, o in outs.items()} == dict.fromkeys(benches, 0), [o.stderr[-2000:] for o in outs.values()]
    parsed = {n: o.stdout.split()[-2:] for n, o in outs.items()}
    assert parsed["s220m_defaults"] == ["auto", "auto"] and parsed["s220m_defaults_xla"] == ["auto", "xla"]
    assert [parsed[n] for n in SCANNED_STAGES[:4]] == [["xla", "xla"], ["xla", "pallas_gpu"], ["cudnn", "xla"],
                                                       ["cudnn", "pallas_gpu"]]


def test_gpu_bench_runs_its_stages_and_reports_failures(tmp_path):
    """Each stage runs its command (here a fake Python that logs its arguments and prints a table
    row: the real commands run in tests/test_documented_commands.py), its output kept in OUT; a
    stage that fails and stages past the budget end the run with one error line naming them."""
    out, log = tmp_path / "out", tmp_path / "argv.log"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\necho "| baseline | 1.0 |"\n')
    fake.chmod(0o755)
    res = run(GPU_BENCH, ["--stages", "kernel,s1044m_segments", "--out", str(out), "--python", str(fake)])
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines() == [
        "-m kernels_pallas.depth_route.bench --train_layers 0",
        "-m deltares.bench --config experiments/s1044m.py --batch 8 --seq_len 2048 --rounds 2 --steps 2 "
        "--config.model.residual.impl=xla --modes baseline,delta --config.model.scan_layers=True --config.model.residual.group_layers=0 "
        "--config.model.residual.scan_segments=12"]
    assert (out / "kernel.txt").read_text() == "| baseline | 1.0 |\n"
    assert res.stdout.count("| baseline | 1.0 |") == 2 and "== s1044m_segments: exit 0" in res.stdout
    res = run(GPU_BENCH, ["--stages", "kernel,s220m", "--out", str(out), "--python", "false"])
    check_one_line_error(res, "2 stage(s) did not finish", "kernel (exit 1)", "s220m (exit 1)")
    res = run(GPU_BENCH, ["--stages", "tests", "--out", str(out), "--budget", "1"])
    check_one_line_error(res, "tests (skipped)")
    assert "--budget 1 spent" in res.stdout


@pytest.mark.parametrize("args, needle", [
    (["--stages", "kernel,nope"], "unknown stage 'nope'"), (["--budget", "10m"], "whole number of seconds"),
    (["--stages", ""], "--stages is empty"), (["--out"], "--out needs a value"), (["--fast"], "unknown argument"),
    (["--gpu", "a100"], "--gpu must be h100 or h200"),
])
def test_gpu_bench_bad_arguments_are_one_line_errors(args, needle):
    check_one_line_error(run(GPU_BENCH, args), needle)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", [TPU, GPU, SLURM, GPU_BENCH])
def test_shellcheck(script):
    subprocess.run(["shellcheck", script], check=True)


def test_scripts_are_executable():
    for script in (TPU, GPU, SLURM, GPU_BENCH):
        assert os.stat(script).st_mode & stat.S_IXUSR
