"""Files that survive a kill at any moment: written to a temp name and renamed (readers see the old
version or the complete new one), temps of dead writers swept, JSON read back without tracebacks.

Temp names are `.<name>.tmp-<host>-<pid>`, so on shared storage each host sweeps only its own dead
writers' files.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import socket
import zipfile
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

# what reading a damaged file can raise (truncated zip or safetensors header, bad pickle, bad JSON, I/O)
READ_ERRORS = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile,
               SafetensorError)

_HOST = re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname())  # in temp names: whose they are


def atomic_write_bytes(path: Path, chunks, durable: bool = True) -> None:
    """Write byte chunks to `path` via a temp file + fsync + rename: readers see all or nothing.
    durable=False skips the fsync, for scratch files that are checked (length, sha256) before any use."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def temp_name(path: Path) -> Path:
    """`.<name>.tmp-<host>-<pid>` beside `path`: what remove_stale_temps removes once its writer is dead."""
    return path.with_name(f".{path.name}.tmp-{_HOST}-{os.getpid()}")


def free_disk(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing ancestor)."""
    path = Path(path).resolve()
    return shutil.disk_usage(next(p for p in [path, *path.parents] if p.exists())).free


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0: checks without signalling, on any POSIX OS)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale_temps(directory: Path, recursive: bool = True) -> list[Path]:
    """Delete the temp files and directories (`.<name>.tmp-<host>-<pid>`) that killed writers on this host
    left in `directory` (and its subdirectories): a killed checkpoint save leaves 1.5 GB at 124M. On
    shared storage, other hosts' temps are left to them, and so is a live writer's."""
    removed = []
    pattern = f"{'**/' if recursive else ''}.*.tmp-{_HOST}-*"
    for tmp in Path(directory).glob(pattern) if Path(directory).is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


@contextmanager
def atomic_dir(final: Path):
    """Build a directory under a temp name beside `final` (`with atomic_dir(d) as tmp: write into tmp`),
    then fsync its files and swap it into place: readers see the old directory or the complete new one,
    never a half-written one. Temps of killed writers beside it are removed first."""
    tmp = start_dir(final)
    try:
        yield tmp
        publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def start_dir(final: Path) -> Path:
    """atomic_dir's first half, for a directory that other processes fill too (a sharded checkpoint's
    ranks): an empty temp directory beside `final`, after the temps of killed writers are swept."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, recursive=False)
    tmp = temp_name(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, final: Path) -> None:
    """atomic_dir's second half: fsync every file under `tmp`, then swap it into place as `final`."""
    final = Path(final)
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # replaced (e.g. the same step saved again): move the old one aside, then swap
        old = temp_name(final.with_name(f"{final.name}.old"))
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):  # 4 MiB reads
            h.update(block)
    return h.hexdigest()


class _HashingFile:
    """A binary file that hashes what is written to it (torch.save and plain writes need only write)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def hashed_write(path: Path, write) -> str:
    """Create `path` with `write(file)` and return the sha256 of the bytes written, computed on the way
    (no read-back). For files inside an atomic_dir, which fsyncs them before the swap."""
    with open(path, "wb") as f:
        out = _HashingFile(f)
        write(out)
    return out.sha.hexdigest()


def cached_sha256(path: Path, cache: dict, key: str | None = None) -> str:
    """sha256 of `path`, reusing cache[key] (default: the path) while the file's size, mtime and inode are
    those recorded: entries are [size, mtime_ns, inode, sha256], so a cache can be kept as JSON."""
    st = Path(path).stat()
    key, stamp = key or str(path), [st.st_size, st.st_mtime_ns, st.st_ino]
    if not (isinstance(cache.get(key), list) and cache[key][:3] == stamp):
        cache[key] = [*stamp, file_sha256(path)]
    return cache[key][3]


def write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, [json.dumps(obj, indent=1, default=str).encode()])


def read_json(path: Path, default=None):
    """The JSON value in `path`, or `default` when the file is missing, unreadable or not valid JSON, or
    (with a default given) holds a value of another type than the default's, e.g. a list for a dict."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default
    return default if default is not None and not isinstance(value, type(default)) else value


def pipeline_home() -> Path:
    """Root for all artifacts (raw data, shards, runs, caches, embedded MLflow/Prefect state)."""
    return Path(os.environ.get("GPTPIPE_HOME", Path.cwd() / "var")).resolve()
