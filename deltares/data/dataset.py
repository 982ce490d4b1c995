"""Reading prepared token data: fixed windows, a seeded global shuffle, per-process shards.

Training windows are `seq_len + 1` tokens taken every `seq_len` tokens of a split's token
stream (so inputs and next-token targets come from one window). The grain pipeline is a pure
function of (seed, step): `MapDataset` shuffles the window indices globally with a new
permutation each epoch, each process takes every `process_count`-th window, and each batch of
windows is read at once (one concurrent request on a bucket) while the next ones are prefetched.
Its iterator state (a few integers) goes into every checkpoint, so a resumed run reads exactly
the batches an uninterrupted one would have. Validation windows are fixed, spread evenly over the
validation split.

A dataset directory may be local or on a bucket (`gs://`, `s3://`): its token files are read
with byte-range requests there (deltares.data.shards), each process reading only its own windows.
"""

from __future__ import annotations

import json
import os

import grain
import numpy as np
from etils import epath

from deltares.data import paths
from deltares.data.documents import DataError, hf_dataset_folder, piece_bytes, source_units, unit_pieces
from deltares.data.prepare import READABLE_FORMATS, SPLITS
from deltares.data.shards import Shard, Tokens
from deltares.data.tokenizer import encode_texts, tokenizer_from_json, tokenizer_sha256


class TokenData:
    """A prepared dataset directory (local or on a bucket): metadata, tokenizer and splits; a
    `DataSource` (deltares.data.source) of its training and validation splits."""

    def __init__(self, path: str):
        path = paths.run_dir(path)
        root = epath.Path(path)
        try:
            text = (root / "meta.json").read_text() if (root / "meta.json").exists() else None
        except OSError as err:
            raise DataError(f"cannot read {path}: {err}") from None
        if text is None:
            raise DataError(f"{path} is not a prepared dataset (no meta.json); run python -m deltares.data.prepare")
        try:
            self.meta = json.loads(text)
        except ValueError:
            raise DataError(f"{path}/meta.json is not readable JSON; prepare the dataset again") from None
        if self.meta.get("format") not in READABLE_FORMATS:
            raise DataError(f"{path}: dataset format {self.meta.get('format')} is not one of {READABLE_FORMATS}; "
                            "prepare it again")
        self.path = path
        self.vocab_size = self.meta["vocab_size"]
        self.eos_id = self.meta["eos_id"]
        self.dtype = self.meta["dtype"]
        self._tokens = {}

    def tokens(self, split: str) -> Tokens:
        """The split's tokens as one array (`Tokens`); DataError naming the file when one is missing,
        empty, or not the length meta.json records (cut short, or another dataset's)."""
        if split not in self._tokens:
            info = self.meta["splits"][split]
            if self.meta["format"] == 1:  # one flat file per split
                shards = [Shard(paths.join(self.path, f"{split}.bin"), info["tokens"])]
            else:
                shards = [Shard(paths.join(self.path, name + ".bin"), n) for name, n in info["shards"]]
            if not shards or not info["tokens"]:
                raise DataError(f"{self.path}: the {split} split is missing or empty")
            self._tokens[split] = Tokens(shards, self.dtype)
        return self._tokens[split]

    @property
    def tokenizer_fingerprint(self) -> str:
        """A hash of the tokenizer that made the dataset (meta.json's, else computed as prepare does)."""
        return self.meta.get("tokenizer_sha256") or tokenizer_sha256(self.meta["tokenizer"], self._tokenizer_json())

    def _tokenizer_json(self) -> str | None:
        path = epath.Path(self.path) / "tokenizer.json"
        return path.read_text() if path.exists() else None

    def record(self) -> dict:
        """What a checkpoint keeps of the dataset it was trained on, to recognise other data later."""
        return {"tokenizer": self.meta["tokenizer"], "tokenizer_sha256": self.tokenizer_fingerprint,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "dtype": self.dtype,
                "tokens": {split: info.get("tokens") for split, info in self.meta["splits"].items()}}

    def check_ids(self, vocab_size: int) -> None:
        """DataError naming the dataset when meta.json records a token id the model has no row for."""
        top = self.meta.get("max_token_id")
        if top is not None and top >= vocab_size:
            raise DataError(f"{self.path} holds token id {top}, outside the model's vocabulary of {vocab_size} "
                            "(config.model.vocab_size)")

    def unigram(self) -> np.ndarray:
        """int64 [2, vocab]: token counts of the train and validation splits (stored by prepare; counted
        here in chunks, in bounded memory, for datasets prepared before it stored them)."""
        stored = epath.Path(self.path) / "unigram.npy"
        if stored.exists():
            with stored.open("rb") as f:
                return np.load(f)
        counts = np.zeros((2, self.vocab_size), np.int64)
        for s, split in enumerate(SPLITS):
            for chunk in self.tokens(split).chunks():
                counts[s] += np.bincount(chunk, minlength=self.vocab_size)[: self.vocab_size]
        return counts

    def bytes_per_token(self, split: str) -> float:
        info = self.meta["splits"][split]
        return info["bytes"] / info["tokens"]

    def windows(self, seq_len: int) -> Windows:
        """The training split's windows."""
        return Windows(self.tokens("train"), seq_len)

    def train_batches(self, seq_len: int, global_batch: int, seed: int, process_index: int = 0,
                      process_count: int = 1) -> grain.MapDataset:
        """The training split's shuffled batches of this process (`train_dataset`)."""
        return train_dataset(self.tokens("train"), seq_len, global_batch, seed, process_index, process_count)

    def validation(self, seq_len: int, batch: int, max_batches: int | None) -> tuple[list[np.ndarray], float]:
        """The validation split's fixed batches (`eval_batches`) and its bytes per token."""
        return eval_batches(self.tokens("val"), seq_len, batch, max_batches), self.bytes_per_token("val")

    def epochs(self, windows: int, seq_len: int) -> float:
        return windows / len(self.windows(seq_len))

    def tokenizer(self):
        return tokenizer_from_json(self.meta["tokenizer"], self._tokenizer_json())


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

    def batch(self, indices) -> np.ndarray:
        """[len(indices), seq_len + 1] int32: the windows at `indices`, read together."""
        if isinstance(self.tokens, Tokens):
            return self.tokens.windows(np.asarray(indices, np.int64) * self.seq_len, self.seq_len + 1)
        rows = [self[i] for i in indices]  # an array in memory
        return np.stack(rows) if rows else np.zeros((0, self.seq_len + 1), np.int32)


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
    ds = grain.MapDataset.range(len(windows)).seed(seed).shuffle().repeat()
    ds = ds[process_index::process_count]
    return ds.batch(global_batch // process_count, drop_remainder=True).map(windows.batch)


def train_iterator(ds: grain.MapDataset, prefetch: int = 4):
    """A checkpointable iterator (`get_state` / `set_state`) with background prefetch."""
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))


