"""Evaluate a checkpoint: loss, perplexity and bits per byte.

    python -m deltares.eval --checkpoint runs/demo --data runs/demo/dataset
    python -m deltares.eval --checkpoint runs/demo/checkpoints/300 --data 'books/*.txt.gz'

`--data` is a prepared dataset directory (its validation split is used) or any source
`deltares.data.prepare --source` takes (text, JSON Lines, Parquet or Arrow files and globs,
comma-separated, compressed or not; `hf:NAME`; `builtin`), with `--text_field` naming the text of
records: read by the same reader (`deltares.data.dataset.data_units`, before the checkpoint is
loaded: a bad source is one error line at once) and tokenized as prepare does (each document,
then end-of-text) with the tokenizer of the run's own dataset.

Every token is scored once: the stream starts with end-of-text (as every document
follows one in training), windows of `seq_len` targets in batches, then the remainder.
Bits per byte divide the total nats by the bytes of exactly that text: each document's
UTF-8 bytes plus one per end-of-text (`piece_bytes`, as in the dataset's meta.json).
With `--max_batches` only the first batches of the fixed validation windows the trainer
reports are scored (its val_bpb: the split's mean bytes per token).
"""

from __future__ import annotations

import math
import sys

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging

from deltares.data.dataset import TokenData, Windows, data_units, eval_batches, prepared_folder, source_tokens
from deltares.data.documents import DataError
from deltares.data.run_data import check_token_ids, check_trained_tokenizer, run_dataset_path
from deltares.nn.model import Transformer
from deltares.training.checkpoint import CheckpointError, load_checkpoint
from deltares.training.scoring import metrics, score
from deltares.training.steps import make_eval_step


def every_token_batches(tokens, eos_id: int, seq_len: int, batch: int):
    """Batches scoring every token of `tokens` exactly once, after a leading end-of-text: full
    batches of `seq_len`-target windows, then the leftover windows, then the shorter last one."""
    stream = np.concatenate([np.asarray([eos_id], np.int32), np.asarray(tokens, np.int32)])
    windows = Windows(stream, seq_len)
    for start in range(0, len(windows), batch):
        yield np.stack([windows[i] for i in range(start, min(start + batch, len(windows)))])
    if len(stream) - 1 > len(windows) * seq_len:
        yield stream[len(windows) * seq_len :][None]


def evaluate_checkpoint(checkpoint: str, data: str, batch: int = 8, max_batches: int | None = None, *,
                        text_field: str = "text", hf_config: str | None = None, hf_split: str = "train") -> dict:
    """Loss, perplexity and bits per byte of the checkpoint on `data` (see the module docstring)."""
    folder = prepared_folder(data)
    units = None if folder else data_units(data, text_field=text_field, hf_config=hf_config, hf_split=hf_split)
    ckpt = load_checkpoint(checkpoint)
    cfg = ml_collections.ConfigDict(ckpt.config)
    if folder:  # a prepared dataset, on a disk or a bucket
        dataset = TokenData(folder)
        tokens, n_bytes = dataset.tokens("val"), dataset.meta["splits"]["val"]["bytes"]
        where = f"{data} (its validation split)"
        check_trained_tokenizer(dataset, ckpt.dataset, ckpt.config, ckpt.workdir, ckpt.step)
    else:  # tokenized by the run's own dataset's tokenizer, checked to be the one it was trained with
        dataset = TokenData(run_dataset_path(ckpt.config, ckpt.workdir))
        check_trained_tokenizer(dataset, ckpt.dataset, ckpt.config, ckpt.workdir, ckpt.step)
        tokens, n_bytes = source_tokens(units, dataset.tokenizer(), text_field)
        where = data
    if dataset.vocab_size > cfg.model.vocab_size:
        raise DataError(f"data vocabulary {dataset.vocab_size} is larger than the model's {cfg.model.vocab_size}")
    check_token_ids([tokens], cfg.model.vocab_size, where)
    eval_step = jax.jit(make_eval_step(Transformer(cfg.model), dataset.eos_id if cfg.data.document_mask else None))
    params = ckpt.state["params"]
    if max_batches:  # the trainer's validation set and bytes-per-token estimate
        batches = eval_batches(tokens, cfg.data.seq_len, batch, max_batches)
        nats, count = score(eval_step, params, batches)
        n_bytes = count * n_bytes / len(tokens)
    else:
        nats, count = score(eval_step, params, every_token_batches(tokens, dataset.eos_id, cfg.data.seq_len, batch))
    if not math.isfinite(nats):
        raise DataError(f"the loss of step {ckpt.step} on {where} is not finite: the checkpoint's parameters or the "
                        "data are broken")
    return {"step": ckpt.step, "tokens": count, "bytes": n_bytes, "nats": nats, **metrics(nats, count, n_bytes)}


def main(argv):
    del argv
    if not _CHECKPOINT.value or not _DATA.value:
        raise app.UsageError("--checkpoint and --data are required")
    logging.set_verbosity(logging.WARNING)
    try:
        m = evaluate_checkpoint(_CHECKPOINT.value, _DATA.value, _BATCH.value, _MAX_BATCHES.value,
                                text_field=_TEXT_FIELD.value, hf_config=_HF_CONFIG.value, hf_split=_HF_SPLIT.value)
    except (DataError, FileNotFoundError, ValueError, CheckpointError) as err:
        sys.exit(f"error: {err}")
    print(f"step {m['step']}: loss {m['val_loss']:.4f}  perplexity {m['val_ppl']:.2f}  bits/byte {m['val_bpb']:.4f}")


def cli() -> None:
    """The command line (`python -m deltares.eval`, `deltares-eval`); flags only here, so modules
    import side by side."""
    global _CHECKPOINT, _DATA, _BATCH, _MAX_BATCHES, _TEXT_FIELD, _HF_CONFIG, _HF_SPLIT
    from deltares import command_line
    from deltares.common.domains import AT_LEAST_1, define_number
    from deltares.data.documents import SOURCE_HELP

    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run's workdir, or one checkpoint step directory.")
    _DATA = flags.DEFINE_string("data", None, "A prepared dataset directory, or any source prepare's --source "
                                "takes (files and globs, comma-separated; hf:NAME; builtin).")
    _TEXT_FIELD = flags.DEFINE_string("text_field", "text", SOURCE_HELP["text_field"])
    _HF_CONFIG = flags.DEFINE_string("hf_config", None, SOURCE_HELP["hf_config"])
    _HF_SPLIT = flags.DEFINE_string("hf_split", "train", SOURCE_HELP["hf_split"])
    _BATCH = define_number(flags.DEFINE_integer, "batch", 8, "Sequences per evaluation batch.",
                                        AT_LEAST_1)
    _MAX_BATCHES = define_number(
        flags.DEFINE_integer, "max_batches", None, "Score only the first N batches of the trainer's validation "
        "windows (bits per byte at the mean bytes per token); unset: every token", AT_LEAST_1)
    command_line.run(main)


if __name__ == "__main__":
    cli()
