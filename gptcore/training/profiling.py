"""A profile on demand: `touch <run_dir>/PROFILE` while a run trains, and every rank records its next few
steps with torch.profiler; or `train.profile_steps=N` to record N steps after the first of every launch.

    touch var/runs/gpt2-124m/PROFILE        # 3 steps (or `echo 5 > .../PROFILE` for 5)
    ls var/runs/gpt2-124m/profiles/step_00001201-00001203/
        rank0.trace.json   # Chrome trace: chrome://tracing or https://ui.perfetto.dev
        rank0.top.txt      # the top operators by self time (device time on CUDA)

The ranks look for the file every POLL_STEPS steps (a stat per rank, nothing else while no profile is asked
for: the run does not slow down), start at the next step, and stop after the last recorded step with the
device synchronised, so the trace holds the steps' kernels. A request is the file's modification time:
each rank records it once; rank 0 removes the file when its recording ends. Rank 0 logs a `profile` row
(metrics.jsonl), which the MLflow shipper attaches to the run (integrations/tracking.py). Written whole or
not at all (temporary names, then renames). No collective runs here, so a rank that cannot profile (a
profiler error) only loses its own trace: an event, and training goes on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from gptcore.files import atomic_write_bytes, temp_name

PROFILE_FILE = "PROFILE"
PROFILES_DIR = "profiles"
POLL_STEPS = 5
DEFAULT_STEPS = 3
TOP_ROWS = 25


def requested_steps(text: str) -> int:
    """How many steps the PROFILE file asks for: a positive number in it, else DEFAULT_STEPS."""
    try:
        n = int(text.strip() or DEFAULT_STEPS)
    except ValueError:
        return DEFAULT_STEPS
    return n if n > 0 else DEFAULT_STEPS


class StepProfiler:
    """Called once before and once after every training step (`before(step)`, `after(step)`); `step` is the
    number of the step about to run / just run (1-based, as metrics.jsonl counts)."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device, first_steps: int, start_step: int,
                 log, event):
        self.run_dir, self.rank, self.device, self.log, self.event = Path(run_dir), rank, device, log, event
        # train.profile_steps: the steps after this launch's first (the first compiles)
        self.window = (start_step + 2, start_step + 1 + first_steps) if first_steps > 0 else None
        self.handled: float | None = None  # the PROFILE file's mtime this rank has recorded
        self.prof = None
        self.last = 0  # the last step of the recording in progress
        self.first = 0
        self.from_file = False  # the recording in progress answers a PROFILE file (rank 0 removes it after)

    def before(self, step: int) -> None:
        if self.prof is not None:
            return
        steps, self.from_file = self._asked(step)
        if steps:
            self.first, self.last = step, step + steps - 1
            try:
                self.prof = torch.profiler.profile(activities=self._activities())
                self.prof.start()
            except Exception as e:  # noqa: BLE001 - a profiler that cannot start costs the profile, not the run
                self.prof = None
                self.event(step, f"profile not recorded on rank {self.rank} ({type(e).__name__}: {e})", who="profile")

    def after(self, step: int) -> None:
        if self.prof is None or step < self.last:
            return
        prof, self.prof = self.prof, None
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the steps' kernels have run: the trace holds them
            prof.stop()
            folder = self.save(prof)
        except Exception as e:  # noqa: BLE001
            self.event(step, f"profile not written on rank {self.rank} ({type(e).__name__}: {e})", who="profile")
            return
        if self.rank == 0:
            if self.from_file:
                self._remove_request()
            rel = str(folder.relative_to(self.run_dir))
            self.log(step, {"dir": rel, "first_step": self.first, "last_step": self.last}, kind="profile")
            self.event(step, f"profiled steps {self.first}-{self.last}: {rel}/", who="profile")

    def _asked(self, step: int) -> tuple[int, bool]:
        """(steps to record from `step` on, whether a PROFILE file asked): the launch's window, or a new
        PROFILE request (looked for every POLL_STEPS steps), else (0, False)."""
        if self.window and step == self.window[0]:
            return self.window[1] - self.window[0] + 1, False
        if step % POLL_STEPS:
            return 0, False
        path = self.run_dir / PROFILE_FILE
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return 0, False
        if mtime == self.handled:
            return 0, False
        self.handled = mtime
        try:
            return requested_steps(path.read_text()), True
        except OSError:  # removed between the stat and the read (rank 0 finished first): the default
            return DEFAULT_STEPS, True

    def _remove_request(self) -> None:
        """Remove the PROFILE file this recording answered; one touched again since is a new request: kept."""
        path = self.run_dir / PROFILE_FILE
        try:
            if path.stat().st_mtime == self.handled:
                path.unlink()
        except FileNotFoundError:
            pass

    def _activities(self) -> list:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return acts

    def save(self, prof) -> Path:
        """rankN.trace.json and rankN.top.txt in profiles/step_FIRST-LAST/, each written to a temporary name
        and renamed."""
        folder = self.run_dir / PROFILES_DIR / f"step_{self.first:08d}-{self.last:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        trace, top = folder / f"rank{self.rank}.trace.json", folder / f"rank{self.rank}.top.txt"
        tmp = temp_name(trace)  # the profiler writes the file itself: to the project's temp name, then renamed
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=TOP_ROWS)
        text = f"steps {self.first}-{self.last}, rank {self.rank}, recorded {time.ctime()}\n{table}\n"
        atomic_write_bytes(top, [text.encode()], durable=False)
        return folder
