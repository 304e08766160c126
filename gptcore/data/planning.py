"""Planning: the source cut into pieces, fixed ranges of documents (~data.piece_bytes of text each) that
depend on the source alone, not on the number of workers; so workers finish in any order and the shards
cut from the pieces in order are byte-identical for 1 or N workers. A piece's token file and its record
live under <dataset>/.pieces/ (encode.tokenize_piece writes them)."""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data import formats, sources
from gptcore.data.location import PIECES, DataError, dataset_dir
from gptcore.data.shard_format import ShardError, read_shard
from gptcore.files import free_disk, read_json
from gptcore.model.tokenizer import RANK_FILE_SHA256

BYTES_PER_TOKEN = 3.0  # conservative (English ~4.2 bytes/token): for the free-disk estimate only


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


def piece_paths(cfg: RunConfig, piece: Piece) -> tuple[Path, Path]:
    base = dataset_dir(cfg) / PIECES / f"piece_{piece.index:06d}"
    return base.with_suffix(".bin"), base.with_suffix(".json")


def piece_record(cfg: RunConfig, piece: Piece, need_data: bool = True) -> dict | None:
    """The piece's record if it was made from this exact piece (and, with need_data, its token file is
    there with the recorded length); else None. Records outlive the token files (deleted once the
    manifest is written) so a later repair of one shard knows every piece's length without re-tokenizing."""
    bin_path, rec_path = piece_paths(cfg, piece)
    rec = read_json(rec_path, {})  # {} when missing, unreadable or not a JSON object
    with suppress(OSError, ValueError, ShardError):  # the token file missing, damaged or cut short
        if rec.get("key") == piece.key(cfg.data.text_column) and (
                not need_data or len(read_shard(bin_path)) == rec.get("tokens")):
            return rec
    return None
