"""Continuation log-likelihoods from our GPT's forward: the pure-torch half of the lm-evaluation-harness
adapter (gptcore/evals/scorers/harness.py), kept apart from it so that what has no lm-eval (the GPU acceptance image:
benchmarks/harness_parity.py) scores exactly as the adapter does.

    with scoring_context(cfg.eval.options("harness").dtype, autocast_ctx):
        scores = continuation_scores(model, [(context_tokens, continuation_tokens), ...], device)

eval.harness.dtype picks the precision: "float32" scores in full fp32 whatever the caller's autocast (the
scores are then comparable across cards and with Hugging Face's fp32 forward: bf16 autocast moved them by
up to 0.126 nats on CPU, with greedy flips); "autocast" uses the caller's autocast context (faster on big
models, scores that depend on the card's precision).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F

from gptcore.model.tokenizer import EOT

BATCH_TOKENS = 4096  # tokens per forward pass (rows x padded length): the logits are 50,257 wide per token


def scoring_context(dtype_setting: str, autocast_ctx=None) -> AbstractContextManager:
    """The context harness log-likelihoods are computed under, from eval.harness.dtype: "float32" = no
    autocast and full-precision fp32 matmuls (the model's fp32 weights as they are); "autocast" = the
    caller's autocast context (none when the caller has none)."""
    if dtype_setting == "float32":
        return full_fp32()
    if dtype_setting == "autocast":
        return autocast_ctx or nullcontext()
    raise ValueError(f"eval.harness.dtype={dtype_setting!r}; use float32 or autocast")


@contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matmuls without TF32 for the block: on CUDA the trainer turns TF32 on for the whole process
    (gptcore/distributed.use_tf32), which rounds fp32 inputs to 10 mantissa bits and would make "float32"
    scores card-dependent again. Set and restored through the same switches use_tf32 sets."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch 2.9+
        before = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        before, allowed = torch.get_float32_matmul_precision(), matmul.allow_tf32
        torch.set_float32_matmul_precision("highest")
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = allowed
            torch.set_float32_matmul_precision(before)


@torch.no_grad()
def continuation_scores(model: torch.nn.Module, requests: list[tuple[list[int], list[int]]], device,
                        batch_tokens: int = BATCH_TOKENS) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per (context tokens,
    continuation tokens), under whatever precision context the caller entered. `model` is a plain GPT
    (forward(idx) -> (logits over the real vocabulary, loss)), put in eval mode for the call. The input is
    the last block_size tokens before each continuation token, as the harness's HF model class truncates;
    rows of similar length share a forward, padded on the right (causal: padding never reaches a scored
    position)."""
    max_length = model.config.block_size
    rows = []
    for context, continuation in requests:
        whole = (list(context) + list(continuation))[-(max_length + 1):]
        rows.append((whole[:-1], list(continuation)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    was_training = model.training
    model.eval()
    try:
        i = 0
        while i < len(order):
            width = len(rows[order[i]][0])
            batch = order[i:i + max(1, batch_tokens // max(width, 1))]
            i += len(batch)
            x = torch.full((len(batch), width), EOT, dtype=torch.long)
            for r, k in enumerate(batch):
                inp = rows[k][0]
                x[r, :len(inp)] = torch.tensor(inp)
            logits, _ = model(x.to(device))
            for r, k in enumerate(batch):
                inp, cont = rows[k]
                n = len(cont)
                # the positions that predict the continuation only: no softmax over the context's
                lp = F.log_softmax(logits[r, len(inp) - n:len(inp)].float(), dim=-1)
                target = torch.tensor(cont, device=lp.device)
                score = float(lp.gather(1, target[:, None]).sum())
                out[k] = (score, bool((lp.argmax(-1) == target).all()))
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]
