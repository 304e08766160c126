"""The data stage says "complete" only when it is: fingerprinted local sources (a changed, added or
removed file is rebuilt, with a new manifest id), shards reused only when cut from the same pieces, the
trainer checking each shard's sha256, and the bad-input contract (exit 2, one error line, nothing left
half-made). Real CLI processes where the exit code is the contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptcore.data import location
from gptcore.data.shard_format import Manifest
from gptcore.overrides import load_config
from tests.test_train_utils import env, make_dataset, python_cmd

ROOT = Path(__file__).resolve().parents[1]
SHARDS = ["data.shard_tokens=2000", "data.piece_bytes=3000"]


def docs(n, tag=""):
    return [{"text": f"Document {i}{tag}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(120))}
            for i in range(n)]


def write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cli(home: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    e = {**os.environ, "GPTPIPE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "gptcore.data.build", "micro", *SHARDS, "data.num_workers=1",
                           *overrides], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    write_jsonl(d / "a.jsonl", docs(30))
    write_jsonl(d / "b.jsonl", docs(30, "b"))
    return d


def dataset(home, src) -> tuple[Path, Manifest]:
    out = home / "shards" / location.dataset_name(load_config("micro", [*SHARDS, f"data.source={src}"]))
    return out, Manifest.load(out)


def test_a_changed_local_source_is_rebuilt_and_changes_the_manifest_id(src, tmp_path):
    home = tmp_path / "home"
    r = cli(home, f"data.source={src}")
    assert r.returncode == 0, r.stderr
    out, m1 = dataset(home, src)
    assert all(len(f["sha256"]) == 64 for f in m1.source["files"])  # local files are fingerprinted
    # unchanged: nothing to do, and the message says what was checked
    r = cli(home, f"data.source={src}")
    assert "complete; checked:" in r.stderr and "sha256" in r.stderr
    # touched but identical: re-hashed (mtime changed), still complete, same id
    os.utime(src / "a.jsonl")
    r = cli(home, f"data.source={src}")
    assert "nothing to do" in r.stderr and dataset(home, src)[1].id == m1.id
    # one document edited: rebuilt, new id, equal to a fresh build of the new content
    rows = docs(30)
    rows[3]["text"] += " an edit"
    write_jsonl(src / "a.jsonl", rows)
    r = cli(home, f"data.source={src}")
    assert r.returncode == 0 and "the source changed: a.jsonl (changed)" in r.stderr, r.stderr
    _, m2 = dataset(home, src)
    assert m2.id != m1.id
    fresh = tmp_path / "fresh"
    assert cli(fresh, f"data.source={src}").returncode == 0
    out_f, m_f = dataset(fresh, src)
    assert m2.id == m_f.id
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == {p.name: p.read_bytes() for p in out_f.glob("*.bin")}
    # a file added, then one removed
    write_jsonl(src / "c.jsonl", docs(5, "c"))
    r = cli(home, f"data.source={src}")
    assert "c.jsonl (new)" in r.stderr and dataset(home, src)[1].id != m2.id
    (src / "b.jsonl").unlink()
    r = cli(home, f"data.source={src}")
    assert "b.jsonl (removed)" in r.stderr and r.returncode == 0


def test_an_interrupted_build_never_mixes_old_and_new_documents(src, tmp_path):
    """Killed just before manifest.json was written, then a document changed: the shards recorded in
    .progress.json were cut from the old pieces and must not be reused."""
    home = tmp_path / "home"
    assert cli(home, f"data.source={src}").returncode == 0
    out, m1 = dataset(home, src)
    progress = {"spec": m1.source, "shard_tokens": m1.shard_tokens,
                "shards": {str(i): s.__dict__ for i, s in enumerate(m1.shards)}}
    (out / "manifest.json").unlink()  # as if killed before the manifest was written
    (out / ".progress.json").write_text(json.dumps(progress))
    rows = docs(30)
    rows[0]["text"] = "Changed first document: " + rows[0]["text"]
    write_jsonl(src / "a.jsonl", rows)
    assert cli(home, f"data.source={src}").returncode == 0
    fresh = tmp_path / "fresh"
    assert cli(fresh, f"data.source={src}").returncode == 0
    (out_f, m_f), (_, m2) = dataset(fresh, src), dataset(home, src)
    assert m2.id == m_f.id
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == {p.name: p.read_bytes() for p in out_f.glob("*.bin")}


def test_the_trainer_refuses_a_damaged_shard_before_any_step(tmp_path):
    ds = make_dataset(tmp_path / "ds")
    shard = ds / "test_train_000002.bin"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # size and header intact: only the hash can tell
    shard.write_bytes(bytes(data))
    run = tmp_path / "run"
    args = ["micro", f"data.dataset_dir={ds}", f"train.run_dir={run}", "train.max_steps=2",
            "eval.eval_interval=0", "eval.sample_interval=0", "eval.val_tokens=256"]
    r = subprocess.run(python_cmd(args), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "error: shard" in r.stderr and "test_train_000002.bin" in r.stderr and "--full-verify" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    # repaired (the original bytes back): it trains, and remembers the verified hashes for the next start
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = subprocess.run(python_cmd(args), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cache = json.loads((run / "shard_hashes.json").read_text())
    assert set(cache) == {p.name for p in ds.glob("*.bin")}


BAD = {  # what the docs/data.md table lists: input -> the error it gets
    "lone surrogate": ('{"text": "ok"}\n{"text": "bad \\ud800 here"}\n', "lone UTF-16 surrogate"),
    "text not a string": ('{"text": "ok"}\n{"text": 123}\n', "is a int, not a string"),
    "invalid JSON": ('{"text": "ok"}\n{"text": broken\n', "not valid JSON"),
    "missing text field": ('{"body": "ok"}\n', "no field 'text'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_jsonl_exits_2_and_leaves_nothing(case, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", docs(30))  # a good file first: its pieces must not be left behind
    body, message = BAD[case]
    (src / "z.jsonl").write_text(body)
    home = tmp_path / "home"
    r = cli(home, f"data.source={src}")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "z.jsonl" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    left = [p for p in home.rglob("*") if p.is_file()] if home.exists() else []
    assert left == [], left  # no pieces, progress, source.json or temp files


def test_a_rebuild_that_meets_bad_input_leaves_the_finished_dataset_intact(src, tmp_path):
    """A finished dataset whose last source file turns bad: the rebuild fails (exit 2) before it
    rewrites any shard, so the old manifest and shards still agree (a rebuild cuts only at the end)."""
    home = tmp_path / "home"
    assert cli(home, f"data.source={src}").returncode == 0
    out, m1 = dataset(home, src)
    before = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    rows = docs(30)
    rows[0]["text"] = "A changed first document: " + rows[0]["text"]
    write_jsonl(src / "a.jsonl", rows)  # changes every shard's bytes if they were re-cut
    with open(src / "b.jsonl", "a") as f:
        f.write('{"text": broken\n')
    r = cli(home, f"data.source={src}")
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == before
    assert Manifest.load(out).id == m1.id and Manifest.load(out).verify(out, full=True) == []


def test_invalid_utf8_in_txt_is_counted_and_strict_mode_fails(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", docs(30))
    (src / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e ".encode("latin-1") * 50)
    home = tmp_path / "home"
    r = cli(home, f"data.source={src}")
    assert r.returncode == 0, r.stderr
    assert "latin1.txt: 200 invalid UTF-8 sequence(s) replaced" in r.stderr
    assert dataset(home, src)[1].source["invalid_utf8"] == {"latin1.txt": 200}
    r = cli(tmp_path / "strict", f"data.source={src}", "data.strict_utf8=true")
    assert r.returncode == 2 and "latin1.txt is not valid UTF-8" in r.stderr, r.stderr


def test_temp_files_of_killed_writers_are_removed_at_start_up(src, tmp_path):
    from gptcore.files import _HOST

    home = tmp_path / "home"
    assert cli(home, f"data.source={src}").returncode == 0
    out, _ = dataset(home, src)
    (out / "manifest.json").unlink()  # unfinished, so the next run does work
    dead = 2**22 + 12345  # above the largest pid Linux hands out: never a live process
    stale = out / f".x_train_000001.bin.tmp-{_HOST}-{dead}"
    stale.write_bytes(b"\0" * 4096)
    live = out / f".y.bin.tmp-{_HOST}-{os.getpid()}"  # a live writer's file stays
    live.write_bytes(b"x")
    other_host = out / f".z.bin.tmp-otherhost-{dead}"  # another machine's, on shared storage, stays
    other_host.write_bytes(b"x")
    assert cli(home, f"data.source={src}").returncode == 0
    assert not stale.exists() and live.exists() and other_host.exists()
