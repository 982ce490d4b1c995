"""Run directories on a local disk or a bucket (`gs://`, `s3://`), through `etils.epath`.

Checkpoints go to the run directory through orbax (tensorstore writes buckets
natively); metrics and TensorBoard events through `epath` and tensorboardX
(`gcsfs` reaches GCS). Prepared token data is memory-mapped,
so it is always local: the built-in corpus of a run on a bucket is prepared into
a local cache, the same on every host.
"""

from __future__ import annotations

import hashlib
import os

from etils import epath


BUCKET_PREFIXES = ("gs", "s3")  # URL schemes of buckets (epath; gcsfs for gs://, s3fs for s3://)


def is_remote(path) -> bool:
    return "://" in os.fspath(path)


def run_dir(path) -> str:
    """A run directory as a string: absolute when local, unchanged when on a bucket."""
    path = os.fspath(path)
    return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def join(base, *parts) -> str:
    return os.fspath(epath.Path(base).joinpath(*parts))


def makedirs(path) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def cache_dir() -> str:
    """Local cache for data prepared on behalf of runs on buckets ($DELTARES_CACHE)."""
    return os.path.expanduser(os.environ.get("DELTARES_CACHE", "~/.cache/deltares"))


def builtin_dataset_dir(workdir: str, tokenizer: str) -> str:
    """Where a run's built-in corpus, tokenized by `tokenizer` (a resolved spec), is prepared:
    `<workdir>/dataset` for a local run, a local cache directory for a run on a bucket."""
    if not is_remote(workdir):
        return os.path.join(run_dir(workdir), "dataset")
    key = hashlib.sha256(tokenizer.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "datasets", f"builtin-{key}")
