"""What the ranks of a DDP job compare about each other: their weights (bitwise) and their own compute time.

Under DDP every rank's weights must stay bitwise equal: the ranks start from the same weights and apply
the same all-reduced gradients. A silent data corruption on one GPU (a flipped bit in memory or in an
arithmetic unit) makes that replica drift for good, and checkpoints come from rank 0 only, so nothing else
notices. `weights_checksum` is a sum of every parameter's bits as integers, on the device; the trainer
compares the ranks' sums every guard.consistency_interval steps (gptcore/training/trainer.py).

A straggler (a throttled GPU, a noisy neighbour) slows every step of every rank, since each waits for it in
the all-reduce; its own compute time is what shows it. `ComputeTimer` measures the part of a rank's step
in which no collective runs (train_step: forwards, and the backwards of the micro-steps before the last):
CUDA events on a GPU (read at the next host sync, so the step path gains none), the host clock on CPU.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}  # element size -> integer view


@torch.no_grad()
def weights_checksum(model: torch.nn.Module) -> torch.Tensor:
    """The sum of every parameter's elements read as integers of their own width (int64 accumulation), a
    device scalar. Any single flipped bit changes it; it costs one read of the weights."""
    total = None
    for p in model.parameters():
        s = p.detach().view(INT_VIEW[p.element_size()]).sum(dtype=torch.int64)
        total = s if total is None else total + s
    return total


def odd_ranks(sums: list[int]) -> list[int]:
    """The ranks whose checksum differs from the majority's; every rank when no value holds a majority
    (two ranks that disagree: there is no telling which one drifted)."""
    value, count = Counter(sums).most_common(1)[0]
    if count * 2 <= len(sums):
        return list(range(len(sums)))
    return [r for r, s in enumerate(sums) if s != value]


def stragglers(times: list[float], ratio: float) -> list[int]:
    """Ranks slower than `ratio` x the median of all ranks' times."""
    median = statistics.median(times)
    return [r for r, t in enumerate(times) if median > 0 and t > ratio * median]


class ComputeTimer:
    """This rank's own compute time: `with timer:` around work no other rank takes part in; `take()` returns the seconds
    since the previous take (call it after a host sync: on a GPU the events must have completed)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds = 0.0

    def __enter__(self):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, torch.cuda.Event(enable_timing=True)))
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self.t0

    def take(self) -> float:
        seconds = self.seconds + sum(a.elapsed_time(b) for a, b in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return seconds
