"""Where training metrics go: one JSON object per line in `<run_dir>/metrics.jsonl`, written by rank 0.

The file is append-only (a resumed run keeps its history) and flushed per line, so anything can tail it:
integrations/tracking.py ships it to MLflow from outside the training process, and training never waits on
a tracking server. Metric keys: train/loss, train/lr, train/grad_norm, train/step_time,
train/tokens_per_s, train/mfu, train/tokens_seen, val/loss, hellaswag/acc, hellaswag/acc_norm,
hellaswag/n; text samples are kind "sample" with key "text".
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsError(ValueError):
    """metrics.jsonl cannot be read as lines of JSON (e.g. one line longer than the read limit)."""


def _plain(v):
    """Tensors / numpy scalars to plain Python; non-finite floats to null (strict JSON everywhere)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlLogger:
    """Appends `{"step", "time", "kind", **metrics}` lines to `path`, flushing each one. A write that
    fails (e.g. a full disk) does not raise: `error` says why, later rows are dropped, and the trainer
    stops on it at the next step (it checkpoints first; on a full disk that fails with a clear error)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.error: str | None = None
        torn = _last_byte(self.path) not in (b"", b"\n")
        self._f = open(self.path, "a", encoding="utf-8")
        if torn:  # a SIGKILL mid-line: end that line so the next row starts clean
            self._f.write("\n")

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        if self.error is not None:
            return
        row = {"step": int(step), "time": time.time(), "kind": kind,
               **{k: _plain(v) for k, v in metrics.items()}}
        try:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
            print(f"warning: {self.path} cannot be written ({self.error}); stopping at the next step", flush=True)

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # the rows that could not be flushed are the ones `error` is about


def _last_byte(path: Path) -> bytes:
    if not path.is_file() or path.stat().st_size == 0:
        return b""
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


class NullLogger:
    """For ranks other than 0, and for callers that do not want metrics."""

    error = None

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: Path, kind: str | None = None) -> list[dict]:
    """All rows of a metrics.jsonl (optionally of one kind); a torn last line (SIGKILL) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if kind is None or row.get("kind") == kind:
            rows.append(row)
    return rows


def read_new_lines(path: Path, offset: int, max_bytes: int = 4 << 20) -> list[tuple[int, bytes]]:
    """The complete lines after byte `offset`, at most ~max_bytes of them, each with the offset just past
    it (where a reader that has handled it continues): how the MLflow shipper and the Prefect progress
    artifact tail the file while the trainer appends to it."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(max_bytes)
    end = data.rfind(b"\n")
    if end < 0:
        if len(data) == max_bytes:
            raise MetricsError(f"{path}: a line longer than {max_bytes} bytes at offset {offset}")
        return []
    out, pos = [], 0
    for line in data[:end + 1].splitlines(keepends=True):
        pos += len(line)
        out.append((offset + pos, line))
    return out
