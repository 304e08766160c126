"""What a source kind is (gptcore/data/sources.py keeps the registry and the fetch every kind goes
through): SourceKind, the files it lists (SourceFile, source.json) and the helpers kinds share."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data.formats import SourceError
from gptcore.files import read_json, write_json

LISTING = "source.json"


@dataclass
class SourceFile:
    path: str  # absolute path of a local file; for hub/builtin files, relative to the source dir
    kind: str  # formats.kind_of: a format's name + compression suffix (parquet, jsonl, json.gz, txt, ...)
    size: int
    sha256: str = ""  # content hash (hub: checked against the hub's; local: hashed once per size+mtime)
    mtime_ns: int = 0
    name: str = ""  # stable name for lineage (path in the hub repo / relative to the local root)
    prefix_of: str = ""  # a smoke run's first documents of a hub file: that file's sha256

    def resolve(self, source_dir: Path) -> Path:
        return Path(source_dir) / self.path

    def unchanged(self, source_dir: Path) -> bool:
        try:
            st = self.resolve(source_dir).stat()
        except OSError:
            return False
        return st.st_size == self.size and st.st_mtime_ns == self.mtime_ns


class SourceKind:
    """One kind of data.source: how it is named, validated, fetched and checked for changes, and what MLflow
    records as its lineage."""
    name = ""
    in_place = False  # files used where they lie: validated before work, listing removed after bad input

    def matches(self, source: str) -> bool:
        """Whether data.source names this kind."""
        return source == self.name

    def validate(self, cfg: RunConfig) -> None:
        """SourceError naming the setting and the fix, before any work (cheap: no download, no hashing)."""

    def source_id(self, cfg: RunConfig) -> str:
        """A directory-safe name for the source: the raw/<source_id>/ folder."""
        raise NotImplementedError

    def dataset_base(self, cfg: RunConfig) -> str:
        """A derived dataset name, before its caps and shard size."""
        return self.source_id(cfg)

    def fetch(self, cfg: RunConfig, source_dir: Path) -> list[SourceFile]:
        """Make the files available and verified, in document order."""
        raise NotImplementedError

    def changed(self, cfg: RunConfig, recorded: dict, source_dir: Path) -> str | None:
        """How the source differs from the one a manifest recorded (manifest.source), or None."""
        return changes(recorded, previous_files(source_dir), cfg.data.max_docs)

    def record(self, cfg: RunConfig, source_dir: Path) -> dict | None:
        """What the listing and the manifest record about the source beyond its files, under the kind's name
        (the hub: repo, config, split, revision and the commit it resolved to)."""
        return None

    def lineage(self, recorded: dict, dataset_dir: Path) -> tuple[str, dict]:
        """The source as MLflow's dataset sources describe it, from a manifest's `source`: (MLflow's source
        type, its JSON fields), e.g. ("local", {"uri": path}), ("http", {"url": ...})."""
        return "local", {"uri": str(recorded.get("source") or dataset_dir)}


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def load_listing(source_dir: Path) -> tuple[dict, list[SourceFile]]:
    path = Path(source_dir) / LISTING
    if not path.is_file():
        raise SourceError(f"{path} does not exist: run the download stage (gptcore.data.sources.fetch) first")
    doc = json.loads(path.read_text())
    return doc, [SourceFile(**f) for f in doc["files"]]


def previous_files(source_dir: Path) -> list[SourceFile]:
    """The last listing's files ([] if none or unreadable): their hashes are reused for files whose size
    and mtime are unchanged."""
    try:
        return load_listing(source_dir)[1]
    except (SourceError, ValueError, KeyError, TypeError):
        return []


def save_listing(source_dir: Path, cfg: RunConfig, kind: SourceKind, files: list[SourceFile], complete: bool,
                 record: dict | None = None) -> None:
    """source.json: the verified files so far (a fetch killed midway resumes after them) and the kind's
    record (`record`, else the kind's own)."""
    d = cfg.data
    record = record if record is not None else kind.record(cfg, source_dir)
    doc = {"id": kind.source_id(cfg), "source": d.source, "complete": complete, "max_docs": d.max_docs,
           **({kind.name: record} if record else {}), "files": [asdict(f) for f in files]}
    path = Path(source_dir) / LISTING
    if read_json(path) != doc:  # rewritten only when something changed
        write_json(path, doc)


def changed_files(recorded: list[dict], current: list[SourceFile], additions: bool = True) -> list[str]:
    """What differs between the files a dataset was built from ({name, sha256} records) and the source
    now: "name (changed)", "name (removed)", and with `additions`, "name (new)"."""
    now = {f.name: f.sha256 for f in current}
    out = [f"{r['name']} ({'removed' if r['name'] not in now else 'changed'})" for r in recorded
           if now.get(r["name"]) != r.get("sha256")]
    if additions:
        names = {r["name"] for r in recorded}
        out += [f"{n} (new)" for n in now if n not in names]
    return out


def changes(recorded: dict, now: list[SourceFile], max_docs: int) -> str | None:
    """The files that differ from a manifest's, as a reason to rebuild, or None."""
    changed = changed_files(recorded.get("files", []), now, additions=not max_docs)
    return f"the source changed: {', '.join(changed[:10])}{' ...' if len(changed) > 10 else ''}" if changed else None
