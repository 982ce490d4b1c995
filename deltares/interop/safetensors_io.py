"""Reading and writing safetensors files one tensor at a time, bfloat16 included, through the
`safetensors` library's numpy API.

Reading opens the file with `safe_open(..., framework="numpy")`, which memory-maps it and
materialises a tensor only when asked for (`read`), so a checkpoint is never held twice in
memory. Writing passes the arrays to `safetensors.numpy.save_file` (which writes from their
buffers, no copy) into a temporary file renamed when complete. bfloat16 arrays are
`ml_dtypes.bfloat16` both ways. Errors are `SafetensorsError` naming the file and tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import safetensors
import safetensors.numpy


class SafetensorsError(ValueError):
    """A file that is not valid safetensors; the message names the file."""


class SafetensorsFile:
    """The tensors of one `.safetensors` file: `names()`, `shape(name)`, `dtype(name)`, `read(name)`."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._file = safetensors.safe_open(path, framework="numpy")
        except (OSError, safetensors.SafetensorError) as err:
            raise SafetensorsError(f"{path}: not a readable safetensors file ({err})") from None
        self.metadata = self._file.metadata() or {}

    def names(self) -> list[str]:
        return list(self._file.keys())

    def _slice(self, name: str):
        try:
            return self._file.get_slice(name)
        except safetensors.SafetensorError as err:
            raise SafetensorsError(f"{self.path}: tensor {name}: {err}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The file's dtype code: 'F32', 'BF16', ..."""
        return self._slice(name).get_dtype()

    def read(self, name: str) -> np.ndarray:
        try:
            return self._file.get_tensor(name)
        except (safetensors.SafetensorError, TypeError, ValueError) as err:
            raise SafetensorsError(f"{self.path}: tensor {name} cannot be read ({err})") from None


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None) -> None:
    """Writes `(name, array)` pairs to `path` (through a temporary file, renamed when complete)."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors}
    tmp = path + ".tmp"
    try:
        safetensors.numpy.save_file(arrays, tmp, metadata=metadata)
    except (safetensors.SafetensorError, TypeError, ValueError) as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SafetensorsError(f"{path}: cannot write ({err})") from None
    os.replace(tmp, path)
