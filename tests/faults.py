"""Fault injection against debug runs: every fault of issues 22, 41 and 48, with what each ended in, as a table.

    python tests/faults.py                 # all faults (about 20 minutes on 2 CPU cores)
    python tests/faults.py --only kill     # those whose name holds "kill"
    python tests/faults.py --out faults.md

For each fault: the exit code of the command it hit, the first line it printed that starts with
`error:` or `warning:`, whether a Python traceback appeared, whether the run recovered (rerun as a
user would: its losses are those of an uninterrupted run, bit for bit) and whether data was lost
(a checkpoint or metrics record missing or changed; a damaged checkpoint moved aside is kept).
The goal is 0 tracebacks, 0 silent wrong results and 0 data lost. The tests prove each behaviour
on its own (tests/test_faults.py, tests/test_train.py, tests/test_workdir.py); this runs them the way
a user meets them, through the command lines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from debug_runs import RESUME_OVERRIDES, STEPS, checkpoint_steps, module_cmd, read_metrics, tree_digest  # noqa: E402
from jax_cache import ENV, ROOT  # noqa: E402
import test_faults as tf  # noqa: E402 - the damages and command lines the tests use
import test_interrupts as ti  # noqa: E402 - how the tests see that a command reached a phase

DEBUG = os.path.join(ROOT, "experiments", "debug.py")
RESUME = tuple(f"--config.train.{k}={v}" for k, v in RESUME_OVERRIDES.items())


class Bench:
    """The shared inputs: a prepared dataset and an uninterrupted reference run (its losses)."""

    def __init__(self, root: str):
        self.root = root
        self.data = os.path.join(root, "dataset")
        from deltares.data.prepare import prepare

        prepare("builtin", "bytes", self.data, val_fraction=0.05, progress=False)
        self.reference = self.dir("reference")
        proc = self.train(self.reference)
        assert proc.returncode == 0, proc.stderr[-2000:]
        self.loss = losses(self.reference)

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def cmd(self, workdir, *extra):
        return module_cmd("deltares.train", "--config", DEBUG, "--workdir", str(workdir),
                          f"--config.data.dataset={self.data}", *RESUME, *extra)

    def train(self, workdir, *extra, env=None, timeout=300, prefix=()):
        return run([*prefix, *self.cmd(workdir, *extra)], env=env, timeout=timeout)

    def finished_copy(self, name: str) -> str:
        workdir = self.dir(name)
        shutil.copytree(self.reference, workdir)
        return workdir


def run(cmd, env=None, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir)} if os.path.exists(
        os.path.join(workdir, "metrics.jsonl")) else {}


def said(proc) -> str:
    for line in re.split(r"[\r\n]+", proc.stderr):
        if line.startswith(("error:", "warning:")):
            return line
    return ""


def row(fault, proc, recovered="n/a", lost="no", traceback=None):
    traceback = "Traceback" in (proc.stderr + proc.stdout) if traceback is None else traceback
    return dict(fault=fault, exit=proc.returncode, line=said(proc), traceback=traceback, recovered=recovered,
                lost=lost)


def recovered_like_reference(bench, workdir) -> str:
    got = losses(workdir)
    complete = sorted(got) == list(range(1, STEPS + 1)) and checkpoint_steps(workdir)[-1:] == [STEPS]
    return "yes" if complete and got == bench.loss else f"NO ({len(got)} records, differ: {got != bench.loss})"


def unchanged(before, after) -> str:
    return "no" if before == after else "YES (changed)"


# ----------------------------------------------------------------------------- the faults


def slug(name: str) -> str:
    return re.sub(r"[^\w.]+", "_", name).strip("_")


def interrupted(bench, name, sig, wait_for=8):
    workdir = bench.dir(slug(name))
    proc = subprocess.Popen(bench.cmd(workdir), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if wait_for is None or (checkpoint_steps(workdir) and checkpoint_steps(workdir)[-1] >= wait_for):
            break
        time.sleep(0.005)
    if wait_for is None:
        time.sleep(2.0)  # inside the first compile
    proc.send_signal(sig)
    out, err = proc.communicate()
    first = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    rerun = bench.train(workdir)
    tb = "Traceback" in first.stderr + rerun.stderr
    return row(name, rerun if not said(first) else first, recovered_like_reference(bench, workdir), traceback=tb)


def damaged(bench, name):
    hurt, _ = tf.DAMAGE[name]
    workdir = bench.finished_copy(name)
    step30 = os.path.join(workdir, "checkpoints", "30")
    hurt(step30)
    damaged_files = tree_digest(step30)
    proc = bench.train(workdir)
    aside = os.path.join(workdir, "checkpoints_aside", "30")
    kept = os.path.isdir(aside) and {k: v for k, v in tree_digest(aside).items() if k != "REASON"} == damaged_files
    return row(f"damaged newest step: {name}", proc, recovered_like_reference(bench, workdir),
               "no" if kept else "YES (damaged step not kept)")


def damaged_only_step(bench):
    workdir = bench.finished_copy("only_step")
    for step in (24, 28):
        shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
    tf.truncate_array_file(os.path.join(workdir, "checkpoints", "30"))
    before = tree_digest(workdir)
    proc = bench.train(workdir)
    return row("damaged only step", proc, lost=unchanged(before, tree_digest(workdir)))


def two_trainers(bench, name, *extra):
    workdir = bench.dir(slug(name))
    first = subprocess.Popen(bench.cmd(workdir), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    while not os.path.exists(os.path.join(workdir, "LOCK")) and first.poll() is None:
        time.sleep(0.01)
    second = bench.train(workdir, *extra)
    out, err = first.communicate()
    ok = first.returncode == 0 and recovered_like_reference(bench, workdir) == "yes"
    return row(name, second, lost="no" if ok else f"YES (first run: rc {first.returncode}, {err[-300:]})")


def stale_lock(bench):
    return interrupted(bench, "stale lock (SIGKILL, rerun)", signal.SIGKILL)


def file_size_limit(bench):
    workdir = bench.dir("file_size_limit")
    proc = bench.train(workdir, prefix=("prlimit", "--fsize=100000"))
    clean = read_metrics(workdir) == [] and checkpoint_steps(workdir) == []
    rerun = bench.train(workdir)
    tb = "Traceback" in proc.stderr + rerun.stderr
    return row("checkpoint write fails (file size limit)", proc, recovered_like_reference(bench, workdir),
               "no" if clean else "YES (records of steps no checkpoint holds)", traceback=tb)


def disk_full(bench):
    """A 1.6 MB tmpfs holds two checkpoints of the debug model; the third fails with ENOSPC. Then the
    disk grows (as a user frees space) and the same command resumes. In a mount namespace of its own."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return dict(fault="disk full", exit="-", line="skipped: needs root and unshare", traceback=False,
                    recovered="n/a", lost="n/a")
    out = bench.dir("disk_full")
    os.makedirs(out)
    run_dir = os.path.join(out, "mnt")
    os.makedirs(run_dir)
    workdir = os.path.join(run_dir, "run")
    py = " ".join(f"'{a}'" for a in bench.cmd(workdir))
    script = (f'mount -t tmpfs -o size=1600k tmpfs {run_dir} && ({py} > {out}/1.out 2> {out}/1.err;'
              f' echo $? > {out}/1.rc;'
              f' cp -a {workdir} {out}/after_failure; mount -o remount,size=50m {run_dir};'
              f' {py} > {out}/2.out 2> {out}/2.err; echo $? > {out}/2.rc; cp -a {workdir} {out}/after_rerun)')
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=ENV, timeout=600)
    read = lambda name: open(os.path.join(out, name)).read()  # noqa: E731
    first = subprocess.CompletedProcess([], int(read("1.rc")), read("1.out"), read("1.err"))
    failed_dir = os.path.join(out, "after_failure")
    steps = checkpoint_steps(failed_dir)
    records = [r["step"] for r in read_metrics(failed_dir)]
    clean = steps and records == list(range(1, steps[-1] + 1)) and losses(failed_dir) == {
        s: bench.loss[s] for s in records}
    tb = "Traceback" in read("1.err") + read("2.err")
    return row(f"disk full (ENOSPC at a later checkpoint; kept {steps})", first,
               recovered_like_reference(bench, os.path.join(out, "after_rerun")),
               "no" if clean else f"YES (steps {steps}, records up to {records[-1:]})", traceback=tb)


