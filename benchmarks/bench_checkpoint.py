"""What a verified checkpoint costs at GPT-2 124M: writing one (weights, optimizer state, both hashes,
fsync) and resuming from one (both hashes, load, finite check) against the plain load it protects,
measured in the same run. Sizes the shutdown grace (docs/training.md "Shutdown grace").

    python -m benchmarks.bench_checkpoint [--rounds 3] [--dir /path/on/the/storage/to/measure]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gptcore import checkpoint as C
from gptcore.config import OptimConfig, model_preset
from gptcore.files import file_sha256
from gptcore.model import GPT
from gptcore.optim import adamw


def trained_state():
    torch.manual_seed(0)
    model = GPT(model_preset("gpt2"))
    opt = adamw(model.parameters(), OptimConfig(), "cpu")
    for p in model.parameters():  # optimizer state of the real size without a 124M forward pass
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"optimizer": opt.state_dict(), "loader": {"position": 0}, "rng": [{"torch": torch.get_rng_state()}],
             "scaler": {}, "step": 1, "world": 1}
    return model, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on this disk)")
    a = ap.parse_args(argv)
    model, state = trained_state()
    rows: dict[str, list[float]] = {k: [] for k in ("save", "hash both", "plain load", "verified load")}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        run = Path(d)
        for r in range(a.rounds):
            t = time.perf_counter()
            ck = C.save_checkpoint(run, r + 1, model, state, {"run_name": "bench"}, keep_last=1)
            rows["save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            file_sha256(ck / C.MODEL_FILE), file_sha256(ck / C.TRAINER_FILE)
            rows["hash both"].append(time.perf_counter() - t)
            target = GPT(model_preset("gpt2"))
            t = time.perf_counter()
            C.load_weights(target, ck / C.MODEL_FILE)
            C.load_trainer_state(ck)
            rows["plain load"].append(time.perf_counter() - t)
            t = time.perf_counter()
            C.load_for_resume(ck, target)
            rows["verified load"].append(time.perf_counter() - t)
        sizes = {f.name: f.stat().st_size for f in ck.iterdir()}
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"gpt2 124M checkpoint: {', '.join(f'{k} {v / 1e6:.0f} MB' for k, v in sorted(sizes.items()))}")
    for k, v in rows.items():
        print(f"  {k:14s} median {med[k]:6.2f} s  (min {min(v):.2f}, max {max(v):.2f}, {len(v)} rounds)")
    print(f"  verification adds {med['verified load'] / med['plain load']:.2f}x the plain load at resume "
          f"({med['verified load'] - med['plain load']:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
