"""A run directory checked before a run starts, and the lock that keeps one trainer per run directory.

`check_workdir` refuses, before anything is compiled or written, a run directory that cannot hold
a run: a folder that holds something else (a dataset, a Hugging Face model, other files), a file
where the directory or one of its folders must be, a folder where a file must be, or a place that
cannot be written (read-only, no permission).

`WorkdirLock` is the file `<workdir>/LOCK`, created exclusively (`O_EXCL` on a disk; on a bucket
an object written only if it does not exist yet, a generation precondition with gcsfs). It names
its holder (host, process id and that process's start time, the command) and carries a heartbeat
that the holder refreshes every minute. A second trainer refuses with one line naming the holder.
A lock left by a process that died is taken over with a warning: at once on the same host (the
process is gone, or its id now belongs to a process started later), and from another host once its
heartbeat is older than `STALE_AFTER_S`. A multi-host run takes it once, on process 0.

A local run directory is held open while the lock is held, and the run writes everything through it
(`WorkdirLock.through`), so nothing reaches the old path once the directory is moved, deleted, replaced
or a link on its path changes; `WorkdirLock.problem` says which happened.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid

from etils import epath

from deltares.data import paths

LOCK = "LOCK"
STALE_AFTER_S = 600.0  # a lock from another host whose heartbeat is older than this was left by a dead run
HEARTBEAT_S = 60.0
# What a run writes into its directory, and whether each is a folder or a file.
LAYOUT = {"checkpoints": "dir", "checkpoints_aside": "dir", "tensorboard": "dir", "profile": "dir", "dataset": "dir",
          "metrics.jsonl.d": "dir", "metrics.jsonl": "file", LOCK: "file"}


class WorkdirError(RuntimeError):
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


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), to tell a reused id apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote `holder` still runs (only answerable on its own host)."""
    try:
        pid = int(holder["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it runs
    except (KeyError, TypeError, ValueError, OverflowError):
        return False
    started = holder.get("pid_start")
    return started is None or _process_start(pid) in (None, started)


PROC_FD = "/proc/self/fd"  # Linux: `PROC_FD/N` is the open directory N wherever it is now


def _where(fd: int) -> str | None:
    """Where the open directory `fd` is now ("" where this system cannot tell), or None once deleted."""
    try:
        now = os.readlink(f"{PROC_FD}/{fd}")
    except OSError:
        return None if os.fstat(fd).st_nlink == 0 else ""
    return None if now.endswith(" (deleted)") or os.fstat(fd).st_nlink == 0 else now


class WorkdirLock:
    """The lock of one run directory (see the module docstring); `acquire` then `release`, or `with`.

    A local run directory is held open from `acquire` (or `hold`) to `release`: the lock file is read and
    written through it, and so is everything the run writes (`through`), so nothing reaches the path
    once it leads elsewhere; `problem` says when it does (the directory moved, deleted, or a link on
    its path changed). A bucket cannot be held open: there the run writes by name."""

    def __init__(self, workdir: str, log=lambda message: print(message, file=sys.stderr)):
        self.workdir, self.path, self.log = workdir, epath.Path(workdir) / LOCK, log
        self.record = None
        self._stop = threading.Event()
        self._thread = None
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

    def _new_record(self) -> dict:
        now = time.time()
        return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)), "heartbeat": now,
                "token": uuid.uuid4().hex, "command": " ".join(sys.argv)[:500]}

    def _read(self) -> dict | None:
        """The lock's record (None: no lock file; {}: unreadable), through the directory held open if it is."""
        try:
            if self._dir_fd is None:
                text = self.path.read_text()
            else:
                with os.fdopen(os.open(LOCK, os.O_RDONLY, dir_fd=self._dir_fd)) as f:
                    text = f.read()
            holder = json.loads(text)
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError):
            return {}  # being written, or cut short by a crash
        return holder if isinstance(holder, dict) else {}

    def _create(self) -> bool:
        """Writes our record into a new lock file; False when one exists."""
        data = json.dumps(self.record).encode()
        try:
            if paths.is_remote(self.workdir):
                import fsspec  # noqa: PLC0415 - buckets only (gcsfs: a generation-match-0 precondition)

                fs, path = fsspec.core.url_to_fs(os.fspath(self.path))
                with fs.open(path, "xb") as f:
                    f.write(data)
                return True
            fd = os.open(LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self._dir_fd)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def _stale(self, holder: dict) -> str | None:
        """Why the lock `holder` was left by a run that is gone, or None while it may still run."""
        if not holder:
            age = time.time() - self._mtime()
            return f"an unreadable lock {age:.0f} s old" if age > STALE_AFTER_S else None
        who = f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"
        if holder.get("host") == socket.gethostname():
            return None if _alive(holder) else f"{who}, which is no longer running"
        age = time.time() - float(holder.get("heartbeat", 0))
        return f"{who}, whose heartbeat stopped {age:.0f} s ago" if age > STALE_AFTER_S else None

    def acquire(self) -> None:
        """Takes the lock, or raises WorkdirError naming the trainer that holds it."""
        self.hold()
        try:
            self._acquire()
        except BaseException:
            self._let_go()
            raise

    def _acquire(self) -> None:
        self.record = self._new_record()
        for _ in range(3):
            if self._create():
                self._start_heartbeat()
                return
            holder = self._read()
            if holder is None:  # released between our attempt and the read
                continue
            reason = self._stale(holder)
            if reason is None:
                self.record = None
                who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                       if holder else "a trainer that is starting")
                raise WorkdirError(
                    f"{self.workdir} is in use by another trainer ({who}); wait for it to end or stop it, or use "
                    f"another --workdir (a lock left by a run that is gone is taken over automatically: at once on "
                    f"the same host, after {STALE_AFTER_S / 60:.0f} minutes from another; or delete {self.path})"
                )
            if self._take_over(holder):
                self.log(f"warning: took over the lock of {self.workdir} from {reason}")
                self._start_heartbeat()
                return
        self.record = None
        raise WorkdirError(f"could not take the lock {self.path}: other trainers are starting in {self.workdir}")

    def _take_over(self, holder: dict) -> bool:
        """Replaces the stale lock `holder` by ours; False when another process changed it first."""
        if self._read() != holder:
            return False
        self._write(self.record)
        time.sleep(0.05)  # two takers at once: the later write wins, the other sees it and backs off
        return self._read() == self.record

    def _write(self, record: dict) -> None:
        if paths.is_remote(self.workdir):
            self.path.write_text(json.dumps(record))
            return
        tmp, at = f"{LOCK}.{os.getpid()}.tmp", self._dir_fd
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=at), "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, LOCK, src_dir_fd=at, dst_dir_fd=at)

    def _mtime(self) -> float:
        try:
            if self._dir_fd is not None:
                return os.stat(LOCK, dir_fd=self._dir_fd).st_mtime
            return float(self.path.stat().mtime)
        except OSError:
            return time.time()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="deltares-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self._read() not in (self.record, {}):
                    return  # taken over (this process was thought dead): the next save or release notices
                self.record["heartbeat"] = time.time()
                self._write(self.record)
            except OSError:
                pass  # a full disk or a bucket hiccup: the next beat tries again

    def live_holder(self) -> str | None:
        """Who holds the lock while that trainer may still run (`process N on HOST, started ...`), else None."""
        holder = self._read()
        if holder is None or self._stale(holder) is not None:
            return None
        return f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder else (
            "a trainer that is starting")

    def held(self) -> bool:
        """Whether the lock file still names this process (not taken over by another trainer)."""
        return self.record is not None and self._read() == self.record

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
        who = (f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}" if holder
               else "a trainer that is starting")
        return f"the lock of {self.workdir} was taken over by another trainer ({who}); stopped without saving"

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
                self._stop.set()
                if self._thread is not None:
                    self._thread.join()
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

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
