"""Tokenize-and-shard: source text -> GPT-2 token shards (llm.c layout) + manifest.json.

    pieces = plan_pieces(cfg, source_dir)      # fixed contiguous document ranges of the source
    for p in pieces: tokenize_piece(cfg, p)    # in parallel (processes / Prefect tasks), any order
    manifest = ShardCutter(cfg, pieces).finish()   # cut shards from the ordered concatenation of pieces

    manifest = build(cfg, tokenize)            # all of it: fetch, plan, `tokenize` runs the pieces (a process
                                               # pool in run(), Prefect tasks in tasks/tokenize.py), cut as they finish

Every document is preceded by EOT (50256), as in build-nanogpt. Shards hold exactly data.shard_tokens
tokens (the last one fewer); documents may span shards and no token is dropped. Shard 0 is `val`.

Why pieces: a piece is a range of documents fixed by the source alone (not by the number of workers),
so workers can finish in any order and the shards, cut afterwards from the pieces in order, are
byte-identical for 1 or N workers. Each piece file and each shard is written atomically and recorded
with its sha256, so a run killed at any point (even SIGKILL) redoes only what is missing or broken.
The manifest is written last: its presence means the dataset is complete.

CLI: python -m gptcore.data.build <preset|file.toml> [data.key=value ...] [--full-verify]
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gptcore.config import RunConfig, pipeline_home
from gptcore.data import formats, sources
from gptcore.data.shard_format import MANIFEST, Manifest, ShardError, ShardInfo, read_shard, write_shard_chunks
from gptcore.files import (
    atomic_write_bytes,
    cached_sha256,
    file_sha256,
    free_disk,
    read_json,
    remove_stale_temps,
    write_json,
)
from gptcore.runlock import LockHeld, LocksUnsupported, RunLock
from gptcore.tokenizer import EOT, RANK_FILE_SHA256, get_encoding

PIECES = ".pieces"  # work area inside the dataset dir; removed once the manifest is written
PROGRESS = ".progress.json"  # shards written so far (so a resumed build skips them)
SHARD_HASHES = "shard_hashes.json"  # verified sha256 per shard by (size, mtime, inode): checks re-hash what changed
BYTES_PER_TOKEN = 3.0  # conservative (English ~4.2 bytes/token): for the free-disk estimate only


class DataError(RuntimeError):
    """Tokenize-and-shard cannot proceed; the message names the problem and the fix."""


@dataclass(frozen=True)
class Piece:
    index: int
    path: str  # source file, absolute
    kind: str  # formats.kind_of (parquet, jsonl, json.gz, txt, ...)
    name: str  # the file's stable name (lineage)
    file_id: str  # sha256 of the file's content: a changed file invalidates its pieces
    start: int  # parquet: first row group; uncompressed JSON Lines: byte offset; else 0
    stop: int  # parquet: end row group (exclusive); uncompressed JSON Lines: end byte offset; else file size
    limit: int = -1  # documents to take (data.max_docs cap), -1 = all
    est_bytes: int = 0  # approximate text bytes (progress bars, disk estimate)

    def key(self, text_column: str) -> str:
        ident = {k: v for k, v in asdict(self).items() if k not in ("index", "path", "est_bytes")}
        ident |= {"text_column": text_column, "tokenizer": RANK_FILE_SHA256}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


# --- where things go ------------------------------------------------------------------------------

def dataset_name(cfg: RunConfig) -> str:
    """data.dataset_name, or derived from the source and shard size (distinct specs never collide)."""
    d = cfg.data
    if d.dataset_name:
        return d.dataset_name
    base = sources.source_kind(cfg).dataset_base(d)
    base += f"-{d.max_docs}docs" if d.max_docs else ""
    return sources.safe_name(f"{base}-{_short(d.shard_tokens)}")


def _short(n: int) -> str:
    for unit, div in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def pinned(cfg: RunConfig) -> RunConfig:
    """A copy of cfg with data.dataset_dir set to the absolute output directory, for handing to worker
    processes: their environment (GPTPIPE_HOME, cwd) may differ from the caller's."""
    cfg = copy.deepcopy(cfg)
    cfg.data.dataset_dir = str(dataset_dir(cfg))
    return cfg


