"""What an on-call engineer sees in the Prefect UI while the pipeline works.

Training: one progress artifact per train task,
updated in place from <run_dir>/metrics.jsonl (at most every few seconds, from the task's thread: the
trainer never waits on it), whose description reads

    step 4,210 / 19,073 · loss 3.41 · val 3.52 · 3.6M tok/s · MFU 41% · this run: ETA 1 h 10 min ·
    whole run: ETA 5 h 10 min · 24.48 GPU-hours so far (8 GPUs) · cost $61.20 so far, $277.40 projected ·
    MLflow run <link>

(MFU where the device's peak is known; on a CPU the hours are CPU-process-hours; the cost where
train.price_per_gpu_hour is set: gptcore/training/cost.py)

plus warnings in the flow run's log when metrics shipping to MLflow stalls, and an info line once it
has caught up. Tokenizing: a progress artifact `<dataset>-tokenize` for the pieces done (PieceProgress).
"""

from __future__ import annotations

# lazy imports: prefect only when an artifact is written (the trainer's tracking runs without Prefect)
import json
import re
import time
from pathlib import Path

from gptcore.metrics import METRICS_FILE, read_new_lines
from gptcore.training.cost import duration, hours_text

HEALTH_WARN_SECONDS = 30.0  # tracking unreachable this long: say so in the flow run's log


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes: ("tiny-cpu", "training") ->
    "tiny-cpu-training"."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


class ProgressArtifact:
    """One Prefect progress artifact: created by the first `set`, updated in place after. Progress is a
    convenience, so a failing Prefect API call is logged at debug level and never raised."""

    def __init__(self, key: str, log):
        self.key, self.log, self.id = key, log, None

    def set(self, percent: float, description: str) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        try:
            if self.id is None:
                self.id = create_progress_artifact(percent, key=self.key, description=description)
            else:
                update_progress_artifact(self.id, percent, description=description)
        except Exception as e:  # noqa: BLE001
            self.log.debug("progress artifact %s not updated: %s", self.key, e)