def wrong_shape(bench, name, kind):
    workdir = bench.dir(f"wrong_{name}")
    os.makedirs(workdir)
    target = os.path.join(workdir, name)
    os.mkdir(target) if kind == "dir" else open(target, "w").close()
    before = tree_digest(workdir)
    proc = bench.train(workdir)
    kind_name = "folder" if kind == "dir" else "file"
    return row(f"{name} is a {kind_name}", proc, lost=unchanged(before, tree_digest(workdir)))


def read_only(bench):
    workdir = bench.finished_copy("read_only")
    before = tree_digest(workdir)
    try:
        cmd = tf.read_only_command(workdir, bench.cmd(workdir))
    except BaseException as err:  # pytest.skip outside pytest
        return dict(fault="read-only workdir", exit="-", line=f"skipped: {err}", traceback=False, recovered="n/a",
                    lost="n/a")
    proc = run(cmd)
    os.chmod(workdir, 0o755)
    return row("read-only workdir", proc, lost=unchanged(before, tree_digest(workdir)))


def dataset_copy(bench, name):
    data = bench.dir(name)
    shutil.copytree(bench.data, data)
    return data


def bad_token_ids(bench):
    import numpy as np

    data = dataset_copy(bench, "data_bad_ids")
    meta = json.loads(open(os.path.join(data, "meta.json")).read())
    del meta["max_token_id"]  # as a dataset prepared before prepare recorded it, disagreeing with its tokens
    open(os.path.join(data, "meta.json"), "w").write(json.dumps(meta))
    for split in ("train", "val"):
        tokens = np.memmap(tf.shard(__import__("pathlib").Path(data), split), dtype=np.uint16, mode="r+")
        tokens[::50] = 400
        tokens.flush()
    workdir = bench.dir("bad_ids")
    proc = run(module_cmd("deltares.train", "--config", DEBUG, "--workdir", workdir, f"--config.data.dataset={data}"))
    evaluation = run(module_cmd("deltares.eval", "--checkpoint", bench.reference, "--data", data))
    return [row("token ids outside the vocabulary (train)", proc),
            row("token ids outside the vocabulary (eval)", evaluation)]


def odd_length_split(bench):
    data = dataset_copy(bench, "data_odd")
    with open(tf.shard(__import__("pathlib").Path(data), "train"), "ab") as f:
        f.write(b"\x01")
    return row("token file of odd length", bench.train(bench.dir("odd"), f"--config.data.dataset={data}"))


