"""What the ranks of a job compare about each other: their weights (bitwise) and their own compute time.

Under DDP every rank's weights must stay bitwise equal: the ranks start from the same weights and apply
the same all-reduced gradients; under HSDP so must the shards of one index across nodes (the replicas of a
shard; gptcore.training.parallel.replica_groups). A silent data corruption on one GPU (a flipped bit in memory or in an
arithmetic unit) makes that replica drift for good, and checkpoints come from rank 0 only, so nothing else
notices. `weights_checksum` is a sum of every parameter's bits as integers, on the device; the trainer
compares the ranks' sums every guard.consistency_interval steps and `Disagreements` says what a difference
means: a rollback the first time, ReplicasDisagree (exit 4) when the same rank differs again.

A straggler (a throttled GPU, a noisy neighbour) slows every step of every rank, since each waits for it in
the all-reduce; its own compute time is what shows it. `ComputeTimer` measures the part of a rank's step
in which no collective runs (train_step: forwards, and the backwards of the micro-steps before the last):
CUDA events on a GPU (read at the next host sync, so the step path gains none), the host clock on CPU.
`Stragglers` names a rank that stays slow over several log steps.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch

INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}  # element size -> integer view


class ReplicasDisagree(RuntimeError):
    """A rank's weights differed from the others' a second time: its host corrupts data (exit 4)."""


@torch.no_grad()
def weights_checksum(model: torch.nn.Module) -> torch.Tensor:
    """The sum of every parameter's elements read as integers of their own width (int64 accumulation), a
    device scalar. Any single flipped bit changes it; it costs one read of the weights."""
    total = None
    for p in model.parameters():
        p = p.detach()
        p = p.to_local() if hasattr(p, "to_local") else p  # FSDP2's DTensor: this rank's shard
        s = p.view(INT_VIEW[p.element_size()]).sum(dtype=torch.int64)
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


class Disagreements:
    """The consistency checks each rank failed. `hosts[r]` names rank r's host; `event(step, text, **values)`
    reports (the trainer's EventLog)."""

    def __init__(self, hosts: list[str], event: Callable[..., None]):
        self.hosts, self.event = hosts, event
        self.count = [0] * len(hosts)

    def check(self, step: int, sums: list[int], groups: list[list[int]] | None = None) -> bool:
        """Every rank's weights checksum at `step`, compared within each group of ranks that hold the same
        tensors (default: all; HSDP: the ranks of one shard, parallel.replica_groups). Equal: False. A rank
        that differs for the first time: an event, and True: the caller rolls every rank back to the newest
        good checkpoint (a one-off flip is gone then). A rank that differs again: ReplicasDisagree, naming
        its host (it corrupts data)."""
        groups = groups if groups is not None else [list(range(len(sums)))]
        odd, no_majority = [], False
        for g in groups:
            values = [sums[r] for r in g]
            if len(set(values)) > 1:
                found = odd_ranks(values)
                odd += [g[i] for i in found]
                no_majority |= len(found) == len(g)
        if not odd:
            return False
        odd.sort()
        names = ", ".join(f"rank {r} on host {self.hosts[r]}" for r in odd)
        for r in odd:
            self.count[r] += 1
        again = [r for r in odd if self.count[r] > 1]
        if again:
            hosts = sorted({self.hosts[r] for r in again})
            raise ReplicasDisagree(
                f"the replicas' weights differ again at step {step} ({names}); weights of one replica change "
                f"on their own, a silent data corruption: drain host(s) {', '.join(hosts)} (GPU memory or compute "
                "errors: nvidia-smi -q -d ECC,ROW_REMAPPER; dcgmi diag), then run the same command without them "
                "to continue from the newest checkpoint")
        self.event(step, f"replicas disagree at step {step}: the weights of {names} differ from "
                   f"{'each other' if no_majority else 'the majority'} (checksums {sums}); rolling back",
                   **{"guard/replica_mismatch": len(odd)})
        return True


class Stragglers:
    """A rank over `ratio` x the median compute time at `logs` log steps in a row is named in an event, once
    per streak (one slow step is noise; a streak is a throttled GPU or a noisy neighbour). `hosts[r]` names
    rank r's host; `event(step, text, **values)` reports (the trainer's EventLog)."""

    def __init__(self, ratio: float, logs: int, hosts: list[str], event: Callable[..., None]):
        self.ratio, self.logs, self.hosts, self.event = ratio, logs, hosts, event
        self.streak = [0] * len(hosts)  # log steps in a row each rank was a straggler

    def observe(self, step: int, times: list[float]) -> dict[str, float]:
        """Every rank's own compute time per step at log step `step`; returns the slowest rank's, for the
        metrics row (nothing for a single process: there is no other rank to compare with)."""
        if len(times) < 2:
            return {}
        slowest, median = max(range(len(times)), key=times.__getitem__), statistics.median(times)
        slow = set(stragglers(times, self.ratio))
        for r in range(len(times)):
            self.streak[r] = self.streak[r] + 1 if r in slow else 0
            if self.streak[r] == self.logs:
                self.event(step, f"straggler: rank {r} on host {self.hosts[r]} computed {times[r] * 1000:.1f} ms "
                           f"per step, {times[r] / median:.2f}x the median {median * 1000:.1f} ms, at "
                           f"{self.logs} log steps in a row; every rank waits for it in each all-reduce "
                           "(check that host's GPU clocks, temperature and neighbours)",
                           **{"straggler/rank": r, "straggler/ratio": times[r] / median})
        return {"straggler/slowest_s": times[slowest], "straggler/slowest_rank": slowest,
                "straggler/median_s": median}


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