def dataset_dir(cfg: RunConfig) -> Path:
    """data.dataset_dir if set, else <home>/shards/<dataset_name>."""
    if getattr(cfg.data, "dataset_dir", ""):
        return Path(cfg.data.dataset_dir).expanduser().resolve()
    return pipeline_home() / "shards" / dataset_name(cfg)


CHECKED = ("manifest, every shard's header, size and sha256 (re-hashed only when its size, mtime or inode changed), "
           "and the source files' fingerprints (sha256 per size and mtime); --full-verify: re-hash every shard")


def remember_hashes(out: Path, m: Manifest) -> None:
    """Seed the hash cache with the shards just written (their sha256s were computed while writing)."""
    hashes = {}
    for s in m.shards:
        st = (out / s.name).stat()
        hashes[s.name] = [st.st_size, st.st_mtime_ns, st.st_ino, s.sha256]
    with suppress(OSError):
        write_json(out / SHARD_HASHES, hashes)


def why_incomplete(cfg: RunConfig, full: bool = False) -> str | None:
    """None when the dataset dir holds a manifest for this config whose shards check out (headers and
    sizes; with `full`, every sha256) and whose source files are unchanged (a local source is re-stat'ed
    and only files whose size or mtime changed are re-hashed; hub and built-in files are fixed by their
    hashes). Otherwise what is missing or changed. A hub source on a branch asks the hub once which commit
    the branch is now (unreachable: taken as unchanged, with a warning); one pinned to a commit asks nothing."""
    m = _existing_manifest(dataset_dir(cfg))
    if m is None:
        return "no manifest yet"
    s, d = m.source, cfg.data
    if (m.shard_tokens, s.get("source"), s.get("text_column"), s.get("max_docs")) != (
            d.shard_tokens, d.source, d.text_column, d.max_docs):
        return "the manifest was made with other data settings"
    bad = m.verify_hashes(dataset_dir(cfg), dataset_dir(cfg) / SHARD_HASHES, rehash_all=full)
    if bad:
        return f"shards missing or damaged: {', '.join(bad[:5])}"
    return sources.source_kind(cfg).changed(cfg, s, listing_path(cfg).parent)


# --- planning -------------------------------------------------------------------------------------

def plan_pieces(cfg: RunConfig, source_dir: Path) -> list[Piece]:
    """Cut the source into pieces of ~data.piece_bytes of text, in document order. Depends only on the
    source and piece_bytes, so every run (any worker count) plans the same pieces. Checks free disk."""
    d = cfg.data
    _, files = sources.load_listing(source_dir)
    pieces: list[Piece] = []
    docs_left = d.max_docs or -1
    for f in files:
        if docs_left == 0:
            break
        path = f.resolve(source_dir)
        if not path.is_file():
            raise DataError(f"source file {path} is missing; re-run the download stage")
        if not f.sha256:
            raise DataError(f"source file {path} has no fingerprint in {sources.LISTING}; re-run the "
                            "download stage")
        fmt, opener, compressed = formats.file_format(f.kind)
        ranges = fmt.ranges(path, opener, compressed, d.piece_bytes, d.text_column, docs_left > 0)
        for start, stop, ndocs, nbytes in ranges:
            if docs_left == 0:
                break
            limit = -1
            if docs_left > 0:
                limit = min(docs_left, ndocs)
                docs_left -= limit
                limit = -1 if limit == ndocs else limit
            if ndocs == 0:
                continue
            pieces.append(Piece(len(pieces), str(path), f.kind, f.name, f.sha256, start, stop, limit, nbytes))
    if not pieces:
        raise DataError(f"source {d.source!r} has no documents (empty files); nothing to tokenize")
    # fail before any work if the estimated output does not fit: the shards, or in a rebuild the pieces
    # (old shards are replaced in place), plus a margin; a piece's file is deleted once it is cut
    out = dataset_dir(cfg)
    need = int(sum(p.est_bytes for p in pieces) / BYTES_PER_TOKEN * 2 * 1.1)  # uint16 tokens
    free = free_disk(out)
    if need > free:
        raise DataError(f"not enough free disk for the tokenized dataset in {out}: need ~{need / 1e9:.2f} GB "
                        f", {free / 1e9:.2f} GB free. Free space, point GPTPIPE_HOME at a "
                        "larger disk, or cap the data with data.max_docs")
    return pieces


