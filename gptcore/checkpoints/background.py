"""Checkpoints off the critical path: the ranks wait for a copy of the state, not for the disk.

Rank 0 copies the weights and trainer state off the device into CPU buffers that are reused from save to
save (pinned on CUDA, so the copy runs at full bus speed and allocates nothing after the first save), then
a background thread writes them with the one checkpoint writer (gptcore.checkpoints.checkpoint.write_checkpoint:
hashed while written, fsynced, swapped in atomically, pruned). This is torchtitan's async checkpointing
on a thread; torchtitan's process-based variant is not needed at one file pair per run.

At most one write is in flight: the trainer confirms the previous write before the next save. The outcome
(written / skipped: non-finite weights / failed: e.g. a full disk) reaches every rank at the trainer's next
host read, so a failed write stops every rank with the same error, and a step is never reported as
checkpointed before its directory is on disk. A SIGKILL mid-write leaves only a temp directory, which the
next save sweeps; the previous checkpoint is untouched. With `train.async_checkpoint=false` the same
write runs inline, as before.

Under FSDP2 every rank writes its own shard (gptcore/checkpoints/sharded.py): `save_sharded` on every rank
after the ranks started DCP's background save; rank 0's writer waits for it to finish everywhere, then hashes
the shards and swaps the step in with the same writer; the other ranks' writers only wait for their part.
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from gptcore.checkpoints import run_files
from gptcore.checkpoints.checkpoint import portable, write_checkpoint
from gptcore.checkpoints.run_files import CheckpointError, step_dir
from gptcore.files import start_dir, write_json

WRITTEN, SKIPPED, FAILED = "written", "skipped", "failed"
ALIGN = 64  # bytes: every tensor's view into the staging buffer starts at a multiple (any dtype's alignment)


@dataclass
class Outcome:
    """How the write of one checkpoint ended."""
    step: int
    status: str  # WRITTEN, SKIPPED (non-finite weights: nothing written, the run goes on) or FAILED
    text: str  # the checkpoint's directory, or why not
    seconds: float = 0.0  # how long the write took (hashing, fsync, rename), off the critical path


class Checkpointer:
    """Rank 0's checkpoint writer: `save` snapshots and starts the write, `outcome` reports how it ended,
    `attach` adds a file (eval.json) to a checkpoint once it is on disk, `close` waits for the write."""

    def __init__(self, run_dir: Path, keep_last: int, background: bool = True):
        self.run_dir, self.keep_last, self.background = run_dir, keep_last, background
        # the weights and the trainer state each in their own buffer: torch.save writes a view's whole
        # storage, so trainer.pt must not share one with the weights
        self._weights, self._state = Staging(), Staging()
        self._thread: threading.Thread | None = None
        self._outcome: Outcome | None = None
        self._lock = threading.Lock()  # guards _writing and _attachments (the writer thread reads them)
        self._writing: int | None = None  # the step whose directory is not on disk yet
        self._attachments: list[tuple[str, dict]] = []

    def save(self, step: int, weights: dict[str, torch.Tensor], trainer_state: dict, meta: dict) -> None:
        """Copy the state off the device (the only part the ranks wait for), then write it. `weights`: the
        model's portable state dict (checkpoint.weights_of, or a sharded model's gathered one)."""
        self.wait()
        weights, state = self._weights.copy(portable(weights)), self._state.copy(trainer_state)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        with self._lock:
            self._writing = step
        self._start(self._write, step, weights, state, meta)

    def staging_dir(self, step: int) -> Path:
        """Rank 0: the empty temp directory a sharded step's ranks write their shards into (files.start_dir);
        the previous write has ended first."""
        self.wait()
        return start_dir(step_dir(self.run_dir, step))

    def save_sharded(self, step: int, saving: Future | None, staged: Path, trainer_state: dict | None,
                     meta: dict | None, master: bool) -> None:
        """Every rank, once sharded.start_save returned `saving` (None: non-finite weights, nothing written).
        Rank 0 (`master`, with the trainer state and meta) finishes the step once every rank's shard is on
        disk; the others' writers wait for their own part only (a failure anywhere fails rank 0's save too)."""
        self.wait()
        if not master:
            self._start(_settle, saving)
            return
        with self._lock:
            self._writing = step
        state = self._state.copy(trainer_state)
        self._start(self._write, step, None, state, meta, saving, staged)

    def outcome(self, wait: bool) -> Outcome | None:
        """The finished write's outcome, once; None while it is still being written (or after none)."""
        if wait:
            self.wait()
        if self._thread is not None and self._thread.is_alive():
            return None
        out, self._outcome = self._outcome, None
        return out

    def attach(self, step: int, name: str, obj: dict) -> None:
        """Write `obj` as <checkpoint of step>/<name>: now if the checkpoint is on disk, else by the writer
        right after it is swapped in (before retention looks at it). Dropped if it was never written."""
        with self._lock:
            if self._writing == step:
                self._attachments.append((name, obj))
                return
        if step_dir(self.run_dir, step).is_dir():
            _attach_file(step_dir(self.run_dir, step), name, obj)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    close = wait

    # --- inside -------------------------------------------------------------------------------

    def _start(self, target, *args) -> None:
        if self.background:
            self._thread = threading.Thread(target=target, args=args, name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            target(*args)

    def _write(self, step: int, weights: dict | None, state: dict, meta: dict, saving: Future | None = None,
               staged: Path | None = None) -> None:
        t0 = time.monotonic()
        try:
            if staged is not None and saving is None:
                raise CheckpointError(f"refusing to write step {step}: a rank's shard holds non-finite values")
            if saving is not None:
                saving.result()  # every rank's shard and DCP's .metadata are on disk (or the error of one)
            path = write_checkpoint(self.run_dir, step, weights, state, meta, self.keep_last,
                                    before_prune=self._write_attachments, staged=staged)
            out = Outcome(step, WRITTEN, str(path))
        except CheckpointError as e:  # non-finite weights are never written
            out = Outcome(step, SKIPPED, str(e))
        except Exception as e:  # noqa: BLE001 -- e.g. a full disk (torch.save: RuntimeError); must reach the ranks
            out = Outcome(step, FAILED, unwritable(self.run_dir, step, e))
        finally:
            if staged is not None:  # a sharded step not swapped in (skipped, failed): its temp goes
                shutil.rmtree(staged, ignore_errors=True)
            with self._lock:
                self._writing = None
                self._attachments = []
        out.seconds = time.monotonic() - t0
        self._outcome = out

    def _write_attachments(self, path: Path) -> None:
        with self._lock:
            pending, self._attachments, self._writing = self._attachments, [], None
        for name, obj in pending:
            _attach_file(path, name, obj)


class Staging:
    """CPU copies of a snapshot's tensors in one buffer per dtype (pinned when they come from the GPU),
    allocated once at their exact size and reused by every later save of the same layout; other values are
    deep-copied, so training may go on changing the originals. One allocation per dtype, not one per
    tensor: pinned memory is slow to allocate (the first save of a run pays for it, the later ones do not)
    and the caching host allocator rounds each request up to a power of two. Per dtype, because torch.save
    refuses views of one storage as different types. The copies are non-blocking: synchronize first."""

    def __init__(self):
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.views: list[torch.Tensor] = []  # one per tensor, in traversal order
        self.layout: list | None = None  # the shapes and dtypes they were carved for, and pinned or not

    def copy(self, obj):
        tensors: list[torch.Tensor] = []
        walk(obj, tensors.append)
        views = iter(self.views_for(tensors))
        return walk(obj, lambda t: next(views).copy_(t.detach(), non_blocking=t.is_cuda))

    def views_for(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        pinned = any(t.is_cuda for t in tensors)
        layout = [(tuple(t.shape), t.dtype) for t in tensors] + [pinned]
        if layout != self.layout:
            offsets, totals = [], {}
            for t in tensors:
                offsets.append(totals.get(t.dtype, 0))
                step = max(ALIGN // t.element_size(), 1)  # each view starts ALIGN bytes aligned
                totals[t.dtype] = offsets[-1] + -(-t.numel() // step) * step
            self.flats, self.views = {}, []  # the old buffers are freed before the new ones are allocated
            self.flats = {d: torch.empty(n, dtype=d, pin_memory=pinned) for d, n in totals.items()}
            self.views = [self.flats[t.dtype][o:o + t.numel()].view(t.shape)
                          for o, t in zip(offsets, tensors, strict=True)]
            self.layout = layout
        return self.views


def walk(x, on_tensor):
    """`x` rebuilt with on_tensor(t) in place of each tensor (dicts, lists, tuples); other values copied."""
    if isinstance(x, torch.Tensor):
        return on_tensor(x)
    if isinstance(x, dict):
        return {k: walk(v, on_tensor) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(walk(v, on_tensor) for v in x)
    return copy.deepcopy(x)


def _settle(saving: Future | None) -> None:
    """A non-zero rank's part of a sharded save: wait for it. An error is rank 0's to report (DCP's last
    collective gives rank 0 every rank's error), so it is only printed here."""
    try:
        if saving is not None:
            saving.result()
    except Exception as e:  # noqa: BLE001 -- reported by rank 0's writer; this rank trains on meanwhile
        print(f"warning: this rank's part of a sharded checkpoint failed ({type(e).__name__}: {e})", flush=True)


def _attach_file(ckpt: Path, name: str, obj: dict) -> None:
    """An extra file is no part of the checkpoint's integrity: failing to write it is a warning."""
    try:
        write_json(ckpt / name, obj)
    except OSError as e:
        print(f"warning: {ckpt / name} not written ({type(e).__name__}: {e})", flush=True)


def unwritable(run_dir: Path, step: int, e: Exception) -> str:
    """What to say when a checkpoint could not be written (atomic_dir removed the partial one)."""
    last = run_files.newest_healthy(run_files.list_checkpoints(run_dir))
    return (f"checkpoint step {step} could not be written to {run_files.checkpoints_dir(run_dir)} "
            f"({type(e).__name__}: {e}); nothing half-written was kept. Make room on that disk (or lower "
            f"train.keep_last), then run again: it resumes from {last or 'the start'}")
