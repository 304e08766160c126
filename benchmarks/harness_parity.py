"""Harness scores against Hugging Face's fp32 forward, on this device: the GPU acceptance row for
eval.harness.dtype=float32 (the default).

    python -m benchmarks.harness_parity [--device cuda]

A GPT-2-shaped model (gpt2-124m's shape on CUDA, a small one on CPU; random weights from a fixed seed) is
exported with gptcore.model.hf.export_hf and loaded back with transformers' GPT2LMHeadModel in fp32. Per-continuation
log-likelihoods of 16 (context, continuation) token sequences are computed as the lm-evaluation-harness
adapter computes them (gptcore.evals.scorers.harness_scoring: the same function GPTHarness calls, in the precision
eval.harness.dtype=float32 picks, with the trainer's bf16 autocast passed in as during training) and by a
plain transformers forward of each sequence alone. The row passes when they agree to 1e-4 nats.

Needs torch, transformers, tiktoken and safetensors; not lm-eval (the bare CUDA image lacks it).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

TOLERANCE = 1e-4  # nats, per continuation: fp32 kernels differ in summation order, not in precision
SEQUENCES = 16


def parity_model(device: torch.device):
    """gpt2-124m's shape on CUDA, a small one on CPU; random weights from a fixed seed, every parameter
    (LayerNorms and biases too, which a fresh init leaves at 1 and 0) perturbed so that an export mistake
    in any of them shows."""
    from gptcore.config import ModelConfig
    from gptcore.model.gpt import GPT
    from gptcore.presets import model_preset

    cfg = model_preset("gpt2") if device.type == "cuda" else ModelConfig(block_size=128, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to(device).eval()


def sequences(block_size: int, n: int = SEQUENCES) -> list[tuple[list[int], list[int]]]:
    """n (context, continuation) token pairs of spread lengths, up to a whole block (the longest input the
    model takes), so that the adapter pads several lengths into shared batches."""
    from gptcore.model.tokenizer import N_VOCAB

    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(n):
        cont_len = 1 + i % 8
        total = max(cont_len + 1, (block_size + 1) * (i + 1) // n)  # the last: block_size + 1 tokens
        ids = torch.randint(0, N_VOCAB, (total,), generator=g).tolist()
        out.append((ids[:-cont_len], ids[-cont_len:]))
    return out


@torch.no_grad()
def reference_scores(hf_model, pairs: list[tuple[list[int], list[int]]], device: torch.device) -> list[float]:
    """Each continuation's log-likelihood from a plain transformers forward of its sequence alone (no
    batching, no padding): the positions before each continuation token predict it."""
    out = []
    for context, continuation in pairs:
        ids = torch.tensor((context + continuation)[:-1], device=device)[None]
        logits = hf_model(input_ids=ids).logits[0, -len(continuation):].float()
        target = torch.tensor(continuation, device=device)
        out.append(float(F.log_softmax(logits, dim=-1).gather(1, target[:, None]).sum()))
    return out


def check_harness_parity(device: torch.device) -> tuple[bool | None, str]:
    """(passed, detail): the adapter's continuation log-likelihoods (eval.harness.dtype=float32, the trainer's
    bf16 autocast passed in) against transformers' fp32 forward of the exported weights, max |difference|
    <= 1e-4 over 16 sequences. None when transformers is not installed (nothing to compare with)."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        return None, f"transformers is not installed ({e}); pip install transformers to compare with its forward"
    from gptcore.evals.scorers.harness_scoring import continuation_scores, full_fp32, scoring_context
    from gptcore.model.hf import export_hf

    model = parity_model(device)
    pairs = sequences(model.config.block_size)
    trainer_autocast = torch.autocast(device.type, dtype=torch.bfloat16)  # what a run's evaluation passes
    with scoring_context("float32", trainer_autocast):
        ours = [score for score, _ in continuation_scores(model, pairs, device)]
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = GPT2LMHeadModel.from_pretrained(str(export_hf(model, Path(tmp) / "hf")))
    hf_model = hf_model.to(device=device, dtype=torch.float32).eval()
    with full_fp32():  # the reference in fp32 proper, whatever TF32 setting this process has
        theirs = reference_scores(hf_model, pairs, device)
    worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    cfg = model.config
    detail = (f"max |log-likelihood difference| {worst:.2e} nats over {len(pairs)} sequences (pass <= "
              f"{TOLERANCE:.0e}): the adapter's scoring at eval.harness.dtype=float32 against transformers' "
              f"GPT2LMHeadModel fp32 forward of the HF export ({cfg.n_layer} layers x {cfg.n_embd}, "
              f"{sum(len(c) + len(k) for c, k in pairs):,} tokens, {device.type})")
    return worst <= TOLERANCE, detail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    ok, detail = check_harness_parity(torch.device(a.device))
    print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  harness parity  {detail}")
    return 1 if ok is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
