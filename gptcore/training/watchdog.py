"""The hang watchdog: each rank watches its own progress and ends itself when it stops.

A rank that stops making progress (a collective whose peer died or was stopped, a GPU that no longer
answers) would otherwise wait out the process group's timeout, and the night with it. Here every step,
evaluation batch and checkpoint counts as progress (`beat`); with none for the limit, a thread writes every
thread's Python stack to <run_dir>/hangs/<time>/rank<r>.txt, logs an event, and the process exits with
HANG_EXIT. torchrun (`--max-restarts`, train.max_restarts) then restarts every rank, and the run continues
from its newest checkpoint.

The limit: train.hang_timeout_s when set; else HANG_FACTOR x the run's median step time, within
[FLOOR_S, CEILING_S], and CEILING_S until there are step times (the first steps compile) and while an
evaluation runs (`patience`: rank 0 may score harness tasks alone while the others wait). The process
group's timeout is set above the largest limit (gptcore/distributed.py), so the watchdog speaks first.

When Python itself cannot run. The watchdog is a Python thread: a rank whose main thread holds the GIL
(a page fault in a memory-mapped shard on a hung network filesystem, a C call that never returns) would
never let it run. A backstop in C, faulthandler.dump_traceback_later(exit=True), is re-armed as progress is
made (at most every quarter of the limit) to fire BACKSTOP_S after the Python watchdog would have: it
prints every thread's stack to stderr and exits with status 1, GIL or not. And when the file system is
what hung: the Python path prints the stacks to stderr first, then writes the hang file and the event
from a helper thread it waits WRITE_TIMEOUT_S for, then exits whatever the writes do (a write blocked in
the kernel cannot hold the process).

The hang folder is named by the step and the launch's attempt (gptcore/training/verdict.py: agreed by every
rank, on every host), hangs/step<N>-attempt<k>/, the same on every rank, so one hang is one folder.

The watchdog starts before the process group (gptcore/training/train.py): a rank that never arrives, or a
link that goes down while the ranks meet, is a hang of start-up with the same limit, stacks and exit.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from gptcore.training import verdict

HANG_EXIT = 5  # distinct from 2 (bad input), 3 (diverged), 4 (replicas disagree)
HANG_FACTOR = 50.0  # x the median step time: an evaluation or a checkpoint beats well within that
FLOOR_S = 300.0
CEILING_S = 1200.0  # 20 min, under the 30-min process group timeout
WRITE_TIMEOUT_S = 10.0  # the hang path's file writes (hang file, event): a hung file system must not hold the exit
BACKSTOP_S = WRITE_TIMEOUT_S + 5.0  # the C backstop fires this long after the Python watchdog would (+ a poll)


def real_stderr():
    """The process's own stderr (file descriptor 2): faulthandler writes to a descriptor, and sys.stderr may be
    a stand-in without one (pytest's capture when the trainer runs in-process)."""
    return sys.__stderr__ if sys.__stderr__ is not None else sys.stderr


def limit_for(timeout_s: float, step_times: list[float], floor_s: float = FLOOR_S) -> float:
    """Seconds without progress that count as a hang."""
    if timeout_s > 0:
        return timeout_s
    if not step_times:
        return CEILING_S
    return min(max(HANG_FACTOR * statistics.median(step_times), floor_s), CEILING_S)


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float = 0.0, poll_s: float | None = None):
        self.run_dir, self.rank, self.timeout_s = Path(run_dir), rank, timeout_s
        # the trainer's EventLog, once it has one: (step, text, who=...). Never a bound method of the
        # trainer: that cycle would keep the DDP module alive past the process group's teardown
        self.on_hang: Callable[..., None] | None = None
        self.step = 0  # the newest step, for the event
        self.step_times: deque[float] = deque(maxlen=100)
        self.last = time.monotonic()
        self.doing = "starting"
        self.patience = 0.0  # the smallest limit until the next beat (an evaluation is not paced by steps)
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(timeout_s / 10, 0.1) if timeout_s else 5.0)
        # tests make the derived limit's floor small to reach a derived limit in seconds, not minutes
        self.floor_s = float(os.environ.get("GPTPIPE_TEST_HANG_FLOOR_S") or FLOOR_S)
        self.armed_at, self.armed_limit = -float("inf"), 0.0  # the C backstop's last arming
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        self._arm(time.monotonic())
        return self

    def beat(self, doing: str = "training", step_time: float | None = None, step: int | None = None,
             patience: float = 0.0) -> None:
        """Progress: called from the training loop (cheap: no lock, no device work). `patience`: allow at
        least this long until the next beat (an evaluation that runs on rank 0 alone, e.g. harness tasks,
        leaves the other ranks waiting in a collective without progress of their own)."""
        self.last, self.doing, self.patience = time.monotonic(), doing, patience
        if step is not None:
            self.step = step
        if step_time is not None:
            self.step_times.append(step_time)
        limit = self.limit()
        # re-arming starts a C thread: only when a longer wait is allowed now, or a quarter limit went by
        if limit > self.armed_limit or self.last - self.armed_at > self.armed_limit / 4:
            self._arm(self.last, limit)

    def _arm(self, now: float, limit: float | None = None) -> None:
        """The backstop fires if no beat re-arms it within limit + a quarter + BACKSTOP_S (the re-arming's
        slack and the Python path's turn): stacks to stderr, exit status 1."""
        if self._stop.is_set():
            return
        self.armed_at, self.armed_limit = now, limit if limit is not None else self.limit()
        try:
            faulthandler.dump_traceback_later(self.armed_limit * 1.25 + self.poll_s + BACKSTOP_S, exit=True,
                                              file=real_stderr())
        except (OSError, ValueError, AttributeError) as e:  # no file descriptor to write to: no backstop
            print(f"warning: the hang watchdog's backstop is off ({type(e).__name__}: {e})", file=sys.stderr)
            self.armed_limit = float("inf")  # not tried again on every beat

    def limit(self) -> float:
        """The user's own limit (train.hang_timeout_s) or the derived one, but never less than the current
        wait's patience: a wait known to be long (a probe's compile, a checkpoint write, an evaluation) is
        paced by its own work, not by the steps either limit is made for."""
        base = self.timeout_s if self.timeout_s > 0 else limit_for(0.0, list(self.step_times), self.floor_s)
        return max(base, self.patience)

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()

    def hang_folder(self) -> Path:
        """One folder per hang, the same on every rank: the newest step and the launch's attempt (read when the
        hang happens: the ranks agree on it after the watchdog started)."""
        return self.run_dir / "hangs" / f"step{self.step:08d}-attempt{verdict.this_launch()[1]}"

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle, limit = time.monotonic() - self.last, self.limit()
            if idle > limit:
                self._hang(idle, limit)

    def _hang(self, idle: float, limit: float) -> None:
        path = self.hang_folder() / f"rank{self.rank}.txt"
        text = (f"rank {self.rank} (pid {os.getpid()}, host {os.uname().nodename}) made no progress for "
                f"{idle:.0f}s (limit {limit:.0f}s) while {self.doing}; exiting with {HANG_EXIT} so that the job is "
                f"restarted from its newest checkpoint (train.max_restarts: torchrun's or the train task's)")
        # stderr first: it needs no file system, which may be what hung
        print(f"error: {text}; stacks follow and in {path}", file=sys.stderr, flush=True)
        try:
            faulthandler.dump_traceback(real_stderr(), all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass  # no file descriptor for stderr: the hang file below still gets them
        writer = threading.Thread(target=self._record, args=(path, text), name="hang-record", daemon=True)
        writer.start()
        writer.join(WRITE_TIMEOUT_S)
        if writer.is_alive():
            print(f"hang watchdog: writing {path} did not finish in {WRITE_TIMEOUT_S:.0f}s (is that file system "
                  "hung?); exiting without it", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)  # the main thread is stuck: no clean shutdown is possible

    def _record(self, path: Path, text: str) -> None:
        """The hang file with every thread's stack, then the event (metrics.jsonl); either may block."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:  # a full or gone disk: the stacks are on stderr already
            print(f"hang watchdog: cannot write {path}: {e}", file=sys.stderr, flush=True)
        if self.on_hang is not None:
            try:
                self.on_hang(self.step, f"{text}; stacks in {path}", who="watchdog")
            except Exception:  # noqa: BLE001 - the exit must happen whatever the event log does
                pass
