"""Where a dataset lives and whether it is complete: what the trainer, the evaluator and the flow's skip
check need, without the builder (gptcore/data/build.py drives the build; planning.py, tokenizing.py and
cutting.py do its parts).

    dataset_dir(cfg)        data.dataset_dir, or <home>/shards/<dataset_name(cfg)>
    why_incomplete(cfg)     None when its manifest and shards check out and its source is unchanged
"""

from __future__ import annotations

import copy
from contextlib import suppress
from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data import sources
from gptcore.data.shard_format import Manifest, ShardError
from gptcore.files import pipeline_home, write_json

PIECES = ".pieces"  # work area inside the dataset dir; removed once the manifest is written
PROGRESS = ".progress.json"  # shards written so far (so a resumed build skips them)
SHARD_HASHES = "shard_hashes.json"  # verified sha256 per shard by (size, mtime, inode): checks re-hash what changed


class DataError(RuntimeError):
    """Tokenize-and-shard cannot proceed; the message names the problem and the fix."""


def dataset_name(cfg: RunConfig) -> str:
    """data.dataset_name, or derived from the source and shard size (distinct specs never collide)."""
    d = cfg.data
    if d.dataset_name:
        return d.dataset_name
    base = sources.source_kind(cfg).dataset_base(cfg)
    base += f"-{d.max_docs}docs" if d.max_docs else ""
    return sources.safe_name(f"{base}-{_short(d.shard_tokens)}")


def _short(n: int) -> str:
    for unit, div in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def located(cfg: RunConfig) -> RunConfig:
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
    m = existing_manifest(dataset_dir(cfg))
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


def existing_manifest(out: Path) -> Manifest | None:
    """The dataset dir's manifest, None when there is none or it does not load."""
    try:
        return Manifest.load(out)
    except ShardError:
        return None


def listing_path(cfg: RunConfig) -> Path:
    return sources.raw_dir(cfg) / sources.LISTING
