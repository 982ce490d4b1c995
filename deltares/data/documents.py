"""Documents of a corpus, read lazily, in units that workers and hosts can tokenize independently.

A text source (files, `.gz`, globs, comma-separated, on a disk or a bucket; `builtin` is Moby-Dick) is cut into
documents at blank lines. Record files (Parquet, JSON Lines plain or `.gz`/`.zst`, the same ways)
and a Hugging Face dataset (`hf:NAME`, or a local dataset directory) give one document per record:
the text of its `--text_field`, empty records skipped. The source is planned as a list of units
(`plan_units`, `hf_files`): a plain text file is cut into pieces of about `unit_bytes` at blank
lines (so no document spans two units), a gzipped text file and a JSON Lines file are one unit each,
a Parquet file is one unit or, when large, runs of its row groups (read from its footer), and a
Hugging Face dataset is planned by its own data files in the same way. No unit reads another's
records. Units are numbered in source order; the prepared token stream is the units' documents in
that order, whoever tokenized them.

A document is read line by line and handed on in pieces of about `PIECE_BYTES`, cut after a
newline that a non-space character follows, and a line longer than that before a space that
precedes a letter (where byte-level BPE pre-tokenizers always start a new token, so the pieces
encode to the ids of the whole; tests/test_prepare.py checks it), so a book without blank lines
is never encoded whole; a record's text is cut at the same places. Whether a document is held out for
validation is decided by a hash of its first `HASH_BYTES` bytes: independent of file order and of
how the source is split, and one-document-per-file corpora get a validation split too.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import itertools
import json
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
UNIT_BYTES = 64 << 20  # plain text files (and large Parquet files) are cut into units of about this size
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
    """The files of a source (text or records, local or on a bucket): paths and globs, comma-separated."""
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


def plan_units(source: str, unit_bytes: int = UNIT_BYTES, field: str = "text") -> list[dict]:
    """The units of a source of files, in source order: {path, start, end} byte ranges of plain text
    files cut at blank lines, {path} for a whole file (gzipped text, JSON Lines), and record files'
    units (`record_units`, `field` their text's)."""
    if source == BUILTIN:  # resolved when read: the plan holds no path of this installation
        return [{"path": BUILTIN, "start": 0, "end": None}]
    units = []
    for path in (p if "://" in p else os.path.abspath(p) for p in text_paths(source)):
        if is_records(path):
            units += record_units(path, field, unit_bytes)
            continue
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


def count_documents(units: list[dict], max_docs: int, field: str = "text") -> list[int]:
    """How many documents each unit contributes to the first `max_docs` of the source (a
    counting pass that reads the text, or the records' text column, but tokenizes nothing)."""
    limits, left = [], max_docs
    for unit in units:
        if left <= 0:
            limits.append(0)
            continue
        if is_records(unit["path"]):
            n = sum(1 for _ in itertools.islice(record_texts(unit, field), left))
        else:
            n = sum(1 for piece in text_pieces(unit, 0.0, left) if piece.last)
        limits.append(n)
        left -= n
    return limits


# ----------------------------------------------------------------------------- records (Parquet, JSON Lines, hf:)

RECORD_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
BATCH_RECORDS = 1024  # records decoded at a time (Parquet and Arrow batches, JSON lines)


def is_records(path: str) -> bool:
    """Whether a file holds records, one document each (Parquet, JSON Lines, the Arrow files of a
    saved Hugging Face dataset), rather than text cut at blank lines."""
    return path.endswith(RECORD_SUFFIXES)


def _pyarrow():
    try:
        import pyarrow  # noqa: PLC0415 - record sources only (installed with datasets)
        import pyarrow.parquet  # noqa: F401, PLC0415
    except ImportError:
        raise DataError("Parquet and JSON Lines sources need pyarrow (pip install pyarrow)") from None
    return pyarrow


def record_units(path: str, field: str, unit_bytes: int = UNIT_BYTES) -> list[dict]:
    """The units of a record file: a JSON Lines or Arrow file whole; a Parquet file whole, or, when its
    text column holds more than `unit_bytes` in several row groups, runs of row groups of about
    `unit_bytes` each ({path, row_groups: [first, stop]}: read from the file's footer)."""
    if not path.endswith(".parquet"):
        return [{"path": path}]
    pa = _pyarrow()
    try:
        with _open_binary(path) as raw:
            parquet = pa.parquet.ParquetFile(raw)
            _check_field(parquet.schema_arrow, field, path)
            meta = parquet.metadata
            column = next(j for j in range(meta.num_columns) if meta.schema.column(j).path == field)
            sizes = [meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups)]
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path} is not a readable Parquet file: {err}") from None
    runs, size = [[0, 0]], 0
    for group, group_bytes in enumerate(sizes):
        if size >= unit_bytes:
            runs.append([group, group])
            size = 0
        runs[-1][1] = group + 1
        size += group_bytes
    return [{"path": path, "row_groups": run} for run in runs]


def _check_field(schema, field: str, path: str) -> None:
    pa = _pyarrow()
    if field not in schema.names:
        raise DataError(f"{path} has no field {field!r} (--text_field); its fields: {', '.join(schema.names)}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{path}: field {field!r} holds {kind}, not text (--text_field)")


