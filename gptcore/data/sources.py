"""Where training text comes from, behind one interface:

    source_dir = fetch(cfg)              # local dir holding source.json (+ downloaded files); idempotent
    files = load_listing(source_dir)     # the verified source files, in document order
    for texts in read_texts(path, kind, start, stop, text_column): ...   # documents (formats.py)

`data.source` selects the source kind (SOURCE_KINDS at the end of this module: one entry per kind, with
how it is named, fetched and checked for changes; anything else is a local path or glob):
  "builtin"   the small public-domain corpus shipped in the package (Shakespeare, ~1.6M tokens)
  "hf"        a Hugging Face hub dataset (default FineWeb-Edu sample-10BT): `datasets` resolves the config's
              data files of the requested split (data.hf_split) at the commit data.hf_revision resolves
              to, as it would for `load_dataset` (YAML configs in the card, or splits inferred from file
              names); those files are fetched one by one into <home>/raw/<source_id>/ and verified
              against the hub's size and sha256. The commit is recorded; a branch that moved is a changed
              source. HF_TOKEN and HF_ENDPOINT are honoured (HF_ENDPOINT also when set after import)
  other       a local directory or glob of files in a format formats.py reads (used in place, not copied),
              each fingerprinted (size, mtime, sha256; re-hashed only when size or mtime changed), so a
              changed, added or removed file is noticed and the dataset rebuilt from it

Documents and file formats (parquet, JSON Lines / JSON arrays, txt, compressed or not): formats.py.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gptcore.config import DataConfig, RunConfig, pipeline_home
from gptcore.data.formats import COMPRESSIONS, FORMATS, SourceError, kind_of, read_texts, readable_suffixes
from gptcore.files import file_sha256, free_disk, read_json, write_json

BUILTIN = Path(__file__).parents[1] / "assets" / "corpus" / "shakespeare.parquet"
BUILTIN_SHA256 = "2db4ec02cd015044806362430773d64ca4be9030c573aa55d0afe047b3e76c7c"
LISTING = "source.json"
__all__ = ["SourceError", "fetch", "kind_of", "load_listing", "read_texts", "source_kind"]


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


def source_id(cfg: RunConfig) -> str:
    """A directory-safe name for the source (the raw/<source_id>/ folder)."""
    return source_kind(cfg).source_id(cfg.data)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def raw_dir(cfg: RunConfig) -> Path:
    """<home>/raw/<source_id>/: the listing (source.json) and any downloaded files."""
    return pipeline_home() / "raw" / source_id(cfg)


def fetch(cfg: RunConfig) -> Path:
    """Make the source available locally and verified; returns the source directory (with source.json).
    A second call with everything in place only checks sizes/mtimes: no network, no re-hashing."""
    source_dir = raw_dir(cfg)
    files = source_kind(cfg).fetch(cfg, source_dir)
    _save_listing(source_dir, cfg, files, complete=True)
    return source_dir


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


def _save_listing(source_dir: Path, cfg: RunConfig, files: list[SourceFile], complete: bool,
                  commit: str | None = None) -> None:
    d = cfg.data
    hub = {"repo": d.hf_repo, "config": d.hf_config, "split": d.hf_split, "revision": d.hf_revision,
           "commit": commit or hub_commit(source_dir),
           "documents": f"the first {d.max_docs}" if d.max_docs else "all"} if d.source == "hf" else None
    doc = {"id": source_id(cfg), "source": d.source, "complete": complete, "max_docs": d.max_docs, "hf": hub,
           "files": [asdict(f) for f in files]}
    path = Path(source_dir) / LISTING
    if read_json(path) != doc:  # rewritten only when something changed
        write_json(path, doc)


# --- builtin --------------------------------------------------------------------------------------

def _builtin_file() -> SourceFile:
    if not BUILTIN.is_file():
        raise SourceError(f"the built-in corpus {BUILTIN} is missing; reinstall the package "
                          "(pip install -e .)")
    if file_sha256(BUILTIN) != BUILTIN_SHA256:
        raise SourceError(f"the built-in corpus {BUILTIN} is corrupted (sha256 mismatch); reinstall the "
                          "package or rebuild it with gptcore/assets/corpus/build_corpus.py")
    st = BUILTIN.stat()
    return SourceFile(path=str(BUILTIN), kind="parquet", size=st.st_size, sha256=BUILTIN_SHA256,
                      mtime_ns=st.st_mtime_ns, name="shakespeare.parquet")


# --- local directory / glob -----------------------------------------------------------------------

def local_files(spec: str, previous: list[SourceFile] = (), fingerprint: bool = True) -> list[SourceFile]:
    """The source files `spec` names, checked readable, in path order; with `fingerprint`, each with its
    sha256 (taken from `previous` when name, size and mtime are unchanged, else hashed now)."""
    known = {f.name: f for f in previous}
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        paths, root = [Path(p) for p in glob.glob(str(path), recursive=True)], None
    elif path.is_dir():
        paths, root = [p for p in path.rglob("*") if p.is_file()], path
    elif path.is_file():
        paths, root = [path], path.parent
    else:
        raise SourceError(f"data.source={spec!r} does not exist; use 'builtin', 'hf', or an existing "
                          f"directory / glob of {readable_suffixes()} files")
    paths = [p.absolute() for p in paths if p.is_file() and kind_of(p)]
    if not paths:
        raise SourceError(f"data.source={spec!r} holds no {readable_suffixes()} files; point it at a "
                          "directory or glob that matches some")
    # names relative to the source directory; for a glob, to its matches' common folder, so two files with
    # one base name in different folders keep apart (their fingerprints would otherwise collide)
    root = root.absolute() if root is not None else Path(os.path.commonpath([p.parent for p in paths]))
    files = []
    for p in sorted(paths, key=Path.resolve):
        name, p = str(p.relative_to(root)), p.resolve()
        if not os.access(p, os.R_OK):
            raise SourceError(f"source file {p} is not readable (permission denied); fix its permissions")
        st = p.stat()
        f = SourceFile(path=str(p), kind=kind_of(p), size=st.st_size, mtime_ns=st.st_mtime_ns, name=name)
        if fingerprint:
            old = known.get(name)
            same = old is not None and old.sha256 and (old.size, old.mtime_ns) == (f.size, f.mtime_ns)
            f.sha256 = old.sha256 if same else file_sha256(p)
        files.append(f)
    if all(f.size == 0 for f in files):
        raise SourceError(f"data.source={spec!r}: all {len(files)} files are empty; nothing to tokenize")
    return files


# --- Hugging Face hub -----------------------------------------------------------------------------

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


def hub_commit(source_dir: Path) -> str | None:
    """The commit sha a hub source's listing was resolved at (None: not a hub source, or not yet)."""
    return (read_json(Path(source_dir) / LISTING, {}).get("hf") or {}).get("commit")


