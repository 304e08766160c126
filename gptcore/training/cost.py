"""When will the run finish and what has it cost: the ETA from the measured step time, and the GPU-hours the
run has held, carried from checkpoint to checkpoint so that a nightly run's total spans its invocations.

Each read of the step stats adds to the metrics row (and so to MLflow, and the Prefect progress artifact):
  train/eta_s       seconds to train.max_steps at the smoothed time per step (evaluations, checkpoints
                    and samples between reads included: what the steps really take on this machine)
  train/gpu_hours   devices x wall hours: this invocation's since its start, plus what the checkpoint it
                    resumed from had recorded (the hours of steps a crash lost since then are not counted);
                    on a CPU these are training processes' hours, and `hours_text` names them so
  train/cost_usd, train/cost_projected_usd   with train.price_per_gpu_hour > 0 (off by default: there is
                    no default price): the GPU-hours so far, and so far plus the ETA's, times the price
"""

from __future__ import annotations

import time
from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest step time in the running estimate


@dataclass
class RunClock:
    world: int  # devices billed
    price: float  # $ per GPU-hour; 0 = no cost
    t_start: float  # when this invocation started (time.time())
    hours_before: float = 0.0  # GPU-hours recorded in the checkpoint this invocation resumed from
    step_s: float | None = None  # smoothed seconds per step

    def gpu_hours(self, now: float | None = None) -> float:
        return self.hours_before + self.world * ((now or time.time()) - self.t_start) / 3600

    def row(self, step: int, max_steps: int, step_s: float, now: float | None = None) -> dict:
        """The metrics of a read at `step`, after steps that took `step_s` seconds each."""
        self.step_s = step_s if self.step_s is None else SMOOTHING * step_s + (1 - SMOOTHING) * self.step_s
        eta = max(0, max_steps - step) * self.step_s
        hours = self.gpu_hours(now)
        out = {"train/eta_s": eta, "train/gpu_hours": hours}
        if self.price > 0:
            out["train/cost_usd"] = hours * self.price
            out["train/cost_projected_usd"] = (hours + self.world * eta / 3600) * self.price
        return out


def checkpoint_cost(hours: float, price: float) -> dict:
    """What a checkpoint's meta.json records of the run's cost at its step (the registry's and the flow's
    summary read it): the GPU-hours, and their cost when a price is set."""
    return {"gpu_hours": round(hours, 6), **({"cost_usd": round(hours * price, 4)} if price > 0 else {})}


def hours_text(hours: float, world: int, cuda: bool) -> str:
    """train/gpu_hours named for what it counts, `world` devices x wall hours: GPU-hours on CUDA; on a CPU
    the training processes' hours (each process uses several cores: neither GPU- nor core-hours)."""
    number = f"{hours:,.2f}" if hours >= 1 else f"{hours:.4f}"  # a tiny CPU run holds hundredths of an hour
    held = f"{world} GPU{'s' * (world != 1)}" if cuda else f"{world} process{'es' * (world != 1)}"
    return f"{number} {'GPU-hours' if cuda else 'CPU-process-hours'} so far ({held})"


def duration(seconds: float) -> str:
    """12 s, 4 min 10 s, 3 h 5 min."""
    seconds = max(0, int(seconds))
    h, m = divmod(seconds // 60, 60)
    return f"{h} h {m} min" if h else f"{m} min {seconds % 60} s" if m else f"{seconds} s"
