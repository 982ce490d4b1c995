"""A `gs://` bucket served from a local directory through fsspec (what gcsfs does for real
buckets): the tests' `fake_bucket` fixture and the data benchmark's slow bucket."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def local_bucket(root: str, latency: float = 0.0, on_write: Callable[[int], None] | None = None):
    """An fsspec filesystem class for `gs://` and `gcs://` whose objects are the files under `root`
    (`gs://NAME/...` is `root/NAME/...`); `latency` seconds are added to every read request, and
    `on_write` is called with the size of every write."""
    from fsspec.implementations.local import LocalFileSystem

    class Filesystem(LocalFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, *args, **kwargs):
            super().__init__()

        @classmethod
        def _strip_protocol(cls, path):
            path = os.fspath(path).removeprefix("gs://")
            return (path if path.startswith(root) else os.path.join(root, path)).rstrip("/")

        def _open(self, path, mode="rb", **kwargs):
            f = super()._open(path, mode, **kwargs)
            if on_write is not None and ("w" in mode or "a" in mode):
                write = f.write

                def counted(data):
                    on_write(len(data))
                    return write(data)

                f.write = counted
            return f

        def cat_file(self, path, start=None, end=None, **kwargs):
            if latency:
                time.sleep(latency)
            return super().cat_file(path, start, end, **kwargs)

    return Filesystem
