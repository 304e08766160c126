"""lm-evaluation-harness requests per second: our adapter (gptcore/evals/scorers/harness.py) against the harness's own
Hugging Face model class on the HF export of the same weights, on the same requests in the same run.

    python -m benchmarks.bench_harness [--preset tiny-cpu] [--requests 256] [--rounds 3] [--smoke]

The requests are HellaSwag-shaped log-likelihoods (contexts and endings from the bundled fixture, each
context numbered so that no two requests are identical), the kind GPT-2's suite is made of. The two are
timed alternately, --rounds times; the line reports the median ratio with its spread. Target: the adapter
>= 1.0x the HF model class.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from benchmarks import parse_args
from gptcore.evals.scorers import hellaswag
from gptcore.evals.scorers.harness import GPTHarness
from gptcore.model.gpt import GPT
from gptcore.model.hf import export_hf
from gptcore.presets import model_preset

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hellaswag_mini.jsonl"
SMOKE = {"requests": 16, "rounds": 1, "preset": "micro"}


def make_requests(n: int) -> list[Instance]:
    records = hellaswag.read_records(FIXTURE)
    args = [(ctx, " " + ending) for ctx, endings, _ in records for ending in endings]
    # every request distinct (a numbered context): the harness's HF class computes identical ones once
    return [Instance(request_type="loglikelihood", doc={}, idx=i,
                     arguments=(f"Example {i}. {args[i % len(args)][0]}", args[i % len(args)][1])) for i in range(n)]


def timed(lm, requests) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = lm.loglikelihood(requests, disable_tqdm=True)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-cpu", help="model preset (gptcore.presets.MODEL_PRESETS)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = parse_args(ap, argv, SMOKE)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(model_preset(a.preset)).eval()
    requests = make_requests(a.requests)
    with tempfile.TemporaryDirectory() as tmp:
        ours = GPTHarness(model, "cpu")
        theirs = HFLM(pretrained=str(export_hf(model, Path(tmp) / "hf")), device="cpu", batch_size=16,
                      dtype="float32")
        ratios, worst = [], 0.0
        for _ in range(a.rounds):  # alternated: drift in the machine's speed hits both alike
            t_ours, got = timed(ours, requests)
            t_theirs, want = timed(theirs, requests)
            ratios.append(t_theirs / t_ours)
            worst = max(worst, max(abs(x[0] - y[0]) for x, y in zip(got, want, strict=True)))
    ratio = statistics.median(ratios)
    print(f"{a.preset}: ours {a.requests / t_ours:,.1f} req/s | lm-eval HFLM {a.requests / t_theirs:,.1f} req/s "
          f"| ratio {ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds) "
          f"| largest log-likelihood difference {worst:.1e}")
    print(f"target (ours >= 1.0x HFLM): {'met' if ratio >= 1.0 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
