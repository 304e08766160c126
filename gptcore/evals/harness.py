"""lm-evaluation-harness tasks as an evaluation (gptcore/evals/scorers/harness.py runs them): eval.harness.tasks,
each task's metrics with the harness's standard errors; on rank 0 (the harness knows nothing of our ranks).
During training: every eval.harness.interval steps when set (0 = not during training)."""

from __future__ import annotations

from dataclasses import dataclass

from gptcore.config import ConfigError
from gptcore.evals.base import Context, Evaluation
from gptcore.security import check_code_path

# the precisions harness log-likelihoods can be scored in (gptcore/evals/scorers/harness_scoring.py
# `scoring_context` implements each)
DTYPES = ("float32", "autocast")


@dataclass
class HarnessSettings:
    tasks: str = ""  # lm-evaluation-harness tasks, comma-separated; "" = none (the evaluation is off)
    include_path: str = ""  # a folder of your own task YAMLs (under GPTPIPE_CODE_ROOTS: a YAML can run Python)
    limit: int = 0  # examples per task; 0 = all
    interval: int = 0  # steps between harness runs during training (at an eval step); 0 = not during training
    # "float32" (the default: scores comparable across cards and with Hugging Face's fp32 forward; bf16
    # autocast moved them by up to 0.126 nats on CPU, with greedy flips, and fp32 is cheap at 124M) or
    # "autocast" (the trainer's autocast dtype: faster on big models)
    dtype: str = "float32"

    @property
    def task_list(self) -> list[str]:
        return [t.strip() for t in self.tasks.split(",") if t.strip()]

    def validate(self) -> None:
        if self.limit < 0 or self.interval < 0:
            raise ConfigError(f"eval.harness.limit and eval.harness.interval must be >= 0, got {self.limit} "
                              f"and {self.interval}")
        check_code_path("eval.harness.include_path", self.include_path)
        if self.dtype not in DTYPES:
            raise ConfigError(f"eval.harness.dtype={self.dtype!r}; use float32 (scores comparable across cards, "
                              "the default) or autocast (the trainer's autocast dtype)")


class Harness(Evaluation):
    name = "harness"
    Settings = HarnessSettings

    def enabled(self, cfg) -> bool:
        return bool(self.options(cfg).task_list)

    def settings(self, cfg) -> dict:
        o = self.options(cfg)
        # dtype: fp32 and autocast scores differ (bf16 moved log-likelihoods by up to 0.126 nats), so results
        # scored in one are never taken for the other's
        return {"tasks": o.task_list, "limit": o.limit, "include_path": o.include_path, "dtype": o.dtype}

    def interval(self, cfg) -> int | None:
        return self.options(cfg).interval or None

    has_documents = True

    def documents(self, ctx: Context) -> dict[str, list[list[int]] | str]:
        """Each task's documents (a str: why a task has none)."""
        from gptcore.evals.scorers.harness import task_documents  # lm-eval: only when harness tasks are asked for

        o = self.options(ctx.cfg)
        found = task_documents(o.task_list, o.include_path or None, o.limit or None)
        return {f"harness/{task}": docs for task, docs in found.items()}

    def run(self, ctx: Context) -> dict:
        from gptcore.evals.scorers.harness import run_tasks  # lm-eval: imported only when a task is asked for

        o = self.options(ctx.cfg)
        return run_tasks(ctx.model, o.task_list, ctx.device, ctx.autocast_ctx, o.include_path or None,
                         o.limit or None, dtype=o.dtype)
