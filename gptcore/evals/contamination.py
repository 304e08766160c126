"""Contamination as an evaluation (gptcore/contamination.py scans): the share of HellaSwag's examples that
share an eval.contamination_ngram-token n-gram with the run's training shards; on rank 0."""

from __future__ import annotations

from gptcore.evals import Context, Evaluation


class Contamination(Evaluation):
    name = "contamination"

    def enabled(self, cfg) -> bool:
        return cfg.eval.contamination_ngram > 0 and cfg.eval.hellaswag

    def settings(self, cfg) -> dict:
        return {"ngram": cfg.eval.contamination_ngram, "hellaswag_limit": cfg.eval.hellaswag_limit}

    def run(self, ctx: Context) -> dict:
        # imported when it runs: reading the registry must not import torch (see evals/hellaswag.py)
        from gptcore import hellaswag as hs
        from gptcore.contamination import contamination
        from gptcore.data.build import dataset_dir

        cfg = ctx.cfg
        # every rank: reading the examples is collective under DDP (rank 0 reads, the others receive)
        examples, reason = hs.shared_examples(cfg, cfg.eval.hellaswag_path or None, cfg.eval.hellaswag_limit,
                                              master=ctx.rank == 0)
        if examples is None:
            return {"skipped": f"no HellaSwag examples: {reason}"}
        if ctx.rank != 0:
            return {}
        data = ctx.data_dir or dataset_dir(cfg)
        if not (data / "manifest.json").is_file():
            return {"skipped": f"the training dataset {data} is not on this machine (no manifest.json); "
                    "evaluate where the run's shards are, or pass --data DIR"}
        tokens = [ex.ctx_tokens + [t for e in ex.ending_tokens for t in e] for ex in examples]
        report = contamination(data, {"hellaswag": tokens}, cfg.eval.contamination_ngram)
        return {k: {f: v[f] for f in ("n", "examples", "contaminated", "share")} for k, v in report.items()}
