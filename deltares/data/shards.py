"""The token files of a prepared dataset, written unit by unit and read as one array per split.

Format 2 (`deltares.data.prepare`), in the dataset directory (a local path or a bucket URL):

- `<split>/<unit>.bin`: the tokens of the unit's documents of that split, each document followed by
  end-of-text, a flat little-endian uint16 (vocabulary <= 65536) or uint32 array;
- `meta.json` lists each split's shards in order with their token counts: the split's tokens are
  the shards concatenated.

Flat files rather than ArrayRecord: training reads fixed windows of `seq_len + 1` tokens at any
offset, which a flat file serves with one read (a positional read on a disk, one byte-range request
on a bucket), where a record format would read and decode whole records; document boundaries are the
end-of-text tokens. (Datasets prepared by earlier versions also hold a `<split>/<unit>.idx` of
document ends, which nothing reads.) Format 1 (one `<split>.bin`) reads as a single shard.

`Tokens` reads a split: positional reads of the open shard files on a disk (not a memory map: a file cut
short under a map ends the process with SIGBUS; a read returns short, and the run stops cleanly), byte
ranges of the shard objects on a bucket (`gs://` through gcsfs, `s3://` through s3fs), a batch of
windows in one concurrent request (`Tokens.windows`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from deltares.data import paths
from deltares.common.inputs import DataError, bucket_filesystem


class Shard(NamedTuple):
    path: str  # local path or URL
    tokens: int


class Tokens:
    """One split of a dataset: its shards read as one read-only token array (len, slices, windows)."""

    def __init__(self, shards: list[Shard], dtype: str):
        self.shards = [s for s in shards if s.tokens > 0]
        self.dtype = np.dtype(dtype)
        self.ends = np.cumsum([s.tokens for s in self.shards], dtype=np.int64)
        self.remote = bool(self.shards) and paths.is_remote(self.shards[0].path)
        self._check_sizes()
        self._files = {} if not self.remote else None  # shard index: open file descriptor
        self._fs = bucket_filesystem(self.shards[0].path)[0] if self.remote else None

    def _check_sizes(self) -> None:
        if self.remote:
            fs = bucket_filesystem(self.shards[0].path)[0]
            listed = {}
            for directory in {os.path.dirname(s.path) for s in self.shards}:
                try:
                    for entry in fs.ls(directory, detail=True):
                        listed[entry["name"].rstrip("/").split("/")[-1], directory] = entry["size"]
                except (FileNotFoundError, OSError) as err:
                    raise DataError(f"cannot list {directory}: {err}") from None
            sizes = {s.path: listed.get((os.path.basename(s.path), os.path.dirname(s.path))) for s in self.shards}
        else:
            sizes = {s.path: os.path.getsize(s.path) if os.path.exists(s.path) else None for s in self.shards}
        for shard in self.shards:
            size, want = sizes[shard.path], shard.tokens * self.dtype.itemsize
            if size is None or size == 0:
                raise DataError(f"{shard.path} is missing or empty")
            if size != want:
                raise DataError(f"{shard.path} is cut short or not this dataset's: {size} bytes, where meta.json "
                                f"records {shard.tokens} {self.dtype.name} tokens ({want} bytes); prepare it again")

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _read_file(self, i: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of local shard `i`; DataError if the file no longer holds them."""
        if i not in self._files:
            try:
                self._files[i] = os.open(self.shards[i].path, os.O_RDONLY)
            except OSError as err:
                raise DataError(f"cannot read {self.shards[i].path}: {err.strerror}") from None
        size = self.dtype.itemsize
        out = np.empty(stop - start, self.dtype)
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):
            try:
                n = os.preadv(self._files[i], [view[done:]], start * size + done)
            except OSError as err:
                raise DataError(f"cannot read {self.shards[i].path}: {err.strerror}") from None
            if n == 0:
                raise DataError(f"{self.shards[i].path} is cut short (changed while it was read?): it ends before "
                                f"token {start + done // size} of the {self.shards[i].tokens} meta.json records")
            done += n
        return out

    def __del__(self):
        for fd in (getattr(self, "_files", None) or {}).values():
            try:
                os.close(fd)
            except OSError:  # closed already (a copy of this object held the same descriptor)
                pass

    def _pieces(self, start: int, stop: int):
        """(shard index, start, stop within the shard) covering [start, stop) of the split."""
        i = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            begin = int(self.ends[i - 1]) if i else 0
            end = min(stop, int(self.ends[i]))
            yield i, start - begin, end - begin
            start, i = end, i + 1

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(index)
            return self.read([(i, i + 1)])[0][0]
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("Tokens supports integers and contiguous slices")
        start, stop, _ = index.indices(len(self))
        return self.read([(start, max(start, stop))])[0]

    def __iter__(self):
        for chunk in self.chunks():
            yield from chunk

    def read(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]:
        """The tokens of each [start, stop) range, read together (one concurrent request on a bucket)."""
        parts = [list(self._pieces(a, b)) for a, b in ranges]
        if not self.remote:
            return [np.concatenate([self._read_file(i, a, b) for i, a, b in p]) if p else np.zeros(0, self.dtype)
                    for p in parts]
        flat = [piece for p in parts for piece in p]
        size = self.dtype.itemsize
        data = self._fs.cat_ranges([self.shards[i].path for i, _, _ in flat], [a * size for _, a, _ in flat],
                                   [b * size for _, _, b in flat])
        for blob in data:
            if isinstance(blob, Exception):
                raise DataError(f"reading the dataset failed: {blob}")
        arrays = iter(np.frombuffer(blob, dtype=self.dtype) for blob in data)
        return [np.concatenate([next(arrays) for _ in p]) if p else np.zeros(0, self.dtype) for p in parts]

    def windows(self, starts, length: int) -> np.ndarray:
        """[n, length] int32: the windows of `length` tokens at each start."""
        rows = self.read([(int(s), int(s) + length) for s in starts])
        return np.stack(rows).astype(np.int32) if rows else np.zeros((0, length), np.int32)

    def chunks(self, size: int = 1 << 24):
        """The split in consecutive arrays of at most `size` tokens (for scans in bounded memory)."""
        for start in range(0, len(self), size):
            yield self[start : min(len(self), start + size)]

    def __array__(self, dtype=None, copy=None):
        out = self[0 : len(self)]
        return out if dtype is None else out.astype(dtype)

    def max(self) -> int:
        return max((int(chunk.max()) for chunk in self.chunks() if len(chunk)), default=-1)


