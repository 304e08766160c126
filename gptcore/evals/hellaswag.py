"""HellaSwag as an evaluation (gptcore/hellaswag.py scores it): acc and acc_norm with their binomial
standard errors, the examples split across ranks. A dataset that cannot be had is a skip, with the fix."""

from __future__ import annotations

import logging

from gptcore import hellaswag as hs
from gptcore.evals import Context, Evaluation

log = logging.getLogger(__name__)


class HellaSwag(Evaluation):
    name = "hellaswag"

    def enabled(self, cfg) -> bool:
        return cfg.eval.hellaswag

    def settings(self, cfg) -> dict:
        return {"limit": cfg.eval.hellaswag_limit}

    def run(self, ctx: Context) -> dict:
        cfg = ctx.cfg
        examples, reason = hs.shared_examples(cfg, cfg.eval.hellaswag_path or None, cfg.eval.hellaswag_limit,
                                              master=ctx.rank == 0)
        if examples is None:
            log.warning("HellaSwag evaluation skipped: %s", reason)
            return {"skipped": reason}
        return hs.evaluate(ctx.model, examples, ctx.device, ctx.autocast_ctx, ctx.rank, ctx.world)
