"""What a stage of the pretrain flow is (`Stage`), what the stages of one flow run share (`FlowRun`), and the
loop that runs them (`run_stages`).

A stage first looks for its verified result (`stored`): found, the stage is skipped, and its reason shows
as a task run in state "Skipped"; not found, it does its work (`work`: its Prefect tasks). Either way it
has one result, which `reason` describes in a line and `keep` leaves on the FlowRun (and publishes as
artifacts), so no stage reads twice what it decided on. The loop owns the bookkeeping: the log line, the
Skipped task run, the row of the flow run's stages table. A stage's task calls the same `stored` check,
so a task called alone is idempotent too.

Adding a stage: a `Stage` subclass in its own module and one line in flows/pretrain.py's STAGES
(tests/test_flow.py adds a toy one after sample, from a module of its own, and runs the real flow).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from gptcore.config import RunConfig


@task(name="skipped", cache_policy=NO_CACHE)
def skipped_task(reason: str) -> None:
    """A stage with nothing to do: a task run that completes at once, its reason in the state message, so
    every flow run of a deployment shows the same stages in the UI's graph."""
    return Completed(name="Skipped", message=f"skipped: {reason}")


@dataclass
class FlowRun:
    """What the stages share: the flow's resolved config and parameters, and what each stage made."""
    cfg: RunConfig
    log: Any  # the flow run's logger
    nproc: int = 0
    wait_seconds: float = 600.0
    tracking: bool = True
    dask_address: str = ""
    model_name: str = ""
    dataset_dir: str = ""
    tokens: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # the training run's (run_files.run_state)
    result: dict | None = None  # eval.json of the newest checkpoint
    reg: dict | None = None  # the registered version
    sample: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)  # each stage: ran / skipped, and why

    @property
    def ckpt(self) -> str:
        return self.state["checkpoint"]

    @property
    def registered_name(self) -> str:
        return self.model_name or self.cfg.preset


class Stage:
    name = ""
    switch: str | None = None  # the flow parameter that turns it off (None: it always runs)

    def stored(self, run: FlowRun) -> Any | None:
        """Its verified result when it is already there (the stage is skipped), else None."""
        return None

    def work(self, run: FlowRun) -> Any:
        """Make the result (its Prefect tasks run here)."""
        raise NotImplementedError

    def reason(self, run: FlowRun, result: Any, ran: bool) -> str:
        """One line: what it did, or why there was nothing to do."""
        return ""

    def keep(self, run: FlowRun, result: Any) -> None:
        """Leave the result on the FlowRun for the stages after it; publish its artifacts."""

    def task_run_name(self, run: FlowRun) -> str:
        """The Skipped task run's name (the name its real task run would have)."""
        return self.name


def run_stages(run: FlowRun, stages: list[Stage], switches: dict[str, bool]) -> None:
    """Each stage in order (but those switched off): its stored result, or its work; the bookkeeping."""
    for stage in stages:
        if stage.switch is not None and not switches[stage.switch]:
            continue
        found = stage.stored(run)
        result = stage.work(run) if found is None else found
        status = "ran" if found is None else "skipped"
        detail = stage.reason(run, result, ran=found is None)
        run.rows.append({"stage": stage.name, "status": status, "detail": detail})
        run.log.info("stage %s: %s %s", stage.name, status, detail)
        if found is not None:
            skipped_task.with_options(name=stage.name, task_run_name=stage.task_run_name(run))(detail)
        stage.keep(run, result)
