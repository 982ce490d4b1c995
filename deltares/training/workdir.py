"""A run directory checked before a run starts, and the lock that keeps one trainer per run directory.

`check_workdir` refuses, before anything is compiled or written, a run directory that cannot hold
a run: a folder that holds something else (a dataset, a Hugging Face model, other files) or lies inside
one (deltares.common.outputs.check_place), a file
where the directory or one of its folders must be, a folder where a file must be, or a place that
cannot be written (read-only, no permission).

`WorkdirLock` is the file `<workdir>/LOCK`: the lock of deltares.common.lock (one holder, named; a
heartbeat; stale locks taken over with a warning) that also holds the run directory open, so that a
directory moved or deleted during the run is noticed (`problem`). A multi-host run takes it once, on
process 0. A second trainer refuses with one line naming the holder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid

from etils import epath

from deltares.common.lock import STALE_AFTER_S, FileLock, LockError, _process_start  # noqa: F401 - tests read them here
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


class WorkdirLock(FileLock):
    """The lock of one run directory (see the module docstring); `acquire` then `release`, or `with`."""

    error = WorkdirError

    def __init__(self, workdir: str, log=lambda message: print(message, file=sys.stderr)):
        super().__init__(epath.Path(workdir) / LOCK, workdir, holder="trainer", flag="--workdir", log=log)
        self.workdir = workdir
        self._dir_fd = None  # the run directory held open (local only): where it went if it is moved or deleted
        self._in_place_at = time.time()  # when the run directory was last found where the run began

    def _read(self, dir_fd: int | None = None) -> dict | None:
        """The lock's record (None: no lock file; {}: unreadable), from `dir_fd`'s directory if given."""
        if dir_fd is None:
            return super()._read()
        try:
            with os.fdopen(os.open(LOCK, os.O_RDONLY, dir_fd=dir_fd)) as f:
                holder = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError):
            return {}  # being written, or cut short by a crash
        return holder if isinstance(holder, dict) else {}

    def _start_heartbeat(self) -> None:
        if not paths.is_remote(self.workdir) and self._dir_fd is None:
            self._dir_fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        super()._start_heartbeat()

    def problem(self) -> str | None:
        """Why the run must stop storing its work in this directory, or None while the lock is ours: the
        run directory was deleted or moved, or another trainer took the lock over. A lock file that was
        removed (and not taken by another trainer) is made again, with a warning."""
        if self.record is None:
            return None
        if (gone := self._directory_gone()) is not None:
            return gone
        holder = self._read()
        if holder is None:
            if self._create():
                self.log(f"warning: the lock file {self.path} was removed during the run; made it again")
                return None
            holder = self._read()
        if holder == self.record:
            return None
        who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder
               else "a trainer that is starting")
        return f"the lock of {self.workdir} was taken over by another trainer ({who}); stopped without saving"

    def _directory_gone(self) -> str | None:
        """`the run directory ... was deleted / moved to ...`, or None while it is where the run began."""
        if self._dir_fd is None:
            return None
        try:
            same = os.path.samestat(os.stat(self.workdir), os.fstat(self._dir_fd))
        except OSError:
            same = False
        if same:
            self._in_place_at = time.time()
            return None
        try:
            now = os.readlink(f"/proc/self/fd/{self._dir_fd}")
        except OSError:
            now = " (deleted)"
        if now.endswith(" (deleted)") or os.fstat(self._dir_fd).st_nlink == 0:
            return f"the run directory {self.workdir} was deleted during the run; stopped (nothing more can be saved)"
        return (f"the run directory {self.workdir} was moved to {now} during the run; stopped without saving there: "
                f"rerun with --workdir {now} to resume it")

    def clear_old_path(self) -> bool:
        """After the run directory was moved: removes the folder that a save begun as it moved made again
        at the old path, so that nothing of the run stays there. Only a folder that holds nothing but
        `checkpoints/`, all made since the directory was last found in place, is ours; anything else stays."""
        if self._dir_fd is None or self._directory_gone() is None or not os.path.isdir(self.workdir):
            return False
        try:
            if os.path.samestat(os.stat(self.workdir), os.fstat(self._dir_fd)) or os.listdir(self.workdir) != [
                    "checkpoints"]:
                return False
            since = self._in_place_at - 1.0  # file times come from a coarser clock than time.time()
            for folder, dirs, files in os.walk(self.workdir):
                if any(os.lstat(os.path.join(folder, name)).st_ctime < since for name in [".", *dirs, *files]):
                    return False
            shutil.rmtree(self.workdir)
        except OSError:
            return False
        return True

    def release(self) -> None:
        if self.record is None:
            return
        self._stop_heartbeat()
        try:
            if self._dir_fd is not None:  # the directory where it is now, if it was moved
                if self._read(self._dir_fd) == self.record:
                    os.unlink(LOCK, dir_fd=self._dir_fd)
            elif self._read() == self.record:
                self.path.unlink()
        except OSError:
            pass  # a lock we cannot remove is taken over by the next run on this host
        finally:
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
        self.record = None