class TrainProgress:
    """Tails metrics.jsonl from where it was when the train task started and publishes progress."""

    def __init__(self, run_dir: Path, run_name: str, max_steps: int, budget_s: float, shipper, log,
                 every: float = 5.0, world: int = 1, cuda: bool = False):
        self.path = Path(run_dir) / METRICS_FILE
        self.max_steps, self.budget_s = max_steps, budget_s
        self.world, self.cuda = world, cuda  # the training processes, and whether each holds a GPU
        self.shipper, self.log, self.every = shipper, log, every
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.t0, self.last_publish = time.time(), 0.0
        self.first: tuple[float, int] | None = None  # (time, step) of the first step of this invocation
        self.step, self.loss, self.val, self.tok_s, self.mfu = 0, None, None, None, None
        self.hours: float | None = None  # devices x wall hours of training so far (train/gpu_hours)
        self.cost: tuple[float, float] | None = None  # $ so far, $ projected (train.price_per_gpu_hour)
        self.artifact = ProgressArtifact(artifact_key(run_name, "training"), log)
        self.down_since: float | None = None  # tracking unreachable since
        self.shipped_then = 0  # rows the shipper had sent when the outage began
        self.warned = False

    def _read(self) -> None:
        while lines := read_new_lines(self.path, self.offset):
            self.offset = lines[-1][0]
            for _, line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if row.get("kind", "train") == "train":
                    self.step, self.loss = row["step"], row.get("train/loss")
                    self.tok_s, self.mfu = row.get("train/tokens_per_s"), row.get("train/mfu")
                    self.hours = row.get("train/gpu_hours", self.hours)
                    if "train/cost_usd" in row:
                        self.cost = (row["train/cost_usd"], row["train/cost_projected_usd"])
                    if self.first is None:
                        self.first = (time.time(), self.step - 1)
                elif "val/loss" in row:
                    self.val = row["val/loss"]

    def describe(self) -> str:
        parts = [f"step {self.step:,} / {self.max_steps:,}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.val is not None:
            parts.append(f"val {self.val:.3f}")
        if self.tok_s:
            parts.append(f"{self.tok_s / 1e6:.2f}M tok/s" if self.tok_s >= 1e5 else f"{self.tok_s:,.0f} tok/s")
        if self.mfu:
            parts.append(f"MFU {self.mfu:.0%}")
        if self.first is not None and self.step > self.first[1]:
            rate = (self.step - self.first[1]) / max(time.time() - self.first[0], 1e-6)  # steps/s
            to_end = (self.max_steps - self.step) / rate
            here = min(to_end, self.budget_s - (time.time() - self.t0)) if self.budget_s else to_end
            parts += [f"this run: ETA {duration(here)}", f"whole run: ETA {duration(to_end)}"]
        if self.hours is not None:
            parts.append(hours_text(self.hours, self.world, self.cuda))
        if self.cost is not None:
            parts.append(f"cost ${self.cost[0]:,.2f} so far, ${self.cost[1]:,.2f} projected")
        if self.shipper is not None and self.shipper.run_id:
            parts.append(f"MLflow run {self.shipper.run_id}")
        if self.down_since is not None:
            parts.append(f"tracking delayed {duration(time.time() - self.down_since)}")
        return " · ".join(parts)

    def tick(self, final: bool = False) -> None:
        """Called often from the launcher's loop; does work at most every `every` seconds."""
        now = time.time()
        if not final and now - self.last_publish < self.every:
            return
        self.last_publish = now
        try:
            self._read()
            self._health(now)
            self.artifact.set(100.0 * min(self.step, self.max_steps) / max(self.max_steps, 1), self.describe())
        except Exception as e:  # noqa: BLE001 -- progress is a convenience: never fail training for it
            self.log.debug("progress update failed: %s", e)

    def _health(self, now: float) -> None:
        s = self.shipper
        if s is None:
            return
        if s.last_error is not None:
            if self.down_since is None:
                self.down_since, self.shipped_then, self.warned = now, s.shipped, False
            elif now - self.down_since >= HEALTH_WARN_SECONDS and not self.warned:
                self.log.warning("metrics are not reaching MLflow for %s (%s); they stay in %s and are sent "
                                 "when it is back", duration(now - self.down_since), s.last_error, self.path)
                self.warned = True  # once per outage
        elif self.down_since is not None:
            if self.warned:
                self.log.info("MLflow shipping caught up after %s: %s rows were sent late",
                              duration(now - self.down_since), f"{s.shipped - self.shipped_then:,}")
            self.down_since = None


class PieceProgress:
    """Pieces tokenized so far, as a progress artifact; updated at most every `every` seconds."""

    def __init__(self, dataset: str, todo: int, planned: int, log, every: float = 2.0):
        self.todo, self.planned, self.every = todo, planned, every
        self.done, self.tokens, self.t0, self.last = 0, 0, time.time(), 0.0
        self.artifact = ProgressArtifact(artifact_key(dataset, "tokenize"), log)
        self.artifact.set(100.0 if not todo else 0.0, self.describe())

    def describe(self) -> str:
        rate = self.tokens / max(time.time() - self.t0, 1e-6)
        return (f"{self.done:,} / {self.todo:,} pieces tokenized ({self.planned - self.todo:,} of "
                f"{self.planned:,} were already done) · {self.tokens:,} tokens · {rate:,.0f} tok/s")

    def piece_done(self, tokens: int) -> None:
        self.done, self.tokens = self.done + 1, self.tokens + tokens
        if self.done == self.todo or time.time() - self.last >= self.every:
            self.last = time.time()
            self.artifact.set(100.0 * self.done / max(self.todo, 1), self.describe())


def step_label(path: str | Path) -> str:
    """"step 120" for a checkpoint dir step_00000120, else the directory's name: short, for task-run names."""
    name = Path(path).name
    return f"step {int(name[5:])}" if name.startswith("step_") and name[5:].isdigit() else name
