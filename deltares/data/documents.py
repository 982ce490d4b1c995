"""Documents of a corpus, read lazily, in units that workers and hosts can tokenize independently.

What a source names is decided in `source_units`, once for every tool: `builtin` (Moby-Dick), a
Hugging Face dataset (`hf:NAME`, or a folder written by `datasets.save_to_disk`), or files and globs,
comma-separated, on a disk or a bucket, named as every input is (deltares.common.inputs). Each file is
read as what its content says it is (deltares.data.formats): text, cut into documents at blank lines,
or records (JSON Lines, Parquet, Arrow), one document per record: the text of its `--text_field`, empty
records skipped; compressed or not. The source is planned as a list of units: a plain text file is cut
into pieces of about `unit_bytes` at blank lines (so no document spans two units), a compressed text
file and a JSON Lines or Arrow file are one unit each, a Parquet file is one unit or, when large, runs
of its row groups (read from its footer), and a Hugging Face dataset is planned by its own data files in
the same way. No unit reads another's records. Units are numbered in source order; the prepared token
stream is the units' documents in that order, whoever tokenized them.

A document is read line by line (a line longer than `PIECE_BYTES` in parts) and handed on in pieces of
about `PIECE_BYTES`, cut after a newline that a non-space character follows, or before a space that
follows a non-space character and precedes a letter (where byte-level BPE pre-tokenizers always start a
new token, so the pieces encode to the ids of the whole; tests/test_prepare.py checks it), so a book
without blank lines is never encoded whole; a record's text is cut at the same places. Where no such
place comes within `HARD_PIECE * PIECE_BYTES` characters (a record of megabytes without a space), the
text is cut there anyway: the ids next to that cut may differ from the whole's, but no tokenizer ever
gets more text at once. Whether a document is held out for validation is decided by a hash of its first
`HASH_BYTES` bytes: independent of file order and of how the source is split, and
one-document-per-file corpora get a validation split too.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from importlib import resources
from typing import NamedTuple

from deltares.common.inputs import DataError, resolve_inputs  # noqa: F401 - DataError: the data's error too
from deltares.data import formats
from deltares.data.formats import ARROW_FILE, ARROW_STREAM, JSON_LINES, PARQUET, TEXT, Format

BUILTIN = "builtin"
SOURCE_HELP = {  # the help of the flags that name what a source's records hold, in every tool that reads sources
    "text_field": "The field of a record (Parquet, Arrow, JSON Lines, Hugging Face) holding its text.",
    "hf_config": "Hugging Face dataset configuration name (hf:NAME sources).",
    "hf_split": "Hugging Face dataset split to read (hf:NAME sources and saved dataset folders).",
}
PIECE_BYTES = 256 << 10  # a longer document is encoded in pieces of about this size (a 1 MB text costs the
# GPT-2 tokenizer about 100 MB while it is encoded, 256 KB about 7 MB)
HARD_PIECE = 2  # a piece is cut anyway once it reaches HARD_PIECE * PIECE_BYTES characters without a place to cut
HASH_BYTES = 1 << 16  # the validation split hashes this much of each document
UNIT_BYTES = 64 << 20  # plain text files (and large Parquet files) are cut into units of about this size
_BOUNDARY = re.compile(rb"\n[ \t\r\f\v]*\n")  # a blank line between documents
# Where a text may be cut so that its pieces encode to the ids of the whole: after a newline that a
# non-space character follows, or (within a line) before a space that follows a non-space character
# and precedes a letter. Byte-level BPE pre-tokenizers (GPT-2's, Qwen's, Llama 3's) start a new
# pre-token at both.
_CUT = re.compile(r"\n(?=\S)|(?<=\S)(?= [^\W\d_])")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Piece(NamedTuple):
    """Part of a document: its text, whether it ends the document, and the document's split."""

    text: str
    last: bool
    split: str  # "train" or "val"


def builtin_path() -> str:
    return str(resources.files("deltares.data") / "assets" / "mobydick.txt.gz")


