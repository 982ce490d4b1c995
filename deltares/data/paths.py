"""Run directories on a local disk or a bucket (`gs://`, `s3://`), through `etils.epath`, and the one way
every command replaces what it writes: beside it first, swapped in whole.

Checkpoints go to the run directory through orbax (tensorstore writes buckets
natively); metrics and TensorBoard events through `epath` and tensorboardX
(`gcsfs` reaches GCS). The built-in corpus of a run on a bucket is prepared
into a local cache, the same on every host.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Callable

from etils import epath

from deltares.common.outputs import contents, is_remote, resolve, staging  # noqa: F401 - shared with every layer


BUCKET_PREFIXES = ("gs", "s3")  # URL schemes of buckets (epath; gcsfs for gs://, s3fs for s3://)


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


# ----------------------------------------------------------------------------- replacing outputs

def swap_in(built, final) -> None:
    """Puts the finished folder `built` at `final` (a local link's target: the link stays), deleting what
    `final` held only afterwards. Locally by renames: the old folder is set aside, the new one renamed in
    (the old one is put back if that fails), then the old one deleted; once the new one is in place
    nothing raises (an old folder that cannot be deleted is a warning naming it). A bucket has no rename
    of a folder: the old one is deleted and the new one moved (copied) in, so a failure in the move leaves
    the new one whole at `built`."""
    built, final = epath.Path(built), epath.Path(final)
    if is_remote(final):
        if final.exists():
            final.rmtree()
        built.rename(final)
        return
    final = epath.Path(os.path.realpath(final))
    if not final.exists():
        os.replace(built, final)
        return
    aside = f"{os.fspath(final)}.old-{os.getpid()}"
    os.replace(final, aside)
    try:
        os.replace(built, final)
    except BaseException:
        os.replace(aside, final)
        raise
    try:
        shutil.rmtree(aside) if os.path.isdir(aside) else os.remove(aside)
    except OSError as err:
        print(f"warning: {os.fspath(final)} was replaced, but its old contents could not be deleted ({err}); "
              f"delete {aside} yourself", file=sys.stderr)


def write_whole(out: str, write: Callable[[str], None], *, overwrite: bool, flag: str = "--out",
                shown: str | None = None) -> None:
    """`write(folder)` fills a new, empty folder beside the local folder `out` (a link's target), which gets it
    only once `write` returns: a failure leaves `out` as it was and no partial folder. A non-empty `out` is
    refused before `write` runs (FileExistsError, one line naming what it holds, `out` as the user gave it:
    `shown`) unless `overwrite`; what may be written at all is deltares.common.outputs.check_output's to say,
    before this."""
    held = contents(out)
    if held is not None and not overwrite:
        raise FileExistsError(f"{flag} {shown or out} holds {held}; pass --overwrite to replace it, or choose a new "
                              f"{flag}")
    final = resolve(out, flag)
    built = staging(final)
    shutil.rmtree(built, ignore_errors=True)  # a killed command's leftover: never a whole output
    os.makedirs(built)
    try:
        write(built)
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise
    try:
        swap_in(built, final)
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise


def write_file_whole(path, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes a local file beside `path` (`<path>.tmp<pid>`), renamed over `path` once whole: a
    failure leaves `path` as it was."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{os.fspath(path)} is a folder; give the name of a file to write")
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomic(path, text: str) -> None:
    """`text` into `path` whole: a local file through a rename, a bucket object in one write."""
    if is_remote(path):
        epath.Path(path).write_text(text)
        return
    write_file_whole(path, lambda tmp: epath.Path(tmp).write_text(text))
