"""Checkpoints with orbax: train state, data-iterator state, config and dataset record in one step directory.

`<workdir>/checkpoints/<step>/{state,data,config,dataset}`. Saves are asynchronous and atomic (orbax
writes a temporary directory and renames it when complete), so an interrupted save leaves the
previous checkpoint usable. A save that fails in the background is reported to the training loop
by `Checkpointer.poll` (called every step) as one line naming the step, the cause and the previous
durable step; orbax's own reports of it are kept off the terminal. A step counts as durable once it
is finalized and passes `step_problem` (deltares.training.checkpoint_check); only then are older
steps removed (the last `keep_last`, plus every multiple of `keep_every`, are kept), so a failed
save never costs an older checkpoint.

Every reader checks a step before using it and falls back to the newest usable one (`find_checkpoint`,
`Checkpointer.resume_step`), saying which step it skipped and why. The trainer, which holds the run
directory's lock, moves a damaged step to `<workdir>/checkpoints_aside/` (never deletes it) so
that it does not stand in the way of later runs; readers leave the run directory as it is.
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import re
import sys
import threading
import time
import warnings
from typing import Callable, NamedTuple

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from deltares.data import paths
from deltares.nn.model import Transformer
from deltares.training.checkpoint_check import step_problem
from deltares.training.experiment import with_schema_defaults
from deltares.training.sharding import state_shardings
from deltares.training.steps import abstract_params

ASIDE = "checkpoints_aside"  # beside `checkpoints/`: steps moved out of the way, each with a REASON file
ITEMS = ("state", "data", "config", "dataset")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or used; the message says which step and why in one line."""


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cause(err: BaseException | str) -> str:
    """One short line for a storage failure: the operating system's words where tensorstore gives them."""
    text = str(err).strip()
    # tensorstore appends payloads ([os_error_code='27'] [tensorstore_spec='...'] ...) in varying order
    if match := re.search(r"\[os_error_code='?(\d+)'?\]", text):
        code = int(match.group(1))
        return f"{os.strerror(code)} (errno {code})"
    first = text.splitlines()[0][:300] if text else ""
    return first if isinstance(err, str) else f"{type(err).__name__}: {first}"


class _QuietClosedLoops:
    """sys.stderr, less the tracebacks "RuntimeError: Event loop is closed" that tensorstore prints (from
    C++, so no Python handler sees them) for each write still in flight when orbax's background save
    fails and closes its event loop: dozens per failure, none of them saying anything more. A
    traceback is held, per thread, until its last line shows what it is; other threads write meanwhile."""

    DROPPED = "RuntimeError: Event loop is closed"

    def __init__(self, stream):
        self.stream, self.held, self.lock = stream, {}, threading.Lock()

    def write(self, text: str) -> int:
        thread = threading.get_ident()
        with self.lock:
            held = self.held.get(thread)
            if held is None and not text.startswith("Traceback (most recent call last):"):
                return self.stream.write(text)
            held = (held or "") + text
            self.held[thread] = held
            for line in held.split("\n")[1:-1]:
                if line and not line[0].isspace():  # the exception line ends the traceback
                    del self.held[thread]
                    if line.strip() != self.DROPPED:
                        self.stream.write(held)
                    break
            return len(text)

    def release(self):
        """The stream it wraps; a traceback still held is written out unless it is one of those dropped."""
        with self.lock:
            for held in self.held.values():
                if "call_soon_threadsafe" not in held:
                    self.stream.write(held)
            self.held = {}
        return self.stream

    def flush(self) -> None:
        self.stream.flush()

    def __eq__(self, other) -> bool:  # the stream it wraps: tqdm.write clears a bar drawn on that stream
        return other is self or other is self.stream or other == self.stream

    __hash__ = object.__hash__

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _not_an_orbax_write_left_behind(record) -> bool:
    """A filter for the `asyncio` logger: drops its "exception was never retrieved" reports of the
    writes a failed orbax save left behind (logged when they are collected, often at exit); the
    failure itself is reported by `Checkpointer.poll`."""
    return not (record.levelno >= std_logging.ERROR and "orbax-checkpoint-tmp" in record.getMessage())


class _OrbaxErrors(std_logging.Filter):
    """Keeps orbax's reports of a failed background write off the terminal (hundreds of lines of
    thread tracebacks) and keeps the first one for the trainer's message. Installed on the `absl`
    logger while a Checkpointer is open."""

    def __init__(self):
        super().__init__()
        self.error = None

    def filter(self, record) -> bool:
        if record.levelno >= std_logging.ERROR and "orbax" in record.pathname:
            if self.error is None:
                self.error = record.exc_info[1] if record.exc_info else record.getMessage()
            return False
        return True

    def take(self):
        error, self.error = self.error, None
        return error