def eval_batches(tokens, seq_len: int, batch: int, max_batches: int | None = None) -> list[np.ndarray]:
    """The fixed validation set, as full batches (at least one): all windows in order, or with
    `max_batches` that many batches of windows spread evenly over the split (not its first files only)."""
    windows = Windows(tokens, seq_len)
    n_batches = len(windows) // batch
    if n_batches == 0:
        raise DataError(
            f"validation split has {len(tokens)} tokens: {len(windows)} windows of {seq_len + 1}, "
            f"fewer than one evaluation batch of {batch}"
        )
    spread = bool(max_batches) and max_batches < n_batches
    if spread:
        n_batches = max_batches
    n = n_batches * batch
    picked = np.arange(n, dtype=np.int64) * len(windows) // n if spread else np.arange(n, dtype=np.int64)
    rows = windows.batch(picked)
    return [rows[b * batch : (b + 1) * batch] for b in range(n_batches)]


def prepared_folder(spec: str) -> str | None:
    """The prepared dataset folder `spec` names (one folder holding meta.json, on a disk or a bucket: its real path,
    or its URL), or None."""
    spec = spec.strip()
    if not spec or "," in spec or (not paths.is_remote(spec) and not os.path.isdir(os.path.expanduser(spec))):
        return None
    try:
        if not (epath.Path(paths.run_dir(spec)) / "meta.json").exists():
            return None
    except OSError:
        return None
    return spec if paths.is_remote(spec) else os.path.realpath(os.path.expanduser(spec))


def data_units(spec: str, *, flag: str = "--data", text_field: str = "text", hf_config: str | None = None,
               hf_split: str = "train") -> list[dict]:
    """The units of the text a tool scores (`deltares.eval --data`, `deltares.analyze --data`) when `spec` names
    no prepared dataset: every source `prepare --source` takes (deltares.data.documents.source_units)."""
    folder = os.path.expanduser(spec.strip())
    if "," not in spec and not paths.is_remote(spec) and os.path.isdir(folder) and not hf_dataset_folder(spec):
        raise DataError(f"{flag} {spec} is a folder but not a prepared dataset (no meta.json) nor a saved Hugging "
                        f"Face dataset; name the files in it, e.g. '{spec.rstrip('/')}/*.txt'")
    return source_units(spec, flag=flag, text_field=text_field, hf_config=hf_config, hf_split=hf_split)


def source_tokens(units: list[dict], tokenizer, text_field: str = "text") -> tuple[np.ndarray, int]:
    """Tokens of the documents of `units` (`data_units`), each followed by end-of-text as prepare writes them
    (the same pieces, encoded the same way), and the bytes they count for bits per byte (`piece_bytes`: UTF-8
    plus one per end-of-text, as the dataset's meta.json counts them)."""
    chunks, batch, n_bytes, size = [], [], 0, 0

    def encode():
        for piece, ids in zip(batch, encode_texts([p.text for p in batch], tokenizer)):
            chunks.append(np.asarray(ids + [tokenizer.eos_id] if piece.last else ids, np.int32))

    for unit in units:
        for piece in unit_pieces(unit, 0.0, text_field):
            batch.append(piece)
            n_bytes += piece_bytes(piece)
            size += len(piece.text)
            if size >= 512 << 10:
                encode()
                batch, size = [], 0
    encode()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    if not len(tokens):
        raise DataError(f"{', '.join(sorted({u['path'] for u in units})[:3])} holds no text")
    return tokens, n_bytes
