"""Evaluation during training: validation loss, the registered evaluations that are due (gptcore/evals:
each at its own interval, e.g. HellaSwag every eval.hellaswag.interval steps, harness tasks every
eval.harness.interval) and text samples, on the plain model, after the checkpoint of their step, and
never the end of the run.

Evaluation runs on the GPT inside the DDP / torch.compile wrappers (gptcore.model.gpt.evaluating): no DDP
forward, and the training step's compiled graph is left as it was. HellaSwag, the harness and samples run
eagerly (their shapes vary); validation, one fixed (micro_batch, seq_len) shape, runs compiled where
training compiles: one graph, made at an invocation's first evaluation (docs/training.md "Evaluation during
training": on an H100, eager validation alone cost 5.7% of gpt2-124m's wall time).
Each rank computes its share with no collective, then one all-reduce carries the validation sums and a
"failed" flag, and one all-gather the evaluations' shares: an evaluation that raises on any rank (an
out-of-memory, a compile error, a bug) is agreed on by every rank, logged as an `event` row, and training
goes on. After eval.max_failures failures in a row, evaluation is off for the rest of the invocation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from gptcore import distributed, evals
from gptcore.config import RunConfig
from gptcore.evals.record import eval_settings, result_metrics
from gptcore.evals.validation import mean_loss, validation_sums
from gptcore.model.gpt import GPT, evaluating
from gptcore.model.tokenizer import decode, encode
from gptcore.training.guard import FaultInjector

# the all-reduced evaluation vector: the failed flag, then validation_sums
FAILED, VAL = slice(0, 1), slice(1, 3)


class Evaluator:
    """The trainer's evaluations. `event(step, text, who=)` reports what went wrong (the Trainer's event log)."""

    def __init__(self, cfg: RunConfig, env: distributed.Env, data_dir: Path, model: GPT, logger, event,
                 faults: FaultInjector):
        self.cfg, self.env, self.data_dir, self.model = cfg, env, data_dir, model
        self.logger, self.event, self.faults = logger, event, faults
        self.failures = 0  # in a row
        self.off = False
        self.cache: dict = {}  # what the evaluations loaded (HellaSwag's examples), kept across steps
        self.unavailable: dict[str, str] = {}  # evaluation -> why it cannot run in this invocation
        # validation's forward: the same plain model compiled (in eval mode, under no_grad: its own graph),
        # or None for eager (no compile, or after the compiled forward failed once in this invocation)
        self.compiled_val = torch.compile(model, dynamic=False) if env.compile else None

    def evaluate(self, step: int, last: bool) -> dict | None:
        """The eval.json record for the weights after `step` (validation loss, and each evaluation that is
        due), or None when evaluation is off or failed. Collective: every rank calls it at the same step."""
        if self.off:
            return None
        env, error, seconds, shares = self.env, None, {}, {}
        ctx = evals.Context(self.model, self.cfg, env.device, env.autocast(), env.rank, env.world,
                            self.data_dir, self.cache)
        due = [ev for ev in evals.due(self.cfg, step, last) if self.prepared(ev, ctx)]
        packed = torch.zeros(3, dtype=torch.float64, device=env.device)
        try:
            self.faults.before_eval(env.rank)
            t0 = time.time()
            packed[VAL] = self.validation(step)
            distributed.synchronize(env.device)
            seconds["val"] = time.time() - t0
            with evaluating(self.model) as plain:
                ctx.model = plain
                for ev in due:
                    t0 = time.time()
                    shares[ev.name] = ev.share(ctx)
                    distributed.synchronize(env.device)
                    seconds[ev.name] = time.time() - t0
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
        gathered = distributed.all_gather_object(shares) if due and env.world > 1 else [shares]
        results = {ev.name: ev.combine([g[ev.name] for g in gathered]) for ev in due}
        return self._record(step, packed, results, seconds)

    def validation(self, step: int) -> torch.Tensor:
        """validation_sums through the compiled forward where there is one; if it fails (a compile error, an
        out-of-memory in its first graph), eagerly, now and for the rest of the invocation, with an event:
        the same numbers either way, so a compile problem costs speed, never the evaluation."""
        env = self.env
        args = (self.model, self.cfg, self.data_dir, env.device, env.autocast(), env.rank, env.world)
        if self.compiled_val is not None:
            try:
                return validation_sums(*args, forward=self.compiled_val)
            except Exception as e:  # noqa: BLE001 - eager validation is the fallback for any compiled failure
                self.compiled_val = None
                if env.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.event(step, f"validation's compiled forward failed ({type(e).__name__}: {e}); validation "
                                 "runs eagerly for the rest of this invocation", who="eval")
        return validation_sums(*args)

    def prepared(self, ev: evals.Evaluation, ctx: evals.Context) -> bool:
        """Run `ev`'s prepare (collective: every rank alike); an evaluation whose data is bad is off for this
        invocation, with one warning: a benchmark must not stop a training run."""
        if ev.name not in self.unavailable:
            try:
                ev.prepare(ctx)
            except ValueError as e:  # a bad dataset file, raised on every rank alike
                self.unavailable[ev.name] = str(e)
                if self.env.master:
                    print(f"warning: {ev.name} evaluation skipped: {e}", flush=True)
        return ev.name not in self.unavailable

    def _record(self, step: int, packed: torch.Tensor, results: dict[str, dict], seconds: dict[str, float]) -> dict:
        val, tc = mean_loss(packed[VAL].cpu(), self.cfg), self.cfg.train
        # per-part times and sizes: what benchmarks/gpu_check projects to a run's cadence
        row = {"val/loss": val, "val/tokens": int(packed[VAL][1]) * tc.resolved_micro_batch() * tc.seq_len,
               **{f"time/{k}_s": v for k, v in seconds.items()}}
        for name, result in results.items():
            row.update(result_metrics(name, result))
            row.update({f"{name}/n": result["n"]} if isinstance(result.get("n"), int) else {})
        if self.env.compile:  # graphs dynamo compiled so far: evaluation must not add any (tests assert it)
            row["compile/unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        self.logger.log(step, row, kind="eval")
        record = {"step": step, "kind": "checkpoint", "by": "trainer", "val_loss": val,
                  "val_tokens": row["val/tokens"], **results}
        record["settings"] = eval_settings(self.cfg, val=True, only=tuple(results))
        record["seconds"] = round(sum(seconds.values()), 2)
        if self.env.master:
            lines = "".join(f"\n  {evals.EVALUATIONS[name].summary(r)}" for name, r in results.items())
            print(f"step {step:6d} | val loss {val:.4f} ({record['seconds']:.1f} s){lines}", flush=True)
        return record

    def _failed(self, step: int, errors: list[str | None]) -> None:
        self.failures += 1
        who = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        limit = self.cfg.eval.max_failures
        if limit and self.failures >= limit:
            self.off = True
            then = (f"{self.failures} failures in a row: evaluation is off for the rest of this invocation; "
                    "evaluate a checkpoint standalone with `python -m gptcore.evals.evaluate <checkpoint dir> --val`")
        else:
            then = f"training goes on and evaluation is tried again at the next eval step ({self.failures} in a row)"
        self.event(step, f"evaluation failed ({who}); {then}", who="eval")
        if self.env.master:
            print(f"warning: evaluation at step {step} failed ({who}); {then}", file=sys.stderr, flush=True)

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
