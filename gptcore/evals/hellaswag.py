"""HellaSwag as an evaluation (gptcore/evals/scorers/hellaswag.py scores it): acc and acc_norm with their binomial
standard errors, the examples split across ranks. A dataset that cannot be had is a skip, with the fix.
Its settings: eval.hellaswag.* (below). During training: every eval.hellaswag.interval steps (0 = at the
end only)."""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import torch
import logging
from dataclasses import dataclass

from gptcore.config import ConfigError
from gptcore.evals.base import Context, Evaluation

log = logging.getLogger(__name__)


@dataclass
class HellaSwagSettings:
    enabled: bool = True
    interval: int = 1000  # steps between HellaSwag evaluations (at an eval step); 0 = only at the end
    path: str = ""  # a local hellaswag_val.jsonl (air-gapped); "" = download into the cache
    limit: int = 0  # 0 = all 10,042 examples
    # also scored on its clean examples only: those sharing no eval.contamination.ngram-gram with the shards
    exclude_contaminated: bool = False

    def validate(self) -> None:
        if self.interval < 0 or self.limit < 0:
            raise ConfigError(f"eval.hellaswag.interval and eval.hellaswag.limit must be >= 0, got "
                              f"{self.interval} and {self.limit}")


class HellaSwag(Evaluation):
    name = "hellaswag"
    Settings = HellaSwagSettings
    headline = "acc_norm"  # build-nanogpt's and GPT-2's reported number

    def settings(self, cfg) -> dict:
        ngram = clean_ngram(cfg)
        return {"limit": self.options(cfg).limit, **({"clean_ngram": ngram} if ngram else {})}

    def prepare(self, ctx: Context) -> None:
        examples(ctx)

    has_documents = True

    def documents(self, ctx: Context) -> dict[str, list[list[int]] | str]:
        found, reason = examples(ctx)
        return {"hellaswag": f"no HellaSwag examples: {reason}" if found is None else [ex.tokens for ex in found]}

    def share(self, ctx: Context) -> dict:
        # the scorer (torch) is imported when it runs: reading the registry (a no-op flow re-run compares
        # eval.json's settings) must not import torch
        from gptcore.evals.scorers import hellaswag as hs

        found, reason = examples(ctx)
        if found is None:
            return {"skipped": reason}
        args = (ctx.model, ctx.device, ctx.autocast_ctx, ctx.rank, ctx.world)
        out = {"counts": hs.local_counts(args[0], found, *args[1:]).tolist()}
        if "clean_ngram" in self.settings(ctx.cfg):
            clean = self.clean(ctx, found)
            if clean is not None:  # the same scorer on the examples found nowhere in the training shards
                out["clean_counts"] = hs.local_counts(args[0], clean, *args[1:]).tolist()
        return out

    def combine(self, shares: list[dict]) -> dict:
        from gptcore.evals.scorers import hellaswag as hs

        if "skipped" in shares[0]:
            return shares[0]
        result = hs.summary([sum(s["counts"][i] for s in shares) for i in range(3)])
        if "clean_counts" in shares[0]:
            clean = hs.summary([sum(s["clean_counts"][i] for s in shares) for i in range(3)])
            result.update({f"clean_{k}": v for k, v in clean.items()})
        return result

    @staticmethod
    def clean(ctx: Context, found: list) -> list | None:
        """The examples without a contamination_ngram-gram in the training shards
        (gptcore/evals/scorers/contamination.py, cached per dataset); None when the dataset is not on this
        machine. Every rank computes it once per invocation (ctx.cache; the scan's answer is cached beside
        the manifest after the first)."""
        from gptcore.evals.overlap import hellaswag_report

        o = ctx.cfg.eval.options("hellaswag")
        key = ("hellaswag-clean", o.path, o.limit, clean_ngram(ctx.cfg))  # as `examples`
        if key not in ctx.cache:
            report = hellaswag_report(ctx, found)
            dirty = set(report["ids"]) if report is not None else set()
            ctx.cache[key] = None if report is None else [ex for i, ex in enumerate(found) if i not in dirty]
        return ctx.cache[key]


def examples(ctx: Context) -> tuple[list | None, str]:
    """HellaSwag's examples on every rank (rank 0 reads or downloads them and broadcasts: collective), kept
    in ctx.cache for the next step; (None, why) when they cannot be had. A bad explicit file raises
    HellaSwagError on every rank alike (the trainer turns it into a skip: a benchmark never stops a run)."""
    from gptcore.evals.scorers import hellaswag as hs

    o = ctx.cfg.eval.options("hellaswag")
    key = ("hellaswag", o.path, o.limit)
    if key not in ctx.cache:
        found, why = hs.shared_examples(ctx.cfg, o.path or None, o.limit, master=ctx.rank == 0)
        if found is None:
            log.warning("HellaSwag evaluation skipped: %s", why)
        ctx.cache[key] = (found, why)
    return ctx.cache[key]


def clean_ngram(cfg) -> int:
    """The n-gram the clean examples are judged by: the contamination scan's, when eval.hellaswag asks for
    clean scores and the scan is on; 0 = no clean scores."""
    wanted = cfg.eval.options("hellaswag").exclude_contaminated
    return cfg.eval.options("contamination").ngram if wanted else 0
