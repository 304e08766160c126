"""Sources: the built-in corpus, local files, and the Hugging Face hub path against a real HTTP server on
127.0.0.1 that serves the hub's layout (tests/hub_standin.py: repo info by revision, paginated tree API,
paths-info, resolve URLs with LFS headers and range requests). huggingface_hub and datasets themselves
make the requests: nothing is mocked."""

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gptcore.data import build, location, source_builtin, source_hub, source_local, sources
from gptcore.data.shard_format import read_shard
from gptcore.model.tokenizer import EOT, get_encoding
from gptcore.overrides import load_config
from tests.hub_standin import parquet_bytes

REPO = "HuggingFaceFW/fineweb-edu"
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


@pytest.fixture
def hub(standin):
    """FineWeb-Edu's layout: YAML configs in the card, sample/10BT/*.parquet with fineweb's extra columns."""
    texts = pq.read_table(source_builtin.BUILTIN, columns=["text"]).column("text").to_pylist()
    files = {"README.md": CARD.encode(), "data/CC-MAIN-2024/x.parquet": parquet_bytes(pa.table({"text": ["other"]}))}
    for i in range(3):  # 3 files x 2 documents
        t = pa.table({"text": texts[2 * i: 2 * i + 2], "id": [f"doc{2 * i}", f"doc{2 * i + 1}"],
                      "score": [3.1, 2.9]})
        files[f"sample/10BT/{i:03d}_00000.parquet"] = parquet_bytes(t)
    standin.commit = standin.publish(REPO, files)
    standin.root = standin.tree(REPO)
    standin.texts = texts[:6]
    return standin


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
    assert doc["hf"]["commit"] == hub.commit and doc["hf"]["split"] == "train"  # pinned to what main was

    n = len(hub.requests)  # second run: one question (which commit is main now?), nothing downloaded
    assert sources.fetch(cfg) == src
    assert [p for _, p, _ in hub.requests[n:]] == [f"/api/datasets/{REPO}/revision/main"]
    pinned = hf_cfg(f"data.hub.revision={hub.commit}")  # pinned to the commit: its own download, then
    sources.fetch(pinned)
    n = len(hub.requests)
    assert sources.fetch(pinned) and len(hub.requests) == n  # no network at all

    # a damaged local file is re-downloaded, the others are kept
    victim = files[1].resolve(src)
    victim.write_bytes(b"x" * 10)
    sources.fetch(cfg)
    gets = [p for m, p, _ in hub.requests[n:] if m == "GET" and p.endswith(".parquet")]
    assert gets == [f"/datasets/{REPO}/resolve/{hub.commit}/{files[1].name}"]  # the pinned commit's file
    assert victim.read_bytes() == (hub.root / files[1].name).read_bytes()

    # a listing damaged on disk (truncated) is not a dead end: every file is checked against the hub again
    (src / sources.LISTING).write_text('{"id": "x", "files": [')
    assert [f.sha256 for f in sources.load_listing(sources.fetch(cfg))[1]] == [f.sha256 for f in files]

    m = build.run(cfg, workers=1)
    got = np.concatenate([np.asarray(read_shard(location.dataset_dir(cfg) / s.name)) for s in m.shards])
    enc = get_encoding()
    want = [t for text in hub.texts for t in [EOT, *enc.encode_ordinary(text)]]
    assert np.array_equal(got, np.array(want, dtype=np.uint16))
    assert location.dataset_dir(cfg).name == "fineweb-edu-sample-10BT-20K"
    assert [f["sha256"] for f in m.source["files"]] == [f.sha256 for f in files]


def test_hub_checksum_mismatch_is_never_accepted(hub):
    hub.corrupt.add("sample/10BT/001_00000.parquet")
    with pytest.raises(sources.SourceError, match="does not match the hub"):
        sources.fetch(hf_cfg())
    src = location.pipeline_home() / "raw" / sources.source_id(hf_cfg())
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
    with pytest.raises(sources.SourceError, match=r"(?s)no config 'nope'.*'sample-10BT'"):
        sources.fetch(hf_cfg("data.hub.config=nope"))