def other_data_same_path(bench, name, edit, evaluate=True):
    """The run's dataset replaced by other data under the same path: resuming must refuse, and (for
    another tokenizer) so must scoring it; other data of the same tokenizer is scored as it is."""
    workdir = bench.finished_copy(slug(name))
    data = bench.data
    kept = data + ".kept"
    shutil.copytree(data, kept)
    try:
        edit(data)
        before = tree_digest(workdir)
        proc = bench.train(workdir)
        evaluation = run(module_cmd("deltares.eval", "--checkpoint", workdir, "--data", data)) if evaluate else None
        lost = unchanged(before, tree_digest(workdir))
    finally:
        shutil.rmtree(data)
        os.rename(kept, data)
    return [row(f"{name} (resume)", proc, lost=lost)] + ([row(f"{name} (eval)", evaluation)] if evaluate else [])


def own_dataset_of_another_tokenizer(bench):
    """A run directory whose `dataset/` holds the built-in corpus prepared with the bytes tokenizer, trained
    with a config that asks for gpt2: refused before anything is read or written."""
    workdir = bench.dir("own_dataset_other_tokenizer")
    shutil.copytree(bench.data, os.path.join(workdir, "dataset"))
    before = tree_digest(workdir)
    proc = run(module_cmd("deltares.train", "--config", DEBUG, "--workdir", workdir, "--config.data.dataset=builtin",
                          "--config.data.tokenizer=gpt2", "--config.model.vocab_size=50304", *RESUME))
    return row("run's own dataset/ of another tokenizer than the config's", proc,
               lost=unchanged(before, tree_digest(workdir)))


def other_tokenizer(data):
    tf.edit_meta(__import__("pathlib").Path(data), tokenizer_sha256="0" * 64)


def other_tokens(data):
    tf.shrink_train(__import__("pathlib").Path(data), 100)


def non_finite(bench):
    """The loss diverges at step 3 (a learning rate of 1e30): the run stops naming the step and the last
    good checkpoint; no checkpoint of non-finite parameters is saved (the records of the steps before
    are kept: they show the divergence)."""
    workdir = bench.dir("non_finite")
    proc = bench.train(workdir, "--config.optim.lr=1e30", "--config.optim.warmup_steps=1",
                       "--config.train.checkpoint_every=1")
    import numpy as np
    from deltares.training.checkpoint import load_checkpoint

    steps = checkpoint_steps(workdir)
    finite = not steps or all(np.isfinite(np.asarray(x)).all()
                              for x in __import__("jax").tree.leaves(load_checkpoint(workdir).state["params"]))
    return row("non-finite loss", proc, lost="no" if finite else "YES (a checkpoint of non-finite parameters)")


# issue 41: interrupts

PHASES = {  # how a test sees that the trainer got there (tests/test_interrupts.py)
    "the first imports": lambda started, workdir: ti.handles_sigterm(started.proc.pid),
    "the lock taken": lambda started, workdir: os.path.exists(os.path.join(workdir, "LOCK")),
    "the first compile": lambda started, workdir: "train:" in started.stderr(),
}


def interrupted_at(bench, name, sig, phase, workdir=None):
    """`sig` to a trainer once it reached `phase` (a new run directory, or `workdir`), then the same command
    again. Lost: a run directory the interrupted run changed, other than by the step it saved in the loop."""
    workdir = workdir or bench.dir(slug(name))
    before = tree_digest(workdir) if os.path.isdir(workdir) else None
    started = ti.Started(bench.cmd(workdir))
    started.wait_for(lambda: PHASES[phase](started, workdir), phase)
    first = started.interrupt(sig)
    after = tree_digest(workdir) if os.path.isdir(workdir) else None
    lost = "no" if phase == "the first compile" else unchanged(before, after)
    rerun = bench.train(workdir)
    tb = "Traceback" in first.stderr + rerun.stderr
    return row(name, first, recovered_like_reference(bench, workdir), lost, traceback=tb)


def commands(bench):
    tmp = __import__("pathlib").Path(bench.dir("commands"))
    tmp.mkdir()
    finished = bench.finished_copy("commands_run")
    rows = []
    cases = tf.bad_commands(tmp, finished, __import__("pathlib").Path(bench.data))
    before = tree_digest(bench.root)
    for name, args, _, env in cases:
        rows.append(row(f"command: {name}", run(module_cmd(*args), env=env)))
    after = tree_digest(bench.root)
    changed = sorted(set(before.items()) ^ set(after.items()))
    for r in rows:
        r["lost"] = "no" if not changed else f"YES ({len(changed)} files changed)"
    long_prompt = "Call me Ishmael. " * 600  # 10,200 byte tokens for a model trained on 32
    proc = run(module_cmd("deltares.generate", "--checkpoint", bench.reference, "--prompt", long_prompt,
                          "--max_new_tokens", "8", "--temperature", "0"))
    rows.append(row("generate: 10,200-token prompt, 32-token model", proc))
    return rows


# issue 41: nothing destroyed