# --- tokenizing one piece -------------------------------------------------------------------------

def _piece_paths(cfg: RunConfig, piece: Piece) -> tuple[Path, Path]:
    base = dataset_dir(cfg) / PIECES / f"piece_{piece.index:06d}"
    return base.with_suffix(".bin"), base.with_suffix(".json")


def piece_record(cfg: RunConfig, piece: Piece, need_data: bool = True) -> dict | None:
    """The piece's record if it was made from this exact piece (and, with need_data, its token file is
    there with the recorded length); else None. Records outlive the token files (deleted once the
    manifest is written) so a later repair of one shard knows every piece's length without re-tokenizing."""
    bin_path, rec_path = _piece_paths(cfg, piece)
    rec = read_json(rec_path, {})  # {} when missing, unreadable or not a JSON object
    with suppress(OSError, ValueError, ShardError):  # the token file missing, damaged or cut short
        if rec.get("key") == piece.key(cfg.data.text_column) and (
                not need_data or len(read_shard(bin_path)) == rec.get("tokens")):
            return rec
    return None


def encode_documents(texts: list[str], threads: int) -> np.ndarray:
    """EOT + tokens of each document, concatenated, as uint16. tiktoken's numpy path gives the same ids
    as encode_ordinary (special-token text stays ordinary text) without building Python int lists;
    its Rust core releases the GIL, so threads run in parallel. The ids go straight into the uint16
    output (no uint32 copy and no max pass: the vocabulary's largest id is checked once, up front)."""
    enc = get_encoding()
    if enc.max_token_value > np.iinfo(np.uint16).max:
        raise DataError(f"token id {enc.max_token_value} does not fit uint16 (max 65535): the tokenizer is not "
                        "GPT-2's 50257-token BPE; shards store uint16 ids, so use gptcore.tokenizer")
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
    bin_path, rec_path = _piece_paths(cfg, piece)
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


# --- cutting shards -------------------------------------------------------------------------------

def _check_total(total: int, S: int) -> None:
    if total <= S:
        raise DataError(f"the source has only {total:,} tokens: one shard of data.shard_tokens={S:,} would "
                        "be the val split with nothing left to train on; use data.shard_tokens <= "
                        f"{total // 2:,}")


def _shard_file(name: str, k: int) -> tuple[str, str]:
    """Shard k's file name and split (shard 0 is val)."""
    split = "val" if k == 0 else "train"
    return f"{name}_{split}_{k:06d}.bin", split


def _settings(spec: dict) -> dict:
    """A spec without its files: what must match for an existing dataset dir to be rebuilt in place (a
    changed source file, or a hub branch that moved to another commit, is a rebuild; another source,
    column, cap or tokenizer is another dataset)."""
    return {k: v for k, v in spec.items() if k not in ("files", "documents", "invalid_utf8", "hf")}


def _known_shards(cfg: RunConfig, spec: dict) -> dict[int, ShardInfo]:
    """Shards recorded by an earlier run of this dataset (finished manifest or interrupted progress);
    each is reused only if cut from the same pieces (by content), see ShardCutter._kept."""
    out, S = dataset_dir(cfg), cfg.data.shard_tokens
    known: dict[int, ShardInfo] = {}
    m = _existing_manifest(out)
    if m is not None:
        if _settings(m.source) != _settings(spec) or m.shard_tokens != S:
            raise DataError(f"{out} already holds a different dataset (source or shard_tokens differ); set "
                            "data.dataset_name to a new name, or delete that directory to rebuild it")
        known = dict(enumerate(m.shards))
    doc = read_json(out / PROGRESS, {})  # {} when missing, unreadable or not a JSON object
    with suppress(ValueError, KeyError, TypeError):
        if _settings(doc["spec"]) == _settings(spec) and doc["shard_tokens"] == S:
            known |= {int(k): ShardInfo(**v) for k, v in doc["shards"].items()}
    return known


