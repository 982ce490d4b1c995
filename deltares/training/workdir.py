"""A run directory checked before a run starts, and the lock that keeps one trainer per run directory.

`check_workdir` refuses, before anything is compiled or written, a run directory that cannot hold
a run: a folder that holds something else (a dataset, a Hugging Face model, other files) or lies inside
one (deltares.common.outputs.check_place), a file
where the directory or one of its folders must be, a folder where a file must be, or a place that
cannot be written (read-only, no permission).

`WorkdirLock` is the file `<workdir>/LOCK`: the lock of deltares.common.lock (one holder, named; a
heartbeat; stale locks taken over with a warning). A multi-host run takes it once, on process 0. A second
trainer refuses with one line naming the holder.

A local run directory is held open while the lock is held, and the run writes everything through it
(`WorkdirLock.through`), so nothing reaches the old path once the directory is moved, deleted, replaced
or a link on its path changes; `WorkdirLock.problem` says which happened.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

from etils import epath

from deltares.common.lock import FileLock, LockError, describe
from deltares.common.outputs import RUN_LAYOUT as LAYOUT, RUN_LOCK as LOCK, OutputError, check_place
from deltares.data import paths


class WorkdirError(LockError):
    """A run directory that cannot be used; the message says why in one line."""


def check_workdir(workdir: str) -> None:
    """Raises WorkdirError unless `workdir` (a local path or a bucket URL) can hold a run: it and
    what the run writes into it have the right types, and it can be written."""
    root = epath.Path(workdir)
    for parent in [root, *root.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise WorkdirError(f"cannot use {workdir} as a run directory: {parent} is a file")
            break
    try:
        check_place(workdir, "--workdir")  # not inside a dataset, a model, or another run's own folders
    except OutputError as err:
        raise WorkdirError(str(err)) from None
    if (other := _not_a_run(root)) is not None:
        raise WorkdirError(f"{workdir} holds {other}, not a run; use a new or empty --workdir")
    for name, kind in LAYOUT.items():
        path = root / name
        if kind == "dir" and path.exists() and not path.is_dir():
            raise WorkdirError(f"{path} is a file where the run keeps a folder; move it away or use another --workdir")
        if kind == "file" and path.is_dir():
            raise WorkdirError(f"{path} is a folder where the run keeps a file; move it away or use another --workdir")
    for folder in [root] + [root / n for n, kind in LAYOUT.items() if kind == "dir" and (root / n).is_dir()]:
        _probe_write(folder, workdir)
    metrics = root / "metrics.jsonl"
    if not paths.is_remote(workdir) and metrics.exists() and not os.access(metrics, os.W_OK):
        raise WorkdirError(f"cannot write to {metrics} (permission denied)")


def _not_a_run(root: epath.Path) -> str | None:
    """What the folder `root` holds if that is something other than a run (a dataset, a Hugging Face
    model, other files: `paths.contents`), else None (missing, empty, a run, or a run's first folders)."""
    what = paths.contents(root) if root.is_dir() else None
    if what in (None, "a run") or all(p.name in LAYOUT for p in root.iterdir()):
        return None
    return what


def _probe_write(folder: epath.Path, workdir: str) -> None:
    """Writes and removes a small file in `folder` (made if missing, and removed again if it was)."""
    made = []
    try:
        for path in reversed([folder, *folder.parents]):
            if not path.exists():
                path.mkdir()
                made.append(path)
        probe = folder / f".write-probe-{uuid.uuid4().hex[:8]}"
        probe.write_text("deltares")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or str(err).strip().splitlines()[0]
        raise WorkdirError(f"cannot write to {folder} ({reason}); use a writable --workdir") from None
    finally:
        for path in reversed(made):
            try:
                path.rmdir()
            except OSError:
                pass


PROC_FD = "/proc/self/fd"  # Linux: `PROC_FD/N` is the open directory N wherever it is now


def _where(fd: int) -> str | None:
    """Where the open directory `fd` is now ("" where this system cannot tell), or None once deleted."""
    try:
        now = os.readlink(f"{PROC_FD}/{fd}")
    except OSError:
        return None if os.fstat(fd).st_nlink == 0 else ""
    return None if now.endswith(" (deleted)") or os.fstat(fd).st_nlink == 0 else now


class WorkdirLock(FileLock):
    """The lock of one run directory (see the module docstring); `acquire` then `release`, or `with`.

    A local run directory is held open from `acquire` (or `hold`) to `release`: the lock file is read and
    written through it, and so is everything the run writes (`through`), so nothing reaches the path
    once it leads elsewhere; `problem` says when it does (the directory moved, deleted, or a link on
    its path changed). A bucket cannot be held open: there the run writes by name."""

    error = WorkdirError

    def __init__(self, workdir: str, log=lambda message: print(message, file=sys.stderr)):
        super().__init__(epath.Path(workdir) / LOCK, workdir, holder="trainer", flag="--workdir", log=log)
        self.workdir = workdir
        self._dir_fd = None  # the run directory held open (local only)
        self._began_at = None  # where it was then (its path, links resolved)

    def hold(self) -> None:
        """Holds the local run directory open (it must exist), once; nothing for a bucket."""
        if self._dir_fd is None and not paths.is_remote(self.workdir):
            self._dir_fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
            self._began_at = _where(self._dir_fd) or os.path.realpath(self.workdir)

    @property
    def through(self) -> str:
        """The path the run writes its files through: on Linux `/proc/self/fd/N`, the run directory held
        open, which leads to it wherever it is moved (and nowhere once it is deleted); else the workdir."""
        if self._dir_fd is not None and os.path.isdir(PROC_FD):
            return f"{PROC_FD}/{self._dir_fd}"
        return self.workdir

    def _read(self) -> dict | None:
        """The lock's record (None: no lock file; {}: unreadable), through the directory held open if it is."""
        if self._dir_fd is None:
            return super()._read()
        try:
            with os.fdopen(os.open(LOCK, os.O_RDONLY, dir_fd=self._dir_fd)) as f:
                holder = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError):
            return {}  # being written, or cut short by a crash
        return holder if isinstance(holder, dict) else {}

    def _create(self) -> bool:
        """Writes our record into a new lock file (through the directory held open); False when one exists."""
        if self._dir_fd is None:
            return super()._create()
        try:
            fd = os.open(LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self._dir_fd)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(self.record).encode())
        return True

    def _write(self, record: dict) -> None:
        if self._dir_fd is None:
            return super()._write(record)
        tmp, at = f"{LOCK}.{os.getpid()}.tmp", self._dir_fd
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=at), "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, LOCK, src_dir_fd=at, dst_dir_fd=at)

    def _mtime(self) -> float:
        if self._dir_fd is None:
            return super()._mtime()
        try:
            return os.stat(LOCK, dir_fd=self._dir_fd).st_mtime
        except OSError:
            return time.time()

    def acquire(self) -> None:
        """Takes the lock, or raises WorkdirError naming the trainer that holds it."""
        self.hold()
        try:
            super().acquire()
        except BaseException:
            self._let_go()
            raise

    def problem(self) -> str | None:
        """Why the run must stop storing its work in this directory, or None while the lock is ours: the
        path no longer leads to the run directory (`_elsewhere`), or another trainer took the lock over.
        A lock file that was removed (and not taken by another trainer) is made again, with a warning."""
        if self.record is None:
            return None
        if (elsewhere := self._elsewhere()) is not None:
            return elsewhere
        holder = self._read()
        if holder is None:
            if self._create():
                self.log(f"warning: the lock file {self.path} was removed during the run; made it again")
                return None
            holder = self._read()
        if holder == self.record:
            return None
        return (f"the lock of {self.workdir} was taken over by another trainer "
                f"({describe(holder, 'a trainer that is starting')}); stopped without saving")

    def _elsewhere(self) -> str | None:
        """Why the workdir's path no longer leads to the run directory held open (it was deleted, moved,
        or a link on its path now points elsewhere), or None while it does."""
        if self._dir_fd is None:
            return None
        try:
            if os.path.samestat(os.stat(self.workdir), os.fstat(self._dir_fd)):
                return None
        except OSError:
            pass
        now = _where(self._dir_fd)
        if now is None:
            return f"the run directory {self.workdir} was deleted during the run; stopped (nothing more can be saved)"
        if not now:
            return (f"the run directory {self.workdir} was moved or replaced during the run; stopped without saving "
                    "there: rerun with --workdir naming where it is now to resume it")
        if now == self._began_at:
            return (f"{self.workdir} no longer leads to the run directory (a link on the path changed during the run; "
                    f"the run is in {now}); stopped without saving there: rerun with --workdir {now} to resume it")
        return (f"the run directory {self.workdir} was moved to {now} during the run; stopped without saving there: "
                f"rerun with --workdir {now} to resume it")

    def release(self) -> None:
        """Stops the heartbeat, removes the lock file where the directory is now (if it is still ours) and
        lets go of the directory."""
        try:
            if self.record is not None:
                self._stop_heartbeat()
                try:
                    if self._read() == self.record:
                        if self._dir_fd is not None:
                            os.unlink(LOCK, dir_fd=self._dir_fd)
                        else:
                            self.path.unlink()
                except OSError:
                    pass  # a lock we cannot remove is taken over by the next run on this host
        finally:
            self.record = None
            self._let_go()

    def _let_go(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