def _fetch_hub(cfg: RunConfig, source_dir: Path) -> list[SourceFile]:
    """Download the requested split's data files one at a time (so a kill resumes at the file it was on),
    each verified against the hub's size + sha256 before it is recorded in source.json."""
    d = cfg.data
    files, doc = previous_files(source_dir), read_json(Path(source_dir) / LISTING, {})
    done = {f.name: f for f in files if f.unchanged(source_dir)}
    verified = bool(files) and doc.get("complete") and doc.get("max_docs") == d.max_docs and len(done) == len(files)
    pinned = hub_commit(source_dir)
    if verified and pinned == d.hf_revision:
        return files  # a commit sha never moves: no network

    from huggingface_hub import HfApi, hf_hub_download  # only the hub source needs it

    endpoint, token = _hub_endpoint(), os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        commit = api.dataset_info(d.hf_repo, revision=d.hf_revision).sha
    except Exception as e:  # noqa: BLE001 -- offline, auth, missing repo: say which and what to do
        if verified:  # offline with a complete download: train on what is verified, say it
            print(f"warning: cannot ask {endpoint} which commit {d.hf_repo}@{d.hf_revision} is now ({e}); "
                  f"using the verified download of commit {pinned}", flush=True)
            return files
        raise SourceError(f"cannot reach {d.hf_repo} (revision {d.hf_revision}) on {endpoint}: {e}. Check "
                          "the network or HF_ENDPOINT, set HF_TOKEN for gated/private data, or use a local copy: "
                          "data.source=/path/to/files") from e
    if verified and commit == pinned:
        return files
    if pinned and commit != pinned:
        print(f"{d.hf_repo}@{d.hf_revision} moved from commit {pinned} to {commit}: the source changed, its "
              "files are checked again (pin data.hf_revision=<sha> to train on one commit)", flush=True)
    remote = hub_data_files(api, cfg, commit, token)
    need = sum(e.size for e in remote if e.path not in done)
    free = free_disk(source_dir)
    if need > free and not d.max_docs:
        raise SourceError(f"not enough free disk to download the dataset into {source_dir}: need "
                          f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free. Free space, point GPTPIPE_HOME at "
                          "a larger disk, or download part of it with data.max_docs")
    if d.max_docs:  # a smoke run: read the first documents through range requests, download nothing whole
        return _read_hub_prefix(cfg, source_dir, remote, commit, endpoint, token)
    get = functools.partial(hf_hub_download, d.hf_repo, repo_type="dataset", revision=commit,
                            endpoint=endpoint, token=token)  # a file of this commit, into local_dir
    files = []
    for entry in remote:
        f = done.pop(entry.path, None)
        if f is None or f.sha256 != entry.sha256:
            f = _download_one(get, source_dir, entry)
        files.append(f)
        # record progress: a kill now resumes at the next file (earlier verified ones stay listed)
        _save_listing(source_dir, cfg, [*files, *done.values()], complete=False, commit=commit)
    return files