def _record_batches(unit: dict, field: str) -> Iterator[list]:
    """The values of `field` in the records of a unit, in batches of consecutive records (None where a
    record's value is null). DataError naming the file for a missing field, a value that is not text,
    a line that is no JSON object, or a file that cannot be read or decompressed."""
    path = unit["path"]
    pa = _pyarrow()
    kind = "Parquet" if path.endswith(".parquet") else "Arrow" if path.endswith(".arrow") else "JSON Lines"
    try:
        with _open_binary(path) as raw:
            if path.endswith(".parquet"):
                parquet = pa.parquet.ParquetFile(raw)
                _check_field(parquet.schema_arrow, field, path)
                first, stop = unit["row_groups"]
                if first < stop:
                    for batch in parquet.iter_batches(BATCH_RECORDS, row_groups=range(first, stop), columns=[field]):
                        yield batch.column(0).to_pylist()
            elif path.endswith(".arrow"):  # a saved Hugging Face dataset: an Arrow stream
                reader = pa.ipc.open_stream(raw)
                _check_field(reader.schema, field, path)
                index = reader.schema.get_field_index(field)
                for batch in reader:
                    yield batch.column(index).to_pylist()
            else:
                yield from _json_lines(raw, field, path)
    except (OSError, EOFError, zlib.error, pa.ArrowException) as err:
        raise DataError(f"{path} is not a readable {kind} file: {err}") from None


def _json_lines(raw, field: str, path: str) -> Iterator[list]:
    """The values of `field` of a JSON Lines file (plain, .gz or .zst) in batches; blank lines skipped."""
    if path.endswith(".gz"):
        stream = gzip.open(raw)
    elif path.endswith(".zst"):
        stream = io.BufferedReader(_pyarrow().CompressedInputStream(raw, "zstd"), 1 << 20)
    else:
        stream = raw
    batch = []
    for number, line in enumerate(stream, 1):
        if number == 1:
            line = line.removeprefix(codecs.BOM_UTF8)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:  # not JSON, or not UTF-8
            raise DataError(f"{path} line {number} is not a JSON record ({err}); JSON Lines files hold one "
                            "object per line") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {number} is not a JSON object but a {type(record).__name__}; JSON Lines "
                            "files hold one object per line")
        if field not in record:
            raise DataError(f"{path} line {number} has no field {field!r} (--text_field); its fields: "
                            f"{', '.join(record)}")
        value = record[field]
        if value is not None and not isinstance(value, str):
            raise DataError(f"{path} line {number}: field {field!r} holds {json.dumps(value)[:40]}, not text")
        batch.append(value)
        if len(batch) == BATCH_RECORDS:
            yield batch
            batch = []
    if batch:
        yield batch


def record_texts(unit: dict, field: str) -> Iterator[str]:
    """The documents of a record unit: each record's text, in file order, empty ones (null, "" or
    only whitespace) skipped."""
    for batch in _record_batches(unit, field):
        yield from (text for text in batch if text and not text.isspace())


def record_pieces(unit: dict, field: str, val_fraction: float, limit: int | None = None) -> Iterator[Piece]:
    """The documents of a record unit (at most `limit`) in pieces cut as `_cut` cuts."""
    for text in itertools.islice(record_texts(unit, field), limit):
        split = "val" if held_out(text, val_fraction) else "train"
        pieces = _cut(text)
        for i, part in enumerate(pieces):
            yield Piece(part, i == len(pieces) - 1, split)


def unit_pieces(unit: dict, val_fraction: float, field: str, limit: int | None = None) -> Iterator[Piece]:
    """The pieces of the documents of any unit (text or records), at most `limit` documents."""
    if is_records(unit["path"]):
        return record_pieces(unit, field, val_fraction, limit)
    return text_pieces(unit, val_fraction, limit)


def hf_files(name: str, config: str | None, split: str) -> list[str]:
    """The data files of a split of a Hugging Face dataset: the Arrow files of a local directory
    written by `datasets.save_to_disk`, else the files the dataset's own configuration lists
    (`datasets.load_dataset_builder`): `hf://` URLs of the Hub (read through huggingface_hub's
    filesystem, revision pinned), local paths for a local folder."""
    folder = os.path.expanduser(name)
    if os.path.exists(os.path.join(folder, "dataset_dict.json")):
        with open(os.path.join(folder, "dataset_dict.json")) as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise DataError(f"{name} has no split {split!r} (--hf_split); its splits: {', '.join(splits)}")
        folder = os.path.join(folder, split)
    if os.path.exists(os.path.join(folder, "state.json")):
        with open(os.path.join(folder, "state.json")) as f:
            return [os.path.abspath(os.path.join(folder, d["filename"])) for d in json.load(f)["_data_files"]]
    try:
        import datasets  # noqa: PLC0415 - optional dependency: only hf: sources need it
    except ImportError:
        raise DataError("hf: sources need the datasets package (pip install datasets)") from None
    try:
        files = datasets.load_dataset_builder(name, config).config.data_files or {}
    except (OSError, ValueError, ConnectionError) as err:  # not found, no such config, offline
        raise DataError(f"cannot load hf:{name}: {err}") from None
    if split not in files:
        raise DataError(f"hf:{name} has no split {split!r} (--hf_split); its splits: {', '.join(files)}")
    found = [path if "://" in path else os.path.abspath(path) for path in files[split]]
    other = [path for path in found if not is_records(path)]
    if other:
        raise DataError(f"hf:{name}: {other[0]} is no Parquet, JSON Lines or Arrow file, which prepare reads")
    return found


def _cut(text: str) -> list[str]:
    """A text held in memory in pieces of about PIECE_BYTES, cut where `text_pieces` cuts."""
    if len(text) <= PIECE_BYTES:
        return [text]
    pieces, start = [], 0
    while (match := _CUT.search(text, start + PIECE_BYTES)) is not None:
        pieces.append(text[start : match.end()])
        start = match.end()
    return pieces + [text[start:]]