def read_json_item(step_dir, item: str):
    """The JSON item `item` (config, data, dataset) of a step directory, or None where it has none."""
    path = epath.Path(step_dir) / item / "metadata"
    return json.loads(path.read_text()) if path.exists() else None


def usable_step(directory: str, need: str, log: Callable[[str], None] = _warn,
                set_aside: Callable[[int, str], str] | None = None, name: str | None = None) -> int | None:
    """The newest step under `directory` (called `name` in messages, if given) that passes `step_problem`
    (None when there are no steps). Each newer step that does not is reported in one line through `log`
    and, with `set_aside`, moved out of the way. Raises CheckpointError when every step is damaged;
    nothing is moved then."""
    steps = sorted(ocp.utils.checkpoint_steps(directory), reverse=True) if epath.Path(directory).is_dir() else []
    skipped, name = [], name or directory
    for step in steps:
        problem = step_problem(paths.join(directory, str(step)), need)
        if problem is None:
            for bad, why in skipped:
                moved = f"; moved it to {set_aside(bad, why)}" if set_aside is not None else ""
                log(f"warning: skipped checkpoint step {bad} of {name}: {why}{moved}")
            return step
        skipped.append((step, problem))
    if skipped:
        listed = "; ".join(f"step {s}: {why}" for s, why in skipped[:3])
        raise CheckpointError(
            f"no usable checkpoint in {name} ({listed}); nothing was moved or deleted: repair the "
            f"step{'s' if len(skipped) > 1 else ''} or move {'them' if len(skipped) > 1 else 'it'} away to start "
            "from scratch"
        )
    return None


