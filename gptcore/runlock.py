"""One trainer per run directory: an exclusive lock on <run_dir>/train.lock, taken by the trainer itself.

The trainer's rank 0 holds it for its whole life (one holder across all nodes of a run: the run directory
is on a filesystem every node shares). The kernel drops an flock when its holder dies, even by SIGKILL, so
a crashed run never leaves a stale lock. The file records the holder (host, pid, since when) so a second
trainer can name it. On NFS, Linux emulates flock with POSIX byte-range locks, which the server enforces
across clients; a filesystem with no lock support gets a clear error instead of an unguarded run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "train.lock"
LAUNCHER_ENV = "GPTPIPE_LAUNCHED_BY"  # set by a launcher to be named in the lock record


class LockHeld(RuntimeError):
    """Another trainer holds the run directory (or the filesystem cannot lock); the message says which."""


class LocksUnsupported(LockHeld):
    """The filesystem cannot lock at all."""


class RunLock:
    """An exclusive flock on <run_dir>/train.lock (or another `name`), polled for up to `timeout` seconds
    (0 = try once). With `remove`, the file goes when the lock is released (a lock beside data that must
    leave nothing behind); a waiter that then holds the removed file's lock notices and locks the new one."""

    def __init__(self, run_dir: Path, timeout: float = 0.0, name: str = LOCK_FILE, remove: bool = False):
        self.path = Path(run_dir) / name
        self.timeout, self.remove = timeout, remove
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        launcher = os.environ.get(LAUNCHER_ENV)  # e.g. the Prefect flow run that started this trainer
        if launcher:
            try:
                self.holder["launched_by"] = json.loads(launcher)
            except ValueError:
                self.holder["launched_by"] = launcher
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        end = time.monotonic() + self.timeout
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._current(fd):
                    break
                os.close(fd)  # its holder removed the file on release: lock the one there now
            except BlockingIOError:
                who = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if time.monotonic() >= end:
                    raise LockHeld(f"another trainer holds {self.path} (holder: {who}); two trainers must "
                                   "never write one run directory. Wait for it to finish or stop it (STOP "
                                   "file, SIGTERM); use another train.run_name for a separate run") from None
                time.sleep(0.5)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise LocksUnsupported(
                        f"the filesystem of {self.path} does not support file locks ({e.strerror}), so the trainer "
                        "cannot make sure it is alone on this run; put the run directory (train.run_dir) on a "
                        "filesystem with locks (local disk, NFSv4, Lustre/GPFS with locking enabled)") from None
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.holder).encode(), 0)
        self.fd = fd
        return self

    def _current(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self.fd is not None:
            if self.remove:
                self.path.unlink(missing_ok=True)  # before the lock drops, so no one locks a removed file unseen
            os.close(self.fd)  # closing the last descriptor drops the lock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
