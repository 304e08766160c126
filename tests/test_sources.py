"""Sources: the built-in corpus, local files, and the Hugging Face hub path against a real HTTP server on
127.0.0.1 that serves the hub's layout (dataset card, paginated tree API, resolve URLs with LFS
headers and range requests). huggingface_hub itself makes the requests: nothing is mocked."""

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gptcore import sharding, sources
from gptcore.config import load_config
from gptcore.shard_format import read_shard
from gptcore.tokenizer import EOT, get_encoding
from tests.local_http import serve

REPO = "HuggingFaceFW/fineweb-edu"
COMMIT = "a" * 40
CARD = """---
license: odc-by
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# test card
"""


class Hub:
    """Files of one dataset repo served the way huggingface.co serves them."""

    def __init__(self, root: Path):
        self.root, self.requests, self.corrupt = root, [], set()
        self.server = serve(self.handle)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def files(self):
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def handle(self, h, head):
        u = urlparse(h.path)
        self.requests.append((h.command, unquote(u.path), h.headers.get("Authorization")))
        tree = re.match(rf"^/api/datasets/{REPO}/tree/([^/]+)(?:/(.*))?$", u.path)
        resolve = re.match(rf"^/datasets/{REPO}/resolve/([^/]+)/(.+)$", u.path)
        if tree:
            prefix = unquote(tree.group(2) or "")
            entries = []
            for rel in self.files():
                if rel.startswith(prefix + "/") or not prefix:
                    data = (self.root / rel).read_bytes()
                    lfs = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    entries.append({"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                                    "path": rel, **({"lfs": lfs} if rel.endswith(".parquet") else {})})
            cursor = int(parse_qs(u.query).get("cursor", ["0"])[0])
            page = entries[cursor: cursor + 2]  # tiny pages: exercise the Link-header pagination
            body = json.dumps(page).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            if cursor + 2 < len(entries):
                h.send_header("Link", f'<{self.url}{u.path}?recursive=true&cursor={cursor + 2}>; rel="next"')
        elif resolve and (self.root / unquote(resolve.group(2))).is_file():
            rel = unquote(resolve.group(2))
            data = (self.root / rel).read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            if rel in self.corrupt:
                data = data[:-10] + b"0123456789"  # same size, wrong bytes
            start = 0
            if rng := re.match(r"bytes=(\d+)-", h.headers.get("Range") or ""):
                start = int(rng.group(1))
            body = data[start:]
            h.send_response(206 if start else 200)
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("ETag", f'"{sha if rel.endswith(".parquet") else hashlib.sha1(data).hexdigest()}"')
            if start:
                h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            body = b'{"error": "Entry not found"}'
            h.send_response(404)
            h.send_header("X-Error-Code", "EntryNotFound")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "sample" / "10BT").mkdir(parents=True)
    (root / "data" / "CC-MAIN-2024").mkdir(parents=True)
    (root / "README.md").write_text(CARD)
    texts = pq.read_table(sources.BUILTIN, columns=["text"]).column("text").to_pylist()
    for i in range(3):  # 3 files x 2 documents, with fineweb's extra columns
        t = pa.table({"text": texts[2 * i: 2 * i + 2], "id": [f"doc{2 * i}", f"doc{2 * i + 1}"],
                      "score": [3.1, 2.9]})
        pq.write_table(t, root / "sample" / "10BT" / f"{i:03d}_00000.parquet")
    pq.write_table(pa.table({"text": ["other config"]}), root / "data" / "CC-MAIN-2024" / "x.parquet")
    server = Hub(root)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    server.texts = texts[:6]
    yield server
    server.close()


def hf_cfg(*ov):
    return load_config("micro", ["data.source=hf", "data.shard_tokens=20000", *ov])


def test_hub_download_verified_idempotent_and_tokenized(hub):
    cfg = hf_cfg()
    src = sources.fetch(cfg)
    doc, files = sources.load_listing(src)
    assert [f.name for f in files] == [f"sample/10BT/{i:03d}_00000.parquet" for i in range(3)]
    for f in files:  # byte-identical to the hub's files, sha256 recorded from the hub's LFS metadata
        assert f.resolve(src).read_bytes() == (hub.root / f.name).read_bytes()
        assert f.sha256 == hashlib.sha256((hub.root / f.name).read_bytes()).hexdigest()
    assert doc["complete"] and not list(src.rglob("*.incomplete"))
    repo_requests = [r for r in hub.requests if REPO in r[1]]
    assert repo_requests and all(auth == "Bearer hf_test_token" for _, _, auth in repo_requests)  # HF_TOKEN
    assert sum("tree" in p for _, p, _ in hub.requests) >= 2  # paginated listing followed

    n = len(hub.requests)
    assert sources.fetch(cfg) == src and len(hub.requests) == n  # second run: no network at all

    # a damaged local file is re-downloaded, the others are kept
    victim = files[1].resolve(src)
    victim.write_bytes(b"x" * 10)
    sources.fetch(cfg)
    gets = [p for m, p, _ in hub.requests[n:] if m == "GET" and p.endswith(".parquet")]
    assert gets == [f"/datasets/{REPO}/resolve/main/{files[1].name}"]
    assert victim.read_bytes() == (hub.root / files[1].name).read_bytes()

    # a listing damaged on disk (truncated) is not a dead end: every file is checked against the hub again
    (src / sources.LISTING).write_text('{"id": "x", "files": [')
    assert [f.sha256 for f in sources.load_listing(sources.fetch(cfg))[1]] == [f.sha256 for f in files]

    m = sharding.run(cfg, workers=1)
    got = np.concatenate([np.asarray(read_shard(sharding.dataset_dir(cfg) / s.name)) for s in m.shards])
    enc = get_encoding()
    want = [t for text in hub.texts for t in [EOT, *enc.encode_ordinary(text)]]
    assert np.array_equal(got, np.array(want, dtype=np.uint16))
    assert sharding.dataset_dir(cfg).name == "fineweb-edu-sample-10BT-20K"
    assert [f["sha256"] for f in m.source["files"]] == [f.sha256 for f in files]


def test_hub_checksum_mismatch_is_never_accepted(hub):
    hub.corrupt.add("sample/10BT/001_00000.parquet")
    with pytest.raises(sources.SourceError, match="does not match the hub"):
        sources.fetch(hf_cfg())
    src = sharding.pipeline_home() / "raw" / sources.source_id(hf_cfg())
    doc, files = sources.load_listing(src)
    assert not doc["complete"] and [f.name for f in files] == ["sample/10BT/000_00000.parquet"]
    assert not (src / "files" / "sample/10BT/001_00000.parquet").exists()
    hub.corrupt.clear()  # the hub recovers: the next run resumes at the file it failed on
    n = len(hub.requests)
    sources.fetch(hf_cfg())
    gets = [p.rsplit("/", 1)[-1] for m, p, _ in hub.requests[n:] if m == "GET" and p.endswith(".parquet")]
    assert gets == ["001_00000.parquet", "002_00000.parquet"]


def test_hub_max_docs_stops_downloading_early_and_unknown_config(hub):
    cfg = hf_cfg("data.max_docs=2")
    _, files = sources.load_listing(sources.fetch(cfg))
    assert len(files) == 1  # 2 documents are in the first file: the rest is not fetched
    with pytest.raises(sources.SourceError, match=r"no config 'nope'.*'sample-10BT'"):
        sources.fetch(hf_cfg("data.hf_config=nope"))


def test_hub_not_enough_disk(hub, monkeypatch):
    monkeypatch.setattr(sources, "free_disk", lambda path: 1000)
    with pytest.raises(sources.SourceError, match="not enough free disk to download"):
        sources.fetch(hf_cfg())
    assert not list((sharding.pipeline_home() / "raw").rglob("*.parquet"))


def test_hub_missing_repo_says_what_to_do(hub):
    with pytest.raises(sources.SourceError, match=r"(?s)cannot list nobody/nothing.*data.source=/path/to"):
        sources.fetch(hf_cfg("data.hf_repo=nobody/nothing"))


def test_builtin_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    src = sources.fetch(load_config("micro"))
    _, files = sources.load_listing(src)
    assert files[0].sha256 == sources.BUILTIN_SHA256
    t = pq.read_table(sources.BUILTIN)
    assert t.num_rows == 42 and len(set(t.column("title").to_pylist())) == 42  # one document per work
    text = "\n".join(t.column("text").to_pylist())
    assert "Gutenberg" not in text and "Tragedie" not in text  # no licence text, no folio duplicates
    assert sum(len(x) for x in get_encoding().encode_ordinary_batch(t.column("text").to_pylist())) > 1_500_000


def test_local_listing_is_sorted_and_fingerprinted(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    d = tmp_path / "d"
    (d / "b").mkdir(parents=True)
    for name in ["b/2.txt", "a.jsonl", "b/1.txt"]:
        (d / name).write_text('{"text": "x"}\n')
    _, files = sources.load_listing(sources.fetch(load_config("micro", [f"data.source={d}"])))
    assert [f.name for f in files] == ["a.jsonl", "b/1.txt", "b/2.txt"]
    _, files = sources.load_listing(sources.fetch(load_config("micro", [f"data.source={d}/b/*.txt"])))
    assert [f.name for f in files] == ["1.txt", "2.txt"] and all(f.mtime_ns for f in files)


def test_glob_across_folders_names_each_file_uniquely(tmp_path, monkeypatch):
    # two matched files with one base name must not share a fingerprint record: a change to either is seen
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    d = tmp_path / "d"
    for sub in ("a", "b"):
        (d / sub).mkdir(parents=True)
        (d / sub / "x.jsonl").write_text(f'{{"text": "{sub}"}}\n')
    spec = f"{d}/**/*.jsonl"
    files = sources.local_files(spec)
    assert [f.name for f in files] == ["a/x.jsonl", "b/x.jsonl"]
    recorded = [{"name": f.name, "sha256": f.sha256} for f in files]
    (d / "b" / "x.jsonl").write_text('{"text": "changed"}\n')
    assert sources.changed_files(recorded, sources.local_files(spec)) == ["b/x.jsonl (changed)"]


def test_a_symlinked_file_in_the_source_directory_is_listed_by_its_name_there(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "real.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link.jsonl").symlink_to(tmp_path / "elsewhere" / "real.jsonl")
    [f] = sources.local_files(str(tmp_path / "d"))
    assert f.name == "link.jsonl" and f.path == str((tmp_path / "elsewhere" / "real.jsonl").resolve())