_HASHED: dict = {}  # planning and cutting hash each shard once per process (files.cached_sha256)


def pieces_to_tokenize(cfg: RunConfig, pieces: list[Piece]) -> list[Piece]:
    """The pieces whose token files must be (re)made before cutting: those without a valid record and
    file, except pieces whose every token is in a shard that is kept as it is (the cutter deletes a
    piece's file once the shard holding its last token is done). So a resumed build redoes only what no
    kept shard holds, and a finished dataset with a missing or corrupt shard re-tokenizes only the
    pieces that shard is cut from."""
    lacking = [p for p in pieces if piece_record(cfg, p) is None]
    covered = ShardCutter(cfg, pieces).pieces_in_kept_shards() if lacking else set()
    return [p for p in lacking if p.index not in covered]


class ShardCutter:
    """Cuts shards of data.shard_tokens from the pieces in order, keeping shards an earlier (interrupted
    or finished) run wrote that still verify (sha256), and writes the manifest last.

        cutter = ShardCutter(cfg, pieces, todo)   # todo: the pieces still being tokenized
        cutter.piece_done(i)                      # as each finishes, in any order
        manifest = cutter.finish()

    Fed while the pool is still tokenizing, it writes each shard as soon as the pieces before its end are
    all done, so cutting overlaps tokenizing instead of following it. A rebuild of a finished dataset (a
    changed source, a damaged shard) cuts only in finish(): a bad input found late must not overwrite
    finished shards first."""

    def __init__(self, cfg: RunConfig, pieces: list[Piece], todo: list[Piece] = ()):
        self.cfg, self.pieces, self.out, self.S = cfg, pieces, dataset_dir(cfg), cfg.data.shard_tokens
        self.name, self.spec = dataset_name(cfg), _spec(cfg, pieces)
        pending = {p.index for p in todo}
        self.records = [None if p.index in pending else piece_record(cfg, p, need_data=False) for p in pieces]
        self.keys = [p.key(cfg.data.text_column) for p in pieces]
        self.streaming = _existing_manifest(self.out) is None
        self.known = _known_shards(cfg, self.spec)  # refuses a dir holding another dataset, before any work
        self.starts = [0]  # global token offset of each piece of the finished prefix, then the prefix's end
        self.shards: list[ShardInfo] = []
        self.arrays: dict[int, np.ndarray] = {}  # piece token files opened lazily (memmaps), checked once
        self.fresh: set[int] = set()  # pieces tokenized by this run: their writer hashed them moments ago

    def piece_done(self, index: int) -> None:
        self.records[index] = piece_record(self.cfg, self.pieces[index], need_data=False)
        self.fresh.add(index)
        if self.streaming:
            self._cut(final=False)

    def finish(self) -> Manifest:
        if None in self.records:
            i = self.records.index(None)
            p = self.pieces[i]
            raise DataError(f"piece {i} ({p.name} [{p.start}:{p.stop}]) is not tokenized; run tokenize_piece "
                            "on pieces_to_tokenize(cfg, pieces) first")
        invalid: dict[str, int] = {}
        for p, r in zip(self.pieces, self.records, strict=True):
            if r.get("invalid_utf8"):
                invalid[p.name] = invalid.get(p.name, 0) + r["invalid_utf8"]
        if invalid and self.cfg.data.strict_utf8:
            raise DataError(f"invalid UTF-8 in {sorted(invalid)} (data.strict_utf8=true); convert those files")
        if invalid:  # part of what the dataset is made of (and of its id)
            self.spec = {**self.spec, "invalid_utf8": invalid}
        self._cut(final=True)
        docs = sum(r["docs"] for r in self.records)
        manifest = Manifest(shard_tokens=self.S, source={**self.spec, "documents": docs}, shards=self.shards)
        manifest.save(self.out)  # last: the manifest's presence marks the dataset complete
        (self.out / PROGRESS).unlink(missing_ok=True)
        remove_stale_temps(self.out)  # e.g. a piece a killed worker was writing (redone elsewhere)
        for p in self.pieces:  # keep the tiny records, drop the token copies
            _piece_paths(self.cfg, p)[0].unlink(missing_ok=True)
        return manifest

    def pieces_in_kept_shards(self) -> set[int]:
        """Pieces all of whose tokens lie in shards that can be kept as they are. Global offsets are known
        up to the first piece without a record; pieces past it are not counted."""
        total, S = self._grow_prefix(), self.S
        complete = len(self.starts) == len(self.records) + 1
        if complete:
            _check_total(total, S)
        stale, end, k = set(), 0, 0
        while (k + 1) * S <= total or (complete and k * S < total):
            a, b = k * S, min((k + 1) * S, total)
            idx = self._overlapping(a, b)
            if not self._kept(k, a, b, idx):
                stale |= set(idx)
            end, k = b, k + 1
        return {i for i in range(len(self.starts) - 1) if self.starts[i + 1] <= end} - stale

    def _grow_prefix(self) -> int:
        """Extend `starts` over the pieces recorded since; returns the end of the recorded prefix."""
        while len(self.starts) <= len(self.records) and self.records[len(self.starts) - 1] is not None:
            self.starts.append(self.starts[-1] + self.records[len(self.starts) - 1]["tokens"])
        return self.starts[-1]

    def _overlapping(self, a: int, b: int) -> list[int]:
        """Indices of the pieces whose tokens fall in the global range [a, b)."""
        return [i for i in range(len(self.starts) - 1) if self.starts[i] < b and self.starts[i + 1] > a]

    def _cut_from(self, idx: list[int]) -> list[str]:
        """What a shard's bytes are made of: each piece's content key and its global token offset."""
        return [f"{self.keys[i]}@{int(self.starts[i])}" for i in idx]

    def _kept(self, k: int, a: int, b: int, idx: list[int]) -> bool:
        """Shard k's existing file can stay when it is the one recorded, cut from the same token range of the
        same pieces (content keys) at the same offsets, and its bytes still hash to the record."""
        info, path = self.known.get(k), self.out / _shard_file(self.name, k)[0]
        return (info is not None and info.name == path.name and info.tokens == b - a
                and info.source_range.get("tokens") == [a, b]
                and info.source_range.get("cut_from") == self._cut_from(idx)
                and path.is_file() and cached_sha256(path, _HASHED) == info.sha256)

    def _cut(self, final: bool) -> None:
        done, S = self._grow_prefix(), self.S
        if final:
            _check_total(done, S)
        while True:
            k = len(self.shards)
            # before the end a shard is cut only when a token follows it, so the total check cannot fail after
            if k * S >= done or (not final and (k + 1) * S >= done):
                return
            self._shard(k, k * S, min((k + 1) * S, done))

    def _shard(self, k: int, a: int, b: int) -> None:
        idx = self._overlapping(a, b)
        if not self._kept(k, a, b, idx):
            fname, split = _shard_file(self.name, k)
            chunks = [self._tokens(i)[max(a, self.starts[i]) - self.starts[i]: min(b, self.starts[i + 1])
                                      - self.starts[i]] for i in idx]
            n_eot = sum(int(np.count_nonzero(c == EOT)) for c in chunks)
            before = self.shards[-1].source_range["docs"][1] + 1 if self.shards else 0  # docs started before
            first_doc = before + int(chunks[0][0] == EOT) - 1  # a shard may start mid-document
            srange = {"tokens": [a, b], "docs": [first_doc, before + n_eot - 1],
                      "pieces": [idx[0], idx[-1]], "cut_from": self._cut_from(idx),
                      "files": sorted({self.pieces[i].name for i in idx})[:2]}
            info = ShardInfo(fname, split, b - a, write_shard_chunks(self.out / fname, chunks, b - a), srange)
            self.known[k] = info  # recorded with the earlier run's shards, whose later ones may yet be kept
            doc = {"spec": self.spec, "shard_tokens": self.S,
                   "shards": {str(j): asdict(v) for j, v in self.known.items()}}
            atomic_write_bytes(self.out / PROGRESS, [json.dumps(doc).encode()])
        self.shards.append(self.known[k])
        for i in idx:  # recorded above: a piece whose last token is in this shard is needed no more
            if self.starts[i + 1] <= b:
                self.arrays.pop(i, None)
                _piece_paths(self.cfg, self.pieces[i])[0].unlink(missing_ok=True)

    def _tokens(self, i: int) -> np.ndarray:
        if i not in self.arrays:
            path, rec = _piece_paths(self.cfg, self.pieces[i])
            # a piece file from an earlier run is re-hashed before use (it may have been damaged since)
            if piece_record(self.cfg, self.pieces[i]) is None or (
                    i not in self.fresh and file_sha256(path) != self.records[i]["sha256"]):
                rec.unlink(missing_ok=True)
                raise ShardError(f"piece file {path} is missing or corrupt; its record was removed: re-run "
                                 "the tokenize stage to re-make it")
            self.arrays[i] = read_shard(path)
        return self.arrays[i]


