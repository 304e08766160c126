"""The "hf" source kind: a Hugging Face hub dataset (default FineWeb-Edu sample-10BT). `datasets` resolves
the config's data files of the requested split (data.hub.split) at the commit data.hub.revision resolves to,
as it would for `load_dataset` (YAML configs in the card, or splits inferred from file names); those files
are fetched one by one into <home>/raw/<source_id>/ and verified against the hub's size and sha256. The
commit is recorded (listing and manifest, under "hf"); a branch that moved is a changed source. HF_TOKEN and
HF_ENDPOINT are honoured (HF_ENDPOINT also when set after import). Its settings: its own config section,
data.hub (repo, config, split, revision; config.HubConfig)."""

from __future__ import annotations

# lazy imports: huggingface_hub and datasets (~1 s) load only when a hub source is fetched or asked about
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gptcore.config import RunConfig
from gptcore.data.formats import COMPRESSIONS, FORMATS, SourceError, kind_of, readable_suffixes
from gptcore.data.source_kind import (
    LISTING,
    SourceFile,
    SourceKind,
    changes,
    previous_files,
    safe_name,
    save_listing,
)
from gptcore.files import file_sha256, free_disk, pipeline_home, read_json


class Hub(SourceKind):
    name = "hf"

    def validate(self, cfg: RunConfig) -> None:
        d = cfg.data
        if not (d.hub.repo and d.hub.split and d.hub.revision):
            raise SourceError("data.hub.repo, data.hub.split and data.hub.revision must not be empty with "
                              "data.source=hf")

    def source_id(self, cfg: RunConfig) -> str:
        d = cfg.data
        return safe_name(f"hf-{d.hub.repo.replace('/', '--')}-{d.hub.config}{_split_suffix(cfg)}-{d.hub.revision}")

    def dataset_base(self, cfg: RunConfig) -> str:
        d = cfg.data
        pinned = "" if d.hub.revision == "main" else f"-{d.hub.revision[:12]}"  # a commit or tag: a dataset of its own
        return f"{d.hub.repo.split('/')[-1]}-{d.hub.config}{_split_suffix(cfg)}{pinned}"

    def fetch(self, cfg: RunConfig, source_dir: Path) -> list[SourceFile]:
        return _fetch_hub(cfg, source_dir)

    def changed(self, cfg: RunConfig, recorded: dict, source_dir: Path) -> str | None:
        d, pinned = cfg.data, (recorded.get(self.name) or {}).get("commit")
        if d.hub.revision != pinned:  # a branch or tag: has it moved since the dataset was built? (one request)
            head = hub_head(cfg)
            if head and pinned and head != pinned:
                return (f"the source changed: {d.hub.repo}@{d.hub.revision} moved from commit {pinned[:12]} "
                        f"to {head[:12]}")
        return changes(recorded, previous_files(source_dir), d.max_docs)

    def record(self, cfg: RunConfig, source_dir: Path, commit: str | None = None) -> dict:
        d = cfg.data
        return {"repo": d.hub.repo, "config": d.hub.config, "split": d.hub.split, "revision": d.hub.revision,
                "commit": commit or hub_commit(source_dir),
                "documents": f"the first {d.max_docs}" if d.max_docs else "all"}

    def lineage(self, recorded: dict, dataset_dir: Path) -> tuple[str, dict]:
        hub = recorded.get(self.name) or {}
        return "hugging_face", {"path": hub.get("repo"), "config_name": hub.get("config") or None,
                                "data_dir": None, "data_files": None, "split": hub.get("split"),
                                "revision": hub.get("commit")}


def _split_suffix(cfg: RunConfig) -> str:
    return "" if cfg.data.hub.split == "train" else f"-{cfg.data.hub.split}"  # train keeps the ids and names it had


def hub_commit(source_dir: Path) -> str | None:
    """The commit sha a hub source's listing was resolved at (None: not a hub source, or not yet)."""
    return (read_json(Path(source_dir) / LISTING, {}).get(Hub.name) or {}).get("commit")


