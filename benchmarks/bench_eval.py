"""Evaluation during training: eager on the plain model (what the trainer does) against a compiled eval
model (`torch.compile` of the same GPT), measured in one run on the same weights, batches and examples.

    python -m benchmarks.bench_eval [--preset tiny-cpu] [--evals 5] [--examples 64] [--val-tokens 8192]
    python -m benchmarks.bench_eval --smoke    # 2 evaluations of one batch + 4 examples (still compiles)

For each way: the first evaluation of an invocation (for the compiled model that includes compiling one
graph per shape it meets) and the median of the later ones. The trainer pays the first one once per
invocation and the later ones every eval step, so the number that decides is the break-even: how many
evaluations an invocation must run before the compiled model has paid back its compile time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import parse_args
from benchmarks.bench_hellaswag import FIXTURE
from gptcore.data.loader import val_batches
from gptcore.evals.scorers import hellaswag
from gptcore.model.gpt import GPT
from gptcore.overrides import load_config
from tests.test_train_utils import make_dataset

SMOKE = {"evals": 2, "examples": 4, "val_tokens": 1024}  # 2: the first evaluation and one later one


@torch.no_grad()
def evaluation(forward, cfg, data_dir: Path, examples) -> float:
    """The forwards of one trainer evaluation through `forward` (the plain model, or a compiled one):
    validation batches through the loss path, then HellaSwag's padded batches, one shape per length
    bucket (gptcore.evals.scorers.hellaswag.score's batching); seconds."""
    t = time.perf_counter()
    for x, y in val_batches(data_dir, cfg.train.micro_batch, cfg.train.seq_len, cfg.eval.val_tokens):
        forward(x, y, return_logits=False)
    block = cfg.model.block_size
    buckets = hellaswag.bucket_lengths(block)
    lengths = sorted(next(b for b in buckets if b >= max(len(t) for t, _ in hellaswag.example_rows(ex, block)))
                     for ex in examples)
    for length in sorted(set(lengths)):
        per_batch = max(1, 512 // (4 * length))  # the scorer's CPU batch: 512 tokens
        for _ in range(0, lengths.count(length), per_batch):
            forward(torch.zeros(4 * per_batch, length, dtype=torch.long))
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--evals", type=int, default=5)
    ap.add_argument("--examples", type=int, default=64, help="HellaSwag examples (the fixture, repeated)")
    ap.add_argument("--val-tokens", type=int, default=8192, help="validation tokens per evaluation")
    a = parse_args(ap, argv, SMOKE)
    if a.evals < 2:
        ap.error("--evals must be >= 2: the first evaluation and at least one later one")
    cfg = load_config(a.preset, ["train.micro_batch=4", "train.seq_len=256", f"eval.val_tokens={a.val_tokens}"])
    records = hellaswag.read_records(FIXTURE)
    examples = [hellaswag.make_example(*records[i % len(records)]) for i in range(a.examples)]
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    with tempfile.TemporaryDirectory() as d:
        data = make_dataset(Path(d), sizes=(20_000, 20_000), seed=1)
        times = {}
        for name, target in (("eager (trainer)", model), ("compiled", torch.compile(model))):
            times[name] = [evaluation(target, cfg, data, examples) for _ in range(a.evals)]
    print(f"{a.preset}: validation {cfg.eval.val_tokens:,} tokens + HellaSwag {a.examples} examples per evaluation")
    for name, t in times.items():
        print(f"  {name:16s} first {t[0]:7.2f} s, later median {statistics.median(t[1:]):.2f} s "
              f"({min(t[1:]):.2f}..{max(t[1:]):.2f}, {len(t) - 1} evaluations)")
    eager, compiled = times["eager (trainer)"], times["compiled"]
    saved = statistics.median(eager[1:]) - statistics.median(compiled[1:])
    extra = compiled[0] - eager[0]
    if saved > 0:
        print(f"  compiled saves {saved:.2f} s per evaluation after a {extra:.1f} s first evaluation: it pays back "
              f"after {extra / saved:.0f} evaluations in one invocation")
    else:
        print(f"  compiled is not faster after its first evaluation ({-saved:.2f} s slower); its first costs "
              f"{extra:.1f} s more")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