def _read_hub_prefix(cfg: RunConfig, source_dir: Path, remote: list[_Remote], commit: str, endpoint: str,
                     token: str | None) -> list[SourceFile]:
    """The first data.max_docs documents of the split, read with range requests (huggingface_hub's
    HfFileSystem: a parquet file's footer, then row group after row group; a JSON Lines file line by line,
    decompressed as it streams) and written as local prefix files (`prefix/<path>`, uncompressed), so a
    1,000-document smoke run of a 2 GB parquet file moves megabytes. Each prefix file is recorded with its
    own sha256 and the remote file's (`prefix_of`)."""
    from huggingface_hub import HfFileSystem

    d = cfg.data
    fs = HfFileSystem(endpoint=endpoint, token=token, skip_instance_cache=True)
    files, left = [], d.max_docs
    for entry in remote:
        if left <= 0:
            break
        # a compressed file's prefix is written decompressed: its name loses the compression suffix
        compression = Path(entry.path).suffix if Path(entry.path).suffix in COMPRESSIONS else ""
        local = Path(source_dir) / "prefix" / entry.path.removesuffix(compression)
        fmt = FORMATS[Path(local.name).suffix]
        with fs.open(f"datasets/{d.hf_repo}@{commit}/{entry.path}", "rb", block_size=1 << 16) as remote_file:
            text = COMPRESSIONS[compression](remote_file) if compression else remote_file
            taken = fmt.copy_prefix(text, local, left, d.text_column)
        left -= taken
        st = local.stat()
        files.append(SourceFile(path=str(local.relative_to(source_dir)), kind=kind_of(local), size=st.st_size,
                                sha256=file_sha256(local), mtime_ns=st.st_mtime_ns, name=entry.path,
                                prefix_of=entry.sha256))
        _save_listing(source_dir, cfg, files, complete=False, commit=commit)
    return files


