"""`python -m deltares.train ARGS` as tests/test_multihost.py runs it, one process per simulated host,
recording what the test checks.

The trainer's own `__main__` runs unchanged (flags, `initialize_distributed` from the SLURM or
`JAX_*` environment, the loop). Two hooks record, into `$DELTARES_TEST_RECORD` at exit: the local
rows of every batch the loop takes from the data iterator (one `next` per step) and the step of
every checkpoint save; with them the process's index and count, and whether it joined a cluster.
`$DELTARES_TEST_STEP_SLEEP` seconds of sleep per step keep the run going long enough for a signal
to land mid-run. `$DELTARES_TEST_FAIL_SAVE=process:step` makes that process's save of that step fail
as a background write that ran out of disk space does (orbax's report of it, seen by that process
alone). `$DELTARES_TEST_FAIL_READ=process:step` makes that process's read of that step's batch fail as
a bucket that stops answering does (a DataError saying `$DELTARES_TEST_READ_ERROR`). In a SLURM job (tests/test_slurm.py) `{process}` and `{restart}` in the record's
path become the task's `SLURM_PROCID` and the job's `SLURM_RESTART_COUNT`, the sleep may be a list
with one value per restart (the last one for later restarts), and the record also holds what SLURM
gave the task: its CPUs (the process's CPU affinity) and SLURM's CPU and memory variables.
"""

import atexit
import json
import os
import runpy
import sys
import time

import jax
import numpy as np
from jax._src import distributed  # whether jax.distributed.initialize ran (its client)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deltares.training import checkpoint  # noqa: E402
from deltares.data import dataset  # noqa: E402

RESTART = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
RECORD = os.environ["DELTARES_TEST_RECORD"].format(process=os.environ.get("SLURM_PROCID", "0"), restart=RESTART)
SLEEPS = [float(s) for s in os.environ.get("DELTARES_TEST_STEP_SLEEP", "0").split(",")]
SLEEP = SLEEPS[min(RESTART, len(SLEEPS) - 1)]
SLURM = ("SLURM_CPUS_ON_NODE", "SLURM_JOB_CPUS_PER_NODE", "SLURM_MEM_PER_NODE", "SLURM_NODEID", "SLURM_JOB_NODELIST")
FAIL_SAVE = os.environ.get("DELTARES_TEST_FAIL_SAVE")
FAIL_READ = os.environ.get("DELTARES_TEST_FAIL_READ")
READ_ERROR = os.environ.get("DELTARES_TEST_READ_ERROR")
rows, saves = [], []


class RecordingIterator:
    """The trainer's data iterator, keeping a copy of every batch it hands out."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        if FAIL_READ == f"{jax.process_index()}:{len(rows) + 1}":
            raise dataset.DataError(READ_ERROR)
        batch = next(self.inner)
        rows.append(np.asarray(batch).copy())
        time.sleep(SLEEP)
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def recording_iterator(ds, prefetch=4, _inner=dataset.train_iterator):
    return RecordingIterator(_inner(ds, prefetch))


def recording_save(self, step, *args, _inner=checkpoint.Checkpointer.save):
    saves.append(int(step))
    if FAIL_SAVE == f"{jax.process_index()}:{step}":
        self._errors.error = OSError(28, "No space left on device")  # read by the save's own poll
    return _inner(self, step, *args)


@atexit.register  # before jax's own exit handlers (they were registered first, so they run later)
def dump():
    np.save(RECORD + ".npy", np.stack(rows) if rows else np.zeros((0, 0, 0), np.int32))
    with open(RECORD + ".json", "w") as f:
        json.dump({"saves": saves, "steps": len(rows), "process": [jax.process_index(), jax.process_count()],
                   "distributed": distributed.global_state.client is not None,
                   "cpus": len(os.sched_getaffinity(0)), "slurm": {k: os.environ.get(k) for k in SLURM}}, f)


dataset.train_iterator = recording_iterator  # `deltares.train` imports both names when it runs below
checkpoint.Checkpointer.save = recording_save
sys.argv = ["deltares.train", *sys.argv[1:]]
runpy.run_module("deltares.train", run_name="__main__", alter_sys=True)
