"""HellaSwag as an evaluation (gptcore/evals/scorers/hellaswag.py scores it): acc and acc_norm with their binomial
standard errors, the examples split across ranks. A dataset that cannot be had is a skip, with the fix.
During training: every eval.hellaswag_interval steps (0 = at the end only)."""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import torch
import logging

from gptcore.evals.base import Context, Evaluation

log = logging.getLogger(__name__)


class HellaSwag(Evaluation):
    name = "hellaswag"
    headline = "acc_norm"  # build-nanogpt's and GPT-2's reported number

    def enabled(self, cfg) -> bool:
        return cfg.eval.hellaswag

    def settings(self, cfg) -> dict:
        clean = cfg.eval.exclude_contaminated and cfg.eval.contamination_ngram > 0
        return {"limit": cfg.eval.hellaswag_limit, **({"clean_ngram": cfg.eval.contamination_ngram} if clean else {})}

    def interval(self, cfg) -> int:
        return cfg.eval.hellaswag_interval

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

        e = ctx.cfg.eval
        key = ("hellaswag-clean", e.hellaswag_path, e.hellaswag_limit, e.contamination_ngram)  # as `examples`
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

    cfg = ctx.cfg
    key = ("hellaswag", cfg.eval.hellaswag_path, cfg.eval.hellaswag_limit)
    if key not in ctx.cache:
        found, why = hs.shared_examples(cfg, cfg.eval.hellaswag_path or None, cfg.eval.hellaswag_limit,
                                        master=ctx.rank == 0)
        if found is None:
            log.warning("HellaSwag evaluation skipped: %s", why)
        ctx.cache[key] = (found, why)
    return ctx.cache[key]
