"""lm-evaluation-harness tasks as an evaluation (gptcore/evals/scorers/harness.py runs them): eval.harness_tasks, each
task's metrics with the harness's standard errors; on rank 0 (the harness knows nothing of our ranks).
During training: every eval.harness_interval steps when set (0 = not during training)."""

from __future__ import annotations

from gptcore.evals.base import Context, Evaluation


class Harness(Evaluation):
    name = "harness"

    def enabled(self, cfg) -> bool:
        return bool(cfg.eval.harness_task_list)

    def settings(self, cfg) -> dict:
        e = cfg.eval
        # dtype: fp32 and autocast scores differ (bf16 moved log-likelihoods by up to 0.126 nats), so results
        # scored in one are never taken for the other's
        return {"tasks": e.harness_task_list, "limit": e.harness_limit, "include_path": e.harness_include_path,
                "dtype": e.harness_dtype}

    def interval(self, cfg) -> int | None:
        return cfg.eval.harness_interval or None

    has_documents = True

    def documents(self, ctx: Context) -> dict[str, list[list[int]] | str]:
        """Each task's documents (a str: why a task has none)."""
        from gptcore.evals.scorers.harness import task_documents  # lm-eval: only when harness tasks are asked for

        e = ctx.cfg.eval
        found = task_documents(e.harness_task_list, e.harness_include_path or None, e.harness_limit or None)
        return {f"harness/{task}": docs for task, docs in found.items()}

    def run(self, ctx: Context) -> dict:
        from gptcore.evals.scorers.harness import run_tasks  # lm-eval: imported only when a task is asked for

        e = ctx.cfg.eval
        return run_tasks(ctx.model, e.harness_task_list, ctx.device, ctx.autocast_ctx,
                         e.harness_include_path or None, e.harness_limit or None, dtype=e.harness_dtype)
