"""Any hub dataset users bring, resolved by `datasets` the way `load_dataset` reads it, against the hub
stand-in on 127.0.0.1 (tests/hub_standin.py; real huggingface_hub and datasets clients): only the
requested split is tokenized, the commit a branch resolved to is recorded, a moved branch is a changed
source, and jsonl repositories and cards without YAML configs work."""

import json

import numpy as np
import pyarrow as pa
import pytest

from gptcore.data import build, location, sources
from gptcore.data.shard_format import read_shard
from gptcore.model.tokenizer import EOT, get_encoding
from gptcore.overrides import load_config
from tests.hub_standin import parquet_bytes

SPLITS = "someone/three-splits"
JSONL = "someone/jsonl-corpus"


def docs(split: str, n: int, tag: str = "") -> list[str]:
    return [f"{split} document {i}{tag}: " + "the quick brown fox " * (100 + i) for i in range(n)]


def hub_cfg(repo: str, *ov):
    return load_config("micro", ["data.source=hf", f"data.hub.repo={repo}", "data.hub.config=",
                                 "data.shard_tokens=1024", *ov])


def tokens_of(cfg) -> np.ndarray:
    m = build.run(cfg, workers=1)
    return np.concatenate([np.asarray(read_shard(location.dataset_dir(cfg) / s.name)) for s in m.shards]), m


def expected(texts: list[str]) -> np.ndarray:
    enc = get_encoding()
    return np.array([t for text in texts for t in [EOT, *enc.encode_ordinary(text)]], dtype=np.uint16)


@pytest.fixture
def three_splits(standin):
    """No dataset card configs: `datasets` infers train/validation/test from the file names."""
    files = {"README.md": b"# no YAML header\n"}
    for split, n in (("train", 5), ("validation", 3), ("test", 2)):
        files[f"data/{split}-00000-of-00001.parquet"] = parquet_bytes(pa.table({"text": docs(split, n)}))
    standin.commit = standin.publish(SPLITS, files)
    return standin


def test_only_the_requested_split_is_tokenized_and_the_commit_is_recorded(three_splits):
    got, m = tokens_of(hub_cfg(SPLITS))
    assert np.array_equal(got, expected(docs("train", 5)))  # not a token of validation or test
    assert m.source["hf"] == {"repo": SPLITS, "config": "", "split": "train", "revision": "main",
                              "commit": three_splits.commit, "documents": "all"}
    got, m = tokens_of(hub_cfg(SPLITS, "data.hub.split=validation"))
    assert np.array_equal(got, expected(docs("validation", 3)))
    assert location.dataset_dir(hub_cfg(SPLITS, "data.hub.split=validation")).name.endswith("-validation-1024")


def test_an_unknown_split_or_config_names_the_ones_that_exist(three_splits):
    with pytest.raises(sources.SourceError, match=r"no split 'dev'.*\['test', 'train', 'validation'\]"):
        sources.fetch(hub_cfg(SPLITS, "data.hub.split=dev"))
    with pytest.raises(sources.SourceError, match=r"(?s)no config 'nope'.*default"):
        sources.fetch(hub_cfg(SPLITS, "data.hub.config=nope"))


def test_a_moved_branch_is_a_changed_source_rebuilt_under_a_new_manifest_id(three_splits):
    cfg = hub_cfg(SPLITS)
    _, first = tokens_of(cfg)
    files = {"README.md": b"# no YAML header\n",
             "data/train-00000-of-00001.parquet": parquet_bytes(pa.table({"text": docs("train", 5, " v2")}))}
    moved = three_splits.publish(SPLITS, files)  # main moves to a commit with other training text
    why = location.why_incomplete(cfg)  # the flow's skip check asks the hub (one request), downloads nothing
    old = first.source["hf"]["commit"]
    assert why == f"the source changed: {SPLITS}@main moved from commit {old[:12]} to {moved[:12]}"
    got, second = tokens_of(cfg)
    assert np.array_equal(got, expected(docs("train", 5, " v2")))
    assert second.id != first.id and second.source["hf"]["commit"] == moved != first.source["hf"]["commit"]
    pinned = hub_cfg(SPLITS, f"data.hub.revision={three_splits.commit}")  # the old commit, by its sha
    got, old = tokens_of(pinned)
    assert np.array_equal(got, expected(docs("train", 5))) and old.source["hf"]["commit"] == three_splits.commit


