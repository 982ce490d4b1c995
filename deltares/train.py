"""Train a deltares model.

    python -m deltares.train --config experiments/tiny.py:delta_block --workdir runs/demo
    python -m deltares.train --config experiments/s220m.py:delta --workdir runs/x \
        --config.data.dataset=data/fineweb --config.train.steps=200

Resumes automatically from the newest checkpoint in `--workdir`. SIGTERM or SIGINT
saves a checkpoint and exits cleanly; a resumed run continues with exactly the
losses an uninterrupted one would have had (data order included). Writes
`metrics.jsonl`, TensorBoard events and checkpoints into the workdir.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from deltares import hf, paths
from deltares.checkpoint import Checkpointer, load_checkpoint
from deltares.data.dataset import TokenData, eval_batches, train_dataset, train_iterator
from deltares.data.prepare import BUILTIN, DataError, prepare
from deltares.eval import evaluate, run_dataset_path, run_tokenizer
from deltares.memory import PeakMemory
from deltares.metrics import MetricsWriter, model_flops_per_token, peak_flops_per_device
from deltares.sharding import MeshStep, make_mesh, shard_batch, sharded_train_step
from deltares.steps import make_eval_step, make_stats_step


# Fields that must match to resume a workdir: anything that changes shapes or the data stream.
RESUME_KEYS = ("model", "seed", "data.seq_len", "data.dataset", "train.global_batch")


def initialize_distributed() -> None:
    """Joins the other hosts of a multi-host job (TPU pod slice, SLURM, ...); nothing on one host."""
    try:
        jax.distributed.initialize()
    except (ValueError, RuntimeError) as err:  # no cluster detected: a single-host run
        if "coordinator" not in str(err).lower() and "cluster" not in str(err).lower():
            raise


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    for field in ("global_batch", "micro_batches", "steps", "log_every", "eval_every", "checkpoint_every", "keep_last"):
        if not isinstance(t[field], int) or t[field] < 1:
            raise TrainError(f"config.train.{field}={t[field]!r} must be a positive integer")
    if t.global_batch % t.micro_batches:
        raise TrainError(f"config.train.global_batch={t.global_batch} is not divisible by micro_batches={t.micro_batches}")
    if not isinstance(cfg.data.seq_len, int) or cfg.data.seq_len < 1:
        raise TrainError(f"config.data.seq_len={cfg.data.seq_len!r} must be a positive integer")


def open_dataset(cfg, workdir: str) -> TokenData:
    """The prepared dataset of the config; the built-in corpus is prepared once (see run_dataset_path)."""
    path = cfg.data.dataset
    if not path:
        raise TrainError(
            "config.data.dataset is not set: prepare a corpus with `python -m deltares.data.prepare --out DIR` "
            "and pass --config.data.dataset=DIR (or 'builtin' for the shipped Moby-Dick)"
        )
    if path == BUILTIN:
        try:
            tokenizer = run_tokenizer(cfg)
        except DataError as err:
            raise TrainError(str(err)) from None
        path = run_dataset_path(cfg, workdir)
        if not os.path.exists(os.path.join(path, "meta.json")):
            say(f"preparing the built-in corpus with tokenizer {tokenizer} into {path}")
            prepare(BUILTIN, tokenizer, path, val_fraction=0.05, progress=False)
    data = TokenData(path)
    if data.vocab_size > cfg.model.vocab_size:
        raise TrainError(
            f"the tokenizer of {path} has {data.vocab_size} tokens, more than config.model.vocab_size="
            f"{cfg.model.vocab_size}"
        )
    return data


def unigram_perplexity(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab: int) -> float:
    """Perplexity on the validation split of add-one-smoothed training token frequencies."""
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[np.asarray(val_tokens)].mean()))


def _check_resumable(saved: dict, cfg, workdir: str) -> None:
    current = config_json(cfg)
    diffs = [key for key in RESUME_KEYS if _get(saved, key) != _get(current, key)]
    if diffs and not cfg.force:
        raise TrainError(
            f"{workdir} holds a checkpoint of another config (differs in {', '.join(diffs)}); "
            "use a new --workdir, or --config.force=True to resume it anyway"
        )
    if diffs:
        say(f"warning: resuming {workdir} despite config differences in {', '.join(diffs)} (config.force)")


def _init_from_hf(path: str, model_cfg):
    """Parameters of `model_cfg` from a Hugging Face Qwen3 checkpoint (routing parameters fresh)."""
    try:
        params = hf.load_params(path, model_cfg)
    except hf.HFError as err:
        raise TrainError(f"config.init_from_hf: {err}") from None
    say(f"init_from_hf {path}: loaded as {model_cfg.residual.mode}")
    return params


def _init_from(path: str, params):
    """`params` with every leaf that `path`'s checkpoint also has replaced by the checkpoint's value."""
    try:
        source = load_checkpoint(path).state["params"]
    except FileNotFoundError as err:
        raise TrainError(f"config.init_from: {err}") from None
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
    """Turns SIGTERM / SIGINT into a flag the loop checks after every step."""

    def __init__(self):
        self.signal = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def train(cfg, workdir: str) -> dict:
    """Runs (or resumes) training; returns the final metrics."""
    check_train_config(cfg)
    workdir = paths.run_dir(workdir)
    if cfg.get("init_from_hf"):  # a bad checkpoint fails before anything is written
        try:
            hf.check_checkpoint(cfg.init_from_hf, cfg.model)
        except hf.HFError as err:
            raise TrainError(f"config.init_from_hf: {err}") from None
    paths.makedirs(workdir)
    data = open_dataset(cfg, workdir)
    t = cfg.train
    ckpt = Checkpointer(workdir, t.keep_last, t.keep_every)
    try:
        return _train(cfg, workdir, data, ckpt)
    finally:
        ckpt.wait()
        ckpt.close()


def _train(cfg, workdir: str, data: TokenData, ckpt: Checkpointer) -> dict:
    t = cfg.train
    mesh = make_mesh(cfg.mesh)
    training = sharded_train_step(cfg, mesh)
    model, tx, schedules = training.model, training.tx, training.schedules
    start = ckpt.latest_step()

    train_ds = train_dataset(
        data.tokens("train"), cfg.data.seq_len, t.global_batch, cfg.seed, jax.process_index(), jax.process_count()
    )
    val = eval_batches(data.tokens("val"), cfg.data.seq_len, max(1, t.global_batch // t.micro_batches), t.eval_batches)
    data_iter = train_iterator(train_ds, cfg.data.prefetch)

    if start is None:
        state = training.init(cfg.seed)
        if cfg.init_from or cfg.get("init_from_hf"):
            if cfg.init_from and cfg.get("init_from_hf"):
                raise TrainError("set config.init_from or config.init_from_hf, not both")
            if cfg.init_from:
                params = _init_from(cfg.init_from, state["params"])
            else:
                params = _init_from_hf(cfg.init_from_hf, cfg.model)
            state = jax.device_put({**state, "params": params, "opt_state": tx.init(params)}, training.state_shardings)
        start = 0
    else:
        _check_resumable(ckpt.config(start), cfg, workdir)
        abstract_state = training.abstract_state
        try:
            ckpt.check_params(start, abstract_state["params"])
        except ValueError as err:
            raise TrainError(f"cannot restore step {start} of {ckpt.directory} into this config: {err}") from None
        state, data_state = ckpt.restore(start, abstract_state)
        data_iter.set_state(data_state)
        say(f"resumed {workdir} from step {start}")

    train_step = training.step
    eval_step = MeshStep(jax.jit(make_eval_step(model)), mesh)
    stats_step = MeshStep(jax.jit(make_stats_step(model)), mesh)
    all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)])))
    writer = MetricsWriter(workdir, resume_step=start)
    peak_memory = PeakMemory(train_step)  # device high-water mark, else the compiled step's footprint
    tokens_per_step = t.global_batch * cfg.data.seq_len
    flops_per_step = model_flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    peak = peak_flops_per_device(t.peak_tflops) * jax.device_count()
    bpt = data.bytes_per_token("val")
    config_record = config_json(cfg)

    def save(step):
        try:
            ckpt.save(step, state, data_iter.get_state(), config_record)
        except Exception as err:  # noqa: BLE001 - any storage failure ends the run the same way
            raise TrainError(
                f"saving step {step} failed ({type(err).__name__}: {err}); the previous checkpoint, step "
                f"{ckpt.latest_step()}, is intact in {ckpt.directory}"
            ) from None

    stop = StopRequest()
    bar = tqdm(total=t.steps, initial=start, unit="step", desc="train", dynamic_ncols=True, file=sys.stderr)
    pending, last_eval = [], {}  # (step, device outputs) since the last log
    step, timed, window_start = start, 0, time.perf_counter()  # throughput window, compilation excluded
    try:
        while step < t.steps:
            batch = next(data_iter)
            state, out = train_step(state, shard_batch(batch, training.batch_sharding))
            step += 1
            bar.update(1)
            pending.append((step, out))
            if step == start + 1:
                jax.block_until_ready(out)
                timed, window_start = -1, time.perf_counter()
            timed += 1
            stopping = stop.signal  # read once: a signal arriving later in this step is handled next step
            boundary = step % t.log_every == 0 or step == t.steps or stopping
            save_now = step % t.checkpoint_every == 0 or step == t.steps or stopping
            if boundary or save_now:
                losses = [float(o["loss"]) for _, o in pending]
                norms = [float(o["grad_norm"]) for _, o in pending]
                bad = [s for (s, _), loss, norm in zip(pending, losses, norms) if not math.isfinite(loss + norm)]
                if not bad and save_now and not bool(all_finite(state["params"])):
                    bad = [step]
                if bad:
                    raise TrainError(
                        f"non-finite loss or parameters at step {bad[0]}; stopped. The last good checkpoint is step "
                        f"{ckpt.latest_step()} in {ckpt.directory}"
                    )
                elapsed = time.perf_counter() - window_start
                step_time = elapsed / timed if timed else math.nan
                record = {
                    "loss": losses[-1],
                    "loss_mean": float(np.mean(losses)),
                    "lr": float(schedules["model"](step - 1)),  # the rate this step's update used
                    "grad_norm": norms[-1],
                    "tokens_per_s": tokens_per_step / step_time,
                    "step_time_s": step_time,
                    "mfu": flops_per_step / step_time / peak,
                    "tokens_seen": step * tokens_per_step,
                }
                if step % t.eval_every == 0 or step == t.steps:
                    last_eval = evaluate(eval_step, state["params"], val, bpt)
                    record.update(last_eval)
                if t.stats_every and step % t.stats_every == 0:
                    stats = jax.device_get(stats_step(state["params"], batch))
                    record["routing_max_weight"] = stats["max_weight"].round(4).tolist()
                    record["routing_entropy"] = stats["entropy"].round(4).tolist()
                if (peak_bytes := peak_memory(state, shard_batch(batch, training.batch_sharding))) is not None:
                    record["peak_bytes"] = peak_bytes
                writer.write(step, record)
                bar.set_postfix(loss=f"{record['loss_mean']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
                pending = []
            if save_now:
                save(step)
            if boundary or save_now:
                timed, window_start = 0, time.perf_counter()
            if stopping:
                ckpt.wait()
                bar.close()
                print(f"{stopping}: saved step {step} to {ckpt.directory}; rerun the same command to resume.")
                return {"step": step, "stopped": stopping, **last_eval}
        if not last_eval:  # resumed a finished run: report its final evaluation
            last_eval = evaluate(eval_step, state["params"], val, bpt)
    finally:
        stop.restore()
        bar.close()
        writer.close()
    return {"step": step, **last_eval, "unigram_ppl": unigram_perplexity(data.tokens("train"), data.tokens("val"), data.vocab_size)}


def main(argv):
    del argv
    if _CONFIG.value is None or not _WORKDIR.value:
        raise app.UsageError("--config and --workdir are required")
    logging.set_verbosity(logging.WARNING)  # orbax and jax log every save at INFO
    initialize_distributed()
    try:
        result = train(_CONFIG.value, _WORKDIR.value)
    except (TrainError, DataError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    if "val_ppl" in result and "unigram_ppl" in result:
        print(
            f"step {result['step']}: validation loss {result['val_loss']:.4f}, perplexity {result['val_ppl']:.2f}, "
            f"bits/byte {result['val_bpb']:.4f}; unigram perplexity of the corpus {result['unigram_ppl']:.2f}"
        )


if __name__ == "__main__":  # flags only for the command line, so modules import side by side
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, e.g. experiments/tiny.py:delta_block.")
    _WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, TensorBoard events.")
    app.run(main)
