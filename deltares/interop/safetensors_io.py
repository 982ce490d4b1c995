"""Reading and writing the safetensors format one tensor at a time, bfloat16 included.

A file is an 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets}}`, then the raw bytes. Reading memory-maps the file, so a tensor is
materialised only when asked for and a checkpoint is never held twice in memory.
(The `safetensors` package's numpy backend cannot read bfloat16.)
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message names the file."""


class SafetensorsFile:
    """The tensors of one `.safetensors` file: `names()`, `shape(name)`, `read(name)`."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError, UnicodeDecodeError) as err:
            raise SafetensorsError(f"{path}: not a readable safetensors file ({err})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._entries = header
        self._start = 8 + n
        self._map = None

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._map[self._start + begin : self._start + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Writes `(name, array)` pairs to `path` (through a temporary file, renamed when complete)."""
    tensors = [(name, np.ascontiguousarray(array)) for name, array in tensors]
    header, offset = {}, 0
    for name, array in tensors:
        if array.dtype not in CODES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {array.dtype}")
        header[name] = {"dtype": CODES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, array in tensors:
            f.write(array.tobytes())
    os.replace(tmp, path)