def test_a_jsonl_dataset_with_yaml_configs(standin):
    card = ("---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/*.jsonl\n"
            "- config_name: de\n  data_files:\n  - split: train\n    path: de/*.jsonl\n---\n")
    lines = lambda texts: "".join(json.dumps({"text": t, "meta": 1}) + "\n" for t in texts).encode()  # noqa: E731
    standin.publish(JSONL, {"README.md": card.encode(), "en/part-0.jsonl": lines(docs("en", 3)),
                            "en/part-1.jsonl": lines(docs("en2", 2)), "de/part-0.jsonl": lines(["ein Text"])})
    got, m = tokens_of(hub_cfg(JSONL, "data.hub.config=en"))
    assert np.array_equal(got, expected(docs("en", 3) + docs("en2", 2)))
    assert [f["name"] for f in m.source["files"]] == ["en/part-0.jsonl", "en/part-1.jsonl"]
    _, files = sources.load_listing(sources.fetch(hub_cfg(JSONL, "data.hub.config=en", "data.max_docs=2")))
    assert [f.name for f in files] == ["en/part-0.jsonl"]  # max_docs: the second file is not fetched


def test_a_smoke_run_reads_only_the_documents_it_needs(standin):
    """data.max_docs=30 of a 4,000-document parquet file written in row groups of 100: huggingface_hub's
    HfFileSystem reads the footer and the first row group with range requests, so the stand-in serves a small
    fraction of the file; the shards hold exactly the first 30 documents; the listing and the manifest say
    the dataset is a prefix of the source."""
    import hashlib
    import random

    import pyarrow.parquet as pq

    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    texts = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(4000)]  # incompressible-ish
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts}), sink, row_group_size=100)
    data = sink.getvalue().to_pybytes()
    standin.publish(SPLITS, {"README.md": b"# smoke\n", "data/train-00000-of-00001.parquet": data})
    cfg = hub_cfg(SPLITS, "data.max_docs=30")
    got, m = tokens_of(cfg)
    assert np.array_equal(got, expected(texts[:30]))
    assert standin.served_bytes < len(data) / 10, (standin.served_bytes, len(data))
    _, files = sources.load_listing(sources.raw_dir(cfg))
    assert [f.name for f in files] == ["data/train-00000-of-00001.parquet"]
    assert files[0].prefix_of == hashlib.sha256(data).hexdigest() and files[0].size < len(data) / 10
    assert m.source["hf"]["documents"] == "the first 30" and m.source["max_docs"] == 30


def test_compressed_and_json_array_files_are_read_as_datasets_reads_them(standin):
    """A repository without YAML configs holding gzip'd JSON Lines for train and a JSON array for
    validation: `datasets` infers both splits; each split's documents (and only those) are tokenized, and
    a smoke run streams the first documents of the compressed file, decompressing as it reads."""
    import gzip

    train = docs("train", 6)
    files = {"README.md": b"# compressed\n",
             "data/train-00000-of-00002.jsonl.gz": gzip.compress(
                 "".join(json.dumps({"text": t}) + "\n" for t in train[:4]).encode()),
             "data/train-00001-of-00002.jsonl.gz": gzip.compress(
                 "".join(json.dumps({"text": t}) + "\n" for t in train[4:]).encode()),
             "data/validation-00000-of-00001.json": json.dumps([{"text": t} for t in docs("val", 3)]).encode()}
    standin.publish(SPLITS, files)
    got, _ = tokens_of(hub_cfg(SPLITS))
    assert np.array_equal(got, expected(train))
    assert [f.kind for f in sources.load_listing(sources.raw_dir(hub_cfg(SPLITS)))[1]] == ["jsonl.gz"] * 2
    got, _ = tokens_of(hub_cfg(SPLITS, "data.hub.split=validation"))
    assert np.array_equal(got, expected(docs("val", 3)))
    smoke = hub_cfg(SPLITS, "data.max_docs=3")
    got, _ = tokens_of(smoke)
    assert np.array_equal(got, expected(train[:3]))
    _, listed = sources.load_listing(sources.raw_dir(smoke))
    assert [(f.name, f.path, f.kind) for f in listed] == [
        ("data/train-00000-of-00002.jsonl.gz", "prefix/data/train-00000-of-00002.jsonl", "jsonl")]
