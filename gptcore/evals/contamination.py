"""Contamination as an evaluation (gptcore/evals/scorers/contamination.py scans): the share of each evaluation's
documents (HellaSwag's examples, each harness task's documents) that share an eval.contamination_ngram-token
n-gram with the run's training shards; on rank 0, one scan of the shards for all of them."""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import torch or numpy scans
from gptcore.evals.base import Context, Evaluation
from gptcore.evals.hellaswag import examples
from gptcore.evals.overlap import reports, training_data

FIELDS = ("n", "examples", "contaminated", "share")


class Contamination(Evaluation):
    name = "contamination"

    def enabled(self, cfg) -> bool:
        return cfg.eval.contamination_ngram > 0 and (cfg.eval.hellaswag or bool(cfg.eval.harness_task_list))

    def settings(self, cfg) -> dict:
        e = cfg.eval
        return {"ngram": e.contamination_ngram, "hellaswag_limit": e.hellaswag_limit if e.hellaswag else None,
                "harness_tasks": e.harness_task_list, "harness_limit": e.harness_limit,
                "harness_include_path": e.harness_include_path}

    def prepare(self, ctx: Context) -> None:
        if ctx.cfg.eval.hellaswag:
            examples(ctx)  # every rank: reading the examples is collective (rank 0 reads, the others receive)

    def run(self, ctx: Context) -> dict:
        e, out, documents = ctx.cfg.eval, {}, {}
        if e.hellaswag:
            found, reason = examples(ctx)
            if found is None:
                out["hellaswag"] = {"skipped": f"no HellaSwag examples: {reason}"}
            else:
                documents["hellaswag"] = [ex.tokens for ex in found]
        if e.harness_task_list:
            from gptcore.evals.scorers.harness import task_documents  # lm-eval: only when harness tasks are asked for

            for task, docs in task_documents(e.harness_task_list, e.harness_include_path or None,
                                             e.harness_limit or None).items():
                if isinstance(docs, str):
                    out.setdefault("harness", {})[task] = {"skipped": docs}
                else:
                    documents[f"harness/{task}"] = docs
        found_reports = reports(ctx, documents)
        if found_reports is None:
            return {"skipped": f"the training dataset {training_data(ctx)} is not on this machine (no "
                    "manifest.json); evaluate where the run's shards are, or pass --data DIR"}
        for name, report in found_reports.items():
            group, _, task = name.partition("/")  # "hellaswag" or "harness/<task>"
            row = {f: report[f] for f in FIELDS}
            if task:
                out.setdefault(group, {})[task] = row
            else:
                out[group] = row
        return out
