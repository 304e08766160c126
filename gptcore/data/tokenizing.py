"""Tokenizing one piece: its documents read (gptcore/data/formats.py), each preceded by EOT (50256, as in
build-nanogpt), encoded with tiktoken's GPT-2 BPE into one uint16 token file, written atomically with its
record (the record last: a record means the data is complete)."""

from __future__ import annotations

import functools
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gptcore.config import RunConfig
from gptcore.data import formats
from gptcore.data.location import DataError
from gptcore.data.planning import Piece, piece_paths, piece_record
from gptcore.data.shard_format import write_shard_chunks
from gptcore.files import atomic_write_bytes
from gptcore.model.tokenizer import EOT, get_encoding


def encode_documents(texts: list[str], threads: int) -> np.ndarray:
    """EOT + tokens of each document, concatenated, as uint16. tiktoken's numpy path gives the same ids
    as encode_ordinary (special-token text stays ordinary text) without building Python int lists;
    its Rust core releases the GIL, so threads run in parallel. The ids go straight into the uint16
    output (no uint32 copy and no max pass: the vocabulary's largest id is checked once, up front)."""
    enc = get_encoding()
    if enc.max_token_value > np.iinfo(np.uint16).max:
        raise DataError(f"token id {enc.max_token_value} does not fit uint16 (max 65535): the tokenizer is not "
                        "GPT-2's 50257-token BPE; shards store uint16 ids, so use gptcore.model.tokenizer")
    one = functools.partial(enc.encode_to_numpy, disallowed_special=())
    if threads > 1 and len(texts) > 1:
        with ThreadPoolExecutor(threads) as ex:
            return join_documents(list(ex.map(one, texts)))
    return join_documents([one(t) for t in texts])


def join_documents(arrays: list[np.ndarray]) -> np.ndarray:
    """EOT before each document's ids, all in one uint16 array (ids already known to fit)."""
    out = np.empty(sum(a.size for a in arrays) + len(arrays), dtype=np.uint16)
    pos = 0
    for a in arrays:
        out[pos] = EOT
        out[pos + 1: pos + 1 + a.size] = a
        pos += 1 + a.size
    return out


def worker_threads(cfg: RunConfig, workers: int | None = None) -> int:
    """tiktoken threads per worker process so that workers (default data.num_workers) x threads ~ cores."""
    cores = os.cpu_count() or 1
    return max(1, cores // (workers or cfg.data.num_workers or cores))


def tokenize_piece(cfg: RunConfig, piece: Piece, threads: int | None = None) -> int:
    """Tokenize one piece into <dataset>/.pieces/piece_NNNNNN.bin (+ .json record), atomically; returns its
    token count. Skips (returns at once) if a verified file for this exact piece is already there."""
    bin_path, rec_path = piece_paths(cfg, piece)
    if (rec := piece_record(cfg, piece)) is not None:
        return rec["tokens"]
    threads = threads or worker_threads(cfg)
    chunks, docs, replaced = [], 0, []
    for texts in formats.read_texts(piece.path, piece.kind, piece.start, piece.stop, cfg.data.text_column,
                                    piece.limit, strict_utf8=cfg.data.strict_utf8, replaced=replaced):
        chunks.append(encode_documents(texts, threads))
        docs += len(texts)
    n = sum(c.size for c in chunks)
    # scratch, so no fsync (docs/data.md): after a crash a piece is redone when its
    # record or length is off, and the cutter re-hashes pieces from earlier runs before using them
    sha = write_shard_chunks(bin_path, chunks, n, durable=False)
    rec = {"key": piece.key(cfg.data.text_column), "tokens": n, "docs": docs, "sha256": sha}
    if sum(replaced):
        rec["invalid_utf8"] = sum(replaced)
        print(f"warning: {piece.path}: {sum(replaced)} invalid UTF-8 sequence(s) replaced by U+FFFD (recorded "
              "in the manifest; data.strict_utf8=true makes this an error)", file=sys.stderr, flush=True)
    atomic_write_bytes(rec_path, [json.dumps(rec).encode()], durable=False)  # after the data: record => data complete
    return n
