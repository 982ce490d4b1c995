"""Where a command may write, decided in one place (`check_output`) before anything is written, with or
without `--overwrite`, from what the command reads and what the place holds.

What a folder is (`kind`, `contents`) is read from the files deltares writes into each: a Hugging Face
model (config.json and safetensors), a dataset (meta.json or plan.json, and its tokens, ledger or
tokenizer), a run (metrics.jsonl, a checkpoint step folder, or the LOCK record of a trainer), an analysis
(routing.json). A folder that merely holds one of these names (a `checkpoints` folder of other files in a
home directory) is none of them. Runs, datasets and models are KEPT: only the
command that makes one replaces it (prepare a dataset, convert a model), and none replaces a folder
holding one.

The rules, for an output `out` (a local path or a bucket URL):
- a local path is taken with `~` expanded and every symbolic link on it followed: the output is the
  link's target, replaced whole (a link that leads nowhere, or back to itself, is refused);
- it never is, nor lies inside, an input; a folder replaced whole never contains one (nor does the
  folder it is built in, `<out>.partial`);
- inside a run, a dataset or a model it is refused, but for a new entry directly in a run's top level
  that is none of the run's own (`<run>/analysis`, `<run>/results.md`), and the run directory of the
  command itself (`owner`: the trainer preparing its built-in corpus into `<run>/dataset`);
- a folder replaced whole (`writes="folder"`) is not a file, not KEPT unless the command `replaces` that
  kind, and holds nothing KEPT below it;
- a folder written into (`writes="files"`) is not a file and not KEPT;
- a file (`writes="file"`) is not a folder, and an existing one is replaced only with `overwrite`.
Folders that are not empty are refused without `--overwrite` by the commands themselves
(deltares.data.paths.write_whole, deltares.data.prepare), after this check.

Imports nothing else of deltares.
"""

from __future__ import annotations

import errno
import os

from etils import epath

RUN, DATASET, MODEL, ANALYSIS = "a run", "a dataset", "a Hugging Face model", "an analysis"
KEPT = (RUN, DATASET, MODEL)
RUN_LOCK = "LOCK"
# What a run writes into its directory, and whether each is a folder or a file.
RUN_LAYOUT = {"checkpoints": "dir", "checkpoints_aside": "dir", "tensorboard": "dir", "profile": "dir", "dataset": "dir",
              "dataset.lock": "file", "metrics.jsonl.d": "dir", "metrics.jsonl": "file", RUN_LOCK: "file"}
STAGING_SUFFIX = ".partial"
WALK_LIMIT = 10000  # entries looked at below a folder to be replaced; more is no output of a command


class OutputError(ValueError):
    """An output that would land on an input or on something it must not replace; one line saying why."""


def is_remote(path) -> bool:
    return "://" in os.fspath(path)


def staging(final) -> str:
    """The folder beside `final` where a command builds what replaces it (`<final>.partial`)."""
    return os.fspath(final).rstrip("/") + STAGING_SUFFIX


def _kind(folder, names) -> str | None:
    """What the folder `folder`, whose entries are `names`, is (see `kind`)."""
    names = set(names)
    path = epath.Path(folder)
    if "config.json" in names and any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return MODEL
    if names & {"meta.json", "plan.json"} and names & {"train", "val", "ledger", "train.bin", "tokenizer.json"}:
        return DATASET
    if names & {"checkpoints", "metrics.jsonl", RUN_LOCK} and _is_run(path, names):
        return RUN
    if "routing.json" in names:
        return ANALYSIS
    return None


def _is_run(path: epath.Path, names: set) -> bool:
    """A run's own files, not just their names: metrics.jsonl a file, a checkpoint step folder, or a LOCK
    that a trainer wrote (a record naming its process, or empty while it is written)."""
    try:
        if "metrics.jsonl" in names and (path / "metrics.jsonl").is_file():
            return True
        if "checkpoints" in names and (path / "checkpoints").is_dir() and any(
                p.name.isdigit() for p in (path / "checkpoints").iterdir()):
            return True
        if RUN_LOCK in names and (path / RUN_LOCK).is_file():
            text = (path / RUN_LOCK).read_text()[:65536]
            return not text or '"pid"' in text
    except (OSError, UnicodeDecodeError):
        return False
    return False


def _names(path) -> list[str] | None:
    """The entries of the local or bucket folder `path`, sorted; None when it is no folder (or unreadable)."""
    try:
        if not is_remote(path):
            return sorted(os.listdir(path)) if os.path.isdir(path) else None
        folder = epath.Path(path)
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None
    except OSError:
        return None


def kind(path) -> str | None:
    """What deltares made the folder `path` (RUN, DATASET, MODEL or ANALYSIS), or None."""
    names = _names(path)
    return _kind(path, names) if names else None


def contents(path) -> str | None:
    """What the local or bucket folder `path` holds, in words (a Hugging Face model, a dataset, a run, an
    analysis, or its first files), or None when it is missing or empty."""
    folder = epath.Path(path)
    if not folder.exists():
        return None
    if not folder.is_dir():
        return "a file"
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return None
    found = _kind(path, names)
    if found:
        return found
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'} ({shown})"