def _together(name: str) -> None:
    """With several processes, waits until every process has come here (they call it in the same order)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


class Checkpointer:
    """Saves the steps of one run directory and finds the step to resume from (see the module docstring).
    Its files are read and written through `through` (the run directory held open, see
    deltares.training.workdir.WorkdirLock.through; default the workdir); messages name the workdir."""

    def __init__(self, workdir: str, keep_last: int = 3, keep_every: int = 0, async_save: bool = True,
                 through: str | None = None):
        self.workdir = paths.run_dir(workdir)
        self.directory = paths.join(self.workdir, "checkpoints")  # in messages
        self._files = paths.join(through or self.workdir, "checkpoints")  # what is read and written
        self.keep_last, self.keep_every = keep_last, keep_every
        self._errors, self._stderr = _OrbaxErrors(), None
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self._files, options=options, item_names=ITEMS)
        self.pending = None  # the step being written in the background
        self.durable = None  # the newest step known to be written whole
        self.failed = False  # a save failed

    def step_dir(self, step: int) -> str:
        """The folder of step `step`, to read or write (through `through`)."""
        return paths.join(self._files, str(step))

    def steps(self) -> list[int]:
        """The finalized steps on storage, oldest first."""
        return sorted(ocp.utils.checkpoint_steps(self._files)) if epath.Path(self._files).is_dir() else []

    def set_aside(self, step: int, reason: str) -> str:
        """Moves step `step` to `<workdir>/checkpoints_aside/<step>[-n]` with a REASON file (on process 0);
        returns where it went."""
        aside = epath.Path(self._files).parent / ASIDE
        name, n = str(step), 1
        while (aside / name).exists():
            name, n = f"{step}-{n}", n + 1
        _together(f"set aside {step}")  # every process has read the steps before process 0 moves one
        if jax.process_index() == 0:
            aside.mkdir(parents=True, exist_ok=True)
            epath.Path(self.step_dir(step)).rename(aside / name)
            (aside / name / "REASON").write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}\n")
        _together(f"set aside {step}: moved")
        self.manager.reload()
        return paths.join(self.workdir, ASIDE, name)

    def resume_step(self, want: int | None = None, log: Callable[[str], None] = _warn) -> int | None:
        """The step to resume from: `want` (config.train.resume_step; newer steps are moved aside, so that
        this run's saves follow it), else the newest usable step, damaged newer ones moved aside."""
        if want is None:
            step = usable_step(self._files, "all", log, self.set_aside, name=self.directory)
        else:
            steps = self.steps()
            if want not in steps:
                raise CheckpointError(f"config.train.resume_step={want}: {self.directory} has no step {want} "
                                      f"(it has {', '.join(map(str, steps)) or 'none'})")
            if problem := step_problem(self.step_dir(want)):
                raise CheckpointError(f"config.train.resume_step={want}: step {want} of {self.directory} is "
                                      f"damaged: {problem}")
            for newer in [s for s in steps if s > want]:
                where = self.set_aside(newer, f"newer than config.train.resume_step={want}")
                log(f"moved checkpoint step {newer}, newer than config.train.resume_step={want}, to {where}")
            step = want
        self.durable = step
        return step

    def _quiet_failures(self) -> None:
        """From the first save until `close`: orbax's reports of a failed background write go to `poll`
        instead of the terminal (see _OrbaxErrors, _QuietClosedLoops, _not_an_orbax_write_left_behind)."""
        if self._stderr is not None:
            return
        std_logging.getLogger("absl").addFilter(self._errors)
        asyncio_log = std_logging.getLogger("asyncio")
        if _not_an_orbax_write_left_behind not in asyncio_log.filters:
            asyncio_log.addFilter(_not_an_orbax_write_left_behind)
            # ... and the writes it never started, collected at exit
            warnings.filterwarnings("ignore", r"coroutine '.*(write_fragment|serialize).*' was never awaited",
                                    RuntimeWarning)
        self._stderr = sys.stderr = _QuietClosedLoops(sys.stderr)

    def save(self, step: int, state, data_state: dict, config: dict, dataset: dict | None = None) -> None:
        """Starts writing `step` (in the background when asynchronous); waits for the previous save first."""
        self._quiet_failures()
        self.wait()
        items = dict(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                     config=ocp.args.JsonSave(config))
        if dataset is not None:
            items["dataset"] = ocp.args.JsonSave(dataset)
        self.pending = step
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        except BaseException:
            self.failed = True
            raise
        self.poll()

    def poll(self) -> None:
        """Checks a background save: raises CheckpointError as soon as it has failed; once it has ended
        well, records its step as durable and removes the steps no longer kept. Cheap while it runs."""
        if self.pending is None:
            return
        error = self._errors.take()  # orbax reports a failed write before its save has ended
        if error is None and self.manager.is_saving_in_progress():
            return
        step, self.pending = self.pending, None
        if error is None and jax.process_index() == 0:  # read back by one process; the trainer shares its verdict
            error = "the step was not finalized" if step not in self.steps() else step_problem(self.step_dir(step))
        if error is not None:
            self.failed = True
            raise CheckpointError(f"saving step {step} failed ({_cause(error)}); {self.previous()} in {self.directory}")
        self.durable = step
        self._retain()

    def previous(self) -> str:
        """What a failed save leaves, in words: the newest durable step (checked to be still there)."""
        if self.durable is None:
            return "no checkpoint was saved before it"
        if not epath.Path(self.step_dir(self.durable)).is_dir():
            return f"the previous checkpoint, step {self.durable}, is gone too (its folder was removed)"
        return f"the previous checkpoint, step {self.durable}, is intact"

    def _retain(self) -> None:
        """Removes the steps no longer kept: on process 0 alone, and no other process reads the step folders
        then (a listing on another process of the folder being removed fails: it vanishes under the read)."""
        if jax.process_index() != 0:
            return
        steps = self.steps()
        keep = set(steps[-self.keep_last:]) | {s for s in steps if self.keep_every and s % self.keep_every == 0}
        for step in steps:
            if step not in keep:
                epath.Path(self.step_dir(step)).rmtree(missing_ok=True)
        self.manager.reload()

    def check_params(self, step: int, abstract_params) -> None:
        """Raises ValueError naming the first parameter whose stored shape differs, or that only one of the
        checkpoint and the config has."""
        stored = stored_params(paths.join(self.step_dir(step), "state"))
        stored = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
        needed = set()
        for key, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
            name = jax.tree_util.keystr(key)
            needed.add(name)
            if stored.get(name) != tuple(leaf.shape):
                raise ValueError(f"parameter {name}: checkpoint has {stored.get(name, 'none')}, config needs {leaf.shape}")
        if extra := sorted(set(stored) - needed):
            raise ValueError(f"parameter {extra[0]}: checkpoint has {stored[extra[0]]}, config has none")

    def restore(self, step: int, abstract_state):
        """(state, data_state) of `step`, with `abstract_state`'s structure, shapes and shardings."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
        )
        return out.state, out.data

    def config(self, step: int) -> dict:
        """The saved config of `step`, with fields added since it was written at their defaults."""
        return with_schema_defaults(read_json_item(self.step_dir(step), "config"))

    def dataset(self, step: int) -> dict | None:
        """The record of the dataset `step` was trained on (None for checkpoints written before it was kept)."""
        return read_json_item(self.step_dir(step), "dataset")

    def wait(self) -> None:
        """Waits for a background save and checks it (see `poll`)."""
        if self.pending is not None:
            try:
                self.manager.wait_until_finished()
            except Exception as err:  # noqa: BLE001 - the background save's failure, raised here instead of logged
                self._errors.error = self._errors.error or err
            self.poll()

    def close(self) -> None:
        """Waits for a background save (without raising: a failure was reported or is moot) and closes."""
        try:
            self.manager.wait_until_finished()
            self.manager.close()
        except Exception:  # noqa: BLE001 - a failed save was reported by `poll`, or the run is failing anyway
            pass
        finally:
            # After a failed save tensorstore's writes, and orbax's threads, keep failing until the process
            # ends: the filters stay then.
            if not self.failed:
                std_logging.getLogger("absl").removeFilter(self._errors)
            if self._stderr is not None and sys.stderr is self._stderr and not self.failed:
                sys.stderr = self._stderr.release()
            self._stderr = None


def find_checkpoint(path: str, need: str = "params", log: Callable[[str], None] = _warn) -> tuple[str, int]:
    """(checkpoints directory, step) for a workdir, its `checkpoints/` directory, or one step directory:
    the newest step whose parts in `need` are usable (see `usable_step`, `step_problem`); a step
    directory named by hand must be usable itself. Raises FileNotFoundError or CheckpointError."""
    path = epath.Path(paths.run_dir(path))
    if path.name.isdigit() and any((path / item).exists() for item in ITEMS):
        if problem := step_problem(path, need):
            raise CheckpointError(f"checkpoint step {path} is damaged: {problem}")
        return os.fspath(path.parent), int(path.name)
    directory = path if path.name == "checkpoints" else path / "checkpoints"
    step = usable_step(os.fspath(directory), need, log)
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return os.fspath(directory), step


def stored_params(state_dir: str):
    """The metadata (shape, dtype) of every parameter of a saved train state: orbax reads each
    array's small header (zarr metadata), no array data."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # orbax warns that the step-level metadata file is elsewhere
    try:
        return ocp.StandardCheckpointer().metadata(state_dir).item_metadata["params"]
    finally:
        logging.set_verbosity(verbosity)


def restore_params(state_dir: str, model_cfg, mesh=None) -> dict:
    """`{"params": ...}` of a saved train state: an orbax partial restore that reads no other
    array's data (the optimizer state, Adam's two moments, twice the parameters, is never read).
    On the first device, or with `mesh` each parameter split by the logical rules of `model_cfg`
    (deltares.training.sharding, as training places them), so no device holds more than its shards."""
    stored = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), stored_params(state_dir))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, stored)
    else:
        boxed = abstract_params(Transformer(model_cfg), 1)
        shardings = state_shardings(boxed, stored, mesh)
    item = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                   stored, shardings)}
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        return ocp.PyTreeCheckpointer().restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
            ),
        )
    finally:
        logging.set_verbosity(verbosity)


class LoadedCheckpoint(NamedTuple):
    config: dict
    state: dict | None  # {"params": ...} only: inference never needs the optimizer state
    step: int
    workdir: str  # the run directory holding `checkpoints/`
    dataset: dict | None = None  # the record of the dataset it was trained on (None: older checkpoints)


def load_checkpoint(path: str, want_state: bool = True, mesh=None) -> LoadedCheckpoint:
    """The config and parameters of the newest checkpoint under `path` (see `find_checkpoint`),
    restored without the optimizer state (`restore_params`): on the first device, or split over
    `mesh` by the logical rules of the saved model config. Damaged newer steps are skipped with a
    warning on stderr; raises FileNotFoundError (no checkpoint) or CheckpointError (none usable)."""
    directory, step = find_checkpoint(path, "params" if want_state else "config")
    step_dir = paths.join(directory, str(step))
    config = with_schema_defaults(read_json_item(step_dir, "config"))
    state = None
    if want_state:
        state = restore_params(paths.join(step_dir, "state"), ml_collections.ConfigDict(config).model, mesh)
    return LoadedCheckpoint(config, state, step, os.fspath(epath.Path(directory).parent),
                            read_json_item(step_dir, "dataset"))
