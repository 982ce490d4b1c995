"""Documents of a corpus, read lazily, in units that workers and hosts can tokenize independently.

A text source (files, `.gz`, globs, comma-separated, on a disk or a bucket; `builtin` is Moby-Dick) is cut into
documents at blank lines. A Hugging Face dataset (`hf:NAME` or a local dataset directory) gives
one document per record. The source is planned as a list of units (`plan_units`): a plain text
file is cut into pieces of about `unit_bytes` at blank lines (so no document spans two units), a
gzipped file is one unit, and a Hugging Face dataset is read in ranges of records. Units are
numbered in source order; the prepared token stream is the units' documents in that order,
whoever tokenized them.

A document is read line by line and handed on in pieces of about `PIECE_BYTES`, cut after a
newline that a non-space character follows, and a line longer than that before a space that
precedes a letter (where byte-level BPE pre-tokenizers always start a new token, so the pieces
encode to the ids of the whole; tests/test_prepare.py checks it), so a book without blank lines
is never encoded whole. Whether a document is held out for
validation is decided by a hash of its first `HASH_BYTES` bytes: independent of file order and of
how the source is split, and one-document-per-file corpora get a validation split too.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import os
import re
import zlib
from collections.abc import Iterator
from importlib import resources
from typing import NamedTuple

BUILTIN = "builtin"
PIECE_BYTES = 256 << 10  # a longer document is encoded in pieces of about this size (a 1 MB text costs the
# GPT-2 tokenizer about 100 MB while it is encoded, 256 KB about 7 MB)
HASH_BYTES = 1 << 16  # the validation split hashes this much of each document
UNIT_BYTES = 64 << 20  # plain text files are cut into units of about this size
HF_RECORDS_PER_UNIT = 50_000
_BOUNDARY = re.compile(rb"\n[ \t\r\f\v]*\n")  # a blank line between documents
# Where a text may be cut so that its pieces encode to the ids of the whole: after a newline that a
# non-space character follows, or (within a line) before a space that follows a non-space character
# and precedes a letter. Byte-level BPE pre-tokenizers (GPT-2's, Qwen's, Llama 3's) start a new
# pre-token at both.
_CUT = re.compile(r"\n(?=\S)|(?<=\S)(?= [^\W\d_])")


class DataError(ValueError):
    """Input data that cannot be prepared or read; the message names the problem."""


class Piece(NamedTuple):
    """Part of a document: its text, whether it ends the document, and the document's split."""

    text: str
    last: bool
    split: str  # "train" or "val"


def builtin_path() -> str:
    return str(resources.files("deltares.data") / "assets" / "mobydick.txt.gz")


def _fs(path: str):
    """(filesystem, path) of a bucket URL (fsspec: gcsfs for gs://, s3fs for s3://)."""
    import fsspec  # noqa: PLC0415 - buckets only

    try:
        return fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as err:
        raise DataError(f"cannot read {path}: {err}") from None


def _open_binary(path: str):
    if "://" in path:
        fs, inner = _fs(path)
        return fs.open(inner, "rb")
    return open(path, "rb")


def _size(path: str) -> int:
    if "://" in path:
        fs, inner = _fs(path)
        return fs.size(inner)
    return os.path.getsize(path)


def text_paths(source: str) -> list[str]:
    """The files of a text source (local or on a bucket): paths and globs, comma-separated."""
    paths: list[str] = []
    for pattern in source.split(","):
        pattern = pattern.strip()
        if "://" in pattern:
            fs, inner = _fs(pattern)
            scheme = pattern.split("://")[0]
            found = sorted(fs.glob(inner)) if any(c in pattern for c in "*?[") else ([inner] if fs.isfile(inner) else [])
            if not found:
                raise DataError(f"no such file: {pattern}")
            paths += [f"{scheme}://{p}" if "://" not in p else p for p in found]
            continue
        pattern = os.path.expanduser(pattern)
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        for path in found:
            if os.path.isdir(path):
                raise DataError(f"{path} is a directory; pass files or a glob such as '{path}/*.txt'")
            if not os.path.isfile(path):
                raise DataError(f"no such file: {path}")
            paths.append(path)
    if not paths:
        raise DataError(f"no files match {source!r}")
    return paths


