"""HellaSwag as an evaluation (gptcore/hellaswag.py scores it): acc and acc_norm with their binomial
standard errors, the examples split across ranks. A dataset that cannot be had is a skip, with the fix."""

from __future__ import annotations

import logging

from gptcore.evals import Context, Evaluation

log = logging.getLogger(__name__)


class HellaSwag(Evaluation):
    name = "hellaswag"

    def enabled(self, cfg) -> bool:
        return cfg.eval.hellaswag

    def settings(self, cfg) -> dict:
        clean = cfg.eval.exclude_contaminated and cfg.eval.contamination_ngram > 0
        return {"limit": cfg.eval.hellaswag_limit, **({"clean_ngram": cfg.eval.contamination_ngram} if clean else {})}

    def run(self, ctx: Context) -> dict:
        # the scorer (torch) is imported when it runs: reading the registry (a no-op flow re-run compares
        # eval.json's settings) must not import torch
        from gptcore import hellaswag as hs

        cfg = ctx.cfg
        examples, reason = hs.shared_examples(cfg, cfg.eval.hellaswag_path or None, cfg.eval.hellaswag_limit,
                                              master=ctx.rank == 0)
        if examples is None:
            log.warning("HellaSwag evaluation skipped: %s", reason)
            return {"skipped": reason}
        result = hs.evaluate(ctx.model, examples, ctx.device, ctx.autocast_ctx, ctx.rank, ctx.world)
        if "clean_ngram" in self.settings(cfg):
            clean = self.clean(ctx, examples)
            if clean is not None:  # the same scorer on the examples found nowhere in the training shards
                scores = hs.evaluate(ctx.model, clean, ctx.device, ctx.autocast_ctx, ctx.rank, ctx.world)
                result.update({f"clean_{k}": v for k, v in scores.items()})
        return result

    @staticmethod
    def clean(ctx: Context, examples: list) -> list | None:
        """The examples without a contamination_ngram-gram in the training shards (gptcore/contamination.py,
        cached per dataset); None when the dataset is not on this machine. Every rank computes it (the scan's
        answer is cached beside the manifest after the first)."""
        from gptcore.evals.contamination import hellaswag_report

        report = hellaswag_report(ctx, examples)
        if report is None:
            return None
        dirty = set(report["ids"])
        return [ex for i, ex in enumerate(examples) if i not in dirty]