def hub_head(cfg: RunConfig) -> str | None:
    """The commit data.hf_revision is on the hub now (one request); None, with a warning, when the hub
    cannot be asked (offline: a nightly run goes on with what it has verified)."""
    from huggingface_hub import HfApi

    d, endpoint = cfg.data, _hub_endpoint()
    try:
        return HfApi(endpoint=endpoint, token=os.environ.get("HF_TOKEN") or None).dataset_info(
            d.hf_repo, revision=d.hf_revision).sha
    except Exception as e:  # noqa: BLE001 -- any failure to ask is "unknown", never a reason to stop
        print(f"warning: cannot ask {endpoint} which commit {d.hf_repo}@{d.hf_revision} is now ({e})", flush=True)
        return None


def _hub_endpoint() -> str:
    """HF_ENDPOINT as it is now: huggingface_hub (and datasets, once imported) read it only at import."""
    import sys

    from huggingface_hub import constants

    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    if "datasets" in sys.modules:
        datasets = sys.modules["datasets"]
        datasets.config.HF_ENDPOINT = endpoint
        datasets.config.HUB_DATASETS_URL = endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}"
    return endpoint


@dataclass
class _Remote:
    path: str
    size: int
    sha256: str  # the hub's LFS sha256 ("" for a file stored in git: checked by size only)


def hub_data_files(api, cfg: RunConfig, commit: str, token: str | None) -> list[_Remote]:
    """The data files of data.hf_split in data.hf_config at `commit`, in path order, as `datasets`
    resolves them (`load_dataset_builder`: the card's YAML configs, or splits inferred from file names)."""
    import datasets

    _hub_endpoint()  # datasets is imported now: point it at HF_ENDPOINT as it is
    d = cfg.data
    try:
        builder = datasets.load_dataset_builder(d.hf_repo, d.hf_config or None, revision=commit, token=token,
                                                cache_dir=str(pipeline_home() / "raw" / ".datasets-cache"))
    except ValueError as e:  # an unknown config: datasets names the ones that exist
        raise SourceError(f"{d.hf_repo} has no config {d.hf_config!r} ({e}); set data.hf_config to one of "
                          "those") from e
    except Exception as e:  # noqa: BLE001 -- a missing repo, a layout datasets cannot read
        raise SourceError(f"datasets cannot resolve {d.hf_repo} (config {d.hf_config!r}, commit {commit}): "
                          f"{type(e).__name__}: {e}; use data.source=<local dir> for a copy of its files") from e
    splits = builder.config.data_files or {}
    if d.hf_split not in splits:
        raise SourceError(f"{d.hf_repo} config {builder.config.name!r} has no split {d.hf_split!r}; set "
                          f"data.hf_split to one of {sorted(splits)}")
    prefix = f"hf://datasets/{d.hf_repo}@{commit}/"
    paths = sorted(str(u).removeprefix(prefix) for u in splits[d.hf_split])
    unreadable = [p for p in paths if kind_of(p) is None]
    if unreadable:
        raise SourceError(f"{d.hf_repo} split {d.hf_split!r} has files this pipeline cannot read "
                          f"({unreadable[:3]}; it reads {readable_suffixes()}); convert them, or point "
                          "data.source at a local copy in one of those formats")
    infos = {i.path: i for i in api.get_paths_info(d.hf_repo, paths, revision=commit, repo_type="dataset")}
    return [_Remote(p, infos[p].lfs.size if infos[p].lfs else infos[p].size,
                    infos[p].lfs.sha256 if infos[p].lfs else "") for p in paths]


def _download_one(get, source_dir: Path, entry: _Remote) -> SourceFile:
    # hf_hub_download writes <file>.incomplete and renames when the transfer is complete (and resumes a
    # partial one); we then check size and sha256 before the file is listed as verified. A complete but
    # unverified/damaged copy is removed first, or hf_hub_download would trust its own metadata and keep it.
    (Path(source_dir) / "files" / entry.path).unlink(missing_ok=True)
    local = Path(get(entry.path, local_dir=Path(source_dir) / "files"))
    st = local.stat()
    sha = file_sha256(local)
    if st.st_size != entry.size or (entry.sha256 and sha != entry.sha256):
        local.unlink(missing_ok=True)
        raise SourceError(f"downloaded {entry.path} does not match the hub (size {st.st_size} vs {entry.size}, "
                          f"sha256 {sha[:12]} vs {entry.sha256[:12]}); deleted it: re-run to download "
                          "again")
    return SourceFile(path=str(local.relative_to(source_dir)), kind=kind_of(entry.path), size=st.st_size,
                      sha256=sha, mtime_ns=st.st_mtime_ns, name=entry.path)


