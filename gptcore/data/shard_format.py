"""The token shard format and the dataset manifest (the on-disk format; gptcore.data.build makes datasets
in it): the one reader and writer everyone uses.

A shard is llm.c's layout, so shards interoperate with llm.c and modded-nanogpt:

    header: 256 x int32 (1024 bytes)
        [0] magic   20240520
        [1] version 1        (uint16 tokens)
        [2] number of tokens in this shard
        [3..255] zero
    body:   the tokens, uint16, little-endian

A dataset directory holds shards named `<name>_<split>_<index:06d>.bin` and a `manifest.json` that
records, per shard, its split, token count, sha256 and the source range it came from. The manifest
id (a hash of its content) is the dataset's identity: checkpoints and registered models carry it.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gptcore.files import atomic_write_bytes, cached_sha256, file_sha256, read_json, write_json

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MANIFEST = "manifest.json"


class ShardError(RuntimeError):
    """A shard or manifest is missing, truncated, corrupt or of the wrong format."""


def shard_header(n_tokens: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, n_tokens
    return header.tobytes()


def write_shard(path: Path, tokens: np.ndarray) -> str:
    """Atomically write `tokens` as a shard; returns the file's sha256."""
    tokens = np.asarray(tokens)
    return write_shard_chunks(path, [tokens], tokens.size)


def write_shard_chunks(path: Path, chunks, n_tokens: int, durable: bool = True) -> str:
    """Like write_shard, but from an iterable of token arrays (e.g. memmap slices), so a shard is never
    held in memory as one array. `n_tokens` goes into the header and must equal the chunks' total."""
    h = hashlib.sha256()

    def body():
        header = shard_header(n_tokens)
        h.update(header)
        yield header
        written = 0
        for chunk in chunks:
            chunk = np.asarray(chunk)
            if chunk.dtype != TOKEN_DTYPE and chunk.size and (
                    chunk.min() < 0 or chunk.max() > np.iinfo(TOKEN_DTYPE).max):
                raise ShardError(f"token ids must fit uint16 (0..65535); got {chunk.min()}..{chunk.max()}")
            data = memoryview(np.ascontiguousarray(chunk, dtype=TOKEN_DTYPE)).cast("B")
            h.update(data)
            written += chunk.size
            yield data
        if written != n_tokens:
            raise ShardError(f"shard {path}: header says {n_tokens} tokens but {written} were given")

    atomic_write_bytes(path, body(), durable)
    return h.hexdigest()


def read_shard(path: Path) -> np.ndarray:
    """Memory-map a shard's tokens (uint16), after checking its header against the file size."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"shard {path} does not exist; re-run the tokenize stage to rebuild it")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"shard {path} is truncated ({size} bytes, smaller than the 1024-byte header)")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path} is not a token shard (magic {header[0]}, expected {MAGIC}); "
                         "it may be from another tool or format")
    if header[1] != VERSION:
        raise ShardError(f"shard {path} has version {header[1]}; only version {VERSION} (uint16 GPT-2 "
                         "tokens) is supported")
    n = int(header[2])
    expected = HEADER_BYTES + n * TOKEN_DTYPE.itemsize
    if size != expected:
        raise ShardError(f"shard {path} is truncated or padded: header says {n} tokens ({expected} bytes), "
                         f"file has {size} bytes; delete it and re-run the tokenize stage")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n,))


@dataclass
class ShardInfo:
    name: str  # file name inside the dataset directory
    split: str  # "train" | "val"
    tokens: int
    sha256: str
    source_range: dict = field(default_factory=dict)  # where its tokens came from (free-form, for lineage)


@dataclass
class Manifest:
    tokenizer: str = "gpt2"
    dtype: str = "uint16"
    shard_tokens: int = 0
    source: dict = field(default_factory=dict)  # what was tokenized (source id, files, hashes)
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def id(self) -> str:
        """Content hash: the dataset's identity for lineage (checkpoints, registered models)."""
        body = json.dumps(self._body(), sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()[:16]

    def _body(self) -> dict:
        return {"tokenizer": self.tokenizer, "dtype": self.dtype, "shard_tokens": self.shard_tokens,
                "source": self.source, "shards": [asdict(s) for s in self.shards]}

    def split(self, split: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split]

    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def save(self, directory: Path) -> None:
        write_json(Path(directory) / MANIFEST, {"id": self.id, **self._body()})

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ShardError(f"no {MANIFEST} in {directory}: the dataset was never (completely) tokenized; "
                             "run the tokenize stage first")
        doc = read_json(path)  # None when unreadable: a TypeError below
        try:
            m = cls(tokenizer=doc["tokenizer"], dtype=doc["dtype"], shard_tokens=doc["shard_tokens"],
                    source=doc.get("source", {}), shards=[ShardInfo(**s) for s in doc["shards"]])
        except (KeyError, TypeError, AttributeError) as e:
            raise ShardError(f"{path} is not a valid manifest ({e}); delete it and re-run tokenize") from e
        if m.tokenizer != "gpt2" or m.dtype != "uint16":
            raise ShardError(f"dataset {directory} was made with tokenizer={m.tokenizer} dtype={m.dtype}; "
                             "this pipeline trains on gpt2/uint16 shards: re-tokenize it")
        if doc.get("id") not in (None, m.id):
            raise ShardError(f"{path} was edited by hand (id mismatch); re-run tokenize to rebuild it")
        return m

    def verify(self, directory: Path, full: bool = False, hashes: dict | None = None) -> list[str]:
        """Names of shards that are missing or broken. Size and header are always checked; `full` also
        checks every file's sha256: with a `hashes` cache (files.cached_sha256's records), only files whose
        size, mtime or inode changed are re-hashed, else every one is (slow for 10B tokens)."""
        bad = []
        for s in self.shards:
            path = Path(directory) / s.name
            try:
                if len(read_shard(path)) != s.tokens or (full and (
                        cached_sha256(path, hashes, s.name) if hashes is not None else file_sha256(path)) != s.sha256):
                    bad.append(s.name)
            except (ShardError, OSError):
                bad.append(s.name)
        return bad

    def verify_hashes(self, directory: Path, cache: Path, rehash_all: bool = False) -> list[str]:
        """Names of shards that are missing or whose bytes do not hash to their sha256 here, re-hashing only
        files whose size, mtime or inode changed since `cache` (a JSON file, kept for this manifest's shards
        when the directory is writable) last saw them; `rehash_all`: every file. The one cached check: the
        trainer's before its first step, and the data stage's skip decision."""
        known = {} if rehash_all else read_json(cache, {})
        hashes = {s.name: known.get(s.name) for s in self.shards}
        bad = self.verify(directory, full=True, hashes=hashes)
        if hashes != known:
            with suppress(OSError):  # a read-only directory is checked all the same, only not remembered
                write_json(cache, hashes)
        return bad