class ShardWriter:
    """Writes one unit's tokens of one split, `<split>/<unit>.bin`, through a buffer, with
    the counts the ledger and meta.json keep (tokens, documents, bytes, largest id, unigram)."""

    FLUSH_TOKENS = 1 << 22

    def __init__(self, directory: str, split: str, unit: int, dtype, vocab_size: int):
        from etils import epath  # noqa: PLC0415

        folder = epath.Path(directory) / split
        folder.mkdir(parents=True, exist_ok=True)
        self.name = f"{split}/{unit:05d}"
        # A local file is written under a name of this process's and renamed when whole, so that two
        # prepares of one unit never write into each other's file; a bucket object appears only whole.
        self.final = folder / f"{unit:05d}.bin"
        local = not paths.is_remote(os.fspath(folder))
        self.partial = self.final.with_name(f"{self.final.name}.tmp{os.getpid()}") if local else self.final
        self.bin = self.partial.open("wb")
        self.dtype, self.buffer, self.buffered = np.dtype(dtype), [], 0
        self.tokens = self.documents = self.bytes = 0
        self.max_id = -1
        self.unigram = np.zeros(vocab_size, np.int64)

    def add(self, ids, last: bool, n_bytes: int, eos_id: int) -> None:
        """The ids of a piece of a document; `last`: it ends the document (end-of-text follows)."""
        arr = np.asarray(list(ids) + ([eos_id] if last else []), dtype=np.int64)
        if arr.size:
            self.max_id = max(self.max_id, int(arr.max()))
            self.unigram += np.bincount(arr, minlength=len(self.unigram))[: len(self.unigram)]
            self.buffer.append(arr.astype(self.dtype))
            self.buffered += arr.size
            self.tokens += arr.size
        self.bytes += n_bytes
        self.documents += last
        if self.buffered >= self.FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            self.bin.write(np.concatenate(self.buffer).tobytes())
        self.buffer, self.buffered = [], 0

    def close(self) -> dict:
        self._flush()
        self.bin.close()
        if self.partial != self.final:
            os.replace(self.partial, self.final)
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes}
