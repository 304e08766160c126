"""What the loaders' bit-rot checks cost a node, against a baseline measured in the same run: every rank
of a node hashing every shard its steps read (the loaders before issue 44) vs one loader per node (local
rank 0) hashing every shard any rank reads.

    python -m benchmarks.bench_bitrot [--ranks 8] [--shards 6] [--shard-tokens 20000000]
    python -m benchmarks.bench_bitrot --smoke

Both read the same epoch of a dataset on this machine's disk, `--ranks` loaders stepping together as the
ranks of one node do; what counts is the sha256 work the loaders' background threads do (its thread CPU
time, summed). That work is projected as a share of step time at gpt2-124m's rate on one 8-GPU node
(524,288 tokens per step, each shard hashed once per epoch per hashing rank), from the hash rate measured
here: the ratio of the two is the point; the absolute share depends on the step time you plug in
(--step-s, default 0.142 s: 8xH100 at 40% MFU by nanoGPT's FLOP count, the projection when this was
measured; by the project's count now, llm.c's, README's projection says 0.133 s).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from concurrent.futures import wait
from pathlib import Path

import numpy as np

from benchmarks import parse_args
from gptcore.data import loader as loader_module
from gptcore.data.loader import ShardLoader
from gptcore.data.shard_format import Manifest, ShardInfo, write_shard
from gptcore.files import file_sha256

SMOKE = {"ranks": 2, "shards": 3, "shard_tokens": 200_000}
B, T = 8, 1024


def make_dataset(d: Path, shards: int, tokens: int) -> Path:
    rng = np.random.default_rng(0)
    infos = []
    for i in range(shards + 1):
        split = "val" if i == 0 else "train"
        name = f"b_{split}_{i:06d}.bin"
        toks = rng.integers(0, 50257, tokens if i else B * T + 1).astype(np.uint16)
        infos.append(ShardInfo(name, split, len(toks), write_shard(d / name, toks)))
    Manifest(shard_tokens=tokens, source={"bench_bitrot": 0}, shards=infos).save(d)
    return d


def hashing_seconds(dataset: Path, ranks: int, one_per_node: bool) -> tuple[float, int]:
    """(CPU seconds of the loaders' sha256 work over one epoch, shard checks submitted)."""
    spent, lock = [0.0], threading.Lock()

    def timed_sha256(path):  # in the loaders' hashing threads: their own CPU time
        t0 = time.thread_time()
        digest = file_sha256(path)
        with lock:
            spent[0] += time.thread_time() - t0
        return digest

    loader_module.file_sha256 = timed_sha256  # the benchmark's meter, in this process only
    try:
        loaders = [ShardLoader(dataset, B, T, B * T * ranks, seed=1, rank=r, world=ranks,
                               verify_reads=(r == 0) or not one_per_node) for r in range(ranks)]
        while loaders[0].epoch == 0:  # the ranks of one node step together through an epoch
            for L in loaders:
                L.next_batch()
        for L in loaders:
            wait([f for _, f in L._hashes])
    finally:
        loader_module.file_sha256 = file_sha256
    return spent[0], sum(len(L._hashed) for L in loaders)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--shard-tokens", type=int, default=20_000_000)
    ap.add_argument("--step-s", type=float, default=0.142)
    a = parse_args(ap, argv, SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        ds = make_dataset(Path(tmp), a.shards, a.shard_tokens)
        shard = ds / Manifest.load(ds).split("train")[0].name
        t0 = time.perf_counter()
        file_sha256(shard)
        rate = shard.stat().st_size / (time.perf_counter() - t0)  # bytes/s, one thread
        every, every_n = hashing_seconds(ds, a.ranks, one_per_node=False)
        one, one_n = hashing_seconds(ds, a.ranks, one_per_node=True)
    # at gpt2-124m's rate each step consumes 524,288 tokens (1 MB of uint16) per node; every shard byte is
    # hashed once per epoch per hashing rank
    per_step = {n: n * 524_288 * 2 / rate for n in (a.ranks, 1)}
    print(f"{a.ranks} ranks, {a.shards} shards of {a.shard_tokens:,} tokens, one epoch: sha256 {rate / 1e6:,.0f} MB/s")
    print(f"  every rank hashes: {every_n} shard checks, {every:.2f} s of hashing")
    print(f"  one per node:      {one_n} shard checks, {one:.2f} s of hashing ({every / max(one, 1e-9):.1f}x less)")
    print(f"  at gpt2-124m on one 8-GPU node ({a.step_s} s steps): {per_step[a.ranks] / a.step_s:.2%} of step time "
          f"with {a.ranks} hashing ranks, {per_step[1] / a.step_s:.2%} with one (a background thread's share, "
          "read from the page cache; from a network filesystem each rank's reads also cross the network)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
