"""HellaSwag scoring speed: the batched scorer vs one ending at a time (build-nanogpt's loop, minus
its per-example padding), on the same model and examples in the same run.

    python -m benchmarks.bench_hellaswag [--preset tiny-cpu] [--examples 64] [--file hellaswag_val.jsonl] [--smoke]

Without --file it scores the hand-written fixture examples (repeated to --examples). Also used by the
tests as the independent reference implementation (`reference_scores`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from benchmarks import parse_args
from gptcore import distributed
from gptcore.config import TrainConfig
from gptcore.evals.scorers import hellaswag
from gptcore.model.gpt import GPT
from gptcore.model.tokenizer import encode
from gptcore.presets import model_preset

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hellaswag_mini.jsonl"
SMOKE = {"examples": 8, "repeats": 1, "threads": 1}  # the fixture's 7 examples and one repeated


@torch.no_grad()
def reference_scores(model: torch.nn.Module, records: list[tuple[str, list[str], int]], device="cpu"):
    """Straightforward definition: for each ending, one forward over ctx + " " + ending, cross-entropy
    of the ending tokens given everything before them. Returns lists of (summed, mean) losses."""
    model.eval()
    sums, means = [], []
    for ctx, endings, _ in records:
        ctx_tokens = encode(ctx)
        s_row, m_row = [], []
        for ending in endings:
            end_tokens = encode(" " + ending)
            tokens = torch.tensor([ctx_tokens + end_tokens], device=device)
            logits, _ = model(tokens)
            # logits at position p predict token p+1; the ending starts at len(ctx_tokens)
            pred = logits[0, len(ctx_tokens) - 1:-1].float()
            losses = F.cross_entropy(pred, tokens[0, len(ctx_tokens):], reduction="none")
            s_row.append(losses.sum().item())
            m_row.append(losses.mean().item())
        sums.append(s_row)
        means.append(m_row)
    return sums, means


def reference_accuracy(model: torch.nn.Module, records, device="cpu") -> dict:
    sums, means = reference_scores(model, records, device)
    labels = [r[2] for r in records]
    acc = sum(min(range(4), key=s.__getitem__) == y for s, y in zip(sums, labels, strict=True))
    acc_norm = sum(min(range(4), key=m.__getitem__) == y for m, y in zip(means, labels, strict=True))
    return {"acc": acc / len(records), "acc_norm": acc_norm / len(records), "n": len(records)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-cpu", help="model preset (gptcore.presets.MODEL_PRESETS)")
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--file", default=str(FIXTURE), help="a HellaSwag jsonl (default: the test fixture)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (both paths use it)")
    args = parse_args(ap, argv, SMOKE)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = distributed.select(TrainConfig(device=args.device))
    device, autocast_ctx = env.device, env.autocast()
    model = GPT(model_preset(args.preset)).to(device).eval()
    if args.compile:
        model = torch.compile(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    records = hellaswag.read_records(Path(args.file), args.examples)
    records = (records * (args.examples // len(records) + 1))[:args.examples]
    examples = [hellaswag.make_example(*r) for r in records]

    # warm-up of both paths (allocator, kernels, and with --compile every shape each path needs: a few
    # buckets for the batched scorer, one per distinct length for the reference), then steady state
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # graphs compiled so far
    g0, t0 = graphs(), time.perf_counter()
    hellaswag.evaluate(model, examples, device, autocast_ctx)
    sync()
    g1, t1 = graphs(), time.perf_counter()
    with autocast_ctx:
        reference_accuracy(model, records, device)
    sync()
    g2, t2 = graphs(), time.perf_counter()
    first_pass = {"batched_s": round(t1 - t0, 2), "reference_s": round(t2 - t1, 2),
                  "batched_graphs": g1 - g0, "reference_graphs": g2 - g1}
    # interleaved repeats, best of each: the machine is shared, so single timings are noisy
    t_batched = t_ref = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        batched = hellaswag.evaluate(model, examples, device, autocast_ctx)
        sync()
        t_batched = min(t_batched, time.perf_counter() - t0)
        t0 = time.perf_counter()
        with autocast_ctx:
            ref = reference_accuracy(model, records, device)
        sync()
        t_ref = min(t_ref, time.perf_counter() - t0)

    result = {"preset": args.preset, "device": str(device), "compile": args.compile,
              "examples": len(examples),
              "batched_examples_per_s": round(len(examples) / t_batched, 2),
              "reference_examples_per_s": round(len(examples) / t_ref, 2),
              "speedup": round(t_ref / t_batched, 2),
              "first_pass": first_pass,  # includes compilation with --compile
              "batched": batched, "reference": ref, "same_result": batched == ref}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