# --- the source kinds: one entry each; a new kind of data.source is one entry here ----------------

@dataclass(frozen=True)
class SourceKind:
    """How one kind of data.source is named, fetched and checked for changes."""
    name: str
    source_id: Callable[[DataConfig], str]  # the raw/<source_id>/ folder
    dataset_base: Callable[[DataConfig], str]  # a derived dataset name, before its caps and shard size
    fetch: Callable[[RunConfig, Path], list[SourceFile]]  # make the files available and verified
    changed: Callable[[RunConfig, dict, Path], str | None]  # how the source differs from a manifest's, or None
    in_place: bool = False  # files used where they lie: validated before work, listing removed after bad input


def _changes(recorded: dict, now: list[SourceFile], max_docs: int) -> str | None:
    changed = changed_files(recorded.get("files", []), now, additions=not max_docs)
    return f"the source changed: {', '.join(changed[:10])}{' ...' if len(changed) > 10 else ''}" if changed else None


def _hub_changed(cfg: RunConfig, recorded: dict, source_dir: Path) -> str | None:
    d, pinned = cfg.data, (recorded.get("hf") or {}).get("commit")
    if d.hf_revision != pinned:  # a branch or tag: has it moved since the dataset was built? (one request)
        head = hub_head(cfg)
        if head and pinned and head != pinned:
            return f"the source changed: {d.hf_repo}@{d.hf_revision} moved from commit {pinned[:12]} to {head[:12]}"
    return _changes(recorded, previous_files(source_dir), d.max_docs)


def _hub_split(d: DataConfig) -> str:
    return "" if d.hf_split == "train" else f"-{d.hf_split}"  # train keeps the ids and names it had


def _hub_name(d: DataConfig) -> str:
    pinned = "" if d.hf_revision == "main" else f"-{d.hf_revision[:12]}"  # a commit or tag: a dataset of its own
    return f"{d.hf_repo.split('/')[-1]}-{d.hf_config}{_hub_split(d)}{pinned}"


def _local_id(d: DataConfig) -> str:
    spec = str(Path(d.source).expanduser().resolve()) if not glob.has_magic(d.source) else d.source
    base = Path(d.source.rstrip("/*")).name or "local"
    return safe_name(f"local-{base}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}")


SOURCE_KINDS = {
    "builtin": SourceKind(
        "builtin", source_id=lambda d: "builtin", dataset_base=lambda d: "shakespeare",
        fetch=lambda cfg, source_dir: [_builtin_file()],
        changed=lambda cfg, recorded, source_dir: None),  # fixed by its sha256
    "hf": SourceKind(
        "hf", source_id=lambda d: safe_name(f"hf-{d.hf_repo.replace('/', '--')}-{d.hf_config}{_hub_split(d)}-"
                                            f"{d.hf_revision}"),
        dataset_base=_hub_name, fetch=_fetch_hub, changed=_hub_changed),
}
LOCAL = SourceKind(
    "local", source_id=_local_id, dataset_base=_local_id,
    fetch=lambda cfg, source_dir: local_files(cfg.data.source, previous_files(source_dir)),
    changed=lambda cfg, recorded, source_dir: _changes(
        recorded, local_files(cfg.data.source, previous_files(source_dir)), cfg.data.max_docs),
    in_place=True)


def source_kind(cfg: RunConfig) -> SourceKind:
    """The kind of cfg.data.source: a named kind, or a local path / glob."""
    return SOURCE_KINDS.get(cfg.data.source, LOCAL)
