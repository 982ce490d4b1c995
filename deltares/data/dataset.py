"""Reading prepared token data: fixed windows, a seeded global shuffle, per-process shards.

Training windows are `seq_len + 1` tokens taken every `seq_len` tokens of the flat
training array (so inputs and next-token targets come from one window). The grain
pipeline is a pure function of (seed, step): `MapDataset` shuffles the windows
globally with a new permutation each epoch, each process takes every
`process_count`-th window, and batches are prefetched. Its iterator state (a few
integers) goes into every checkpoint, so a resumed run reads exactly the batches
an uninterrupted one would have. Validation windows are fixed and in order.
"""

from __future__ import annotations

import json
import os

import grain
import numpy as np

from deltares.data.prepare import DATASET_FORMAT, DataError, document_bytes, encode_documents, read_documents
from deltares.data.tokenizer import tokenizer_from_meta, tokenizer_sha256


class TokenData:
    """A prepared dataset directory: metadata, tokenizer and memory-mapped splits."""

    def __init__(self, path: str):
        meta_path = os.path.join(path, "meta.json")
        if not os.path.exists(meta_path):
            raise DataError(f"{path} is not a prepared dataset (no meta.json); run python -m deltares.data.prepare")
        with open(meta_path) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != DATASET_FORMAT:
            raise DataError(f"{path}: dataset format {self.meta.get('format')} is not {DATASET_FORMAT}; prepare it again")
        self.path = path
        self.vocab_size = self.meta["vocab_size"]
        self.eos_id = self.meta["eos_id"]

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens, memory-mapped; DataError naming the file when it is missing, empty, or
        not the length meta.json records (cut short, or another dataset's)."""
        file = os.path.join(self.path, f"{split}.bin")
        if not os.path.exists(file) or os.path.getsize(file) == 0:
            raise DataError(f"{file} is missing or empty")
        size, itemsize = os.path.getsize(file), np.dtype(self.meta["dtype"]).itemsize
        want = self.meta.get("splits", {}).get(split, {}).get("tokens")
        if size % itemsize or (want is not None and size // itemsize != want):
            raise DataError(
                f"{file} is cut short or not this dataset's: {size} bytes, where meta.json records "
                f"{want} {self.meta['dtype']} tokens ({(want or 0) * itemsize} bytes); prepare it again"
            )
        return np.memmap(file, dtype=self.meta["dtype"], mode="r")

    @property
    def tokenizer_fingerprint(self) -> str:
        """A hash of the tokenizer that made the dataset (meta.json's, else computed as prepare does)."""
        return self.meta.get("tokenizer_sha256") or tokenizer_sha256(self.meta["tokenizer"], self._tokenizer_json())

    def _tokenizer_json(self) -> str | None:
        path = os.path.join(self.path, "tokenizer.json")
        return open(path, encoding="utf-8").read() if os.path.exists(path) else None

    def record(self) -> dict:
        """What a checkpoint keeps of the dataset it was trained on, to recognise other data later."""
        return {"tokenizer": self.meta["tokenizer"], "tokenizer_sha256": self.tokenizer_fingerprint,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "dtype": self.meta["dtype"],
                "tokens": {split: info.get("tokens") for split, info in self.meta["splits"].items()}}

    def check_ids(self, vocab_size: int) -> None:
        """DataError naming the dataset when meta.json records a token id the model has no row for."""
        top = self.meta.get("max_token_id")
        if top is not None and top >= vocab_size:
            raise DataError(f"{self.path} holds token id {top}, outside the model's vocabulary of {vocab_size} "
                            "(config.model.vocab_size)")

    def bytes_per_token(self, split: str) -> float:
        info = self.meta["splits"][split]
        return info["bytes"] / info["tokens"]

    def tokenizer(self):
        return tokenizer_from_meta(self.meta, self.path)


class Windows:
    """Random-access source of `seq_len + 1`-token windows at stride `seq_len` (int32)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


def train_dataset(tokens, seq_len, global_batch, seed, process_index=0, process_count=1) -> grain.MapDataset:
    """An infinite, shuffled `MapDataset` of this process's [global_batch / process_count, seq_len + 1] batches."""
    if global_batch % process_count:
        raise DataError(f"global batch {global_batch} is not divisible by {process_count} processes")
    windows = Windows(tokens, seq_len)
    if len(windows) < global_batch:
        raise DataError(
            f"training split has {len(tokens)} tokens: {len(windows)} windows of {seq_len + 1}, "
            f"fewer than one batch of {global_batch}"
        )
    ds = grain.MapDataset.source(windows).seed(seed).shuffle().repeat()
    ds = ds[process_index::process_count]
    return ds.batch(global_batch // process_count, drop_remainder=True)


def train_iterator(ds: grain.MapDataset, prefetch: int = 4):
    """A checkpointable iterator (`get_state` / `set_state`) with background prefetch."""
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))


def eval_batches(tokens, seq_len: int, batch: int, max_batches: int | None = None) -> list[np.ndarray]:
    """The fixed validation set: consecutive windows in order, as full batches (at least one)."""
    windows = Windows(tokens, seq_len)
    n_batches = len(windows) // batch
    if n_batches == 0:
        raise DataError(
            f"validation split has {len(tokens)} tokens: {len(windows)} windows of {seq_len + 1}, "
            f"fewer than one evaluation batch of {batch}"
        )
    if max_batches:
        n_batches = min(n_batches, max_batches)
    return [np.stack([windows[b * batch + i] for i in range(batch)]) for b in range(n_batches)]


def text_tokens(source: str, tokenizer) -> tuple[np.ndarray, int]:
    """Tokens of local text (see `read_documents`), each document followed by end-of-text as
    prepare writes them, and the bytes they spell (`document_bytes`)."""
    docs = read_documents(source)
    if not docs:
        raise DataError(f"{source} holds no text")
    tokens = np.concatenate([np.asarray(ids, np.int32) for ids in encode_documents(docs, tokenizer)])
    return tokens, sum(document_bytes(doc) for doc in docs)
