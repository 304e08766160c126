"""Evaluation documents against the run's training shards: the n-gram overlap scan
(gptcore/evals/scorers/contamination.py) as evaluations use it. The Contamination evaluation reports it;
HellaSwag drops the examples it finds (eval.hellaswag.exclude_contaminated). One scan serves both (cached beside the
manifest)."""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import numpy scans
from gptcore.evals.base import Context


def training_data(ctx: Context):
    """The run's dataset directory: the one given, else the config's."""
    from gptcore.data.location import dataset_dir

    return ctx.data_dir or dataset_dir(ctx.cfg)


def reports(ctx: Context, documents: dict[str, list[list[int]]]) -> dict | None:
    """gptcore.evals.scorers.contamination's report per evaluation's documents against the run's training shards (cached
    beside the manifest); None when that dataset is not on this machine."""
    from gptcore.evals.scorers.contamination import contamination

    data = training_data(ctx)
    if not (data / "manifest.json").is_file():
        return None
    return contamination(data, documents, ctx.cfg.eval.options("contamination").ngram)


def hellaswag_report(ctx: Context, found: list) -> dict | None:
    """The report on HellaSwag's examples (shared with the Contamination evaluation's, through the cache)."""
    found_reports = reports(ctx, {"hellaswag": [ex.tokens for ex in found]})
    return None if found_reports is None else found_reports["hellaswag"]