def resolve(path, flag: str = "--out") -> str:
    """`path` as a command writes it: a bucket URL as given; a local path absolute, `~` expanded, every
    symbolic link on it followed. OutputError for a link that leads back to itself or nowhere."""
    path = os.fspath(path)
    if is_remote(path):
        return path.rstrip("/")
    local = os.path.abspath(os.path.expanduser(path))
    try:
        return os.path.realpath(local, strict=True)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OutputError(f"{flag} {path}: too many levels of symbolic links (a link that leads back to "
                              "itself)") from None
    if os.path.islink(local):
        raise OutputError(f"{flag} {path} is a symbolic link to {os.readlink(local)}, which does not exist; give "
                          "the folder or file itself")
    return os.path.realpath(local)


def _input(path) -> str:
    path = os.fspath(path)
    return path.rstrip("/") if is_remote(path) else os.path.realpath(os.path.expanduser(path))


def within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies inside it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _new_run_entry(real: str, folder: str) -> bool:
    """Whether `real` is an entry directly in the run `folder` that is none of the run's own (its analysis)."""
    entry = os.path.relpath(real, folder)
    return os.sep not in entry and entry not in RUN_LAYOUT and entry != os.curdir and kind(folder) == RUN


def _enclosing(real: str, owner: str | None):
    """(root, kind) of the innermost run, dataset or model that holds `real`, where it may not be written
    (see the module docstring), or None."""
    folder = os.path.dirname(real)
    while True:
        found = kind(folder)
        if found in KEPT and not (owner is not None and folder == owner) and not _new_run_entry(real, folder):
            return folder, found
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def check_place(path, flag: str, owner=None, shown: str | None = None) -> None:
    """OutputError when the local path `path` lies inside a run, a dataset or a model where nothing may be
    written (see the module docstring); `owner`: the command's own run directory."""
    if is_remote(path):
        return
    real = _input(path)
    enclosing = _enclosing(real, None if owner is None else _input(owner))
    if enclosing is not None:
        root, found = enclosing
        raise OutputError(f"{flag} {shown or path} is inside {found} ({root}); write outside it" +
                          (", or into a new folder directly in it" if found == RUN else ""))


def _kept_below(real: str):
    """(path, kind) of a run, dataset or model inside the folder `real` (not following links), ("", None)
    when it holds more than WALK_LIMIT entries, or None."""
    seen = 0
    for folder, dirs, files in os.walk(real):
        seen += len(dirs) + len(files)
        if seen > WALK_LIMIT:
            return "", None
        found = _kind(folder, dirs + files) if folder != real else None
        if found in KEPT:
            return folder, found
    return None


def check_output(out, *, writes: str, inputs=(), flag: str = "--out", overwrite: bool = False,
                 replaces: tuple = (), owner=None) -> str:
    """The path a command writes `out` to (links followed: `resolve`), or OutputError saying in one line why
    it may not (see the module docstring). `writes`: "folder" (replaced whole), "files" (a folder written
    into) or "file"; `inputs`: every file or folder the command reads; `replaces`: the KEPT kinds the command
    makes (it replaces them by its own rules); `owner`: the command's own run directory."""
    real = resolve(out, flag)
    shown = os.fspath(out)
    if not is_remote(real) and real != os.path.abspath(os.path.expanduser(shown)):
        shown = f"{shown} (a link to {real})"
    for path in map(_input, inputs):
        if path == real:
            raise OutputError(f"{flag} {shown} is also what this command reads; write to another path")
        if within(real, path) and not _new_run_entry(real, path):
            raise OutputError(f"{flag} {shown} is inside the input {path}; write outside it")
        if writes == "folder" and within(path, real):
            raise OutputError(f"{flag} {shown} contains the input {path}, which replacing it would delete; "
                              f"choose another {flag}")
        if writes == "folder" and within(path, staging(real)):
            raise OutputError(f"the input {path} is where {flag} {shown} is built ({staging(real)}); rename it "
                              f"or choose another {flag}")
    check_place(real, flag, owner, shown)
    is_dir = epath.Path(real).is_dir()
    if writes == "file":
        if is_dir:
            raise OutputError(f"{flag} {shown} is a folder; give the name of a file to write")
        if epath.Path(real).exists() and not overwrite:
            raise OutputError(f"{flag} {shown} exists; pass --overwrite to replace it, or choose another {flag}")
        return real
    if epath.Path(real).exists() and not is_dir:
        raise OutputError(f"{flag} {shown} is a file; {flag} names a folder")
    found = kind(real)
    if writes == "files":
        if found in KEPT:
            raise OutputError(f"{flag} {shown} is {found}; write into a folder of its own" +
                              (f", such as {os.path.join(real, 'analysis')}" if found == RUN else ""))
        return real
    if found in KEPT and found not in replaces:
        raise OutputError(f"{flag} {shown} holds {found}, which this command does not replace, even with "
                          f"--overwrite; choose another {flag}")
    if found is None and is_dir and not is_remote(real):
        below = _kept_below(real)
        if below is not None:
            where, what = below
            raise OutputError(f"{flag} {shown} holds {what} ({where}), which replacing it would delete; choose "
                              f"another {flag}" if what else
                              f"{flag} {shown} holds more than {WALK_LIMIT} files: no output of deltares; choose "
                              f"another {flag}")
    return real
