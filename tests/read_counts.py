"""Counts the records that `deltares.data.prepare` reads, in its own process and in the worker
processes it spawns: as the reader hands on each batch of records, a digest of every record's text
is appended to a file (tests/test_prepare.py and tests/bench_data.py check that each record of the
source is read exactly once).

    python -m tests.read_counts COUNTS_FILE --source 'corpus/*.parquet' --out data/c   # prepare's flags
"""

from __future__ import annotations

import collections
import hashlib
import os
import sys

ENV = "DELTARES_TEST_READ_COUNTS"  # the counts file, inherited by the spawned workers


def digest(text) -> str:
    """A record's identity in the counts file (its text's; a null record's is that of "")."""
    return hashlib.blake2b((text or "").encode("utf-8"), digest_size=8).hexdigest()


def install(path: str, patch=setattr) -> None:
    """Counts every record read from now on into `path`, in this process and in prepare's workers
    (`patch`: how to replace an attribute, e.g. pytest's monkeypatch.setattr)."""
    from deltares.data import documents, prepare

    os.environ[ENV] = path
    read = documents._record_batches

    def counted(unit, field):
        for batch in read(unit, field):
            fd = os.open(os.environ[ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, "".join(digest(text) + "\n" for text in batch).encode())  # one append per batch
            finally:
                os.close(fd)
            yield batch

    patch(documents, "_record_batches", counted)
    patch(prepare, "_worker_init", _worker_init)


def _worker_init(*args) -> None:
    """A spawned worker of prepare: its own initialization, then counting (the parent's patches are not inherited)."""
    from deltares.data import prepare

    prepare._worker_init(*args)
    install(os.environ[ENV])


def read_counts(path: str) -> collections.Counter:
    """How many times each record (by digest) was read."""
    if not os.path.exists(path):
        return collections.Counter()
    with open(path) as f:
        return collections.Counter(f.read().split())


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m tests.read_counts COUNTS_FILE [flags of deltares.data.prepare]")
    install(sys.argv[1])
    from deltares.data import prepare

    sys.argv = ["deltares.data.prepare"] + sys.argv[2:]
    prepare.cli()


if __name__ == "__main__":
    main()
