"""Contamination as an evaluation (gptcore/contamination.py scans): the share of HellaSwag's examples that
share an eval.contamination_ngram-token n-gram with the run's training shards; on rank 0."""

from __future__ import annotations

from gptcore.evals import Context, Evaluation
from gptcore.evals.hellaswag import examples


class Contamination(Evaluation):
    name = "contamination"

    def enabled(self, cfg) -> bool:
        return cfg.eval.contamination_ngram > 0 and cfg.eval.hellaswag

    def settings(self, cfg) -> dict:
        return {"ngram": cfg.eval.contamination_ngram, "hellaswag_limit": cfg.eval.hellaswag_limit}

    def prepare(self, ctx: Context) -> None:
        examples(ctx)  # every rank: reading the examples is collective (rank 0 reads, the others receive)

    def run(self, ctx: Context) -> dict:
        from gptcore.data.build import dataset_dir

        found, reason = examples(ctx)
        if found is None:
            return {"skipped": f"no HellaSwag examples: {reason}"}
        report = hellaswag_report(ctx, found)
        if report is None:
            return {"skipped": f"the training dataset {ctx.data_dir or dataset_dir(ctx.cfg)} is not on this machine "
                    "(no manifest.json); evaluate where the run's shards are, or pass --data DIR"}
        return {"hellaswag": {f: report[f] for f in ("n", "examples", "contaminated", "share")}}


def hellaswag_report(ctx: Context, examples: list) -> dict | None:
    """gptcore.contamination's report on HellaSwag's `examples` against the run's training shards (cached
    beside the manifest); None when that dataset is not on this machine."""
    from gptcore.contamination import contamination
    from gptcore.data.build import dataset_dir

    data = ctx.data_dir or dataset_dir(ctx.cfg)
    if not (data / "manifest.json").is_file():
        return None
    return contamination(data, {"hellaswag": [ex.tokens for ex in examples]}, ctx.cfg.eval.contamination_ngram
                         )["hellaswag"]
