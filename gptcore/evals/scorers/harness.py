"""EleutherAI's lm-evaluation-harness on the project's own GPT: the standard benchmark suite, no HF export.

    results = run_tasks(model, ["arc_easy", "piqa"], device, autocast_ctx, dtype=cfg.eval.options("harness").dtype)
    python -m gptcore.evals.evaluate runs/gpt2-124m --tasks arc_easy,piqa [--include-path DIR]

`GPTHarness` implements the harness's language-model interface through its `TemplateLM` (which turns a
(context, continuation) pair into tokens exactly as its Hugging Face model class does): log-likelihoods of
continuations and rolling log-likelihoods of whole documents, scored on the device in batches of similar
length (gptcore/evals/scorers/harness_scoring.py, which needs no lm-eval), in full fp32 by default or under the
trainer's autocast (eval.harness.dtype, `scoring_context`). Tasks that generate text are not supported
(GPT-2's suite scores choices). A task whose dataset cannot be fetched (offline, a hub outage) is skipped
with the reason, as HellaSwag is, never a failed evaluation.

lm-eval is imported here only: the trainer and gpu_check never need it.
"""

from __future__ import annotations

import logging
import math
import random
from contextlib import contextmanager

import numpy as np
import torch
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.task import Task
from lm_eval.tasks import TaskManager, get_task_dict
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gptcore.evals.scorers.harness_scoring import BATCH_TOKENS, continuation_scores, scoring_context
from gptcore.model.gpt import GPT, unwrap
from gptcore.model.tokenizer import EOT, get_encoding
from gptcore.security import check_code_path

log = logging.getLogger(__name__)


class GPTHarness(TemplateLM):
    """The harness's model interface over a plain GPT (unwrapped from DDP / torch.compile, in eval mode).
    `dtype` (eval.harness.dtype): "float32" scores in full fp32 and ignores `autocast_ctx`; "autocast"
    scores under `autocast_ctx`."""

    def __init__(self, model: torch.nn.Module, device, autocast_ctx=None, batch_tokens: int = BATCH_TOKENS,
                 dtype: str = "float32"):
        super().__init__()
        self.model: GPT = unwrap(model)
        self._device = torch.device(device)
        self.autocast_ctx = autocast_ctx
        self.dtype = dtype
        scoring_context(dtype)  # a dtype it cannot score in fails here, not after the harness has loaded its tasks
        weights = {p.dtype for p in self.model.parameters()}
        if dtype == "float32" and weights != {torch.float32}:  # fp32 scores need fp32 weights, not a cast copy
            raise ValueError(f"eval.harness.dtype=float32 scores the model's fp32 weights, but they are "
                             f"{sorted(map(str, weights))}; load the model in fp32 or use eval.harness.dtype=autocast")
        self.batch_tokens = batch_tokens
        self.max_length = self.model.config.block_size
        self.encoding = get_encoding()

    @property
    def eot_token_id(self) -> int:
        return EOT

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # as GPT-2's Hugging Face tokenizer encodes: "<|endoftext|>" in the text is the special token
        return self.encoding.encode(string, allowed_special="all")

    def tok_decode(self, tokens) -> str:
        return self.encoding.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request of
        (key, context tokens, continuation tokens): gptcore.evals.scorers.harness_scoring.continuation_scores, in the
        precision eval.harness.dtype picks."""
        with scoring_context(self.dtype, self.autocast_ctx):
            return continuation_scores(self.model, [(ctx, cont) for _, ctx, cont in requests], self._device,
                                       self.batch_tokens)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, in windows of block_size tokens that predict every token once
        (the harness's own windowing), conditioned on the end-of-text token."""
        totals = []
        for (string,) in (r.args for r in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(string), self.prefix_token_id, self.max_length, 1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(s for s, _ in scores))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("generation tasks are not supported by gptcore.evals.scorers.harness (GPT-2's "
                                  "suite scores choices with log-likelihoods); pick multiple-choice or perplexity "
                                  "tasks")


