"""What a data file holds, told by its content (`detect`), and reading it as that: files on a disk or a
bucket (`open_binary`), decompressed (`open_decompressed`), and text as lines of strict UTF-8 (`text_lines`).

- Compression is told by the file's first bytes, whatever its name: gzip, zstd, bzip2 and xz are
  read (decompressed as they stream). A file whose name says it is compressed (`.gz`, `.zst`,
  `.bz2`, `.xz`) but whose bytes are not is refused; so are archives and other containers (zip,
  tar, 7z, rar, lz4, brotli, Unix compress), each in one line naming it.
- Inside: Parquet (`PAR1`), an Arrow IPC file (`ARROW1`, also Feather 2) and an Arrow IPC stream
  (what `datasets.save_to_disk` writes) are told by their bytes too. A Parquet or Arrow file that is
  itself compressed whole is refused (they compress their own columns), and a file named `.parquet`,
  `.arrow` or `.feather` that holds something else is refused (a download that failed leaves an
  error page under that name).
- Everything else is text: JSON Lines when its name ends in `.jsonl`, `.ndjson` or `.json`, or when
  its first non-blank line is a JSON object; plain text otherwise.

Suffixes compare case-insensitively (`.JSONL`, `.TXT.GZ`). Text is strict UTF-8: a byte-order mark
at the start is dropped, and bytes that are not UTF-8 (Latin-1 text, a lone surrogate, binary data)
end in one error naming the file, the line and the byte; text is never decoded any other way.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import lzma
import os
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from deltares.common.inputs import DataError, bucket_filesystem

TEXT, JSON_LINES, PARQUET, ARROW_FILE, ARROW_STREAM = "text", "JSON Lines", "Parquet", "Arrow file", "Arrow stream"
RECORD_KINDS = (JSON_LINES, PARQUET, ARROW_FILE, ARROW_STREAM)
CODECS = {  # name: (magic bytes, suffixes)
    "gzip": (b"\x1f\x8b", (".gz", ".gzip")),
    "zstd": (b"\x28\xb5\x2f\xfd", (".zst", ".zstd")),
    "bzip2": (b"BZh", (".bz2",)),
    "xz": (b"\xfd7zXZ\x00", (".xz",)),
}
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
BINARY_SUFFIXES = {".parquet": PARQUET, ".arrow": "Arrow", ".feather": "Arrow", ".ipc": "Arrow"}
REFUSED_MAGIC = (  # (magic, offset, what it is, what to do)
    (b"PK\x03\x04", 0, "a zip archive", "unpack it and name its files"),
    (b"PK\x05\x06", 0, "a zip archive", "unpack it and name its files"),
    (b"7z\xbc\xaf\x27\x1c", 0, "a 7z archive", "unpack it and name its files"),
    (b"Rar!\x1a\x07", 0, "a rar archive", "unpack it and name its files"),
    (b"ustar\x00", 257, "a tar archive", "unpack it and name its files"),
    (b"ustar  \x00", 257, "a tar archive", "unpack it and name its files"),
    (b"\x04\x22\x4d\x18", 0, "lz4-compressed", "decompress it, or recompress it with gzip or zstd"),
    (b"\x1f\x9d", 0, "compressed by Unix compress (.Z)", "decompress it, or recompress it with gzip or zstd"),
    (b"Obj\x01", 0, "an Avro file", "write it again as Parquet or JSON Lines"),
    (b"\xff\xfe", 0, "UTF-16 text", "convert it to UTF-8, e.g. iconv -f utf-16 -t utf-8"),
    (b"\xfe\xff", 0, "UTF-16 text", "convert it to UTF-8, e.g. iconv -f utf-16 -t utf-8"),
)
REFUSED_SUFFIXES = {".br": "brotli-compressed", ".lz4": "lz4-compressed", ".zip": "a zip archive",
                    ".7z": "a 7z archive", ".rar": "a rar archive", ".tar": "a tar archive", ".z": "compressed by Unix compress"}
HEAD_BYTES = 4096  # read to tell a format
SNIFF_LINE_BYTES = 64 << 20  # the longest first line read to tell JSON Lines from text


class Format(NamedTuple):
    """What a file holds: `kind` (TEXT, JSON_LINES, PARQUET, ARROW_FILE, ARROW_STREAM) and the `codec` the
    whole file is compressed with (None, or a key of CODECS)."""

    kind: str
    codec: str | None = None

    @property
    def records(self) -> bool:
        return self.kind in RECORD_KINDS

    def __str__(self) -> str:
        return f"{self.codec}-compressed {self.kind}" if self.codec else self.kind


# ----------------------------------------------------------------------------- files on a disk or a bucket


def open_binary(path: str):
    if "://" in path:
        fs, inner = bucket_filesystem(path)
        return fs.open(inner, "rb")
    return open(path, "rb")


def size(path: str) -> int:
    if "://" in path:
        fs, inner = bucket_filesystem(path)
        return fs.size(inner)
    return os.path.getsize(path)


def pyarrow():
    try:
        import pyarrow  # noqa: PLC0415 - record files only (installed with datasets)
        import pyarrow.ipc  # noqa: F401, PLC0415
        import pyarrow.parquet  # noqa: F401, PLC0415
    except ImportError:
        raise DataError("Parquet, Arrow and zstd-compressed files need pyarrow (pip install pyarrow)") from None
    return pyarrow


def open_decompressed(raw, codec: str | None):
    """The decompressed bytes of the binary stream `raw` (itself when `codec` is None), as a stream."""
    if codec is None:
        return raw
    if codec == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if codec == "bzip2":
        return bz2.BZ2File(raw, "rb")
    if codec == "xz":
        return lzma.LZMAFile(raw, "rb")
    return io.BufferedReader(pyarrow().CompressedInputStream(raw, "zstd"), 1 << 20)


def decompress_errors() -> tuple:
    """What reading a broken compressed stream raises (and pyarrow's errors, when it is loaded)."""
    import sys  # noqa: PLC0415

    pa = sys.modules.get("pyarrow")
    return (OSError, EOFError, zlib.error, lzma.LZMAError) + ((pa.ArrowException,) if pa is not None else ())


# ----------------------------------------------------------------------------- telling the format


def suffixes(path: str) -> list[str]:
    """The lower-case suffixes of a file name: `a.Train.JSONL.GZ` -> ['.train', '.jsonl', '.gz']."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    return ["." + s for s in name.split(".")[1:]]


def named_json_lines(path: str) -> bool:
    """Whether a file's name says JSON Lines (`.jsonl`, `.ndjson`, `.json`, compressed or not, any case)."""
    names = suffixes(path)
    if names and any(names[-1] in ends for _, ends in CODECS.values()):
        names = names[:-1]
    return bool(names) and names[-1] in JSON_LINES_SUFFIXES


def _codec_of(head: bytes) -> str | None:
    return next((name for name, (magic, _) in CODECS.items() if head.startswith(magic)), None)


def _refused(head: bytes) -> tuple[str, str] | None:
    for magic, offset, what, advice in REFUSED_MAGIC:
        if head[offset : offset + len(magic)] == magic:
            return what, advice
    return None


def _kind_of(head: bytes) -> str | None:
    if head.startswith(b"PAR1"):
        return PARQUET
    if head.startswith(b"ARROW1"):
        return ARROW_FILE
    if head.startswith(b"\xff\xff\xff\xff"):
        return ARROW_STREAM
    return None


def _first_line_is_json_object(lines) -> bool:
    """Whether the first non-blank of `lines` (bytes) is a JSON object (then the file is JSON Lines)."""
    for number, line in enumerate(lines):
        if number == 0:
            line = line.removeprefix(codecs.BOM_UTF8)
        if line.strip():
            if not line.lstrip().startswith(b"{"):
                return False
            try:
                return isinstance(json.loads(line), dict)
            except ValueError:
                return False
    return False


def _file_lines(path: str, codec: str | None):
    with open_binary(path) as raw, open_decompressed(raw, codec) as stream:
        yield from iter(lambda: stream.readline(SNIFF_LINE_BYTES), b"")


def detect(path: str) -> Format:
    """The format of the file at `path` (see the module docstring), from its first bytes; DataError naming
    the file and what it holds when it is not read."""
    codec = None
    try:
        with open_binary(path) as raw:
            head = raw.read(HEAD_BYTES)
            codec = _codec_of(head)
            inner = head
            if codec is not None:
                raw.seek(0)
                with open_decompressed(raw, codec) as stream:
                    inner = stream.read(HEAD_BYTES)
    except decompress_errors() as err:
        raise DataError(f"{path} is not a readable {codec or ''} file: {err}".replace("  ", " ")) from None
    return _decide(path, head, codec, inner, lambda: _file_lines(path, codec))


def read_whole(path: str) -> tuple[bytes, Format]:
    """The bytes of a small file read once (a named pipe too), decompressed, and its format; DataError as
    `detect` says."""
    with open_binary(path) as raw:
        data = raw.read()
    codec = _codec_of(data)
    inner = data
    if codec is not None:
        try:
            with open_decompressed(io.BytesIO(data), codec) as stream:
                inner = stream.read()
        except decompress_errors() as err:
            raise DataError(f"{path} is not a readable {codec} file: {err}") from None
    return inner, _decide(path, data[:HEAD_BYTES], codec, inner[:HEAD_BYTES], lambda: io.BytesIO(inner))


def _decide(path: str, head: bytes, codec: str | None, inner: bytes, lines) -> Format:
    """The format of a file from its first bytes (`head`), the codec they name, the first bytes of what that
    decompresses to (`inner`) and a function giving its lines (to tell JSON Lines by its first line)."""
    names = suffixes(path)
    if (refused := _refused(head) if codec is None else None) is not None:
        raise DataError(f"{path} is {refused[0]}, which is not read; {refused[1]}")
    claimed = next((name for name, (_, ends) in CODECS.items() if names and names[-1] in ends), None)
    if codec is None and claimed is not None:
        raise DataError(f"{path} is named {names[-1]} but is not {claimed}-compressed (it begins with {head[:16]!r}); "
                        "rename or recompress it")
    if codec is None and names and names[-1] in REFUSED_SUFFIXES:
        raise DataError(f"{path} is {REFUSED_SUFFIXES[names[-1]]}, which is not read; decompress or unpack it")
    if codec is not None:
        names = names[:-1] if claimed is not None else names
        if (refused := _refused(inner)) is not None or (refused := _codec_of(inner)) is not None:
            what = refused[0] if isinstance(refused, tuple) else f"data compressed again with {refused}"
            raise DataError(f"{path} is {codec}-compressed and holds {what}, which is not read; decompress it")
    kind = _kind_of(inner)
    if kind is not None and codec is not None and kind != ARROW_STREAM:
        raise DataError(f"{path} is a {kind} file compressed whole with {codec}, which is not read; decompress it "
                        f"({kind} compresses its own columns)")
    if kind is not None:
        return Format(kind, codec)
    if names and names[-1] in BINARY_SUFFIXES:
        raise DataError(f"{path} is named {names[-1]} but is no {BINARY_SUFFIXES[names[-1]]} file (it begins with "
                        f"{inner[:24]!r}); a failed download, or another format: check it")
    if named_json_lines(path):
        return Format(JSON_LINES, codec)
    if inner.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{") and _first_line_is_json_object(lines()):
        return Format(JSON_LINES, codec)
    return Format(TEXT, codec)


def decode_text(data: bytes, shown: str) -> str:
    """Bytes of a whole text file as strict UTF-8 (a byte-order mark at the start dropped); DataError naming the
    file, the line and the byte where they are not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(_not_utf8_lines(io.BytesIO(data), shown)) from None


# ----------------------------------------------------------------------------- text


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


def text_lines(path: str, fmt: Format, start: int = 0, end: int | None = None,
               part: int | None = None, opened: str | None = None) -> Iterator[str]:
    """The lines of a text file (bytes [start, end) of a plain one; a compressed one whole), strict UTF-8
    with universal newlines, a byte-order mark at the start dropped. A line longer than `part` characters
    comes in parts (only the last ends in a newline). DataError naming the file (`opened`, else `path`),
    the line and the byte where the bytes are not UTF-8, or a compressed stream that breaks."""
    shown = opened or path
    try:
        with open_binary(path) as raw:
            stream = (open_decompressed(raw, fmt.codec) if fmt.codec else
                      io.BufferedReader(_Range(raw, start, end), 1 << 20))
            text = io.TextIOWrapper(stream, encoding="utf-8-sig" if start == 0 else "utf-8", errors="strict")
            with text:
                while line := text.readline(-1 if part is None else part):
                    yield line
    except UnicodeDecodeError:
        raise DataError(not_utf8(path, fmt, shown)) from None
    except decompress_errors() as err:
        raise DataError(f"{shown} is not a readable {fmt.codec or ''} file: {err}".replace("  ", " ")) from None


def not_utf8(path: str, fmt: Format, shown: str) -> str:
    """The message for a text file that is not UTF-8: its first line that is not, and the byte (read again
    from the file's start, decompressed: only when it fails)."""
    with open_binary(path) as raw, open_decompressed(raw, fmt.codec) as stream:
        return _not_utf8_lines(stream, shown)


def _not_utf8_lines(stream, shown: str) -> str:
    offset = 0
    for number, line in enumerate(stream, 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            bad = line[err.start : err.start + 3]
            surrogate = len(bad) == 3 and bad[0] == 0xED and 0xA0 <= bad[1] <= 0xBF
            reason = "a lone surrogate, which UTF-8 text never holds" if surrogate else err.reason
            return (f"{shown} line {number} is not UTF-8 text (byte {offset + err.start}: {reason}); convert it, "
                    "e.g. iconv -f latin1 -t utf-8")
        offset += len(line)
    return f"{shown} is not UTF-8 text; convert it, e.g. iconv -f latin1 -t utf-8"
