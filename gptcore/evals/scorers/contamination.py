"""Contamination: which evaluation examples share a 13-token n-gram with the training shards.

GPT-3 (appendix C) called a benchmark example contaminated when one of its 13-grams occurs in the training
data. FineWeb-Edu is web text and HellaSwag comes from web text too, so the share matters when comparing a
reproduction with published numbers.

    report = contamination(dataset_dir, {"hellaswag": [tokens, ...]}, n=13)
    # {"hellaswag": {"n": 13, "examples": 10042, "contaminated": 17, "share": 0.0017, "ids": [...]}}

How: every n-gram is hashed to 64 bits (a polynomial rolling hash over the uint16 tokens, computed with a
few vectorised numpy passes per shard). The examples' n-grams are few (a million for HellaSwag); the
shards' are many (10B for FineWeb-Edu's sample, 80 GB as hashes), so the shards are scanned once against
the sorted set of the examples' hashes rather than stored. The answer is cached beside the manifest,
keyed by the manifest id, n and the examples' content, and reused by every later evaluation and run.
A hash collision can only add a false positive, with odds about 1e-19 per comparison.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from gptcore.data.shard_format import Manifest, read_shard
from gptcore.files import read_json, write_json

NGRAM = 13
CHUNK = 1 << 24  # n-grams hashed at a time (256 MB of uint64 working memory, whatever the shard's size)
FILTER_BITS = 26  # the scan's first filter: 64 MB of booleans, ~2% of lookups pass for a million n-grams
CACHE_DIR = "contamination"  # under the dataset directory, beside manifest.json
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier: the hash is a polynomial in it, mod 2^64


def ngram_hashes(tokens: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """The 64-bit hash of every n-gram of `tokens` (len - n + 1 of them; none when shorter than n)."""
    t = np.asarray(tokens).astype(np.uint64) + np.uint64(1)  # +1: token 0 still moves the hash
    m = len(t) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):  # mod 2^64 arithmetic is the point
        for j in range(n):  # in place: no temporary the size of the shard per pass
            np.multiply(h, _BASE, out=h)
            np.add(h, t[j:j + m], out=h)
    return h


def example_hashes(examples: list[list[int]], n: int = NGRAM) -> tuple[np.ndarray, np.ndarray]:
    """Every example's n-gram hashes, concatenated, and beside each the index of its example."""
    hashes = [np.unique(ngram_hashes(np.asarray(toks, dtype=np.int64), n)) for toks in examples]
    owners = [np.full(len(h), i, dtype=np.int64) for i, h in enumerate(hashes)]
    if not hashes:
        return np.empty(0, np.uint64), np.empty(0, np.int64)
    return np.concatenate(hashes), np.concatenate(owners)


def scan(dataset_dir: Path, manifest: Manifest, wanted: np.ndarray, n: int = NGRAM,
         split: str = "train") -> np.ndarray:
    """Which of `wanted` (sorted, unique hashes) occur among the n-grams of the dataset's `split` shards: a
    boolean mask aligned with it."""
    found = np.zeros(len(wanted), dtype=bool)
    if not len(wanted):
        return found
    # a first filter, one table lookup per n-gram: the wanted hashes' low FILTER_BITS bits; only the rare
    # n-grams that pass it are looked up exactly (binary search in `wanted`)
    mask = np.uint64((1 << FILTER_BITS) - 1)
    table = np.zeros(1 << FILTER_BITS, dtype=bool)
    table[(wanted & mask).astype(np.int64)] = True
    for shard in manifest.split(split):
        tokens = read_shard(Path(dataset_dir) / shard.name)
        # in chunks that overlap by n - 1 tokens: every n-gram once, ~16 bytes of hashes per token at a time
        for start in range(0, max(len(tokens) - n + 1, 0), CHUNK):
            h = ngram_hashes(tokens[start:start + CHUNK + n - 1], n)
            h = h[table[(h & mask).astype(np.int64)]]
            idx = np.searchsorted(wanted, h)
            idx[idx == len(wanted)] = 0
            found[idx[wanted[idx] == h]] = True
    return found


def contamination(dataset_dir: Path, evaluations: dict[str, list[list[int]]], n: int = NGRAM) -> dict:
    """Per evaluation: how many of its examples (each a token list: context and endings together) share an
    n-gram with the training shards. Cached per (manifest, n, examples) under <dataset>/contamination/;
    the evaluations not cached yet share one scan of the shards."""
    dataset_dir = Path(dataset_dir)
    manifest = Manifest.load(dataset_dir)
    out, todo = {}, {}
    for name, examples in evaluations.items():
        content = hashlib.sha256(json.dumps([n, examples]).encode()).hexdigest()[:16]
        cache = dataset_dir / CACHE_DIR / f"{name.replace('/', '--')}-n{n}-{manifest.id}-{content}.json"
        out[name] = read_json(cache, {})
        if not out[name]:
            todo[name] = (cache, *example_hashes(examples, n))
    if todo:
        unique = np.unique(np.concatenate([hashes for _, hashes, _ in todo.values()]))
        seen = unique[scan(dataset_dir, manifest, unique, n)]
        for name, (cache, hashes, owners) in todo.items():
            examples = evaluations[name]
            ids = sorted({int(i) for i in owners[np.isin(hashes, seen)]})
            out[name] = {"n": n, "examples": len(examples), "contaminated": len(ids),
                         "share": len(ids) / len(examples) if examples else 0.0, "ids": ids,
                         "manifest_id": manifest.id}
            try:
                write_json(cache, out[name])
            except OSError:  # a read-only dataset: reported all the same, only not remembered
                pass
    return out