def nothing_destroyed(bench):
    """Commands that replace a folder: refused without --overwrite, and with it a failure leaves the old one
    whole and a success leaves nothing of it; a killed prepare resumes and says how far it had come."""
    from conftest import TINY_HF
    from deltares.data import prepare as prepare_module
    from deltares.data.tokenizer import export_json, load_tokenizer
    from test_data import make_docs, write_corpus

    root = bench.dir("nothing_destroyed")
    os.makedirs(root)
    texts = []
    for i in range(3):  # each file one unit
        texts.append(os.path.join(root, f"t{i}.txt"))
        write_corpus(texts[-1], make_docs(40, i, f"t{i}"))
    bad = os.path.join(root, "latin1.txt")
    open(bad, "wb").write("caf\xe9\n\nna\xefve".encode("latin1"))
    data = os.path.join(root, "data")
    prepare_module.prepare(texts[0], "bytes", data, val_fraction=0.2, progress=False)
    before = tree_digest(data)

    def prep(source, out, *extra):
        return run(module_cmd("deltares.data.prepare", "--source", source, "--tokenizer", "bytes", "--val_fraction",
                              "0.2", "--out", out, *extra))

    rows = [row("prepare --overwrite, the new source fails", prep(f"{texts[1]},{bad}", data, "--overwrite"),
                lost=unchanged(before, tree_digest(data)))]
    rows.append(row("prepare other input, no --overwrite", prep(texts[1], data),
                    lost=unchanged(before, tree_digest(data))))

    killed = os.path.join(root, "killed")
    real = prepare_module.tokenize_unit

    def dies_in_the_second(out, plan, index, tokenizer_json):
        if index == 1:
            raise KeyboardInterrupt
        return real(out, plan, index, tokenizer_json)

    prepare_module.tokenize_unit = dies_in_the_second
    try:
        prepare_module.prepare(",".join(texts), "bytes", killed, val_fraction=0.2, progress=False)
    except KeyboardInterrupt:
        pass
    finally:
        prepare_module.tokenize_unit = real
    proc = prep(",".join(texts), killed)
    told = f"prepare: resuming {killed}: 1 of 3 units already done" in proc.stderr
    rows.append(row("prepare killed, rerun", proc, "yes" if told and proc.returncode == 0 else
                    f"NO (rc {proc.returncode}, resume {'said' if told else 'not said'})"))

    model = os.path.join(root, "model")
    shutil.copytree(TINY_HF, model)
    before = tree_digest(model)

    def convert(*extra):
        return run(module_cmd("deltares.convert", "--checkpoint", bench.reference, "--out", model, *extra))

    proc = convert()
    rows.append(row("convert --out into a model folder, no --overwrite", proc,
                    lost=unchanged(before, tree_digest(model))))
    proc = convert("--overwrite")
    left = {"generation_config.json", "reference.npz"} & set(os.listdir(model))  # the old model's alone
    mixed = left or open(os.path.join(model, "tokenizer.json")).read() != export_json(load_tokenizer("bytes"))
    loads = run(module_cmd("deltares.generate", "--checkpoint", model, "--prompt", "Call me", "--max_new_tokens", "4",
                           "--temperature", "0"))
    rows.append(row("convert --overwrite a model folder with a bytes run", proc,
                    "yes" if loads.returncode == 0 else f"NO (generate: {said(loads) or loads.returncode})",
                    "YES (old files mixed in)" if mixed else "no"))
    return rows


# issue 41: argument domains


def argument_domains(bench):
    """Arguments outside their ranges and experiment files that cannot be loaded (the command lines of
    tests/test_domains.py): each refused in one `error:` line before any work, nothing written."""
    import test_domains as td

    tmp = __import__("pathlib").Path(bench.dir("domains"))
    tmp.mkdir()
    cases = td.bad_arguments(tmp)
    before = tree_digest(bench.root)
    rows = [row(f"argument: {name}", run(module_cmd(*args), env=env)) for name, args, _, env in cases]
    changed = sorted(set(before.items()) ^ set(tree_digest(bench.root).items()))
    for r in rows:
        r["lost"] = "no" if not changed else f"YES ({len(changed)} files changed)"
    return rows



# issue 41: the run directory while a run writes it