def test_hub_not_enough_disk(hub, monkeypatch):
    monkeypatch.setattr(source_hub, "free_disk", lambda path: 1000)
    with pytest.raises(sources.SourceError, match="not enough free disk to download"):
        sources.fetch(hf_cfg())
    assert not list((location.pipeline_home() / "raw").rglob("*.parquet"))


def test_hub_missing_repo_says_what_to_do(hub):
    with pytest.raises(sources.SourceError, match=r"(?s)cannot reach nobody/nothing.*data.source=/path/to"):
        sources.fetch(hf_cfg("data.hub.repo=nobody/nothing"))


def test_builtin_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    src = sources.fetch(load_config("micro"))
    _, files = sources.load_listing(src)
    assert files[0].sha256 == source_builtin.BUILTIN_SHA256
    t = pq.read_table(source_builtin.BUILTIN)
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
    files = source_local.local_files(spec)
    assert [f.name for f in files] == ["a/x.jsonl", "b/x.jsonl"]
    recorded = [{"name": f.name, "sha256": f.sha256} for f in files]
    (d / "b" / "x.jsonl").write_text('{"text": "changed"}\n')
    assert sources.changed_files(recorded, source_local.local_files(spec)) == ["b/x.jsonl (changed)"]


def test_a_symlinked_file_in_the_source_directory_is_listed_by_its_name_there(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "real.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link.jsonl").symlink_to(tmp_path / "elsewhere" / "real.jsonl")
    [f] = source_local.local_files(str(tmp_path / "d"))
    assert f.name == "link.jsonl" and f.path == str((tmp_path / "elsewhere" / "real.jsonl").resolve())


def test_a_local_source_in_every_readable_format(tmp_path):
    """One table of formats (gptcore/data/formats.py): parquet, JSON Lines, a JSON array, JSON Lines in a
    .json file, txt, and json/jsonl/txt compressed with gzip, bz2 or xz all yield their documents, in path
    order; a file of another format is not listed."""
    import bz2
    import gzip
    import json
    import lzma

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gptcore.data import build, location
    from gptcore.data.shard_format import read_shard
    from gptcore.model.tokenizer import EOT, get_encoding

    texts = [f"document {i}: " + "lorem ipsum dolor " * (50 + i) for i in range(16)]
    lines = lambda ts: "".join(json.dumps({"text": t, "id": 1}) + "\n" for t in ts).encode()  # noqa: E731
    src = tmp_path / "mixed"
    src.mkdir()
    pq.write_table(pa.table({"text": texts[0:2]}), src / "a.parquet")
    (src / "b.jsonl").write_bytes(lines(texts[2:4]))
    (src / "c.json").write_text(json.dumps([{"text": t} for t in texts[4:6]]))
    (src / "d.json").write_bytes(lines(texts[6:8]))
    (src / "e.txt").write_text(texts[8])
    (src / "f.jsonl.gz").write_bytes(gzip.compress(lines(texts[9:11])))
    (src / "g.json.bz2").write_bytes(bz2.compress(json.dumps([{"text": t} for t in texts[11:13]]).encode()))
    (src / "h.jsonl.xz").write_bytes(lzma.compress(lines(texts[13:15])))
    (src / "i.txt.gz").write_bytes(gzip.compress(texts[15].encode()))
    (src / "j.csv").write_text("text\nnot read\n")
    cfg = load_config("micro", [f"data.source={src}", "data.shard_tokens=2048"])
    m = build.run(cfg, workers=1)
    assert [f.kind for f in sources.load_listing(sources.raw_dir(cfg))[1]] == [
        "parquet", "jsonl", "json", "json", "txt", "jsonl.gz", "json.bz2", "jsonl.xz", "txt.gz"]
    got = np.concatenate([np.asarray(read_shard(location.dataset_dir(cfg) / s.name)) for s in m.shards])
    enc = get_encoding()
    want = np.array([t for text in texts for t in [EOT, *enc.encode_ordinary(text)]], dtype=np.uint16)
    assert np.array_equal(got, want)
    capped = load_config("micro", [f"data.source={src}", "data.shard_tokens=1024", "data.max_docs=12"])
    got = np.concatenate([np.asarray(read_shard(location.dataset_dir(capped) / s.name))
                          for s in build.run(capped, workers=1).shards])
    assert np.array_equal(got, want[: len([t for text in texts[:12] for t in [EOT, *enc.encode_ordinary(text)]])])


