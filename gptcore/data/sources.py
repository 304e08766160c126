"""Where training text comes from, behind one interface:

    source_dir = fetch(cfg)              # local dir holding source.json (+ downloaded files); idempotent
    files = load_listing(source_dir)     # the verified source files, in document order
    for texts in read_texts(path, kind, start, stop, text_column): ...   # documents (formats.py)

`data.source` selects the source kind: SOURCE_KINDS, one module each, registered at the end of this module.
A kind owns how its sources are named, validated, fetched and checked for changes, and the lineage MLflow
records for them; the rest of the code asks the kind and never tests which kind it is.

    source_kind.py      the interface: SourceKind, SourceFile, source.json, the helpers kinds share
    source_builtin.py   "builtin": the small public-domain corpus shipped in the package (Shakespeare)
    source_hub.py       "hf": a Hugging Face hub dataset (default FineWeb-Edu sample-10BT), resolved by
                        `datasets`, fetched file by file and verified (its settings: data.hub.*)
    source_local.py     anything else: a local directory or glob of files, used in place and fingerprinted

Adding a kind: a module with a SourceKind subclass and one `register(...)` line at the end of this file
(tests/test_sources.py registers a toy one, files served over HTTP, from inside the test).
Documents and file formats (parquet, JSON Lines / JSON arrays, txt, compressed or not): formats.py.
"""

from __future__ import annotations

from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data.formats import SourceError, kind_of, read_texts
from gptcore.data.source_builtin import Builtin
from gptcore.data.source_hub import Hub
from gptcore.data.source_kind import (  # noqa: F401 -- the interface, for callers of this module
    LISTING,
    SourceFile,
    SourceKind,
    changed_files,
    load_listing,
    safe_name,
    save_listing,
)
from gptcore.data.source_local import Local
from gptcore.files import pipeline_home

__all__ = ["SourceError", "fetch", "kind_of", "load_listing", "read_texts", "source_kind"]

SOURCE_KINDS: list[SourceKind] = []  # asked in order; the last (local paths) matches any data.source


def register(kind: SourceKind) -> SourceKind:
    """Add a source kind, asked before the ones already registered (its name must be new)."""
    if not kind.name or any(k.name == kind.name for k in SOURCE_KINDS):
        raise ValueError(f"a source kind needs a new name, got {kind.name!r}")
    SOURCE_KINDS.insert(0, kind)
    return kind


def unregister(name: str) -> None:
    SOURCE_KINDS[:] = [k for k in SOURCE_KINDS if k.name != name]


def kind_for(source: str) -> SourceKind:
    """The kind a data.source value names."""
    return next(k for k in SOURCE_KINDS if k.matches(source))


def source_kind(cfg: RunConfig) -> SourceKind:
    return kind_for(cfg.data.source)


def source_id(cfg: RunConfig) -> str:
    """A directory-safe name for the source (the raw/<source_id>/ folder)."""
    return source_kind(cfg).source_id(cfg)


def raw_dir(cfg: RunConfig) -> Path:
    """<home>/raw/<source_id>/: the listing (source.json) and any downloaded files."""
    return pipeline_home() / "raw" / source_id(cfg)


def fetch(cfg: RunConfig) -> Path:
    """Make the source available locally and verified; returns the source directory (with source.json).
    A second call with everything in place only checks sizes/mtimes: no network, no re-hashing."""
    kind, source_dir = source_kind(cfg), raw_dir(cfg)
    kind.validate(cfg)
    files = kind.fetch(cfg, source_dir)
    save_listing(source_dir, cfg, kind, files, complete=True)
    return source_dir



# --- the source kinds: one module each, one line here -------------------------------------------------

register(Local())  # first registered, asked last: any path or glob
register(Hub())
register(Builtin())
