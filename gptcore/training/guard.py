"""The divergence guard: decides, from each step's all-reduced loss and gradient norm, whether the step
was healthy, must be skipped (non-finite: no update was applied), or calls for a rollback.

A rollback (done by the trainer) reloads the newest good checkpoint and keeps the data position where it
is, so the batches that led into the trouble are skipped (PaLM, section 5.1: restart ~100 steps before the
spike and skip 200-500 batches). Every decision is a pure function of values all ranks share, so every
rank takes the same branch without talking. Nothing here touches a healthy step: with no trouble, the run
is bit-identical to one without the guard.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections import deque

import torch

from gptcore.config import GuardConfig

OK, SKIP, ROLLBACK = "ok", "skip", "rollback"


class Guard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=max(cfg.spike_window, 1))
        self.nonfinite = 0  # consecutive non-finite steps
        self.spiking = 0  # consecutive steps above the spike threshold
        self.rollbacks = 0  # rollbacks since the last checkpoint was written

    def threshold(self) -> float | None:
        """The loss above which a step spikes; None until the window is full (or the rule is off)."""
        n = self.cfg.spike_window
        if n == 0 or len(self.history) < n:
            return None
        mean = sum(self.history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / n)
        return mean + max(self.cfg.spike_sigmas * std, self.cfg.spike_min_delta)

    def observe(self, loss: float, finite: bool) -> str:
        """OK, SKIP (non-finite, no update applied) or ROLLBACK, for the step just taken."""
        if not finite:
            self.nonfinite += 1
            return ROLLBACK if self.nonfinite >= self.cfg.max_nonfinite else SKIP
        self.nonfinite = 0
        limit = self.threshold()
        if limit is not None and loss > limit:
            self.spiking += 1  # spiking losses stay out of the history they are judged against
            return ROLLBACK if self.spiking >= self.cfg.spike_steps else OK
        self.spiking = 0
        self.history.append(loss)
        return OK

    def rolled_back(self) -> bool:
        """Count a rollback; False when there were too many in a row (the run should stop)."""
        self.nonfinite = self.spiking = 0
        self.rollbacks += 1
        return self.rollbacks <= self.cfg.max_rollbacks

    def checkpointed(self) -> None:
        self.rollbacks = 0


SLOW_SECONDS = 0.05  # the injected straggler's extra time per forward pass
STALL_SECONDS = 3600  # the injected hangs: longer than any test waits


def stall_before_process_group(rank: int) -> None:
    """Test-only: GPTPIPE_TEST_FAULT=latejoin@R: rank R stalls before it joins the process group (a host that
    never arrives after the rendezvous); the others wait for it there."""
    spec = os.environ.get("GPTPIPE_TEST_FAULT", "")
    if f"latejoin@{rank}" in spec.split(","):
        time.sleep(STALL_SECONDS)


class FaultInjector:
    """Test-only trouble, from GPTPIPE_TEST_FAULT="nan@5,spike@9,flip@4,slow@1,evalfail@1,evaloom@2":
    before the 5th train_step call of this process, the final LayerNorm's weight becomes NaN (every later
    loss is NaN until a rollback); before the 9th it is multiplied by -30 (the model now favours what it had
    ruled out: a loss spike that lasts); before the 4th, one bit of that weight flips on the last rank only
    (a silent corruption of one replica). Counting calls, not steps, means a rollback does not replay the
    fault. flip0@4: the same bit flip on rank 0, the rank that writes checkpoints. stall@3: rank 0 sleeps
    an hour before its 3rd step (a hang the watchdog thread can see); gil@3: the same inside a C call that
    holds the GIL (no Python thread runs: only the C backstop can act). slow@1: rank 1 sleeps SLOW_SECONDS
    in every forward pass (a straggler). oomabove@4: a forward pass
    of more than 4 sequences runs out of memory (a smaller card); oom@6: the 6th call's second forward pass
    runs out of memory once (after a micro-step's gradients exist). The 1st evaluation raises
    a RuntimeError and the 2nd an out-of-memory error, on rank 0 only (the other ranks finish their share:
    the failure must still be agreed on). Unset: nothing."""

    def __init__(self, rank: int = 0, world: int = 1):
        spec = os.environ.get("GPTPIPE_TEST_FAULT", "")
        faults = [(kind, int(at)) for kind, _, at in (f.partition("@") for f in spec.split(",") if f)]
        self.faults = {at: kind for kind, at in faults if kind in ("nan", "spike", "flip", "flip0", "oom", "stall",
                                                                   "gil")}
        self.oom_above = min((at for kind, at in faults if kind == "oomabove"), default=None)
        self.oom_in = 0  # forward passes until the injected out-of-memory error (0: none pending)
        self.eval_faults = {at: kind for kind, at in faults if kind.startswith("eval")}
        self.slow = rank in {at for kind, at in faults if kind == "slow"}
        self.rank, self.world = rank, world
        self.calls = self.eval_calls = 0

    def install(self, model: torch.nn.Module) -> None:
        """Hooks on the plain model's forward pass: the straggler's sleep, the out-of-memory errors."""
        if self.slow:
            model.register_forward_pre_hook(lambda module, args: time.sleep(SLOW_SECONDS))
        if self.oom_above is not None or any(k == "oom" for k in self.faults.values()):
            model.register_forward_pre_hook(self._out_of_memory)

    def _out_of_memory(self, module, args) -> None:
        if self.oom_above is not None and args[0].shape[0] > self.oom_above:
            raise torch.OutOfMemoryError(f"injected out of memory: {args[0].shape[0]} sequences > "
                                         f"{self.oom_above} (GPTPIPE_TEST_FAULT)")
        if self.oom_in:
            self.oom_in -= 1
            if not self.oom_in:
                raise torch.OutOfMemoryError(f"injected out of memory (GPTPIPE_TEST_FAULT, call {self.calls})")

    @torch.no_grad()
    def before_step(self, model: torch.nn.Module) -> None:
        if not self.faults:
            return
        self.calls += 1
        kind = self.faults.get(self.calls)
        w = model.transformer.ln_f.weight
        if kind == "nan":
            w.fill_(float("nan"))
        elif kind == "spike":
            w.mul_(-30.0)
        elif kind == "oom":
            self.oom_in = 2
        elif kind == "stall" and self.rank == 0:
            time.sleep(STALL_SECONDS)  # a wait Python can watch (the GIL is free)
        elif kind == "gil" and self.rank == 0:
            # a C call that never returns and holds the GIL (as a page fault on a hung file system does):
            # ctypes.PyDLL calls without releasing it, so no Python thread runs until it returns
            ctypes.PyDLL(None).sleep(int(STALL_SECONDS))
        elif (kind == "flip" and self.rank == self.world - 1) or (kind == "flip0" and self.rank == 0):
            local = w.to_local() if hasattr(w, "to_local") else w  # FSDP2: this rank's shard of it
            local.view(torch.int32)[0] ^= 1 << 12  # a low mantissa bit: the loss barely moves, the bits do

    def before_eval(self, rank: int) -> None:
        self.eval_calls += 1
        kind = self.eval_faults.get(self.eval_calls) if rank == 0 else None
        if kind == "evalfail":
            raise RuntimeError(f"injected evaluation failure (GPTPIPE_TEST_FAULT, evaluation {self.eval_calls})")
        if kind == "evaloom":
            raise torch.OutOfMemoryError(f"injected out of memory (GPTPIPE_TEST_FAULT, evaluation {self.eval_calls})")