def held_out(text: str, val_fraction: float) -> bool:
    """Whether a document (its first HASH_BYTES bytes) belongs to the validation split."""
    digest = hashlib.blake2b(text.encode("utf-8")[:HASH_BYTES], digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1_000_000 < round(val_fraction * 1_000_000)


# ----------------------------------------------------------------------------- planning


def plan_units(source: str, unit_bytes: int = UNIT_BYTES) -> list[dict]:
    """The units of a local text source, in source order: {path, start, end} byte ranges of plain
    files cut at blank lines, and {path} for a whole (gzipped) file."""
    if source == BUILTIN:  # resolved when read: the plan holds no path of this installation
        return [{"path": BUILTIN, "start": 0, "end": None}]
    units = []
    for path in (p if "://" in p else os.path.abspath(p) for p in text_paths(source)):
        size = _size(path)
        if path.endswith(".gz") or size <= unit_bytes:
            units.append({"path": path, "start": 0, "end": None})
            continue
        cuts = [0]
        with _open_binary(path) as f:
            while cuts[-1] + unit_bytes < size:
                cut = _next_boundary(f, cuts[-1] + unit_bytes)
                if cut is None or cut >= size:
                    break
                cuts.append(cut)
        units += [{"path": path, "start": a, "end": b} for a, b in zip(cuts, cuts[1:] + [None])]
    return units


def _next_boundary(f, offset: int, window: int = 1 << 20) -> int | None:
    """The first byte after a blank line at or after `offset`, or None (no blank line follows)."""
    position, carry = offset, b""
    while True:
        f.seek(position)
        chunk = f.read(window)
        if not chunk:
            return None
        data = carry + chunk
        match = _BOUNDARY.search(data)
        if match:
            return position - len(carry) + match.end()
        carry = data[-64:]  # a blank line may straddle two reads
        position += len(chunk)


# ----------------------------------------------------------------------------- reading


class _Range(io.RawIOBase):
    """Bytes [start, end) of a binary file, as a readable stream."""

    def __init__(self, f, start: int, end: int | None):
        f.seek(start)
        self.f, self.left = f, None if end is None else end - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = len(buffer) if self.left is None else min(len(buffer), self.left)
        data = self.f.read(n)
        buffer[: len(data)] = data
        if self.left is not None:
            self.left -= len(data)
        return len(data)


def _unit_lines(unit: dict) -> Iterator[str]:
    """The lines of a text unit, decoded as strict UTF-8 with universal newlines (a leading
    byte-order mark dropped). DataError naming the file for text that is not UTF-8 or a broken gzip."""
    path = builtin_path() if unit["path"] == BUILTIN else unit["path"]
    try:
        if path.endswith(".gz"):
            stream = gzip.open(_open_binary(path), "rt", encoding="utf-8-sig")
        else:
            raw = _open_binary(path)
            stream = io.TextIOWrapper(io.BufferedReader(_Range(raw, unit["start"], unit["end"]), 1 << 20),
                                      encoding="utf-8-sig" if unit["start"] == 0 else "utf-8")
        with stream:
            yield from stream
    except UnicodeDecodeError as err:
        where = f"byte {unit['start'] + err.start}" if not path.endswith(".gz") else "its text"
        raise DataError(f"{path} is not UTF-8 text ({where}: {err.reason}); convert it, "
                        "e.g. iconv -f latin1 -t utf-8") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"{path} is not a readable gzip file: {err}") from None