class HTTPFiles(sources.SourceKind):
    """A toy source kind, defined here and nowhere else: data.source = "http://host:port/" names a folder of
    JSON Lines files served over HTTP, listed in its index.txt."""
    name = "http-files"

    def matches(self, source: str) -> bool:
        return source.startswith("http://")

    def source_id(self, cfg) -> str:
        return sources.safe_name("http-" + cfg.data.source.removeprefix("http://").strip("/"))

    def fetch(self, cfg, source_dir):
        from urllib.request import urlopen

        from gptcore.files import file_sha256

        base = cfg.data.source.rstrip("/") + "/"
        files = []
        for name in urlopen(base + "index.txt", timeout=10).read().decode().split():
            local = source_dir / "files" / name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(urlopen(base + name, timeout=10).read())
            st = local.stat()
            files.append(sources.SourceFile(path=f"files/{name}", kind=sources.kind_of(local), size=st.st_size,
                                            sha256=file_sha256(local), mtime_ns=st.st_mtime_ns, name=name))
        return files

    def lineage(self, recorded: dict, dataset_dir) -> tuple[str, dict]:
        return "http", {"url": recorded["source"]}


def test_a_new_source_kind_is_one_registered_class(mlflow_server, tmp_path, monkeypatch):
    """ARCHITECTURE.md's route for a new source kind: a SourceKind registered from inside this test (no other
    file changed) builds a dataset from files served over HTTP, and the run's MLflow dataset input names its
    URL as an MLflow `http` source."""
    import json

    from mlflow import MlflowClient

    from integrations import mlflow_store
    from tests.local_http import end_body, serve

    texts = pq.read_table(source_builtin.BUILTIN, columns=["text"]).column("text").to_pylist()[:6]
    served = {f"part-{i}.jsonl": "".join(json.dumps({"text": t[:4000]}) + "\n" for t in texts[i::2]).encode()
              for i in range(2)}
    served["index.txt"] = "\n".join(sorted(served)).encode()

    def handle(h, head):
        body = served.get(h.path.removeprefix("/corpus/"))
        h.send_response(200 if body is not None else 404)
        end_body(h, head, body or b"")

    server = serve(handle)
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    kind = sources.register(HTTPFiles())
    try:
        url = f"http://127.0.0.1:{server.server_port}/corpus/"
        cfg = load_config("micro", [f"data.source={url}", "data.shard_tokens=2048", "data.num_workers=1"])
        m = build.run(cfg, workers=1)
        assert sources.source_kind(cfg) is kind and m.source["source"] == url
        assert sum(s.tokens for s in m.shards) == sum(len(get_encoding().encode_ordinary(t[:4000])) + 1
                                                      for t in texts)
        assert location.why_incomplete(cfg) is None  # the kind's own change check: the default, by file hashes
        uri = mlflow_server.uri
        mlc = MlflowClient(uri)
        run = mlc.create_run(mlflow_store.experiment_id(mlc, "toy-source-kind"))
        mlflow_store.log_datasets(mlc, run.info.run_id, location.dataset_dir(cfg))
        inputs = mlc.get_run(run.info.run_id).inputs.dataset_inputs
        d = {i.dataset.name: i.dataset for i in inputs}[location.dataset_dir(cfg).name]
        assert (d.source_type, json.loads(d.source)["url"], d.digest) == ("http", url, m.id)
    finally:
        sources.unregister(kind.name)
        server.shutdown()
        server.server_close()
    assert not isinstance(sources.kind_for(url), HTTPFiles)  # unregistered: a URL is a (missing) path again
