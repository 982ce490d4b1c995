"""Train a deltares model.

    python -m deltares.train --config experiments/tiny.py:delta_block --workdir runs/demo
    python -m deltares.train --config experiments/s220m.py:delta --workdir runs/x \
        --config.data.dataset=data/fineweb --config.train.steps=200
    python -m deltares.train --config experiments/s7b6.py:delta_block --config.data.dataset=DATA --dry_run

Resumes automatically from the newest checkpoint in `--workdir`. SIGTERM or SIGINT
saves a checkpoint and exits cleanly, with status 0 or `--stopped_exit_code` (with several
processes, SIGTERM to any one: all save the same step, see `StopRequest`); a resumed run
continues with exactly the losses an uninterrupted one would have had (data order included). Writes
`metrics.jsonl`, TensorBoard events and checkpoints into the workdir. `--dry_run` checks a
command without training (see `dry_run`): nothing is read, allocated or written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from jax.experimental import multihost_utils
from ml_collections import config_flags
from tqdm import tqdm

from deltares import command_line
from deltares.data import paths
from deltares.data.documents import BUILTIN, DataError
from deltares.data.run_data import RunData, open_run_data
from deltares.data.source import DataSource, unigram_perplexity
from deltares.interop import hf
from deltares.nn.config import check_platform
from deltares.nn.stack import with_layer_layout
from deltares.training.experiment import field_names, flat_fields, validate_config
from deltares.training.checkpoint import CheckpointError, Checkpointer, load_checkpoint
from deltares.training.scoring import evaluate
from deltares.training.memory import PeakMemory
from deltares.training.metrics import MetricsWriter, Profiler, mfu, model_flops_per_token, peak_flops_per_device
from deltares.training.sharding import LOGICAL_RULES, check_batch_split, make_mesh, shard_batch
from deltares.training.program import ShardedTraining, sharded_train_step
from deltares.training.wandb_tracker import TrackerError, open_tracker
from deltares.training.workdir import WorkdirError, WorkdirLock, check_workdir


GRACE_S = 1.0  # a failed write waits this long for a deletion of the run directory under way to show
# Fields that must match to resume a workdir: anything that changes shapes or the data stream.
RESUME_KEYS = ("model", "seed", "data.seq_len", "data.dataset", "data.mixture", "train.global_batch")


def initialize_distributed() -> None:
    """Joins the other processes of a multi-host job; nothing on one host. A TPU pod slice (or SLURM,
    Open MPI, Kubernetes) is found by jax itself; elsewhere `JAX_COORDINATOR_ADDRESS=host:port`,
    `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` name the job (jax 0.10 reads only the first).
    A SLURM job step of one task is one process with nothing to join: jax's SLURM detection would
    give it only the GPU numbered by its local task id (`SLURM_LOCALID`), so it is not started."""
    env = os.environ
    if env.get("SLURM_NTASKS") == "1" and "JAX_NUM_PROCESSES" not in env:
        return
    if "JAX_NUM_PROCESSES" in env or "JAX_PROCESS_ID" in env:
        try:
            address, count, index = env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise TrainError(
                "set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID together (integers)"
            ) from None
        jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=index)
        return
    try:
        jax.distributed.initialize()
    except (ValueError, RuntimeError) as err:  # no cluster detected: a single-host run
        if "coordinator" not in str(err).lower() and "cluster" not in str(err).lower():
            raise


def say(message: str) -> None:
    """A status line on stderr, from process 0 only (the others would repeat it); on a line of its own
    while the progress bar is drawn."""
    if jax.process_index() == 0:
        tqdm.write(message, file=sys.stderr)


class TrainError(RuntimeError):
    """A problem that stops training; the message says what and where."""


def _get(tree: dict, dotted: str):
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def config_json(cfg) -> dict:
    return json.loads(cfg.to_json())


def check_train_config(cfg) -> None:
    t = cfg.train
    if cfg.data.mixture and cfg.data.dataset not in (None, "", BUILTIN):
        raise TrainError("set config.data.dataset or config.data.mixture, not both")
    if cfg.data.mixture and cfg.data.dataset is None:  # unset in the paper-scale experiments: the mixture names the data
        cfg.data.dataset = ""
    if not cfg.data.dataset and not cfg.data.mixture:  # unset in the paper-scale experiments: the command line names it
        raise TrainError(
            "config.data.dataset is not set: prepare a corpus with `python -m deltares.data.prepare --out DIR` "
            "and pass --config.data.dataset=DIR (or 'builtin' for the shipped Moby-Dick)"
        )
    try:
        validate_config(cfg)  # every field's type and allowed values (the schema, deltares.training.experiment)
    except ValueError as err:
        raise TrainError(str(err)) from None
    if t.global_batch % t.micro_batches:
        raise TrainError(f"config.train.global_batch={t.global_batch} is not divisible by micro_batches={t.micro_batches}")
    profile = tuple(t.profile_steps or ())
    if profile and not (
        len(profile) == 2 and all(type(s) is int for s in profile) and 1 <= profile[0] < profile[1]
    ):
        raise TrainError(
            f"config.train.profile_steps={t.profile_steps!r} must be (start, end), integers with 1 <= start < end"
        )


def dry_run(cfg) -> dict:
    """Everything a run checks before its first step, on abstract values only: the config
    validated, the model's parameters and one train step of the experiment's global batch
    built with `jax.eval_shape` (the real sharded step over `config.mesh` on the local
    devices). Neither the dataset nor `init_from*` is read and nothing is written."""
    check_train_config(cfg)
    mesh = _mesh(cfg)
    try:
        training = sharded_train_step(cfg, mesh)
    except ValueError as err:
        raise TrainError(str(err)) from None
    t, seq_len = cfg.train, cfg.data.seq_len
    batch = jax.ShapeDtypeStruct((t.global_batch, seq_len + 1), jnp.int32, sharding=training.batch_sharding)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
        state, out = jax.eval_shape(training.step.fn, training.abstract_state, batch)

    def nbytes(tree, per_device=False):
        return sum(
            math.prod(x.sharding.shard_shape(x.shape) if per_device else x.shape) * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
        )

    tokens = t.global_batch * seq_len
    return {
        "params": sum(x.size for x in jax.tree.leaves(state["params"])),
        "state_bytes": nbytes(state),
        "state_bytes_per_device": nbytes(training.abstract_state, per_device=True),
        "tokens_per_step": tokens,
        "flops_per_step": model_flops_per_token(cfg.model, seq_len) * tokens,
        "mesh": ", ".join(f"{axis} {size}" for axis, size in mesh.shape.items()),
        "devices": f"{jax.device_count()} {jax.devices()[0].platform}",
        "outputs": {k: str(v.dtype) + str(list(v.shape)) for k, v in out.items()},
    }


def _check_resumable(saved: dict, saved_data: dict | None, cfg, source: DataSource, workdir: str) -> list[str]:
    """Refuses to resume a checkpoint of another config or other data (unless config.force): the
    fields in RESUME_KEYS, and the dataset the checkpoint recorded (its tokenizer and token counts).
    Returns the differences config.force resumes despite ([] when there are none), each said."""
    current = config_json(cfg)
    diffs = resume_differences(saved, current)
    if saved_data:  # checkpoints written before the dataset record have none
        now = source.record()
        if saved_data.get("tokenizer_sha256") != now["tokenizer_sha256"]:
            diffs.append(f"the tokenizer of the dataset ({saved_data.get('tokenizer')}, another than {source.path}'s)")
        elif saved_data.get("tokens") != now["tokens"]:
            diffs.append(f"the data under data.dataset (token counts {saved_data.get('tokens')}, now {now['tokens']})")
    if diffs and not cfg.force:
        raise TrainError(
            f"{workdir} holds a checkpoint of another config (differs in {'; '.join(diffs)}); "
            "use a new --workdir, or --config.force=True to resume it anyway"
        )
    if diffs:
        say(f"warning: resuming {workdir} despite config differences (config.force): {'; '.join(diffs)}; the "
            "checkpoint's parameters and optimizer state are loaded into this config's model as they are, which "
            "needs the same parameter names and shapes")
    if changed := changed_settings(saved, current):
        say(f"warning: resuming {workdir} with settings other than its checkpoint's: {'; '.join(changed)}")
    return diffs


def resume_differences(saved: dict, current: dict) -> list[str]:
    """`config.<field> <saved> -> <now>` for every field of RESUME_KEYS (each field of a section) that differs
    between a checkpoint's config and the resumed run's."""
    before, now = flat_fields(saved), flat_fields(current)
    keys = [key for key in sorted(before.keys() | now.keys()) if before.get(key) != now.get(key) and any(
        key == k or key.startswith(k + ".") for k in RESUME_KEYS)]
    return [f"config.{key} {before.get(key)!r} -> {now.get(key)!r}" for key in keys]


def changed_settings(saved: dict, current: dict) -> list[str]:
    """`config.<field> <saved> -> <now>` for every field outside RESUME_KEYS that differs between a
    checkpoint's config and the resumed run's (those of RESUME_KEYS are refused, not listed)."""
    before, now = flat_fields(saved), flat_fields(current)
    resume_keys = tuple(k + "." for k in RESUME_KEYS)
    return [f"config.{key} {before.get(key)!r} -> {now.get(key)!r}" for key in sorted(before.keys() | now.keys())
            if before.get(key) != now.get(key) and key not in RESUME_KEYS and not key.startswith(resume_keys)]


def _init_from_hf(path: str, model_cfg):
    """Parameters of `model_cfg` from a Hugging Face Qwen3 checkpoint (routing parameters fresh)."""
    try:
        params = hf.load_params(path, model_cfg)
    except hf.HFError as err:
        raise TrainError(f"config.init_from_hf: {err}") from None
    say(f"init_from_hf {path}: loaded as {model_cfg.residual.mode}")
    return params


def _init_from(path: str, params, model_cfg):
    """`params` with every leaf that `path`'s checkpoint also has replaced by the checkpoint's value
    (its layers stacked or unrolled as `model_cfg.scan_layers` has them)."""
    try:
        source = load_checkpoint(path).state["params"]
    except (FileNotFoundError, CheckpointError) as err:
        raise TrainError(f"config.init_from: {err}") from None
    source = with_layer_layout(source, model_cfg.scan_layers)
    flat_source = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(source)[0]}
    taken, fresh = 0, []

    def pick(path, leaf):
        nonlocal taken
        key = jax.tree_util.keystr(path)
        if key not in flat_source:
            fresh.append(key)
            return leaf
        if flat_source[key].shape != leaf.shape:
            raise TrainError(f"config.init_from: parameter {key} has shape {flat_source[key].shape}, model needs {leaf.shape}")
        taken += 1
        return jnp.asarray(flat_source[key], leaf.dtype)

    params = jax.tree_util.tree_map_with_path(pick, params)
    say(f"init_from {path}: {taken} parameters loaded, {len(fresh)} freshly initialised {fresh[:8]}")
    return params


class StopRequest:
    """Turns SIGTERM / SIGINT into a stop that the loop asks for after every step (`at`).

    One process: a flag set by the signal. Several: SIGTERM to any one of them is a preemption
    notice for jax's preemption service (installed by `jax.distributed.initialize`), which picks
    the same step on every process (`reached_preemption_sync_point`), so that all save it together
    and none is left waiting in a collective; SIGINT is passed on to it as a SIGTERM."""

    def __init__(self):
        self.signal = None
        self.multiprocess = jax.process_count() > 1
        signals = (signal.SIGINT,) if self.multiprocess else (signal.SIGTERM, signal.SIGINT)
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)

    def at(self, step: int) -> str | None:
        """The signal to stop for after `step` (save it, then return), or None. Call once per step, every step."""
        if not self.multiprocess:
            return self.signal
        return (self.signal or "SIGTERM") if multihost_utils.reached_preemption_sync_point(step) else None

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def train(cfg, workdir: str) -> dict:
    """Runs (or resumes) training; returns the final metrics. The config travels once, in order:
    config and mesh (check_train_config, `_mesh`) -> the run directory, checked and locked
    (deltares.training.workdir) -> data (deltares.data.run_data) -> model and sharded step
    (deltares.training.program) -> the state to start from (`_start_state`) -> the loop (`_train`),
    which writes checkpoints and metrics. Nothing is written before the run directory is locked,
    and a run that fails or is interrupted before its first step leaves a new run directory as it
    found it (see `deltares.command_line.handle_interrupts` for an interrupt outside the loop)."""
    check_train_config(cfg)
    mesh = _mesh(cfg)
    workdir = paths.run_dir(workdir)
    fresh = not paths.is_remote(workdir) and not os.path.exists(workdir)
    made = []  # the new run directory (os.stat), once this run made it
    undo = (lambda: _remove_if_empty(workdir, made)) if fresh else (lambda: None)
    _note("locking the run directory")  # before the lock: an interrupt once it is taken says what it left
    try:
        with command_line.on_interrupt(undo), _locked(workdir) as lock:
            made.extend([os.stat(workdir)] if fresh and jax.process_index() == 0 else [])
            try:
                _note("opening the data")
                run = open_run_data(cfg, workdir, jax.process_index(), jax.process_count(), log=say,
                                    through=lock.through)
                _note("building the train step")
                training = sharded_train_step(cfg, mesh, run.source.eos_id)
                t = cfg.train
                ckpt = Checkpointer(workdir, t.keep_last, t.keep_every, through=lock.through)
                try:
                    return _train(cfg, workdir, run, training, ckpt, lock)
                finally:
                    ckpt.close()
            except Exception:
                if (why := lock.problem()) is not None:  # the cause: the run directory moved, deleted, taken over
                    raise TrainError(why) from None
                raise
    except BaseException:
        undo()
        raise


def _remove_if_empty(workdir: str, made: list) -> None:
    """Removes what a run made and left empty: the checkpoints folder, the run directory (once it was
    locked, only while the path still leads to the directory it made, `made`)."""
    try:
        if made and not os.path.samestat(os.stat(workdir), made[0]):
            return
    except OSError:
        return
    for path in (os.path.join(workdir, "checkpoints"), workdir):
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)


def _note(doing: str) -> None:
    """What an interrupt before the training loop reports (the loop's `StopRequest` saves instead)."""
    command_line.interrupt_note(doing, "nothing was saved")


def _mesh(cfg):
    """The device mesh of `cfg.mesh`, checked so that the global batch splits over it."""
    try:
        mesh = make_mesh(cfg.mesh)
        check_batch_split(cfg.train, mesh)
        check_platform(cfg.model, mesh.devices.flat[0].platform, cfg.data.seq_len)  # attention and kernels
    except ValueError as err:
        raise TrainError(str(err)) from None
    return mesh


@contextlib.contextmanager
def _locked(workdir: str):
    """The run directory checked (`check_workdir`) and locked (`WorkdirLock`) for the run's duration,
    by process 0; every process stops with TrainError when it cannot be. Every process holds a local
    run directory open (the others where they see it), and writes through it (`WorkdirLock.through`)."""
    lock, error = WorkdirLock(workdir, log=say), None
    with command_line.on_interrupt(lock.release):
        if jax.process_index() == 0:
            try:
                check_workdir(workdir)
                paths.makedirs(workdir)
                with command_line.whole():  # an interrupt leaves no lock file without its record
                    lock.acquire()
            except (WorkdirError, OSError) as err:
                error = str(err)
        if jax.process_count() > 1 and not multihost_utils.broadcast_one_to_all(np.int32(error is None)):
            error = error or f"process 0 could not check or lock {workdir} (its error says why)"
        if error:
            raise TrainError(error)
        if jax.process_index() != 0 and os.path.isdir(workdir):
            with contextlib.suppress(OSError):  # unreadable here: this process writes by name
                lock.hold()
        try:
            yield lock
        finally:
            lock.release()


def _start_state(cfg, workdir: str, run: RunData, training: ShardedTraining, ckpt: Checkpointer):
    """(state, step) a run starts from: its newest usable checkpoint (or config.train.resume_step;
    the data stream's position restored into `run.train`), else fresh parameters, or those of
    config.init_from / config.init_from_hf (read and checked here, where the parameters are initialised)."""
    try:
        start = ckpt.resume_step(cfg.train.resume_step, log=say)
    except CheckpointError as err:
        raise TrainError(str(err)) from None
    if start is not None:
        _note(f"restoring step {start}")
        forced = _check_resumable(ckpt.config(start), ckpt.dataset(start), cfg, run.source, workdir)
        abstract_state = training.abstract_state
        try:
            ckpt.check_params(start, abstract_state["params"])
        except ValueError as err:
            raise TrainError(_cannot_resume(start, ckpt, str(err), forced, workdir)) from None
        try:
            state, data_state = ckpt.restore(start, abstract_state)
        except Exception as err:  # noqa: BLE001 - whatever the storage layer raises, one line
            if forced:  # another config: its checkpoint is sound, it just does not fit
                raise TrainError(_cannot_resume(start, ckpt, first_line(err), forced, workdir)) from None
            raise TrainError(
                f"restoring step {start} of {ckpt.directory} failed ({first_line(err)}); if the step is damaged, "
                "move it away or resume an older one with --config.train.resume_step"
            ) from None
        run.train.set_state(data_state)
        say(f"resumed {workdir} from step {start}")
        return state, start
    if cfg.init_from and cfg.init_from_hf:
        raise TrainError("set config.init_from or config.init_from_hf, not both")
    _note("initialising the model")
    params = _init_from_hf(cfg.init_from_hf, cfg.model) if cfg.init_from_hf else None
    state = training.init(cfg.seed)
    if cfg.init_from:
        params = _init_from(cfg.init_from, state["params"], cfg.model)
    if params is None:
        return state, 0
    return jax.device_put({**state, "params": params, "opt_state": training.tx.init(params)}, training.state_shardings), 0


def _cannot_resume(step: int, ckpt: Checkpointer, why: str, forced: list[str], workdir: str) -> str:
    """Why step `step` does not restore into this config, and what to do: with config.force, its checkpoint is
    of another config, not damaged, so it stays as it is and this config starts in a new run directory."""
    message = f"cannot restore step {step} of {ckpt.directory} into this config ({why.rstrip(':')})"
    if not forced:
        return message
    return (f"{message}: config.force resumes only a checkpoint whose parameters fit, and this one is of another "
            f"config ({'; '.join(forced)}); nothing was changed. To start this config from its parameters (those "
            f"of the same name and shape), use a new --workdir with --config.init_from={workdir}")


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


def _storage_problem(ckpt: Checkpointer, lock: WorkdirLock | None, every_process: bool,
                     problem: str | None = None) -> str | None:
    """Why the run cannot go on (`problem`, a failure this process already saw: a data read, a write; a
    background save failed; the run directory's lock was taken over), or None. With several processes,
    `every_process` agrees on it (a collective: call it at the same steps on all)."""
    if problem is None and lock is not None:
        problem = lock.problem()  # first: a moved directory also fails the saves
    if problem is None:
        problem = _save_problem(ckpt)
    if every_process and jax.process_count() > 1:
        failed = multihost_utils.process_allgather(np.int32(problem is not None))
        if failed.any() and problem is None:
            problem = "another process of this run could not read its data or store its work (its error says why)"
    return problem


class _Outputs:
    """The device outputs of the steps since the last log, read back at a log boundary."""

    def __init__(self, vocab_size: int, dataset: str):
        self.vocab_size, self.dataset, self.pending = vocab_size, dataset, []

    def add(self, step: int, out) -> None:
        self.pending.append((step, out))

    def read(self, ckpt: Checkpointer) -> tuple[list[float], list[float]]:
        """(losses, gradient norms); TrainError at the first step whose batch held a token id outside
        the vocabulary, or whose loss or gradient norm is not finite (the last good checkpoint named)."""
        host = [jax.device_get(o) for _, o in self.pending]
        steps = [s for s, _ in self.pending]
        self.pending = []
        for step, o in zip(steps, host):
            if int(o["max_token"]) >= self.vocab_size:
                raise TrainError(
                    f"{self.dataset} holds token id {int(o['max_token'])} (in the batch of step {step}), outside the "
                    f"model's vocabulary of {self.vocab_size} (config.model.vocab_size). {_last_good(ckpt)}"
                )
        losses, norms = [float(o["loss"]) for o in host], [float(o["grad_norm"]) for o in host]
        bad = [s for s, loss, norm in zip(steps, losses, norms) if not math.isfinite(loss + norm)]
        if bad:
            raise TrainError(f"non-finite loss or parameters at step {bad[0]}; stopped. {_last_good(ckpt)}")
        return losses, norms


def _last_good(ckpt: Checkpointer) -> str:
    _save_problem(ckpt, wait=True)  # a save that failed leaves the previous durable step, which is what counts
    if ckpt.durable is None:
        return f"No checkpoint was saved yet in {ckpt.directory}"
    return f"The last good checkpoint is step {ckpt.durable} in {ckpt.directory}"


def _train(cfg, workdir: str, run: RunData, training: ShardedTraining, ckpt: Checkpointer,
           lock: WorkdirLock | None = None) -> dict:
    """Trains to config.train.steps from where the run stands; the final (or last) evaluation."""
    loop = _TrainLoop(cfg, workdir, run, training, ckpt, lock)
    try:
        return loop.run()
    finally:
        loop.close()


class _TrainLoop:
    """One run's training loop: steps, metrics records, checkpoints, and a clean stop on a signal, a
    storage failure or non-finite values (the metrics never hold a step that no checkpoint holds)."""

    def __init__(self, cfg, workdir: str, run: RunData, training: ShardedTraining, ckpt: Checkpointer,
                 lock: WorkdirLock | None):
        t = cfg.train
        self.cfg, self.workdir, self.run_data, self.training, self.ckpt, self.lock = cfg, workdir, run, training, ckpt, lock
        self.state, self.start = _start_state(cfg, workdir, run, training, ckpt)
        self.all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))
        self.config_record, self.dataset_record = config_json(cfg), run.source.record()
        through = lock.through if lock is not None else workdir  # every write: see WorkdirLock.through
        try:
            tracker = open_tracker(t.wandb, workdir, self.config_record, through)  # None unless wandb.project is set
        except TrackerError as err:
            raise TrainError(str(err)) from None
        self.writer = MetricsWriter(through, resume_step=self.start, tracker=tracker)
        self.profiler = Profiler(through, t.profile_steps, t.profile_all_processes)
        self.aside = _Aside()  # evaluations, routing statistics, peak memory and saves: not in the step time
        self.logged = False
        self.records = _Records(cfg, run, training, self.aside)
        self.outputs = _Outputs(cfg.model.vocab_size, run.source.path)
        self.single = jax.process_count() == 1
        self.last_eval: dict = {}
        self.problem: str | None = None  # a read or write failure this process saw, not yet shared (`fail`)
        self.blank = None  # this process's rows after its data read failed, with several processes (`next_rows`)
        self.stop = StopRequest()
        self.bar = tqdm(total=t.steps, initial=self.start, unit="step", desc="train", dynamic_ncols=True,
                        file=sys.stderr, disable=jax.process_index() != 0)
        if (epochs := run.source.epochs(t.steps * t.global_batch, cfg.data.seq_len)) > 1:
            say(f"warning: {t.steps} steps of {t.global_batch} windows are {epochs:.2f} epochs of {run.source.path}: "
                "the run repeats its data")

    def close(self) -> None:
        command_line.interrupt_note("closing the run", "every checkpoint it reported is saved")
        self.stop.restore()
        self.bar.close()
        self.profiler.stop()
        self.writer.close()

    def stop_run(self, problem: str):
        """Stops the run for `problem`, or for what happened to the run directory where that is the cause;
        the metrics keep no record of a step that no checkpoint holds."""
        _save_problem(self.ckpt, wait=True)  # a save in flight ends (or fails, quietly) before the run does
        problem = self._run_directory_problem(problem)
        try:
            self.writer.truncate_after(self.ckpt.durable)  # no record of a step that no checkpoint holds
        except OSError:
            pass  # the run directory is gone or unwritable: the problem says so
        raise TrainError(problem)

    def _run_directory_problem(self, problem: str) -> str:
        """What happened to the run directory (`WorkdirLock.problem`), where that is why a write failed, else
        `problem`. A write that failed because files vanished under it is most often a deletion of the whole
        directory under way: it is given a moment to show as one."""
        if self.lock is None:
            return problem
        deadline = time.monotonic() + GRACE_S
        while not (why := self.lock.problem()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return why or problem

    def save(self, step: int) -> None:
        ckpt = self.ckpt
        with self.aside:
            # the previous save first, and the directory checked right before this one starts (by all processes)
            self.check_storage(wait=True)
            try:
                ckpt.save(step, self.state, self.run_data.train.get_state(), self.config_record, self.dataset_record)
            except CheckpointError as err:
                self.fail(str(err))
            except Exception as err:  # noqa: BLE001 - any storage failure ends the run the same way
                self.fail(f"saving step {step} failed ({first_line(err)}); {ckpt.previous()} in {ckpt.directory}")

    def fail(self, problem: str) -> None:
        """A read or write failure this process saw. One process stops for it at once; several stop together at
        the next `check_storage`, where every process learns of it (one that stopped alone would leave the
        others waiting in the next collective until jax's shutdown timeout aborts them, minutes later)."""
        if self.single:
            self.stop_run(problem)
        self.problem = self.problem or problem

    def log(self, step: int, batch, step_time: float, save_now: bool) -> None:
        """The record of a logging (or saving) step, after checking that what is saved is finite. The first
        record's writers start up, and the check belongs to the save: neither is in the step time."""
        first, self.logged = not self.logged, True
        with self.aside if first else contextlib.nullcontext():
            self._log(step, batch, step_time, save_now)

    def _log(self, step: int, batch, step_time: float, save_now: bool) -> None:
        losses, norms = self.outputs.read(self.ckpt)
        with self.aside:
            finite = not save_now or bool(self.all_finite(self.state["params"]))
        if not finite:
            raise TrainError(f"non-finite loss or parameters at step {step}; stopped. {_last_good(self.ckpt)}")
        record, evaluation = self.records.at(step, self.state, batch, losses, norms, step_time)
        self.last_eval = evaluation or self.last_eval
        try:
            self.writer.write(step, record)
        except OSError as err:
            self.fail(f"writing the metrics of step {step} to {self.workdir} failed ({err.strerror or err}); "
                      f"{_last_good(self.ckpt)}")
        self.bar.set_postfix(loss=f"{record['loss_mean']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)

    def next_rows(self, step: int):
        """This process's rows of the batch of step `step + 1`. A read that fails (a bucket that stops
        answering, a file gone bad) stops the run. One process saves the step it stands at first (the data
        position saved is the failed batch's, which a resumed run reads). Several stop together at the next
        check, where every process learns why; until then this one steps on blank rows, so that no other
        waits for it in the step's collectives, and nothing from those steps is saved: they resume from
        their last checkpoint (to save the step they stood at, every step would have to wait for all hosts)."""
        if self.blank is not None:
            return self.blank
        try:
            return next(self.run_data.train)
        except Exception as err:  # noqa: BLE001 - whatever the read raises ends the run the same way
            problem = f"reading the training data for step {step + 1} failed ({first_line(err)})"
        self.fail(f"{problem}. {self.save_before_stopping(step) if self.single else _last_good(self.ckpt)}")
        t = self.cfg.train
        self.blank = np.zeros((t.global_batch // jax.process_count(), self.cfg.data.seq_len + 1), np.int32)
        return self.blank

    def save_before_stopping(self, step: int) -> str:
        """Saves `step` (one process, its parameters finite) unless it is saved or the run's first; where
        the run's work is kept."""
        ckpt = self.ckpt
        if problem := _save_problem(ckpt, wait=True):  # the save in flight failed: its reason names the intact step
            return problem
        if step > self.start and ckpt.durable != step:
            with self.aside:
                finite = bool(self.all_finite(self.state["params"]))
            if finite:
                self.save(step)
                self.check_storage(wait=True)
                return f"Saved step {step} to {ckpt.directory}; rerun the same command to resume"
        return _last_good(ckpt)

    def check_storage(self, wait: bool = False) -> None:
        """Stops the run if a write failed (`wait`: the last save, after waiting for it) or the storage is
        unfit; with several processes, all stop if any one saw a failure (a collective: every process calls
        it at the same steps)."""
        problem = self.problem or (_save_problem(self.ckpt, wait=True) if wait else None)
        if problem := _storage_problem(self.ckpt, self.lock, not self.single, problem):
            self.stop_run(problem)

    def run(self) -> dict:
        t, start = self.cfg.train, self.start
        # The throughput window: from the end of the last one (its logging counted, what `aside` timed not)
        # to the moment its steps have run; the first step, which compiles, is not in any.
        step, timed, window_start = start, 0, time.perf_counter()
        while step < t.steps:
            self.profiler.before(step + 1)
            batch = shard_batch(self.next_rows(step), self.training.batch_sharding)
            self.state, out = self.training.step(self.state, batch)
            step += 1
            self.bar.update(1)
            self.outputs.add(step, out)
            self.profiler.after(step, out)
            if step == start + 1:
                jax.block_until_ready(out)
                timed, window_start = -1, time.perf_counter() + self.aside.take()
            timed += 1
            stopping = self.stop.at(step)  # read once: a signal arriving later in this step is handled next step
            boundary = step % t.log_every == 0 or step == t.steps or stopping
            save_now = step % t.checkpoint_every == 0 or step == t.steps or stopping
            if self.single or boundary or save_now:
                self.check_storage()
            if boundary or save_now:
                jax.block_until_ready(out)  # the window ends when its steps have run, not when they were dispatched
                window_end = time.perf_counter()
                self.log(step, batch, (window_end - window_start) / timed if timed else math.nan, save_now)
            if save_now:
                self.save(step)
            if boundary or save_now:
                timed, window_start = 0, window_end + self.aside.take()
            if stopping:
                self.check_storage(wait=True)
                self.bar.close()
                if jax.process_index() == 0:
                    print(f"{stopping}: saved step {step} to {self.ckpt.directory}; rerun the same command to resume.")
                return {"step": step, "stopped": stopping, **self.last_eval}
        self.check_storage(wait=True)
        if not self.last_eval:  # resumed a finished run: report its final evaluation
            run = self.run_data
            self.last_eval = evaluate(self.training.eval_step, self.state["params"], run.val, run.bytes_per_token)
        if jax.process_index() != 0:  # the corpus's unigram perplexity is printed by process 0
            return {"step": step, **self.last_eval}
        return {"step": step, **self.last_eval, "unigram_ppl": unigram_perplexity(self.run_data.source)}


class _Aside:
    """A stopwatch for the work between train steps that is not training (`with aside:`, nested blocks
    timed once); `take` returns the seconds timed since the last take."""

    def __init__(self):
        self.seconds, self._start, self._depth = 0.0, None, 0

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._start = time.perf_counter()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class _Records:
    """The metrics record of a logging step: the losses and gradient norms since the last one, the
    learning rate, throughput and MFU, and where due the evaluation, routing statistics and peak memory
    (timed by `aside`)."""

    def __init__(self, cfg, run: RunData, training: ShardedTraining, aside: _Aside):
        self.cfg, self.run, self.training, self.aside = cfg, run, training, aside
        self.lr_at = jax.jit(training.schedules["model"])  # one call per record, not a dozen small ones
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.flops_per_step = model_flops_per_token(cfg.model, cfg.data.seq_len) * self.tokens_per_step
        peak = peak_flops_per_device(cfg.train.peak_tflops)
        self.peak = peak and peak * jax.device_count()  # None for an unknown device: mfu is null
        self.peak_memory = PeakMemory(training.step)  # device high-water mark, else the compiled step's footprint

    def at(self, step: int, state, batch, losses, norms, step_time: float) -> tuple[dict, dict | None]:
        """(the record of `step`, its evaluation or None where none was due)."""
        t, params, evaluation = self.cfg.train, state["params"], None
        with self.aside:  # the schedule compiles at the first record
            lr = float(self.lr_at(step - 1))  # the rate this step's update used
        record = {
            "loss": losses[-1],
            "loss_mean": float(np.mean(losses)),
            "lr": lr,
            "grad_norm": norms[-1],
            "tokens_per_s": self.tokens_per_step / step_time,
            "step_time_s": step_time,
            "mfu": mfu(self.flops_per_step, step_time, self.peak),
            "tokens_seen": step * self.tokens_per_step,
            "epoch": self.run.source.epochs(step * t.global_batch, self.cfg.data.seq_len),
        }
        with self.aside:
            if step % t.eval_every == 0 or step == t.steps:
                evaluation = evaluate(self.training.eval_step, params, self.run.val, self.run.bytes_per_token)
                record.update(evaluation)
            if t.stats_every and step % t.stats_every == 0:
                stats = jax.device_get(self.training.stats_step(params, batch))
                record["routing_max_weight"] = stats["max_weight"].round(4).tolist()
                record["routing_entropy"] = stats["entropy"].round(4).tolist()
            if (peak_bytes := self.peak_memory(state, batch)) is not None:
                record["peak_bytes"] = peak_bytes
        return record, evaluation


def _save_problem(ckpt: Checkpointer, wait: bool = False) -> str | None:
    """Why the background save failed, or None (`wait`: after waiting for it; else a cheap poll). Whatever
    the check raises becomes the reason, so that with several processes a failure one of them saw is
    agreed on, not raised past the others (which would wait for it in the next collective)."""
    try:
        ckpt.wait() if wait else ckpt.poll()
    except CheckpointError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - any storage failure ends the run the same way
        return f"checking the checkpoints in {ckpt.directory} failed ({first_line(err)})"
    return None


def print_dry_run(cfg, r: dict) -> None:
    print(
        f"dry run of {cfg.scale} {cfg.model.residual.mode}: config valid; {r['params']:,} parameters "
        f"({r['params'] / 1e6:.1f}M); train state {r['state_bytes'] / 2**30:.2f} GiB "
        f"({r['state_bytes_per_device'] / 2**30:.2f} GiB per device; mesh {r['mesh']} on {r['devices']})\n"
        f"train step (abstract): {cfg.train.global_batch} x {cfg.data.seq_len} = {r['tokens_per_step']:,} tokens, "
        f"{r['flops_per_step']:.3g} model FLOPs per step; outputs {r['outputs']}; nothing allocated or written"
    )


def main(argv):
    del argv
    if _HELPCONFIG.value:
        from deltares.training.experiment import describe_config  # noqa: PLC0415 - only for this listing

        print(describe_config())
        return
    if _CONFIG.value is None or not (_WORKDIR.value or _DRY_RUN.value):
        raise app.UsageError("--config and --workdir are required")
    logging.set_verbosity(logging.WARNING)  # orbax and jax log every save at INFO
    if _DRY_RUN.value:
        try:
            print_dry_run(_CONFIG.value, dry_run(_CONFIG.value))
        except (TrainError, DataError) as err:
            sys.exit(f"error: {err}")
        return
    try:
        initialize_distributed()
        result = train(_CONFIG.value, _WORKDIR.value)
    except (TrainError, DataError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    if result.get("stopped"):
        sys.exit(_STOPPED_EXIT_CODE.value)
    if "val_ppl" in result and "unigram_ppl" in result and jax.process_index() == 0:
        print(
            f"step {result['step']}: validation loss {result['val_loss']:.4f}, perplexity {result['val_ppl']:.2f}, "
            f"bits/byte {result['val_bpb']:.4f}; unigram perplexity of the corpus {result['unigram_ppl']:.2f}"
        )


def cli() -> None:
    """The command line (`python -m deltares.train`, `deltares-train`); flags only here, so modules
    import side by side."""
    global _CONFIG, _WORKDIR, _DRY_RUN, _HELPCONFIG, _STOPPED_EXIT_CODE
    _CONFIG = config_flags.DEFINE_config_file(
        "config", None, "Experiment file, e.g. experiments/tiny.py:delta_block (or a shipped one by name: tiny:delta_block)."
    )
    _WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, TensorBoard events.")
    _DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate the config and build one abstract train step; no run.")
    _HELPCONFIG = flags.DEFINE_bool("helpconfig", False, "List every config field (type, default, allowed values, help).")
    from deltares import command_line
    from deltares.common.domains import Domain, define_number

    _STOPPED_EXIT_CODE = define_number(
        flags.DEFINE_integer, "stopped_exit_code", 0, "Exit status after a signal stopped the run before its last "
        "step and it saved that step (a finished run exits 0): launch/slurm.sh's job passes 75 and requeues itself "
        "when it sees it", Domain(0, 255))

    command_line.run(main, config_fields=field_names)


if __name__ == "__main__":
    cli()