def _fetch_hub(cfg: RunConfig, source_dir: Path) -> list[SourceFile]:
    """Download the requested split's data files one at a time (so a kill resumes at the file it was on),
    each verified against the hub's size + sha256 before it is recorded in source.json."""
    d = cfg.data
    files, doc = previous_files(source_dir), read_json(Path(source_dir) / LISTING, {})
    done = {f.name: f for f in files if f.unchanged(source_dir)}
    verified = bool(files) and doc.get("complete") and doc.get("max_docs") == d.max_docs and len(done) == len(files)
    pinned = hub_commit(source_dir)
    if verified and pinned == d.hub.revision:
        return files  # a commit sha never moves: no network

    from huggingface_hub import HfApi, hf_hub_download  # only the hub source needs it

    endpoint, token = _hub_endpoint(), os.environ.get("HF_TOKEN") or None
    api = HfApi(endpoint=endpoint, token=token)
    try:
        commit = api.dataset_info(d.hub.repo, revision=d.hub.revision).sha
    except Exception as e:  # noqa: BLE001 -- offline, auth, missing repo: say which and what to do
        if verified:  # offline with a complete download: train on what is verified, say it
            print(f"warning: cannot ask {endpoint} which commit {d.hub.repo}@{d.hub.revision} is now ({e}); "
                  f"using the verified download of commit {pinned}", flush=True)
            return files
        raise SourceError(f"cannot reach {d.hub.repo} (revision {d.hub.revision}) on {endpoint}: {e}. Check "
                          "the network or HF_ENDPOINT, set HF_TOKEN for gated/private data, or use a local copy: "
                          "data.source=/path/to/files") from e
    if verified and commit == pinned:
        return files
    if pinned and commit != pinned:
        print(f"{d.hub.repo}@{d.hub.revision} moved from commit {pinned} to {commit}: the source changed, its "
              "files are checked again (pin data.hub.revision=<sha> to train on one commit)", flush=True)
    remote = hub_data_files(api, cfg, commit, token)
    need = sum(e.size for e in remote if e.path not in done)
    free = free_disk(source_dir)
    if need > free and not d.max_docs:
        raise SourceError(f"not enough free disk to download the dataset into {source_dir}: need "
                          f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB free. Free space, point GPTPIPE_HOME at "
                          "a larger disk, or download part of it with data.max_docs")
    if d.max_docs:  # a smoke run: read the first documents through range requests, download nothing whole
        return _read_hub_prefix(cfg, source_dir, remote, commit, endpoint, token)
    get = functools.partial(hf_hub_download, d.hub.repo, repo_type="dataset", revision=commit,
                            endpoint=endpoint, token=token)  # a file of this commit, into local_dir
    files = []
    for entry in remote:
        f = done.pop(entry.path, None)
        if f is None or f.sha256 != entry.sha256:
            f = _download_one(get, source_dir, entry)
        files.append(f)
        # record progress: a kill now resumes at the next file (earlier verified ones stay listed)
        save_listing(source_dir, cfg, Hub(), [*files, *done.values()], complete=False,
                     record=Hub().record(cfg, source_dir, commit))
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
        with fs.open(f"datasets/{d.hub.repo}@{commit}/{entry.path}", "rb", block_size=1 << 16) as remote_file:
            text = COMPRESSIONS[compression](remote_file) if compression else remote_file
            taken = fmt.copy_prefix(text, local, left, d.text_column)
        left -= taken
        st = local.stat()
        files.append(SourceFile(path=str(local.relative_to(source_dir)), kind=kind_of(local), size=st.st_size,
                                sha256=file_sha256(local), mtime_ns=st.st_mtime_ns, name=entry.path,
                                prefix_of=entry.sha256))
        save_listing(source_dir, cfg, Hub(), files, complete=False, record=Hub().record(cfg, source_dir, commit))
    return files


def hub_head(cfg: RunConfig) -> str | None:
    """The commit data.hub.revision is on the hub now (one request); None, with a warning, when the hub
    cannot be asked (offline: a nightly run goes on with what it has verified)."""
    from huggingface_hub import HfApi

    d, endpoint = cfg.data, _hub_endpoint()
    try:
        return HfApi(endpoint=endpoint, token=os.environ.get("HF_TOKEN") or None).dataset_info(
            d.hub.repo, revision=d.hub.revision).sha
    except Exception as e:  # noqa: BLE001 -- any failure to ask is "unknown", never a reason to stop
        print(f"warning: cannot ask {endpoint} which commit {d.hub.repo}@{d.hub.revision} is now ({e})", flush=True)
        return None


def _hub_endpoint() -> str:
    """HF_ENDPOINT as it is now: huggingface_hub (and datasets, once imported) read it only at import."""
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
    """The data files of data.hub.split in data.hub.config at `commit`, in path order, as `datasets`
    resolves them (`load_dataset_builder`: the card's YAML configs, or splits inferred from file names)."""
    import datasets

    _hub_endpoint()  # datasets is imported now: point it at HF_ENDPOINT as it is
    d = cfg.data
    try:
        builder = datasets.load_dataset_builder(d.hub.repo, d.hub.config or None, revision=commit, token=token,
                                                cache_dir=str(pipeline_home() / "raw" / ".datasets-cache"))
    except ValueError as e:  # an unknown config: datasets names the ones that exist
        raise SourceError(f"{d.hub.repo} has no config {d.hub.config!r} ({e}); set data.hub.config to one of "
                          "those") from e
    except Exception as e:  # noqa: BLE001 -- a missing repo, a layout datasets cannot read
        raise SourceError(f"datasets cannot resolve {d.hub.repo} (config {d.hub.config!r}, commit {commit}): "
                          f"{type(e).__name__}: {e}; use data.source=<local dir> for a copy of its files") from e
    splits = builder.config.data_files or {}
    if d.hub.split not in splits:
        raise SourceError(f"{d.hub.repo} config {builder.config.name!r} has no split {d.hub.split!r}; set "
                          f"data.hub.split to one of {sorted(splits)}")
    prefix = f"hf://datasets/{d.hub.repo}@{commit}/"
    paths = sorted(str(u).removeprefix(prefix) for u in splits[d.hub.split])
    unreadable = [p for p in paths if kind_of(p) is None]
    if unreadable:
        raise SourceError(f"{d.hub.repo} split {d.hub.split!r} has files this pipeline cannot read "
                          f"({unreadable[:3]}; it reads {readable_suffixes()}); convert them, or point "
                          "data.source at a local copy in one of those formats")
    infos = {i.path: i for i in api.get_paths_info(d.hub.repo, paths, revision=commit, repo_type="dataset")}
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
