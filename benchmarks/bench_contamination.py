"""Contamination scan speed: gptcore/evals/scorers/contamination.py (64-bit rolling n-gram hashes, binary search against
the examples' sorted hashes) against a plain numpy baseline (every 13-token window as a row of bytes,
np.isin against the examples' windows), on the same shard in the same run, and the time it projects for
FineWeb-Edu's 10B training tokens on one core.

    python -m benchmarks.bench_contamination [--tokens 20000000] [--examples 10042] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args
from gptcore.data.shard_format import Manifest, ShardInfo, write_shard
from gptcore.evals.scorers import contamination as C

SMOKE = {"tokens": 200_000, "examples": 100, "rounds": 1}
FULL_DATASET = 10_000_000_000  # FineWeb-Edu sample-10BT


def baseline(tokens: np.ndarray, examples: list[np.ndarray], n: int) -> set[int]:
    """Plain numpy: windows as n-token rows viewed as one opaque value each, np.isin."""
    def rows(t: np.ndarray) -> np.ndarray:
        w = np.lib.stride_tricks.sliding_window_view(t.astype(np.uint16), n)
        return np.ascontiguousarray(w).view(np.dtype((np.void, 2 * n))).ravel()

    wanted = np.concatenate([rows(e) for e in examples])
    owners = np.concatenate([np.full(len(e) - n + 1, i) for i, e in enumerate(examples)])
    hit = np.isin(wanted, rows(tokens))
    return {int(i) for i in owners[hit]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20_000_000, help="tokens in the shard scanned")
    ap.add_argument("--examples", type=int, default=10_042, help="evaluation examples (HellaSwag has 10,042)")
    ap.add_argument("--rounds", type=int, default=3)
    a = parse_args(ap, argv, SMOKE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50257, a.tokens).astype(np.uint16)
    examples = [rng.integers(0, 50257, 120) for _ in range(a.examples)]  # ~HellaSwag's context + 4 endings
    for i in range(0, a.examples, max(1, a.examples // 10)):  # a tenth of a percent-ish planted
        start = int(rng.integers(0, a.tokens - 20))
        examples[i][5:25] = tokens[start:start + 20]
    n = C.NGRAM
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        Manifest(shard_tokens=a.tokens, source={"bench": 0},
                 shards=[ShardInfo("s_train_0.bin", "train", a.tokens, write_shard(d / "s_train_0.bin", tokens))]
                 ).save(d)
        manifest = Manifest.load(d)
        ours_s, base_s = [], []
        for _ in range(a.rounds):  # alternated
            t0 = time.perf_counter()
            hashes, owners = C.example_hashes(examples, n)
            unique = np.unique(hashes)
            seen = unique[C.scan(d, manifest, unique, n)]
            ours = {int(i) for i in owners[np.isin(hashes, seen)]}
            ours_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            base = baseline(tokens, examples, n)
            base_s.append(time.perf_counter() - t0)
            assert ours == base, (sorted(ours)[:5], sorted(base)[:5])
    ours_tps = a.tokens / statistics.median(ours_s)
    base_tps = a.tokens / statistics.median(base_s)
    ratios = [b / o for o, b in zip(ours_s, base_s, strict=True)]
    print(f"scan {a.tokens:,} tokens against {a.examples:,} examples (n={n}, {len(ours)} found, same as the "
          f"baseline): ours {ours_tps / 1e6:.1f}M tok/s | numpy baseline {base_tps / 1e6:.1f}M tok/s | ratio "
          f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"projected for {FULL_DATASET / 1e9:.0f}B tokens on one core: {FULL_DATASET / ours_tps / 60:.1f} min "
          f"(once per dataset and n; cached beside the manifest)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