def summarize(results: dict) -> dict[str, dict]:
    """{task: {"acc": .., "acc_stderr": .., "acc_norm": .., ...}} from simple_evaluate's results: each metric
    under its plain name (the harness writes "acc,none"), with its standard error beside it."""
    out: dict[str, dict] = {}
    for task, metrics in results.get("results", {}).items():
        row: dict[str, float] = {}
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in ("alias", "sample_len"):
                row[name] = float(value) if math.isfinite(float(value)) else float("nan")
        n = results.get("n-samples", {}).get(task, {})
        if "effective" in n:
            row["n"] = int(n["effective"])
        out[task] = row
    return out


def task_manager(include_path: str | None) -> TaskManager:
    """The harness's task index, with the tasks of `include_path` when given. Loading a task YAML can run
    Python (`!function module.f` imports the module beside it), so the folder is checked against the
    operator's GPTPIPE_CODE_ROOTS here as well as where the config is validated: a config rebuilt from a
    checkpoint's or a registered version's meta.json reaches this point without load_config."""
    if not include_path:
        return TaskManager()
    check_code_path("eval.harness.include_path", include_path)
    return TaskManager(include_path=include_path)


def run_tasks(model: torch.nn.Module, tasks: list[str], device, autocast_ctx=None,
              include_path: str | None = None, limit: int | None = None, dtype: str = "float32") -> dict[str, dict]:
    """Score `model` on each of the harness's `tasks` (names it knows, or defined under `include_path`):
    {task: metrics} or {task: {"skipped": reason}} when the task or its data cannot be had. `dtype`:
    eval.harness.dtype ("float32" ignores `autocast_ctx`)."""
    manager = task_manager(include_path)
    lm = GPTHarness(model, device, autocast_ctx, dtype=dtype)
    out: dict[str, dict] = {}
    for task in tasks:  # one at a time: a task that cannot run costs only itself
        if task not in manager.all_tasks:
            out[task] = {"skipped": f"lm-evaluation-harness knows no task {task!r}; check the name "
                         "(`lm-eval ls tasks`) or pass the folder of its YAML (eval.harness.include_path)"}
            continue
        try:
            with random_state_kept(device):
                results = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                          bootstrap_iters=1000, log_samples=False, verbosity="WARNING")
        except Exception as e:  # noqa: BLE001 - the hub unreachable, a file missing: whatever `datasets` raises
            log.warning("harness task %s skipped: %s", task, e)
            out[task] = {"skipped": f"{type(e).__name__}: {e}. Its dataset could not be loaded: connect to the "
                         "Hugging Face hub (or set HF_ENDPOINT to a mirror), or use a local copy through a task "
                         "YAML in eval.harness.include_path"}
            continue
        out.update(summarize(results or {}))
    return out


def task_documents(tasks: list[str], include_path: str | None = None,
                   limit: int | None = None) -> dict[str, list[list[int]] | str]:
    """Each task's evaluated documents as token lists (its prompt and every choice, the text the model
    reads), for the contamination scan (gptcore/evals/scorers/contamination.py); a reason instead for a task that cannot
    be loaded. `limit`: the first documents, as run_tasks scores them."""
    manager = task_manager(include_path)
    out: dict[str, list[list[int]] | str] = {}
    for name in tasks:
        try:
            task = get_task_dict([name], manager).get(name) if name in manager.all_tasks else None
            if not isinstance(task, Task):
                out[name] = "not a single task the harness knows (a group: name its tasks)"
                continue
            docs = list(task.eval_docs)[:limit or None]
            out[name] = [document_tokens(task, doc) for doc in docs]
        except Exception as e:  # noqa: BLE001 - as in run_tasks: the dataset unreachable is a skip
            out[name] = f"{type(e).__name__}: {e}"
    return out


def document_tokens(task, doc) -> list[int]:
    """One document's text as the model reads it: the prompt, then each choice (or the target)."""
    parts = [task.doc_to_text(doc)]
    parts += task.doc_to_choice(doc) if task.OUTPUT_TYPE == "multiple_choice" else [task.doc_to_target(doc)]
    encoding = get_encoding()
    return [t for part in parts if isinstance(part, str) for t in encoding.encode(" " + part, allowed_special="all")]


@contextmanager
def random_state_kept(device):
    """The harness seeds Python's, numpy's and torch's generators (its few-shot sampling is reproducible);
    during training those belong to the run, so they are put back as they were afterwards."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