def held_out(text: str, val_fraction: float) -> bool:
    """Whether a document (its first HASH_BYTES bytes) belongs to the validation split."""
    digest = hashlib.blake2b(text.encode("utf-8")[:HASH_BYTES], digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1_000_000 < round(val_fraction * 1_000_000)


# ----------------------------------------------------------------------------- planning


def source_units(source: str, *, flag: str = "--source", text_field: str = "text", hf_config: str | None = None,
                 hf_split: str = "train", unit_bytes: int = UNIT_BYTES) -> list[dict]:
    """The units of what `source` names, in source order. The names recognised here and nowhere else:
    `builtin` (the shipped Moby-Dick), `hf:NAME` and a folder written by `datasets.save_to_disk` (a
    Hugging Face dataset, read by its data files: `hf_files`); anything else is files and globs
    (deltares.common.inputs.resolve_inputs, `flag` naming them in messages), each cut as its format
    allows (`file_units`). DataError naming the entry and the cause."""
    if source.strip() == BUILTIN:  # resolved when read: the plan holds no path of this installation
        return [{"path": BUILTIN, "start": 0, "end": None}]
    if source.startswith("hf:") or hf_dataset_folder(source):
        files = hf_files(source.removeprefix("hf:"), hf_config, hf_split)
        return [unit for path in files for unit in record_units(path, text_field, unit_bytes)]
    return [unit for path in resolve_inputs(source, flag=flag) for unit in file_units(path, unit_bytes, text_field)]


def hf_dataset_folder(source: str) -> bool:
    """Whether `source` is a local folder written by `datasets.save_to_disk` (a dataset or a dict of splits)."""
    folder = os.path.expanduser(source.strip())
    return "://" not in source and any(os.path.isfile(os.path.join(folder, name))
                                       for name in ("dataset_dict.json", "state.json"))


def file_units(path: str, unit_bytes: int = UNIT_BYTES, field: str = "text") -> list[dict]:
    """The units of one file: a plain text file in {path, start, end} byte ranges cut at blank lines, a
    compressed text file whole ({path, start: 0, end: None}), a record file as `record_units` cuts it."""
    fmt = file_format(path)
    if fmt.records:
        return record_units(path, field, unit_bytes)
    size = formats.size(path)
    if fmt.codec is not None or size <= unit_bytes:
        return [{"path": path, "start": 0, "end": None}]
    cuts = [0]
    with formats.open_binary(path) as f:
        while cuts[-1] + unit_bytes < size:
            cut = _next_boundary(f, cuts[-1] + unit_bytes)
            if cut is None or cut >= size:
                break
            cuts.append(cut)
    return [{"path": path, "start": a, "end": b} for a, b in zip(cuts, cuts[1:] + [None])]


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


@functools.lru_cache(maxsize=4096)
def _format(path: str, stamp) -> Format:
    return formats.detect(path)


def file_format(path: str) -> Format:
    """The format of a source file, told by its content (deltares.data.formats.detect; once per process
    for a local file that has not changed)."""
    if path == BUILTIN:
        return Format(TEXT, "gzip")
    if "://" in path:
        return _format(path, None)
    try:
        st = os.stat(path)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None
    return _format(path, (st.st_size, st.st_mtime_ns, st.st_ino))


def is_records(unit: dict) -> bool:
    """Whether a unit's file holds records, one document each (Parquet, Arrow, JSON Lines), rather than text
    cut at blank lines."""
    return file_format(unit["path"]).records


# ----------------------------------------------------------------------------- reading


def _unit_lines(unit: dict) -> Iterator[str]:
    """The lines of a text unit (deltares.data.formats.text_lines), a line longer than PIECE_BYTES in parts."""
    path = builtin_path() if unit["path"] == BUILTIN else unit["path"]
    return formats.text_lines(path, file_format(unit["path"]), unit["start"], unit["end"], part=PIECE_BYTES)


class _Pieces:
    """The text of one document as it comes, handed on in pieces of at least PIECE_BYTES characters, cut where
    `_CUT` allows (so the pieces encode to the ids of the whole), or, where no such place comes before
    HARD_PIECE * PIECE_BYTES characters (tens of megabytes without a space), cut there anyway: a tokenizer
    never gets more than that at once."""

    def __init__(self):
        self.parts, self.size, self.scan = [], 0, PIECE_BYTES

    def add(self, text: str) -> list[str]:
        """The pieces completed by `text`."""
        self.parts.append(text)
        self.size += len(text)
        done = []
        while self.size > self.scan:
            whole = "".join(self.parts)
            match = _CUT.search(whole, self.scan, HARD_PIECE * PIECE_BYTES)
            if match is not None:
                cut = match.end()
            elif len(whole) >= HARD_PIECE * PIECE_BYTES:
                cut = PIECE_BYTES
            else:  # wait for more text; what was searched is not searched again
                self.parts, self.scan = [whole], max(PIECE_BYTES, len(whole) - 1)
                break
            done.append(whole[:cut])
            rest = whole[cut:]
            self.parts, self.size, self.scan = [rest] if rest else [], len(rest), PIECE_BYTES
        return done

    def rest(self) -> str:
        return "".join(self.parts)


class _Document:
    """One document of a text as its lines come: stripped, its split decided by its first piece."""

    def __init__(self, val_fraction: float):
        self.val_fraction, self.pieces, self.split, self.started = val_fraction, _Pieces(), None, False

    def _split(self, text: str) -> str:
        if self.split is None:
            self.split = "val" if held_out(text, self.val_fraction) else "train"
        return self.split

    def add(self, text: str) -> list[Piece]:
        if not self.started:
            text = text.lstrip()
            if not text:
                return []
            self.started = True
        return [Piece(part, False, self._split(part)) for part in self.pieces.add(text)]

    def end(self) -> Piece:
        text = self.pieces.rest().rstrip()
        return Piece(text, True, self._split(text))


def text_pieces(unit: dict, val_fraction: float, limit: int | None = None) -> Iterator[Piece]:
    """The documents of a text unit as pieces (see the module docstring): each document is the
    text between blank lines, stripped; at most `limit` documents."""
    doc, count = _Document(val_fraction), 0
    blank, held = True, []  # whether the current line is blank so far, and its whitespace parts
    for part in _unit_lines(unit):
        if blank and not part.strip():
            held.append(part)
            if part.endswith("\n"):  # a blank line
                held = []
                if doc.started:
                    yield doc.end()
                    count += 1
                    if limit is not None and count >= limit:
                        return
                    doc = _Document(val_fraction)
            continue
        for text in [*held, part]:
            yield from doc.add(text)
        held, blank = [], part.endswith("\n")
    if doc.started:
        yield doc.end()


def piece_bytes(piece: Piece) -> int:
    """The bytes a piece counts for bits per byte: its UTF-8 bytes, plus one for the separator that the
    end-of-text token after a document's last piece stands for (so the end-of-text is scored against a byte)."""
    return len(piece.text.encode("utf-8")) + piece.last


def count_documents(units: list[dict], max_docs: int, field: str = "text") -> list[int]:
    """How many documents each unit contributes to the first `max_docs` of the source (a
    counting pass that reads the text, or the records' text column, but tokenizes nothing)."""
    limits, left = [], max_docs
    for unit in units:
        if left <= 0:
            limits.append(0)
            continue
        if is_records(unit):
            n = sum(1 for _ in itertools.islice(record_texts(unit, field), left))
        else:
            n = sum(1 for piece in text_pieces(unit, 0.0, left) if piece.last)
        limits.append(n)
        left -= n
    return limits


# ----------------------------------------------------------------------------- records (Parquet, JSON Lines, hf:)

BATCH_RECORDS = 1024  # records decoded at a time (Parquet and Arrow batches, JSON lines)


def record_units(path: str, field: str, unit_bytes: int = UNIT_BYTES) -> list[dict]:
    """The units of a record file: a JSON Lines or Arrow file whole; a Parquet file whole, or, when its
    text column holds more than `unit_bytes` in several row groups, runs of row groups of about
    `unit_bytes` each ({path, row_groups: [first, stop]}: read from the file's footer)."""
    if file_format(path).kind != PARQUET:
        return [{"path": path}]
    pa = formats.pyarrow()
    try:
        with formats.open_binary(path) as raw:
            parquet = pa.parquet.ParquetFile(raw)
            _check_field(parquet.schema_arrow, field, path)
            meta = parquet.metadata
            column = next(j for j in range(meta.num_columns) if meta.schema.column(j).path.split(".")[0] == field)
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


def _is_text_type(kind) -> bool:
    pa = formats.pyarrow()
    if pa.types.is_dictionary(kind):  # dictionary-encoded strings are text too
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _check_field(schema, field: str, path: str) -> int:
    """The index of the text column `field` in a record file's schema; DataError naming the file and the column
    when it is missing, named twice, or holds no text."""
    found = schema.get_all_field_indices(field)
    if not found:
        raise DataError(f"{path} has no field {field!r} (--text_field); its fields: {', '.join(schema.names)}")
    if len(found) > 1:
        raise DataError(f"{path} has {len(found)} columns named {field!r} (--text_field): which one holds the text "
                        "is not known; write the file again with one")
    kind = schema.field(found[0]).type
    if not _is_text_type(kind):
        raise DataError(f"{path}: field {field!r} holds {kind}, not text (--text_field)")
    return found[0]


def _record_batches(unit: dict, field: str) -> Iterator[list]:
    """The values of `field` in the records of a unit, in batches of consecutive records (None where a
    record's value is null). DataError naming the file for a missing field, a value that is not text,
    a line that is no JSON object, or a file that cannot be read or decompressed."""
    path = unit["path"]
    fmt = file_format(path)
    pa = formats.pyarrow() if fmt.kind != JSON_LINES else None
    errors = formats.decompress_errors() + ((pa.ArrowException,) if pa is not None else ())
    try:
        with formats.open_binary(path) as raw:
            if fmt.kind == PARQUET:
                parquet = pa.parquet.ParquetFile(raw)
                _check_field(parquet.schema_arrow, field, path)
                first, stop = unit["row_groups"]
                if first < stop:
                    for batch in parquet.iter_batches(BATCH_RECORDS, row_groups=range(first, stop), columns=[field]):
                        yield _texts(batch.column(0), path, field)
            elif fmt.kind == ARROW_FILE:  # Arrow IPC file (Feather 2)
                reader = pa.ipc.open_file(raw)
                index = _check_field(reader.schema, field, path)
                for i in range(reader.num_record_batches):
                    yield _texts(reader.get_batch(i).column(index), path, field)
            elif fmt.kind == ARROW_STREAM:  # Arrow IPC stream: a saved Hugging Face dataset
                with formats.open_decompressed(raw, fmt.codec) as stream:
                    reader = pa.ipc.open_stream(stream)
                    index = _check_field(reader.schema, field, path)
                    for batch in reader:
                        yield _texts(batch.column(index), path, field)
            else:
                with formats.open_decompressed(raw, fmt.codec) as stream:
                    yield from _json_lines(stream, field, path)
    except errors as err:
        raise DataError(f"{path} is not a readable {fmt} file: {err}") from None


def _texts(column, path: str, field: str) -> list:
    """The values of an Arrow text column (dictionary-encoded too) as str, None where null."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: field {field!r} holds bytes that are not UTF-8 ({err.reason})") from None


def _json_lines(stream, field: str, path: str) -> Iterator[list]:
    """The values of `field` of a JSON Lines stream (decompressed) in batches; blank lines skipped."""
    batch = []
    for number, line in enumerate(stream, 1):
        if number == 1:
            line = line.removeprefix(codecs.BOM_UTF8)
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{path} line {number} is not UTF-8 text (byte {err.start} of the line: {err.reason})"
                            ) from None
        except ValueError as err:  # not JSON
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
        if value is not None and not value.isascii() and (bad := _SURROGATE.search(value)):
            raise DataError(f"{path} line {number}: field {field!r} holds a lone surrogate (\\u{ord(bad.group()):04x}), "
                            "which is no text")
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
    if is_records(unit):
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
            return [os.path.realpath(os.path.join(folder, d["filename"])) for d in json.load(f)["_data_files"]]
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
    found = [path if "://" in path else os.path.realpath(path) for path in files[split]]
    other = [path for path in found if not set(formats.suffixes(path)) & {
        ".parquet", ".arrow", ".feather", *formats.JSON_LINES_SUFFIXES}]
    if other:
        raise DataError(f"hf:{name}: {other[0]} is no Parquet, JSON Lines or Arrow file, which prepare reads")
    return found


def _cut(text: str) -> list[str]:
    """A text held in memory in pieces of about PIECE_BYTES, cut where `text_pieces` cuts."""
    pieces = _Pieces()
    return [*pieces.add(text), pieces.rest()]
