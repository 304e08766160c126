"""The shard cutter: shards of exactly data.shard_tokens tokens (the last one fewer; shard 0 is `val`)
cut from the ordered concatenation of the pieces, documents spanning shards and no token dropped. Shards an
earlier (interrupted or finished) run wrote are kept when they were cut from the same pieces and still
hash to their record; the manifest is written last: its presence means the dataset is complete."""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import asdict

import numpy as np

from gptcore.config import RunConfig
from gptcore.data import sources
from gptcore.data.location import PROGRESS, DataError, dataset_dir, dataset_name, existing_manifest, listing_path
from gptcore.data.planning import Piece, piece_paths, piece_record
from gptcore.data.shard_format import Manifest, ShardError, ShardInfo, read_shard, write_shard_chunks
from gptcore.files import atomic_write_bytes, cached_sha256, file_sha256, read_json, remove_stale_temps
from gptcore.model.tokenizer import EOT, RANK_FILE_SHA256


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
    kinds = {k.name for k in sources.SOURCE_KINDS}  # a kind's record (the hub's commit): a changed source
    return {k: v for k, v in spec.items() if k not in ("files", "documents", "invalid_utf8") and k not in kinds}


def _known_shards(cfg: RunConfig, spec: dict) -> dict[int, ShardInfo]:
    """Shards recorded by an earlier run of this dataset (finished manifest or interrupted progress);
    each is reused only if cut from the same pieces (by content), see ShardCutter._kept."""
    out, S = dataset_dir(cfg), cfg.data.shard_tokens
    known: dict[int, ShardInfo] = {}
    m = existing_manifest(out)
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
        self.streaming = existing_manifest(self.out) is None
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
            piece_paths(self.cfg, p)[0].unlink(missing_ok=True)
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
                piece_paths(self.cfg, self.pieces[i])[0].unlink(missing_ok=True)

    def _tokens(self, i: int) -> np.ndarray:
        if i not in self.arrays:
            path, rec = piece_paths(self.cfg, self.pieces[i])
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
    d, kind = cfg.data, sources.source_kind(cfg)
    record = read_json(listing_path(cfg), {}).get(kind.name)  # e.g. the hub's repo, config, split and commit
    return {"id": sources.source_id(cfg), "source": d.source, "text_column": d.text_column,
            "max_docs": d.max_docs, "tokenizer_sha256": RANK_FILE_SHA256, "files": list(files.values()),
            **({kind.name: record} if record else {})}
