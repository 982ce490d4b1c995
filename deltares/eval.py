"""Evaluate a checkpoint: loss, perplexity and bits per byte.

    python -m deltares.eval --checkpoint runs/demo --data runs/demo/dataset
    python -m deltares.eval --checkpoint runs/demo/checkpoints/300 --data some_text.txt

`--data` is a prepared dataset directory (its validation split is used) or a plain
text file, tokenized with the tokenizer of the run's own dataset.
"""

from __future__ import annotations

import math
import os
import sys

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging

from deltares.checkpoint import load_checkpoint
from deltares.data.dataset import TokenData, eval_batches
from deltares.data.prepare import BUILTIN, DataError
from deltares.model import Transformer
from deltares.paths import builtin_dataset_dir
from deltares.steps import make_eval_step

FROM_HF = "init_from_hf"  # config.data.tokenizer value: the tokenizer of config.init_from_hf


def evaluate(eval_step, params, batches, bytes_per_token: float) -> dict:
    """Mean token loss (nats), perplexity and bits per byte over `batches`."""
    total, count = 0.0, 0
    for batch in batches:
        nll, n = eval_step(params, batch)
        total += float(nll)
        count += int(n)
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_bpb": loss / math.log(2) / bytes_per_token}


def run_tokenizer(config) -> str:
    """The tokenizer spec of a run's config, `config.data.tokenizer`, with FROM_HF resolved."""
    tokenizer = config["data"]["tokenizer"]
    if tokenizer != FROM_HF:
        return tokenizer
    if not config.get("init_from_hf"):
        raise DataError(f"config.data.tokenizer={FROM_HF!r} needs config.init_from_hf")
    return f"hf:{config['init_from_hf']}"


def run_dataset_path(config, workdir: str) -> str:
    """The prepared dataset a run trains on; the built-in corpus is prepared into the run
    directory, or a local cache for a run on a bucket (deltares.paths.builtin_dataset_dir)."""
    path = config["data"]["dataset"]
    return builtin_dataset_dir(workdir, run_tokenizer(config)) if path == BUILTIN else path


def text_file_tokens(path: str, tokenizer) -> tuple[np.ndarray, float]:
    """Tokens of a plain text file (end-of-text appended) and its bytes per token."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise DataError(f"{path} is empty")
    tokens = np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], np.int32)
    return tokens, len(text.encode("utf-8")) / len(tokens)


def evaluate_checkpoint(checkpoint: str, data: str, batch: int = 8, max_batches: int | None = None) -> dict:
    ckpt = load_checkpoint(checkpoint)
    cfg = ml_collections.ConfigDict(ckpt.config)
    seq_len = cfg.data.seq_len
    if os.path.isdir(data):
        dataset = TokenData(data)
        tokens, bytes_per_token = dataset.tokens("val"), dataset.bytes_per_token("val")
        vocab = dataset.vocab_size
    else:
        if not os.path.isfile(data):
            raise DataError(f"no such dataset directory or text file: {data}")
        tokenizer = TokenData(run_dataset_path(ckpt.config, ckpt.workdir)).tokenizer()
        tokens, bytes_per_token = text_file_tokens(data, tokenizer)
        vocab = tokenizer.vocab_size
        seq_len = min(seq_len, len(tokens) - 1)
        batch = max(1, min(batch, (len(tokens) - 1) // seq_len))
    if vocab > cfg.model.vocab_size:
        raise DataError(f"data vocabulary {vocab} is larger than the model's {cfg.model.vocab_size}")
    eval_step = jax.jit(make_eval_step(Transformer(cfg.model)))
    metrics = evaluate(eval_step, ckpt.state["params"], eval_batches(tokens, seq_len, batch, max_batches), bytes_per_token)
    return {"step": ckpt.step, **metrics}


def main(argv):
    del argv
    if not _CHECKPOINT.value or not _DATA.value:
        raise app.UsageError("--checkpoint and --data are required")
    logging.set_verbosity(logging.WARNING)
    try:
        m = evaluate_checkpoint(_CHECKPOINT.value, _DATA.value, _BATCH.value, _MAX_BATCHES.value)
    except (DataError, FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")
    print(f"step {m['step']}: loss {m['val_loss']:.4f}  perplexity {m['val_ppl']:.2f}  bits/byte {m['val_bpb']:.4f}")


if __name__ == "__main__":  # flags only for the command line, so modules import side by side
    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A run's workdir, or one checkpoint step directory.")
    _DATA = flags.DEFINE_string("data", None, "A prepared dataset directory or a plain text file.")
    _BATCH = flags.DEFINE_integer("batch", 8, "Sequences per evaluation batch.")
    _MAX_BATCHES = flags.DEFINE_integer("max_batches", None, "Evaluate at most this many batches.")
    app.run(main)