def _spec(cfg: RunConfig, pieces: list[Piece]) -> dict:
    """What the dataset is made of (stored as manifest.source; a re-run with another spec is refused)."""
    files: dict[str, dict] = {}
    for p in pieces:
        files.setdefault(p.name, {"name": p.name, "sha256": p.file_id})
    d = cfg.data
    hub = read_json(listing_path(cfg), {}).get("hf")  # repo, config, split, revision and its commit
    return {"id": sources.source_id(cfg), "source": d.source, "text_column": d.text_column,
            "max_docs": d.max_docs, "tokenizer_sha256": RANK_FILE_SHA256, "files": list(files.values()),
            **({"hf": hub} if hub else {})}


def _existing_manifest(out: Path) -> Manifest | None:
    """The dataset dir's manifest, None when there is none or it does not load."""
    try:
        return Manifest.load(out)
    except ShardError:
        return None


# --- the driver, whoever runs the workers ----------------------------------------------------------

def listing_path(cfg: RunConfig) -> Path:
    return sources.raw_dir(cfg) / sources.LISTING


def discard_partial(cfg: RunConfig, listing_existed: bool) -> None:
    """After bad input: leave nothing half-made. Without a finished manifest the work area (piece files,
    progress) goes, and a local source's listing that this run created; a hub download stays (verified
    files, costly to fetch again)."""
    out = dataset_dir(cfg)
    if not (out / MANIFEST).is_file():
        shutil.rmtree(out / PIECES, ignore_errors=True)
        (out / PROGRESS).unlink(missing_ok=True)
        for shard in out.glob(f"{dataset_name(cfg)}_*.bin"):  # cut while later pieces were tokenized
            shard.unlink()
        remove_stale_temps(out)
        with suppress(OSError):  # removed only when empty
            out.rmdir()
    if not listing_existed and sources.source_kind(cfg).in_place:
        listing_path(cfg).unlink(missing_ok=True)
        with suppress(OSError):  # removed only when empty
            listing_path(cfg).parent.rmdir()