def between_saves(proc, workdir, action, timeout=240):
    """Runs `action()` with the trainer `proc` paused once it has a checkpoint and no save in flight."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)
        folder = os.path.join(workdir, "checkpoints")
        ready = checkpoint_steps(workdir) and not any(n.endswith("tmp") for n in os.listdir(folder))
        if ready:
            action()
        proc.send_signal(signal.SIGCONT)
        if ready:
            return
        time.sleep(0.02)


def run_directory(bench):
    """The run directory moved, deleted or its lock removed while a trainer writes it, replaced by another
    run or a link on its path repointed during a save (`taken_away`); a run resumed with another learning
    rate; `compare` of a run being written."""
    rows = []
    for name, act in (("run directory moved during the run", lambda w: os.rename(w, w + "_moved")),
                      ("run directory deleted during the run", shutil.rmtree),
                      ("lock file removed during the run", lambda w: os.remove(os.path.join(w, "LOCK")))):
        workdir = bench.dir(slug(name))
        proc = subprocess.Popen(bench.cmd(workdir), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        between_saves(proc, workdir, lambda: act(workdir))
        out, err = proc.communicate(timeout=300)
        first = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if "moved" in name:
            rerun = bench.train(workdir + "_moved")
            recovered = recovered_like_reference(bench, workdir + "_moved") if rerun.returncode == 0 else "NO"
        elif "deleted" in name:
            recovered = "n/a (deleted)"
        else:
            recovered = recovered_like_reference(bench, workdir)
        rows.append(row(name, first, recovered, traceback="Traceback" in err))
    rows += taken_away(bench)
    workdir = bench.finished_copy("other_lr")
    proc = bench.train(workdir, "--config.optim.lr=1e-3", "--config.train.steps=32")
    rows.append(row("resume with another learning rate", proc,
                    "yes (said)" if "config.optim.lr 0.003 -> 0.001" in proc.stderr else "NO (not said)"))
    workdir = bench.dir("compare_while_running")
    proc = subprocess.Popen(bench.cmd(workdir), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    found = []  # compare runs while the trainer is paused, its lock held
    between_saves(proc, workdir, lambda: found.append(run(module_cmd("deltares.compare", workdir, bench.reference))))
    proc.communicate(timeout=300)
    marked = "(running)" in found[0].stdout
    rows.append(row("compare of a run being written", found[0], "n/a" if marked else "NO (not marked)"))
    return rows


# issue 48: nothing written through a path that no longer leads to the run


def in_a_save(proc, workdir, action, timeout=240) -> bool:
    """Runs `action()` with the trainer `proc` paused while a checkpoint is being written (a temporary step
    folder in checkpoints/); False, without acting, if no such moment came."""
    deadline = time.monotonic() + timeout
    folder = os.path.join(workdir, "checkpoints")
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)
        saving = os.path.isdir(folder) and any("tmp" in n for n in os.listdir(folder))
        if saving:
            action()
        proc.send_signal(signal.SIGCONT)
        if saving:
            return True
        time.sleep(0.002)
    return False


def taken_away(bench):
    """The run directory moved away and another run moved into its path, or a link on its path repointed to
    another run, each while a save is being written: the trainer writes on where the run is and stops; the
    other run must stay byte for byte (files and folders), and the rerun where the run went recovers."""
    rows = []
    for name in ("run directory replaced by another run during a save", "link on the run directory's path "
                 "repointed during a save"):
        root = bench.dir(slug(name))
        os.makedirs(os.path.join(root, "A"))
        os.symlink(os.path.join(root, "A"), os.path.join(root, "link"))
        linked = "link" in name
        workdir = os.path.join(root, "link", "run") if linked else os.path.join(root, "run")
        other = os.path.join(root, "B" if linked else "other", "run")
        shutil.copytree(bench.reference, other)
        before = tf.tree(other)
        where = os.path.join(root, "A", "run") if linked else os.path.join(root, "moved")

        def act():
            if linked:
                os.symlink(os.path.join(root, "B"), os.path.join(root, "link.new"))
                os.replace(os.path.join(root, "link.new"), os.path.join(root, "link"))
            else:
                os.rename(workdir, where)
                os.rename(other, workdir)

        proc = subprocess.Popen(bench.cmd(workdir, "--config.train.checkpoint_every=1"), cwd=ROOT, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        acted = in_a_save(proc, workdir, act)
        out, err = proc.communicate(timeout=300)
        first = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        rerun = bench.train(where)
        recovered = recovered_like_reference(bench, where) if rerun.returncode == 0 else "NO"
        changed = tf.tree(workdir) != before
        rows.append(row(name if acted else f"{name} (NOT DONE: no save caught)", first, recovered,
                        "YES (the other run changed)" if changed else "no", traceback="Traceback" in err))
    return rows


# issue 48: outputs never land on inputs; one writer per output; workers end with their parent


def outputs_and_writers(bench):
    """Outputs onto inputs, runs, datasets and models through every command that writes (refused, nothing
    changed), --overwrite through a link (the target replaced whole), two prepares into one --out at once,
    a resume after its source changed, and prepare's workers when it is killed or interrupted."""
    from test_data import make_docs, write_corpus

    root = bench.dir("outputs")
    os.makedirs(root)
    sources = []
    for i in range(2):
        sources.append(os.path.join(root, "src", f"s{i}.txt"))
        os.makedirs(os.path.dirname(sources[-1]), exist_ok=True)
        write_corpus(sources[-1], make_docs(200, i, f"s{i}"))
    run_copy, data_copy = bench.finished_copy("outputs_run"), dataset_copy(bench, "outputs_data")
    existing = os.path.join(root, "table.md")
    open(existing, "w").write("a table of before")

    def prep(source, out, *extra):
        return module_cmd("deltares.data.prepare", "--source", source, "--tokenizer", "bytes", "--val_fraction",
                          "0.2", "--out", out, *extra)

    cases = [
        ("prepare --out contains its source, --overwrite", prep(sources[0], os.path.join(root, "src"), "--overwrite")),
        ("prepare --out onto a run, --overwrite", prep(sources[0], run_copy, "--overwrite")),
        ("prepare --out inside a dataset", prep(sources[0], os.path.join(data_copy, "train", "x"))),
        ("convert --out onto its own run, --overwrite", module_cmd("deltares.convert", "--checkpoint", run_copy, "--out",
                                                                   run_copy, "--overwrite")),
        ("convert --out onto a dataset, --overwrite", module_cmd("deltares.convert", "--checkpoint", run_copy, "--out",
                                                                 data_copy, "--overwrite")),
        ("compare --out onto a run's metrics.jsonl, --overwrite", module_cmd(
            "deltares.compare", run_copy, "--out", os.path.join(run_copy, "metrics.jsonl"), "--overwrite")),
        ("compare --out onto a file that exists", module_cmd("deltares.compare", run_copy, "--out", existing)),
        ("analyze --out onto a dataset", module_cmd("deltares.analyze", "--workdir", run_copy, "--out", data_copy)),
        ("train --workdir inside a dataset", bench.cmd(os.path.join(data_copy, "run"))),
    ]
    before = tree_digest(bench.root)
    rows = [row(name, run(cmd)) for name, cmd in cases]
    changed = sorted(set(before.items()) ^ set(tree_digest(bench.root).items()))
    for r in rows:
        r["lost"] = "no" if not changed else f"YES ({len(changed)} files changed)"

    target = os.path.join(root, "target")
    prepare_run = run(prep(sources[1], target))
    os.symlink(target, os.path.join(root, "link"))
    proc = run(prep(sources[0], os.path.join(root, "link"), "--overwrite"))
    meta = json.load(open(os.path.join(target, "meta.json"))) if prepare_run.returncode == 0 else {}
    whole = meta.get("source") == sources[0] and os.path.islink(os.path.join(root, "link")) and not any(
        n.endswith((".partial", ".lock")) or ".old-" in n for n in os.listdir(root))
    rows.append(row("prepare --overwrite through a link", proc, "yes" if whole else "NO (target not replaced whole)"))

    out = os.path.join(root, "two")
    procs = [subprocess.Popen(module_cmd("deltares.data.prepare", "--source", source, "--tokenizer", "bpe:400",
                                         "--val_fraction", "0.2", "--out", out), cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for source in sources]
    done = [subprocess.CompletedProcess(p.args, p.wait(), *p.communicate()) for p in procs]
    ok = [p for p in done if p.returncode == 0]
    meta = json.load(open(os.path.join(out, "meta.json"))) if os.path.exists(os.path.join(out, "meta.json")) else {}
    winner = [src for src, p in zip(sources, done) if p.returncode == 0]
    rows.append(row("two prepares of different sources into one --out", next((p for p in done if p.returncode), done[0]),
                    "n/a", "no" if len(ok) == 1 and meta.get("source") == winner[0] else
                    f"YES ({len(ok)} succeeded)"))

    resumed = os.path.join(root, "resumed")
    run(prep(",".join(sources), resumed))
    with open(sources[0], "a", encoding="utf-8") as f:
        f.write("\n\nA document written after the unit was tokenized.\n")
    proc = run(prep(",".join(sources), resumed))
    fresh = os.path.join(root, "fresh")
    run(prep(",".join(sources), fresh))
    same = json.load(open(os.path.join(resumed, "meta.json"))) == json.load(open(os.path.join(fresh, "meta.json")))
    rows.append(row("prepare rerun after a source changed", proc, "yes" if same else "NO (not the fresh dataset)"))

    with open(os.path.join(root, "long.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(make_docs(40000, 9, "long")))
    shutil.copy(os.path.join(root, "long.txt"), os.path.join(root, "long2.txt"))
    long_source = os.path.join(root, "long*.txt")
    for name, sig, moment in (("prepare killed (SIGKILL) while its workers work", signal.SIGKILL, "working"),
                              ("Ctrl-C while prepare's workers start", signal.SIGINT, "starting")):
        started = ti.Started(module_cmd("deltares.data.prepare", "--source", long_source, "--tokenizer", "gpt2",
                                        "--out", bench.dir(slug(name)), "--workers", "2"), start_new_session=True)
        pid = started.proc.pid
        set_up = lambda w: ti.signal_set(w, "SigIgn") & ti.SIGINT_BIT  # noqa: E731
        started.wait_for(lambda: ti.workers_of(pid) and (all(map(set_up, ti.workers_of(pid))) if moment == "working"
                                                        else not all(map(set_up, ti.workers_of(pid)))), moment)
        workers = ti.workers_of(pid)
        os.killpg(pid, sig) if sig == signal.SIGINT else started.proc.kill()
        proc = started.finish()
        left = ti.gone_soon(workers)
        # after a SIGKILL nothing of prepare runs: multiprocessing's resource tracker unlinks the pool's
        # semaphores, and says so; an interrupt leaves it nothing
        noise = sig != signal.SIGKILL and ("leaked" in proc.stderr or "resource_tracker" in proc.stderr)
        rows.append(row(name, proc, "yes" if not left and not noise else
                        f"NO ({len(left)} workers left{', a leaked-resource warning' if noise else ''})"))
    return rows


# issue 48: naming inputs


def inputs(bench):
    """Every class of naming what a command reads (tests/test_inputs.py walks the same classes in process),
    through each command's real command line: a path with glob characters, a glob that matches nothing
    (alone and in a list), a file named twice, overlapping globs, a symlink to a named file, a symlink loop,
    a folder where a file is expected (a file where a folder is), a trailing comma. Recovered: what a command
    that succeeded read is what was named, each file once (prepare's document count; eval's and analyze's
    figures equal to those of naming each file once; generate's prompts; a run that trains). Lost: the
    inputs changed."""
    import concurrent.futures

    from test_inputs import inputs_digest

    root = bench.dir("inputs")
    files, odd, sets, configs = (os.path.join(root, name) for name in ("files", "odd", "datasets", "configs"))
    for folder in (files, odd, os.path.join(odd, "sub"), sets, configs):
        os.makedirs(folder)
    docs = {name: [f"{name[0]} document {i}: call me Ishmael, {i} years ago" for i in range(30)]
            for name in ("a.txt", "b.txt", "data[1].txt")}
    for name, texts in docs.items():
        open(os.path.join(files, name), "w").write("\n\n".join(texts) + "\n")
    os.symlink("../files/a.txt", os.path.join(odd, "link.txt"))
    os.symlink("loop.txt", os.path.join(odd, "loop.txt"))
    open(os.path.join(odd, "sub", "c.txt"), "w").write("inside\n")
    for name in ("ds_a", "ds[1]"):
        shutil.copytree(bench.data, os.path.join(sets, name))
    os.symlink("ds_a", os.path.join(sets, "ds_link"))
    os.symlink("ds_loop", os.path.join(sets, "ds_loop"))
    open(os.path.join(sets, "plain.txt"), "w").write("not a dataset\n")
    shutil.copy(DEBUG, os.path.join(configs, "exp[1].py"))
    os.symlink("exp[1].py", os.path.join(configs, "link.py"))
    os.symlink("loop.py", os.path.join(configs, "loop.py"))
    f, o, d, c = (lambda *names, at=at: ",".join(os.path.join(at, n) for n in names) for at in (files, odd, sets, configs))
    a_b_data = docs["a.txt"] + docs["b.txt"] + docs["data[1].txt"]
    file_classes = [  # class, spec, what it reads (None: an error)
        ("literal with glob characters", f("data[1].txt"), docs["data[1].txt"]),
        ("dead glob alone", f("nothing*.txt"), None), ("dead glob in a list", f("a.txt", "nothing*.txt"), None),
        ("duplicate", f("a.txt", "a.txt"), docs["a.txt"]), ("overlap", f("*.txt", "a*"), a_b_data),
        ("symlink to a listed file", f("a.txt") + "," + o("link.txt"), docs["a.txt"]),
        ("symlink loop", o("loop.txt"), None), ("folder", o("sub"), None), ("trailing comma", f("a.txt") + ",", None)]
    mixture_classes = [  # a mixture: only the first reads (a dataset named twice is refused)
        ("literal with glob characters", d("ds[1]") + "=1," + d("ds_a") + "=1", True),
        ("dead glob alone", d("nothing*") + "=1," + d("ds_a") + "=1", None),
        ("dead glob in a list", d("ds_a") + "=1," + d("nothing*") + "=1", None),
        ("duplicate", d("ds_a") + "=1," + d("ds_a") + "=1", None),
        ("overlap", d("ds*") + "=1," + d("ds_a") + "=1", None),
        ("symlink to a listed folder", d("ds_a") + "=1," + d("ds_link") + "=1", None),
        ("symlink loop", d("ds_loop") + "=1," + d("ds_a") + "=1", None),
        ("file where a folder is expected", d("plain.txt") + "=1," + d("ds_a") + "=1", None),
        ("trailing comma", d("ds_a") + "=1," + d("ds[1]") + "=1,", None)]
    dataset_classes = [  # one folder
        ("literal with glob characters", d("ds[1]"), True), ("dead glob alone", d("nothing*"), None),
        ("dead glob in a list", d("ds_a", "nothing*"), None), ("duplicate", d("ds_a", "ds_a"), None),
        ("overlap", d("ds*"), None), ("symlink", d("ds_link"), True), ("symlink loop", d("ds_loop"), None),
        ("file where a folder is expected", d("plain.txt"), None), ("trailing comma", d("ds_a") + ",", None)]
    config_classes = [("literal with glob characters", c("exp[1].py"), True), ("dead glob alone", c("nothing*.py"), None),
                      ("dead glob in a list", c("exp[1].py", "nothing*.py"), None),
                      ("duplicate", c("exp[1].py", "exp[1].py"), None), ("symlink", c("link.py"), True),
                      ("symlink loop", c("loop.py"), None), ("folder", configs, None),
                      ("trailing comma", c("exp[1].py") + ",", None)]
    out = lambda name: bench.dir(f"inputs_out_{slug(name)}")  # noqa: E731
    short = ("--config.train.steps=2", "--config.train.eval_every=2", "--config.train.checkpoint_every=2")
    meta_documents = lambda proc, n: sum(json.load(open(os.path.join(out(n), "meta.json")))["splits"][s]["documents"]  # noqa: E731
                                         for s in ("train", "val"))
    commands = {  # command: (its command line for a spec, a job name), its classes, what its output says it read
        "prepare --source": (lambda spec, n: module_cmd("deltares.data.prepare", "--source", spec, "--tokenizer", "bytes",
                                                        "--val_fraction", "0.3", "--out", out(n)),
                             file_classes, meta_documents),
        "eval --data": (lambda spec, n: module_cmd("deltares.eval", "--checkpoint", bench.reference, "--data", spec),
                        file_classes, lambda proc, n: proc.stdout.strip()),
        "analyze --data": (lambda spec, n: module_cmd("deltares.analyze", "--checkpoint", bench.reference, "--data", spec,
                                                      "--out", out(n), "--max_batches", "1", "--batch", "1"),
                           file_classes, lambda proc, n: json.load(open(os.path.join(out(n), "routing.json")))["runs"][0][
                               "tokens"]),
        "generate --prompt_file": (lambda spec, n: module_cmd("deltares.generate", "--checkpoint", bench.reference,
                                                              "--prompt_file", spec, "--max_new_tokens", "1",
                                                              "--temperature", "0"),
                                   file_classes, lambda proc, n: proc.stdout.count("--- prompt ")),
        "config.data.mixture": (lambda spec, n: module_cmd("deltares.train", "--config", DEBUG, "--workdir", out(n),
                                                           f"--config.data.mixture={spec}", *short), mixture_classes,
                                lambda proc, n: True),
        "config.data.dataset": (lambda spec, n: module_cmd("deltares.train", "--config", DEBUG, "--workdir", out(n),
                                                           f"--config.data.dataset={spec}", *short), dataset_classes,
                                lambda proc, n: True),
        "--config": (lambda spec, n: module_cmd("deltares.train", "--config", spec, "--workdir", out(n), "--dry_run"),
                     config_classes, lambda proc, n: True),
    }
    # What a command that read what was named, each file once, says: prepare its documents, generate its prompts;
    # eval and analyze what they say of the same files named plainly, once each; the trainer only that it ran.
    plain = {tuple(docs["data[1].txt"]): f("data[1].txt"), tuple(docs["a.txt"]): f("a.txt"),
             tuple(a_b_data): f("a.txt", "b.txt", "data[1].txt")}
    jobs = [(f"inputs: {command}: {name}", command, spec, want) for command, (_, classes, _) in commands.items()
            for name, spec, want in classes]
    jobs += [(f"plain {command} {spec}", command, spec, None) for command in ("eval --data", "analyze --data")
             for spec in plain.values()]
    before = inputs_digest(root)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = dict(zip([j[0] for j in jobs], pool.map(
            lambda job: run(commands[job[1]][0](job[2], job[0]), timeout=600), jobs)))
    rows = []
    for fault, command, spec, want in jobs:
        if fault.startswith("plain "):
            continue
        proc, said_of = procs[fault], commands[command][2]
        recovered = "n/a"
        if want is not None:
            if command in ("eval --data", "analyze --data"):
                name = f"plain {command} {plain[tuple(want)]}"
                wanted = said_of(procs[name], name) if procs[name].returncode == 0 else "the plain run failed"
            else:
                wanted = len(want) if isinstance(want, list) else True
            try:
                got = said_of(proc, fault) if proc.returncode == 0 else f"exit {proc.returncode}"
            except (OSError, ValueError, KeyError) as err:
                got = f"unreadable: {err}"
            recovered = "yes" if got == wanted else f"NO (got {str(got)[:60]!r}, want {str(wanted)[:60]!r})"
        rows.append(row(fault, proc, recovered, unchanged(before, inputs_digest(root))))
    return rows


FAULTS = {
    "sigterm during training": lambda b: interrupted(b, "sigterm during training", signal.SIGTERM),
    "sigkill during training": lambda b: interrupted(b, "sigkill during training", signal.SIGKILL),
    "sigkill during the first compile": lambda b: interrupted(b, "sigkill during the first compile", signal.SIGKILL,
                                                              wait_for=None),
    **{f"damaged {name}": (lambda name: lambda b: damaged(b, name))(name) for name in tf.DAMAGE},
    "damaged only step": damaged_only_step,
    "two trainers, same config": lambda b: two_trainers(b, "two trainers, same config"),
    "two trainers, other learning rate": lambda b: two_trainers(b, "two trainers, other learning rate",
                                                                "--config.optim.lr=1e-3"),
    "stale lock": stale_lock,
    "file size limit": file_size_limit,
    "disk full": disk_full,
    "checkpoints is a file": lambda b: wrong_shape(b, "checkpoints", "file"),
    "metrics.jsonl is a folder": lambda b: wrong_shape(b, "metrics.jsonl", "dir"),
    "read-only workdir": read_only,
    "bad token ids": bad_token_ids,
    "odd-length split": odd_length_split,
    "other tokenizer, same size": lambda b: other_data_same_path(b, "other tokenizer, same size", other_tokenizer),
    "other data, same path": lambda b: other_data_same_path(b, "other data, same path", other_tokens, evaluate=False),
    "run's own dataset of another tokenizer": own_dataset_of_another_tokenizer,
    "non-finite loss": non_finite,
    "commands": commands,
    # issue 41: nothing destroyed
    "nothing destroyed": nothing_destroyed,
    # issue 41: interrupts
    "sigint during the first imports": lambda b: interrupted_at(b, "sigint during the first imports", signal.SIGINT,
                                                               "the first imports"),
    "sigterm once the run directory is locked": lambda b: interrupted_at(
        b, "sigterm once the run directory is locked", signal.SIGTERM, "the lock taken"),
    "sigint during the first compile": lambda b: interrupted_at(b, "sigint during the first compile", signal.SIGINT,
                                                                "the first compile"),
    "sigterm while resuming a finished run": lambda b: interrupted_at(
        b, "sigterm while resuming a finished run", signal.SIGTERM, "the lock taken", b.finished_copy("resuming")),
    # issue 41: argument domains
    "argument domains": argument_domains,
    # issue 41: the run directory while a run writes it
    "run directory": run_directory,
    # issue 48: outputs never land on inputs, one writer per output, workers end with their parent
    "outputs and writers": outputs_and_writers,
    # issue 48: naming inputs
    "inputs": inputs,
}


def silent(r) -> bool:
    """A wrong result nobody is told of: success, with nothing said, where the run did not recover."""
    return r["exit"] == 0 and not r["line"] and r["recovered"] != "yes"


def table(rows, root: str = "") -> str:
    lines = ["| fault | exit | first error or warning line | traceback | silent wrong result | recovered | data lost |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        line = r["line"].replace(ROOT + "/", "")  # no machine path in the table
        line = line.replace(root + "/", "").replace("|", "\\|") if root else line.replace("|", "\\|")
        line = line if len(line) <= 150 else line[:147] + "..."
        lines.append(f"| {r['fault']} | {r['exit']} | {line} | {'YES' if r['traceback'] else 'no'} | "
                     f"{'YES' if silent(r) else 'no'} | {r['recovered']} | {r['lost']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the faults whose name holds this")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    chosen = {name: fn for name, fn in FAULTS.items() if args.only in name}
    start = time.time()
    with tempfile.TemporaryDirectory() as root:
        bench = Bench(root)
        rows = []
        for name, fn in chosen.items():
            print(f"fault: {name} ...", file=sys.stderr, flush=True)
            out = fn(bench)
            rows += out if isinstance(out, list) else [out]
    text = table(rows, root)
    tracebacks = sum(bool(r["traceback"]) for r in rows)
    lost = sum(str(r["lost"]).startswith("YES") for r in rows)
    not_recovered = sum(str(r["recovered"]).startswith("NO") for r in rows)
    summary = (f"{len(rows)} faults in {time.time() - start:.0f} s: {tracebacks} with a traceback, "
               f"{sum(map(silent, rows))} silent wrong results, {not_recovered} not recovered, {lost} with data lost")
    print(text + "\n\n" + summary)
    if args.out:
        where = provenance()  # before the file is opened: the table itself is no local change
        with open(args.out, "w") as f:
            f.write(f"# Fault table\n\n{where}; `python -m tests.faults` (see docs/guides/robustness.md). Paths are "
                    f"relative to the benchmark's temporary directory.\n\n{text}\n\n{summary}\n")


def provenance() -> str:
    """When, where and on which commit the table was measured."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    where = f"commit {commit.stdout.strip()}{' with local changes' if dirty.stdout.strip() else ''}" if (
        commit.returncode == 0) else "outside a git checkout"
    return f"Measured on {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores ({platform.machine()}), {where}"


if __name__ == "__main__":
    main()
