"""The lock that keeps one writer per output: a trainer's run directory (`<workdir>/LOCK`,
deltares.training.workdir) and a prepared dataset (`<out>.lock` beside it, deltares.data.prepare).

A lock is a file created exclusively (`O_EXCL` on a disk; on a bucket an object written only if it
does not exist yet, a generation precondition with gcsfs). It names its holder (host, process id and
that process's start time, the command, and what the holder adds: a prepare's plan) and carries a
heartbeat that the holder refreshes every minute. A second writer refuses with one line naming the
holder. A lock left by a process that died is taken over with a warning: at once on the same host (the
process is gone, or its id now belongs to a process started later), and from another host once its
heartbeat is older than `STALE_AFTER_S`.

`HELD` lists the locks this process holds: an interrupt releases them before the process ends
(deltares.command_line), and deltares.common.outputs knows from it which run is this process's own.
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

from deltares.common.outputs import is_remote

STALE_AFTER_S = 600.0  # a lock from another host whose heartbeat is older than this was left by a dead process
HEARTBEAT_S = 60.0
HELD: set = set()  # the locks this process holds


class LockError(RuntimeError):
    """An output that another process writes; the message says who, in one line."""


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


def describe(holder: dict, starting: str) -> str:
    """`process N on HOST, started ...` of a lock's record ({}: unreadable, a writer that is `starting`)."""
    if not holder:
        return starting
    return f"process {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


class FileLock:
    """The lock file `path` of the output `subject` (see the module docstring); `acquire` then `release`,
    or `with`. `holder` names the kind of writer and `flag` the option that chooses the output, in the
    one line that refuses a second writer; `extra` goes into the record (a prepare's plan)."""

    error = LockError

    def __init__(self, path, subject: str, *, holder: str, flag: str, extra: dict | None = None,
                 log=lambda message: print(message, file=sys.stderr)):
        self.path, self.subject, self.holder, self.flag, self.log = epath.Path(path), subject, holder, flag, log
        self.extra = dict(extra or {})
        self.record = None
        self._stop = threading.Event()
        self._thread = None

    def _new_record(self) -> dict:
        now = time.time()
        return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)), "heartbeat": now,
                "token": uuid.uuid4().hex, "command": " ".join(sys.argv)[:500], **self.extra}

    def _read(self) -> dict | None:
        """The lock's record (None: no lock file; {}: unreadable)."""
        return read_record(self.path)

    def _create(self) -> bool:
        """Writes our record into a new lock file; False when one exists."""
        data = json.dumps(self.record).encode()
        try:
            if is_remote(self.path):
                import fsspec  # noqa: PLC0415 - buckets only (gcsfs: a generation-match-0 precondition)

                fs, path = fsspec.core.url_to_fs(os.fspath(self.path))
                with fs.open(path, "xb") as f:
                    f.write(data)
                return True
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def _mtime(self) -> float:
        """When the lock file was last written (now, where that cannot be read)."""
        try:
            return float(self.path.stat().mtime)
        except OSError:
            return time.time()

    def stale(self, holder: dict) -> str | None:
        """Why the lock `holder` was left by a process that is gone, or None while it may still run."""
        if not holder:
            age = time.time() - self._mtime()
            return f"an unreadable lock {age:.0f} s old" if age > STALE_AFTER_S else None
        who = f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')})"
        if holder.get("host") == socket.gethostname():
            return None if _alive(holder) else f"{who}, which is no longer running"
        age = time.time() - float(holder.get("heartbeat", 0))
        return f"{who}, whose heartbeat stopped {age:.0f} s ago" if age > STALE_AFTER_S else None

    def acquire(self) -> None:
        """Takes the lock, or raises `self.error` naming the process that holds it."""
        self.record = self._new_record()
        for _ in range(3):
            if self._create():
                self._held()
                return
            holder = self._read()
            if holder is None:  # released between our attempt and the read
                continue
            reason = self.stale(holder)
            if reason is None:
                self.record = None
                raise self.error(
                    f"{self.subject} is in use by another {self.holder} ({describe(holder, f'a {self.holder} that is starting')}); "
                    f"wait for it to end or stop it, or use another {self.flag} (a lock left by a {self.holder} that is "
                    f"gone is taken over automatically: at once on the same host, after {STALE_AFTER_S / 60:.0f} minutes "
                    f"from another; or delete {self.path})"
                )
            if self._take_over(holder):
                self.log(f"warning: took over the lock of {self.subject} from {reason}")
                self._held()
                return
        self.record = None
        raise self.error(f"could not take the lock {self.path}: other {self.holder}s are starting in {self.subject}")

    def _take_over(self, holder: dict) -> bool:
        """Replaces the stale lock `holder` by ours; False when another process changed it first."""
        if self._read() != holder:
            return False
        self._write(self.record)
        time.sleep(0.05)  # two takers at once: the later write wins, the other sees it and backs off
        return self._read() == self.record

    def _write(self, record: dict) -> None:
        if is_remote(self.path):
            self.path.write_text(json.dumps(record))
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def _held(self) -> None:
        HELD.add(self)
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="deltares-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self._read() not in (self.record, {}):
                    return  # taken over (this process was thought dead): the holder notices
                self.record["heartbeat"] = time.time()
                self._write(self.record)
            except OSError:
                pass  # a full disk or a bucket hiccup: the next beat tries again

    def live_holder(self) -> str | None:
        """Who holds the lock while that process may still run (`process N on HOST, started ...`), else None."""
        holder = self._read()
        if holder is None or self.stale(holder) is not None:
            return None
        return describe(holder, f"a {self.holder} that is starting")

    def held(self) -> bool:
        """Whether the lock file still names this process (not taken over by another)."""
        return self.record is not None and self._read() == self.record

    def _stop_heartbeat(self) -> None:
        HELD.discard(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def release(self) -> None:
        if self.record is None:
            return
        self._stop_heartbeat()
        try:
            if self._read() == self.record:
                self.path.unlink()
        except OSError:
            pass  # a lock we cannot remove is taken over by the next writer on this host
        self.record = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def read_record(path) -> dict | None:
    """The record of the lock file `path` (None: no lock file; {}: unreadable: being written, or cut short)."""
    try:
        holder = json.loads(epath.Path(path).read_text())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError, OSError):
        return {}
    return holder if isinstance(holder, dict) else {}


def release_all() -> None:
    """Releases every lock this process holds (an interrupt ends the process: no lock is left behind)."""
    for lock in list(HELD):
        try:
            lock.release()
        except Exception:  # noqa: BLE001, S110 - exiting anyway: a lock left is taken over by the next writer
            pass