def text_pieces(unit: dict, val_fraction: float, limit: int | None = None) -> Iterator[Piece]:
    """The documents of a text unit as pieces (see the module docstring): each document is the
    text between blank lines, stripped; at most `limit` documents."""
    lines: list[str] = []
    size, split, count = 0, None, 0

    def flush(last: bool):
        nonlocal lines, size, split
        text = "".join(lines)
        text = text.lstrip() if split is None else text
        text = text.rstrip() if last else text
        if split is None:
            split = "val" if held_out(text, val_fraction) else "train"
        piece = Piece(text, last, split)
        lines, size = [], 0
        if last:
            split = None
        return piece

    for line in _unit_lines(unit):
        if not line.strip():
            if lines:
                yield flush(True)
                count += 1
                if limit is not None and count >= limit:
                    return
            continue
        for k, part in enumerate(_cut(line)):  # a line longer than PIECE_BYTES in parts
            if size >= PIECE_BYTES and (k > 0 or not line[0].isspace()):  # cut where a token starts
                yield flush(False)
            lines.append(part)
            size += len(part)
    if lines:
        yield flush(True)


def document_bytes(doc: str) -> int:
    """The bytes a document counts for bits per byte: its UTF-8 bytes plus one for the separator
    that its end-of-text token stands for (so the end-of-text is scored against a byte)."""
    return len(doc.encode("utf-8")) + 1


def split_documents(text: str) -> list[str]:
    """The documents of a text held in memory (blank-line separated, stripped): what
    `text_pieces` gives for a file of this text, joined."""
    return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def read_text(path: str) -> str:
    """The whole text of a local file as `text_pieces` reads it (for evaluation's small texts)."""
    return "".join(_unit_lines({"path": path, "start": 0, "end": None}))


def read_documents(source: str) -> list[str]:
    """Every document of a small local text source, file by file (evaluation reads texts this way)."""
    return [doc for path in text_paths(source) for doc in split_documents(read_text(path))]


def count_documents(units: list[dict], max_docs: int) -> list[int]:
    """How many documents each unit contributes to the first `max_docs` of the source (a
    counting pass that reads the text but tokenizes nothing)."""
    limits, left = [], max_docs
    for unit in units:
        if left <= 0:
            limits.append(0)
            continue
        n = sum(1 for piece in text_pieces(unit, 0.0, left) if piece.last)
        limits.append(n)
        left -= n
    return limits


# ----------------------------------------------------------------------------- Hugging Face datasets


def hf_dataset(name: str, config: str | None, split: str):
    """A Hugging Face dataset: a local directory (datasets.save_to_disk) read as is, else streamed."""
    import datasets  # optional dependency: only this source needs it

    if os.path.isdir(name) and os.path.exists(os.path.join(name, "state.json")):
        ds = datasets.load_from_disk(name)
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    return datasets.load_dataset(name, config, split=split, streaming=True)


def hf_pieces(ds, field: str, start: int, stop: int, val_fraction: float, name: str) -> Iterator[Piece]:
    """The documents of records [start, stop) of a Hugging Face dataset, each record one document
    (empty ones skipped), in pieces."""
    records = ds.select(range(start, min(stop, len(ds)))) if hasattr(ds, "select") and hasattr(ds, "__len__") \
        else itertools.islice(ds.skip(start) if start else ds, stop - start)
    for record in records:
        if field not in record:
            raise DataError(f"dataset {name!r} has no text field {field!r}; fields: {sorted(record)}")
        text = record[field]
        if not text or not text.strip():
            continue
        split = "val" if held_out(text, val_fraction) else "train"
        pieces = _cut(text)
        for i, part in enumerate(pieces):
            yield Piece(part, i == len(pieces) - 1, split)


def _cut(text: str) -> list[str]:
    """A text held in memory in pieces of about PIECE_BYTES, cut where `text_pieces` cuts."""
    if len(text) <= PIECE_BYTES:
        return [text]
    pieces, start = [], 0
    while (match := _CUT.search(text, start + PIECE_BYTES)) is not None:
        pieces.append(text[start : match.end()])
        start = match.end()
    return pieces + [text[start:]]
