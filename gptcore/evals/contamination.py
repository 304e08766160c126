"""Contamination as an evaluation (gptcore/evals/scorers/contamination.py scans): the share of each evaluation's
documents (every evaluation the config asks for that has documents: HellaSwag's examples, each harness task's)
that share an eval.contamination.ngram-token n-gram with the run's training shards; on rank 0, one scan of
the shards for all of them. It names no other evaluation: it loops over the registry's `documents`."""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import torch or numpy scans
from dataclasses import dataclass

from gptcore.config import ConfigError
from gptcore.evals.base import EVALUATIONS, Context, Evaluation
from gptcore.evals.overlap import reports, training_data

FIELDS = ("n", "examples", "contaminated", "share")


@dataclass
class ContaminationSettings:
    ngram: int = 0  # the n-gram length that counts as shared (GPT-3 used 13); 0 = off

    def validate(self) -> None:
        if self.ngram < 0:
            raise ConfigError(f"eval.contamination.ngram must be >= 0 (0 = off), got {self.ngram}")


class Contamination(Evaluation):
    name = "contamination"
    Settings = ContaminationSettings

    @staticmethod
    def sources(cfg) -> list[Evaluation]:
        """The evaluations the config asks for that have documents (Evaluation.has_documents)."""
        return [ev for ev in EVALUATIONS.values() if ev.has_documents and ev.enabled(cfg)]

    def enabled(self, cfg) -> bool:
        return self.options(cfg).ngram > 0 and bool(self.sources(cfg))

    def settings(self, cfg) -> dict:
        return {"ngram": self.options(cfg).ngram,
                "documents": {ev.name: ev.settings(cfg) for ev in self.sources(cfg)}}

    def prepare(self, ctx: Context) -> None:
        for ev in self.sources(ctx.cfg):  # every rank: reading documents may be collective (HellaSwag's)
            ev.prepare(ctx)

    def run(self, ctx: Context) -> dict:
        out, documents = {}, {}
        for ev in self.sources(ctx.cfg):
            for part, docs in ev.documents(ctx).items():
                if isinstance(docs, str):
                    place(out, part, {"skipped": docs})
                else:
                    documents[part] = docs
        found_reports = reports(ctx, documents)
        if found_reports is None:
            return {"skipped": f"the training dataset {training_data(ctx)} is not on this machine (no "
                    "manifest.json); evaluate where the run's shards are, or pass --data DIR"}
        for part, report in found_reports.items():
            place(out, part, {f: report[f] for f in FIELDS})
        return out


def place(out: dict, part: str, row: dict) -> None:
    """A part's row in the result: "hellaswag" at the top, "harness/<task>" nested under "harness"."""
    group, _, task = part.partition("/")
    if task:
        out.setdefault(group, {})[task] = row
    else:
        out[group] = row
