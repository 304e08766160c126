"""Memory when it runs out: what a user needs to see why a step did not fit, kept before the smaller retry.

On CUDA the allocator records its history (every allocation with its Python stack) from before the
micro-batch probe through the first HISTORY_STEPS steps (the compile, the first allocations of every
buffer: where a run that does not fit fails); then it stops, since recording costs a little per
allocation and the speed measured after the warm-up steps (benchmarks/gpu_check.py) must not pay it.
An out-of-memory step (or a probe where nothing fits) writes `<run_dir>/memory/oom-step<N>-rank<R>/`:

    record.json       the error, the micro-batch and the size it retries at, the probe's table of tried
                      sizes, the process's resident memory, and on CUDA the allocator's counters
    snapshot.pickle   (CUDA, while recording) the allocator's snapshot: drag it onto
                      https://pytorch.org/memory_viz to see every live block and the stack that made it

On CPU the same path writes record.json (resident memory and the probe's table).
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import torch

from gptcore.files import write_json

MEMORY_DIR = "memory"
HISTORY_STEPS = 3  # steps after the probe that the CUDA allocator's history still covers
HISTORY_ENTRIES = 100_000  # allocations kept (a ring): enough for a few steps of a GPT-2 size


class MemoryRecorder:
    def __init__(self, run_dir: Path, rank: int, device: torch.device):
        self.run_dir, self.rank, self.device = run_dir, rank, device
        self.recording = device.type == "cuda"
        self.probe_table: list[dict] = []  # [{"micro_batch": 8, "fits": False}, ...] in the order tried
        if self.recording:
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=HISTORY_ENTRIES)

    def probed(self, chosen: int | None, failed: list[int], how: str) -> None:
        """The probe's answer: the sizes that ran out of memory, then the one that fit (none kept: reused)."""
        self.probe_table = [{"micro_batch": m, "fits": False} for m in failed]
        if chosen is not None and "kept" not in how:
            self.probe_table.append({"micro_batch": chosen, "fits": True})

    def after_step(self, step: int) -> None:
        if self.recording and step >= HISTORY_STEPS:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def out_of_memory(self, step: int, error: BaseException, micro_batch, retry_at: int | None = None) -> Path:
        """Write this rank's record (and on CUDA the snapshot) of an out-of-memory error; returns its folder."""
        folder = self.run_dir / MEMORY_DIR / f"oom-step{step}-rank{self.rank}"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"time": time.time(), "step": step, "rank": self.rank, "error": f"{type(error).__name__}: {error}",
                  "micro_batch": micro_batch, "retry_at": retry_at, "probe": self.probe_table,
                  "rss_bytes": psutil.Process().memory_info().rss}
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            record["cuda"] = {k: stats.get(k) for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                                                        "reserved_bytes.all.current", "num_ooms")}
            record["cuda"]["total_bytes"] = torch.cuda.get_device_properties(self.device).total_memory
            if self.recording:
                torch.cuda.memory._dump_snapshot(str(folder / "snapshot.pickle"))
                record["snapshot"] = "snapshot.pickle (https://pytorch.org/memory_viz)"
        write_json(folder / "record.json", record)
        return folder
