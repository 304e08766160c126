"""Contamination as an evaluation (gptcore/contamination.py scans): the share of each evaluation's
documents (HellaSwag's examples, each harness task's documents) that share an eval.contamination_ngram-token
n-gram with the run's training shards; on rank 0, one scan of the shards for all of them."""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import torch or numpy scans
from gptcore.evals import Context, Evaluation
from gptcore.evals.hellaswag import examples

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
            from gptcore.harness import task_documents  # lm-eval: only when harness tasks are asked for

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


def training_data(ctx: Context):
    """The run's dataset directory: the one given, else the config's."""
    from gptcore.data.location import dataset_dir

    return ctx.data_dir or dataset_dir(ctx.cfg)


def reports(ctx: Context, documents: dict[str, list[list[int]]]) -> dict | None:
    """gptcore.contamination's report per evaluation's documents against the run's training shards (cached
    beside the manifest); None when that dataset is not on this machine."""
    from gptcore.contamination import contamination

    data = training_data(ctx)
    if not (data / "manifest.json").is_file():
        return None
    return contamination(data, documents, ctx.cfg.eval.contamination_ngram)


def hellaswag_report(ctx: Context, found: list) -> dict | None:
    """The report on HellaSwag's examples (shared with the Contamination evaluation's, through the cache)."""
    found_reports = reports(ctx, {"hellaswag": [ex.tokens for ex in found]})
    return None if found_reports is None else found_reports["hellaswag"]
