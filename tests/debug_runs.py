"""Helpers shared by the tests that train the `debug` experiment (tests/test_train.py,
tests/test_faults.py): configs, the command lines of the tools, reading a run directory back, and
the check that a command failed with one `error:` line."""

import glob
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np

from event_files import event_scalars
from jax_cache import ENV, ROOT

STEPS, SEQ, BATCH = 30, 32, 4
# The uninterrupted reference run and the interrupted ones share these overrides.
RESUME_OVERRIDES = dict(log_every=1, checkpoint_every=4)


def debug_config(mode="delta_block"):
    spec = importlib.util.spec_from_file_location("debug_experiment", os.path.join(ROOT, "experiments", "debug.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(mode)


def config_with(dataset, **train_fields):
    cfg = debug_config()
    cfg.data.dataset = str(dataset)
    cfg.train.update(train_fields)
    return cfg


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def checkpoint_steps(workdir):
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def tree_digest(root):
    """{relative path: sha256} of every file under `root`."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def module_cmd(module, *args):
    return [sys.executable, "-m", module, *args]


def train_cmd(workdir, *overrides):
    return module_cmd("deltares.train", "--config", os.path.join(ROOT, "experiments", "debug.py"), "--workdir",
                      str(workdir), *overrides)


def run(cmd, timeout=240):
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def describe(proc):
    return f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


PROGRESS = re.compile(r"^\s*(train|tokenizing):\s+\d+%\|")  # tqdm bars on stderr


def assert_clean_error(proc, *words):
    """Non-zero exit, and stderr is exactly one line `error: ...` containing `words` (no traceback);
    progress bars are the only other output allowed."""
    assert proc.returncode not in (0, None), describe(proc)
    lines = [line for line in re.split(r"[\r\n]+", proc.stderr) if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(proc)
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def assert_each_fails_cleanly(cases):
    """Runs the command lines of `cases` ((name, args, words, extra environment)), two at a time; each must
    end in one `error:` line holding its words, without a traceback (all failures reported together)."""
    import concurrent.futures

    def call(case):
        _, args, _, env = case
        return subprocess.run(module_cmd(*args), cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True,
                              timeout=240)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(call, cases))
    failures = []
    for (name, _, words, _), proc in zip(cases, procs):
        try:
            assert "Traceback" not in proc.stderr
            assert_clean_error(proc, *words)
        except AssertionError as err:
            failures.append(f"{name}: {err}\n{describe(proc)}")
    assert not failures, "\n\n".join(failures)


def assert_nothing_to_resume(workdir):
    """A failed start leaves nothing a later run in the same workdir would resume from or append to."""
    assert checkpoint_steps(workdir) == []
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def tensorboard_scalars(workdir):
    """{(tag, step): value} from the TFRecord event files (parsed here, without tensorboard)."""
    files = glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents*"))
    assert files, "no TensorBoard event file"
    return event_scalars(files)


WORDS = (
    "the whale ship sea captain harpoon deck mast sail wind wave storm ocean voyage crew sailor boat oil white "
    "hunt island harbour rope anchor compass chart night morning fog ice and of a to in was he his that it"
).split()


def write_paragraphs(path, n, seed):
    rng = np.random.default_rng(seed)
    paras = []
    for i in range(n):
        sentences = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 14)))).capitalize() + "." for _ in range(3)]
        paras.append(" ".join(sentences))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(paras) + "\n")
    return paras
