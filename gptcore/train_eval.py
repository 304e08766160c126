"""Evaluation during training: validation loss, HellaSwag and text samples, on the plain model, after
the checkpoint of their step, and never the end of the run.

Evaluation runs eagerly on the GPT inside the DDP / torch.compile wrappers (gptcore.model.evaluating): no
DDP forward, no graphs compiled for evaluation shapes, and the training step's compiled graph is left as
it was (docs/training.md "Evaluation during training" says why eager and not a compiled eval model).
Each rank computes its share with no collective, then one all-reduce carries the shares and a "failed"
flag: an evaluation that raises on any rank (an out-of-memory, a compile error, a bug) is agreed on by
every rank, logged as an `event` row, and training goes on. After eval.max_failures failures in a row,
evaluation is off for the rest of the invocation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from gptcore import distributed, hellaswag
from gptcore.config import RunConfig
from gptcore.evaluate import mean_loss, validation_sums
from gptcore.guard import FaultInjector
from gptcore.model import GPT
from gptcore.run_files import eval_settings
from gptcore.tokenizer import decode, encode

# the all-reduced evaluation vector: the failed flag, validation_sums, then hellaswag.local_counts
FAILED, VAL, HELLASWAG = slice(0, 1), slice(1, 3), slice(3, 6)


class Evaluator:
    """The trainer's evaluations. `event(step, text, who=)` reports what went wrong (the Trainer's event log)."""

    def __init__(self, cfg: RunConfig, env: distributed.Env, data_dir: Path, model: GPT, logger, event,
                 faults: FaultInjector):
        self.cfg, self.env, self.data_dir, self.model = cfg, env, data_dir, model
        self.logger, self.event, self.faults = logger, event, faults
        self.failures = 0  # in a row
        self.off = False
        self._examples: list | None = None  # HellaSwag examples, loaded at the first HellaSwag step

    def evaluate(self, step: int, last: bool) -> dict | None:
        """The eval.json record for the weights after `step` (validation loss, and HellaSwag when due), or
        None when evaluation is off or failed. Collective: every rank calls it at the same step."""
        if self.off:
            return None
        every = self.cfg.eval.hellaswag_interval
        examples = self._hellaswag_examples() if last or (every and step % every == 0) else []
        env, error, seconds = self.env, None, {}
        packed = torch.zeros(6, dtype=torch.float64, device=env.device)
        try:
            self.faults.before_eval(env.rank)
            t0 = time.time()
            packed[VAL] = validation_sums(self.model, self.cfg, self.data_dir, env.device, env.autocast(),
                                          env.rank, env.world)
            distributed.synchronize(env.device)
            seconds["val"], t0 = time.time() - t0, time.time()
            if examples:
                packed[HELLASWAG] = hellaswag.local_counts(self.model, examples, env.device, env.autocast(),
                                                           env.rank, env.world)
                seconds["hellaswag"] = time.time() - t0
        except Exception as e:  # noqa: BLE001 -- any failure of an evaluation is an event, not the run's end
            error = f"{type(e).__name__}: {e}"
            packed.zero_()
            packed[FAILED] = 1
        if env.device.type == "cuda":
            torch.cuda.empty_cache()  # an out-of-memory's half-built activations go back before training
        distributed.all_reduce_sum(packed)
        if packed[FAILED].item() > 0:
            self._failed(step, distributed.all_gather_object(error))
            return None
        self.failures = 0
        return self._record(step, packed, bool(examples), seconds)

    def _record(self, step: int, packed: torch.Tensor, with_hellaswag: bool, seconds: dict[str, float]) -> dict:
        val, tc = mean_loss(packed[VAL].cpu(), self.cfg), self.cfg.train
        # per-part times and sizes: what benchmarks/gpu_check projects to a run's cadence
        row = {"val/loss": val, "val/tokens": int(packed[VAL][1]) * tc.resolved_micro_batch() * tc.seq_len,
               **{f"time/{k}_s": v for k, v in seconds.items()}}
        if self.env.compile:  # graphs dynamo compiled so far: evaluation must not add any (tests assert it)
            row["compile/unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        record = {"step": step, "kind": "checkpoint", "by": "trainer", "val_loss": val, "val_tokens": row["val/tokens"]}
        hs_text = ""
        if with_hellaswag:
            hs = record["hellaswag"] = hellaswag.summary(packed[HELLASWAG])
            row.update({f"hellaswag/{k}": v for k, v in hs.items()})
            hs_text = f" | hellaswag acc_norm {hs['acc_norm']:.4f} (n={hs['n']})"
        self.logger.log(step, row, kind="eval")
        record["settings"] = eval_settings(self.cfg, val=True, only=("hellaswag",) if with_hellaswag else ())
        record["seconds"] = round(sum(seconds.values()), 2)
        if self.env.master:
            print(f"step {step:6d} | val loss {val:.4f}{hs_text} ({record['seconds']:.1f} s)", flush=True)
        return record

    def _failed(self, step: int, errors: list[str | None]) -> None:
        self.failures += 1
        who = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        limit = self.cfg.eval.max_failures
        if limit and self.failures >= limit:
            self.off = True
            then = (f"{self.failures} failures in a row: evaluation is off for the rest of this invocation; "
                    "evaluate a checkpoint standalone with `python -m gptcore.evaluate <checkpoint dir> --val`")
        else:
            then = f"training goes on and evaluation is tried again at the next eval step ({self.failures} in a row)"
        self.event(step, f"evaluation failed ({who}); {then}", who="eval")
        if self.env.master:
            print(f"warning: evaluation at step {step} failed ({who}); {then}", file=sys.stderr, flush=True)

    def _hellaswag_examples(self) -> list:
        if not self.cfg.eval.hellaswag:
            return []
        if self._examples is None:
            # rank 0 reads (or downloads) and broadcasts: ranks need no shared home; a missing or bad
            # file skips HellaSwag on every rank (a benchmark must not stop a training run)
            try:
                examples, why = hellaswag.shared_examples(self.cfg, None, self.cfg.eval.hellaswag_limit,
                                                          self.env.master)
            except hellaswag.HellaSwagError as e:
                examples, why = None, str(e)
            if examples is None and self.env.master:
                print(f"warning: HellaSwag evaluation skipped: {why}", flush=True)
            self._examples = examples or []
        return self._examples

    def sample(self, step: int) -> None:
        """A text sample from the plain model (rank 0; its own generator, so no RNG state is touched); a
        failure is an event."""
        e = self.cfg.eval
        try:
            prompt = torch.tensor([encode(e.sample_prompt)], dtype=torch.long, device=self.env.device)
            n = min(e.sample_tokens, self.model.config.block_size - prompt.size(1))
            if n <= 0:
                return
            with self.env.autocast():
                out = self.model.generate(prompt, n, temperature=1.0, top_k=50, seed=self.cfg.train.seed + step)
        except Exception as err:  # noqa: BLE001 -- a sample is never worth a run
            self.event(step, f"sample failed ({type(err).__name__}: {err})", who="eval")
            return
        text = decode(out[0].tolist())
        self.logger.log(step, {"text": text}, kind="sample")
        print(f"sample @ {step}: {text!r}", flush=True)