def build(cfg: RunConfig, tokenize, full_verify: bool = False, say=None) -> Manifest:
    """fetch -> plan -> tokenize the pieces not done yet -> cut shards as they complete -> manifest.
    `tokenize(cfg, pieces, todo, piece_done)` runs tokenize_piece on each piece of `todo` (a process pool,
    Prefect tasks on any task runner) and calls piece_done(index, tokens) as each finishes, in any order.
    Skips when complete (full_verify: re-hash every shard to decide, which also repairs silently
    corrupted ones). Bad input leaves nothing half-made behind (discard_partial). `say` reports (stderr)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = pinned(cfg)  # workers may run with another GPTPIPE_HOME / cwd
    out = dataset_dir(cfg)
    with build_lock(out, say):
        existed = listing_path(cfg).is_file()
        try:
            remove_stale_temps(out)  # what a killed run was writing
            source_dir = sources.fetch(cfg)
            why = why_incomplete(cfg, full=full_verify)
            if why is None:
                say(f"dataset {out} is complete; checked: {CHECKED}; nothing to do")
                return Manifest.load(out)
            say(f"dataset {out}: {why}; "
                f"{'building it' if why == 'no manifest yet' else 'rebuilding what that touches'}")
            pieces = plan_pieces(cfg, source_dir)
            todo = pieces_to_tokenize(cfg, pieces)
            say(f"{len(pieces)} pieces planned, {len(todo)} to tokenize")
            t0 = time.perf_counter()
            cutter = ShardCutter(cfg, pieces, todo)  # cuts each shard as soon as the pieces before its end are done
            tokenize(cfg, pieces, todo, lambda index, tokens: cutter.piece_done(index))
            manifest = cutter.finish()
        except (sources.SourceError, DataError, ShardError):
            discard_partial(cfg, existed)
            raise
        remember_hashes(out, manifest)
        dt = time.perf_counter() - t0
        say(f"dataset {out}: {manifest.total_tokens():,} tokens in {len(manifest.shards)} shards ({dt:.1f}s, "
            f"{manifest.total_tokens() / max(dt, 1e-9) / 1e6:.2f}M tok/s), manifest {manifest.id}")
        return manifest


@contextmanager
def build_lock(out: Path, say):
    """One build per dataset directory (e.g. two nightly deployments sharing a dataset): the second waits
    for the first, then finds the dataset complete. Before, each took the other's pieces for damage and
    both failed, throwing the work away. An flock, dropped by the kernel when its holder dies."""
    lock = RunLock(out.parent, name=f".{out.name}.build.lock", remove=True)
    try:
        lock.acquire()
    except LocksUnsupported:
        say(f"warning: the filesystem of {out} has no file locks: two builds of it at once are not prevented")
    except LockHeld:
        say(f"waiting for another build of {out} to finish (holder: {read_json(lock.path, {}) or 'unknown'})")
        lock.timeout = float("inf")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()  # nothing to release when the filesystem could not lock


# --- plain-python workers (no Prefect): python -m gptcore.data.build ----------------------------------

def _tokenize_job(args):
    cfg, piece, threads = args
    return piece.index, tokenize_piece(cfg, piece, threads)


def run(cfg: RunConfig, workers: int | None = None, full_verify: bool = False) -> Manifest:
    """build() with the pieces tokenized on a process pool of `workers` (default data.num_workers, or one
    per core) and a progress bar."""
    return build(cfg, lambda *a: _pool_tokenize(*a, workers=workers), full_verify)


def _pool_tokenize(cfg: RunConfig, pieces: list[Piece], todo: list[Piece], piece_done, workers: int | None):
    workers = min(workers or cfg.data.num_workers or os.cpu_count() or 1, max(1, len(todo)))
    jobs = [(cfg, p, worker_threads(cfg, workers)) for p in todo]
    with tqdm(total=int(sum(p.est_bytes for p in todo) / 4.2), unit="tok", unit_scale=True, desc="tokenize",
              disable=None) as bar, ExitStack() as stack:
        results = map(_tokenize_job, jobs)
        if workers > 1:
            import multiprocessing as mp

            from gptcore.data import build  # the job must pickle as gptcore.data.build.*, not __main__.*
            # fork: workers inherit the imported modules and the GPT-2 encoding built here, so they start
            # in milliseconds instead of re-importing and re-building it. The parent has only read parquet
            # metadata so far (no arrow compute threads that fork could strand).
            get_encoding()
            pool = stack.enter_context(mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(workers))
            results = pool.imap_unordered(build._tokenize_job, jobs)
        for i, n in results:
            piece_done(i, n)
            bar.update(n)


def main(argv: list[str] | None = None) -> int:
    from gptcore.config import ConfigError, load_config
    argv = sys.argv[1:] if argv is None else list(argv)
    full = "--full-verify" in argv
    argv = [a for a in argv if a != "--full-verify"]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        run(load_config(argv[0], argv[1:]), full_verify=full)
    except (ConfigError, sources.SourceError, DataError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing: e.g. the disk filled up after the free-space check
        print(f"error: cannot write the dataset: {e}. Nothing half-written was kept and finished pieces and "
              "shards stay for the next run: make room on that disk (or move the file that stands where a "
              "directory belongs) and run again", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
