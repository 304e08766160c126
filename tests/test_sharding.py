"""Tokenize-and-shard: exact content, determinism across workers/order, idempotency, kill-and-resume,
corruption detection and repair, and every bad input named in the issue."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gptcore.data import build, cutting, location, planning, shard_format, source_builtin, sources, tokenizing
from gptcore.data.shard_format import Manifest, read_shard
from gptcore.model.tokenizer import EOT, get_encoding
from gptcore.overrides import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.shard_tokens=20000", "data.max_docs=8", "data.piece_bytes=150000"]  # ~330K tokens, 4 pieces


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def cfg_of(*overrides):
    return load_config("micro", [*SMALL, *overrides])


def shard_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.bin"))}


def expected_tokens(texts) -> np.ndarray:
    enc = get_encoding()
    return np.array([t for text in texts for t in [EOT, *enc.encode_ordinary(text)]], dtype=np.uint16)


def test_shards_hold_every_document_preceded_by_eot():
    cfg = cfg_of()
    m = build.run(cfg, workers=2)
    out = location.dataset_dir(cfg)
    texts = pq.read_table(source_builtin.BUILTIN, columns=["text"]).column("text").to_pylist()[:8]
    want = expected_tokens(texts)
    got = np.concatenate([np.asarray(read_shard(out / s.name)) for s in m.shards])
    assert np.array_equal(got, want)  # nothing dropped, nothing reordered, EOT before every doc
    assert [s.split for s in m.shards] == ["val"] + ["train"] * (len(m.shards) - 1)
    assert m.shards[0].name == "shakespeare-8docs-20K_val_000000.bin"
    assert all(s.tokens == 20000 for s in m.shards[:-1]) and 0 < m.shards[-1].tokens <= 20000
    assert m.source["documents"] == 8 and m.verify(out, full=True) == []
    assert m.shards[1].source_range["tokens"] == [20000, 40000]
    last_doc = m.shards[-1].source_range["docs"][1]
    assert last_doc == 7
    assert not list((out / location.PIECES).glob("*.bin"))  # work files cleaned up
    assert Manifest.load(out).id == m.id


def test_numpy_encoding_path_matches_encode_ordinary():
    tricky = ["", "hello <|endoftext|> world", "  spaces\n\n\ttabs ", "naïve café 東京 🙂", "a" * 5000]
    got = tokenizing.encode_documents(tricky, threads=2)
    assert np.array_equal(got, expected_tokens(tricky))


def test_output_identical_for_any_worker_count_and_completion_order():
    a = cfg_of("data.dataset_name=one")
    build.run(a, workers=1)
    b = cfg_of("data.dataset_name=two")
    build.run(b, workers=3)
    c = cfg_of("data.dataset_name=one")  # same name -> same file names; pieces done in reverse order
    c.data.dataset_dir = str(location.pipeline_home() / "reverse")
    pieces = planning.plan_pieces(c, sources.fetch(c))
    assert len(pieces) >= 3
    for p in reversed(pieces):
        tokenizing.tokenize_piece(c, p, threads=1)
    mc = cutting.ShardCutter(c, pieces).finish()
    one = shard_bytes(location.dataset_dir(a))
    assert one == shard_bytes(location.dataset_dir(c))
    assert list(one.values()) == list(shard_bytes(location.dataset_dir(b)).values())
    assert Manifest.load(location.dataset_dir(a)).id == mc.id


def test_shards_are_cut_while_later_pieces_are_still_tokenizing():
    """ShardCutter writes a shard as soon as the pieces before its end are done (cutting overlaps
    tokenizing), with the same bytes as cutting after everything."""
    ref = cfg_of()
    build.run(ref, workers=1)
    cfg = cfg_of()
    cfg.data.dataset_dir = str(location.pipeline_home() / "streamed")
    out = location.dataset_dir(cfg)
    pieces = planning.plan_pieces(cfg, sources.fetch(cfg))
    cutter = cutting.ShardCutter(cfg, pieces, pieces)
    for p in pieces[:-1]:
        tokenizing.tokenize_piece(cfg, p, threads=1)
        cutter.piece_done(p.index)
    early = shard_bytes(out)
    assert len(early) >= 2 and not (out / "manifest.json").exists()  # before the last piece exists
    # a piece's token file goes as soon as the shard holding its last token is written (disk ~1x, not 2x)
    kept = {p.name for p in (out / location.PIECES).glob("*.bin")}
    assert "piece_000000.bin" not in kept and f"piece_{pieces[-2].index:06d}.bin" in kept
    tokenizing.tokenize_piece(cfg, pieces[-1], threads=1)
    cutter.piece_done(pieces[-1].index)
    m = cutter.finish()
    final = shard_bytes(out)
    assert final == shard_bytes(location.dataset_dir(ref)) and all(final[k] == v for k, v in early.items())
    assert m.id == Manifest.load(location.dataset_dir(ref)).id


def test_a_damaged_piece_from_an_earlier_run_is_caught_before_it_is_cut():
    """Pieces left by an earlier (killed) run are re-hashed before use: a flipped byte stops the cut with
    a ShardError naming the file, its record goes, and the next run re-tokenizes it."""
    ref = cfg_of()
    build.run(ref, workers=1)
    cfg = cfg_of()
    cfg.data.dataset_dir = str(location.pipeline_home() / "damaged")
    pieces = planning.plan_pieces(cfg, sources.fetch(cfg))
    for p in pieces:
        tokenizing.tokenize_piece(cfg, p, threads=1)  # "the earlier run", killed before cutting
    bad = location.dataset_dir(cfg) / location.PIECES / "piece_000001.bin"
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0xFF  # same length: only the hash can tell
    bad.write_bytes(bytes(data))
    with pytest.raises(shard_format.ShardError, match="piece_000001.bin is missing or corrupt"):
        cutting.ShardCutter(cfg, pieces).finish()
    assert not bad.with_suffix(".json").exists()
    build.run(cfg, workers=1)
    assert shard_bytes(location.dataset_dir(cfg)) == shard_bytes(location.dataset_dir(ref))


def test_second_run_does_no_work(monkeypatch):
    """Skipping a complete dataset costs no tokenizing and no hashing of shards or pieces (the build
    remembers the hashes it computed while writing), and rewrites nothing. Counted, not timed: a loaded
    machine makes any run slow, and a fast one hides a full re-hash of a small dataset."""
    from gptcore import files
    from gptcore.data import cutting, location, planning, shard_format

    cfg = cfg_of()
    build.run(cfg, workers=1)
    out = location.dataset_dir(cfg)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    work = []

    def recorded(real):
        return lambda path: work.append(f"hashed {Path(path).name}") or real(path)

    for module in (files, shard_format, cutting):  # every name a shard or piece is hashed through
        monkeypatch.setattr(module, "file_sha256", recorded(module.file_sha256))
    monkeypatch.setattr(build, "tokenize_piece", lambda cfg, piece, threads: work.append(f"tokenized {piece}"))
    m = build.run(cfg, workers=1)
    assert work == []
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == before
    assert location.why_incomplete(cfg) is None and location.why_incomplete(cfg, full=True) is None
    assert cutting.pieces_to_tokenize(cfg, planning.plan_pieces(cfg, sources.fetch(cfg))) == []
    assert m.id == Manifest.load(out).id


def _cli(cfg_overrides, home, **kw):
    env = {**os.environ, "GPTPIPE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kw}
    return subprocess.Popen([sys.executable, "-m", "gptcore.data.build", "micro", *cfg_overrides], cwd=ROOT,
                            env=env, text=True, **kw)


KILL_OV = ["data.shard_tokens=20000", "data.piece_bytes=150000", "data.num_workers=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    # The whole corpus in tiny pieces/shards, so a run lasts long enough to be killed part-way.
    ref_home = tmp_path_factory.mktemp("ref")
    assert _cli(KILL_OV, ref_home).wait(timeout=120) == 0
    return ref_home / "shards" / "shakespeare-20K"


@pytest.mark.parametrize("phase", ["tokenize", "shards"])
def test_sigkill_mid_run_then_resume_gives_identical_dataset(home, uninterrupted, phase):
    ov, ref_dir = KILL_OV, uninterrupted
    out = home / "shards" / "shakespeare-20K"
    proc = _cli(ov, home)
    deadline = time.time() + 60
    while time.time() < deadline:  # kill once the chosen phase has made some progress
        done = (len(list(out.glob(".pieces/*.json"))) >= 3 if phase == "tokenize"
                else len(list(out.glob("*.bin"))) >= 5)
        if done or proc.poll() is not None:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "run finished before it could be killed"
    assert not (out / "manifest.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    pieces_done = {p: p.stat().st_mtime_ns for p in out.glob(".pieces/*.json")}
    assert _cli(ov, home).wait(timeout=120) == 0
    assert pieces_done and all(p.stat().st_mtime_ns == t for p, t in pieces_done.items())  # not redone
    assert shard_bytes(out) == shard_bytes(ref_dir)
    assert (out / "manifest.json").read_bytes() == (ref_dir / "manifest.json").read_bytes()
    if phase == "shards":  # shards written (and recorded) before the kill were verified, not rewritten
        recorded = json.loads((ref_dir / "manifest.json").read_text())["shards"]
        assert kept and sum(out.joinpath(n).stat().st_mtime_ns == t for n, t in kept.items()) >= len(kept) - 1
        assert len(recorded) > len(kept)


def test_two_builds_of_one_dataset_at_once_both_succeed(home, uninterrupted, tmp_path):
    """Two nightly deployments sharing a dataset start together: one builds, the other waits for it and
    then finds the dataset complete (before: each took the other's pieces for damage, both exited 2 and
    the work was thrown away). The lock is held here first so that both surely overlap."""
    from gptcore.runlock import RunLock

    out = home / "shards" / "shakespeare-20K"
    lock = RunLock(out.parent, name=f".{out.name}.build.lock").acquire()
    logs = [tmp_path / f"build{i}.err" for i in range(2)]
    procs = []
    for log in logs:  # stderr to files, readable while the builds run
        with open(log, "w") as f:
            procs.append(_cli(KILL_OV, home, stdout=subprocess.DEVNULL, stderr=f))
    # both reach the lock and say they wait for its holder (this process); a build that ignored the
    # lock never says so and exits, failing here
    deadline = time.monotonic() + 120
    while not all("waiting for another build" in err and f"'pid': {os.getpid()}" in err
                  for err in [log.read_text() for log in logs]):
        assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
        assert time.monotonic() < deadline, [log.read_text() for log in logs]
        time.sleep(0.05)
    assert all(p.poll() is None for p in procs) and not out.exists()  # both wait: nothing written
    lock.release()
    for p in procs:
        p.wait(timeout=120)
    errs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert sum("is complete" in err for err in errs) == 1  # the second found the first's work
    assert shard_bytes(out) == shard_bytes(uninterrupted)
    assert (out / "manifest.json").read_bytes() == (uninterrupted / "manifest.json").read_bytes()
    assert not lock.path.exists()  # the last builder removed it: a build leaves only the dataset


def test_corrupt_and_truncated_shards_are_detected_and_only_they_rebuilt():
    cfg = cfg_of()
    m = build.run(cfg, workers=1)
    out = location.dataset_dir(cfg)
    good = shard_bytes(out)
    victim, flipped = out / m.shards[3].name, out / m.shards[5].name
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated
    data = bytearray(flipped.read_bytes())
    data[2000] ^= 0xFF  # silent bit flip: same size, wrong content
    flipped.write_bytes(bytes(data))
    with pytest.raises(Exception, match="truncated"):
        read_shard(victim)
    assert Manifest.load(out).verify(out) == [victim.name]
    assert Manifest.load(out).verify(out, full=True) == [victim.name, flipped.name]
    assert location.why_incomplete(cfg) is not None
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    build.run(cfg, workers=1, full_verify=True)
    assert shard_bytes(out) == good
    rewritten = {n for n, t in mtimes.items() if (out / n).stat().st_mtime_ns != t}
    assert rewritten == {victim.name, flipped.name}


def test_a_shard_damaged_in_place_is_rebuilt_by_the_next_plain_run(monkeypatch):
    """What a nightly flow run meets: a shard whose bytes changed (same size, header intact). The data
    stage's skip check hashes it the trainer's way (only files whose size, mtime or inode changed), so the
    plain run, no --full-verify, rebuilds it from the source instead of skipping and leaving the trainer to
    refuse it every night; unchanged shards are not re-hashed, not even the first time (the build
    remembers the hashes it computed while writing)."""
    from gptcore import files

    cfg = cfg_of()
    m = build.run(cfg, workers=1)
    out = location.dataset_dir(cfg)
    good = shard_bytes(out)
    hashed = []
    real = files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    assert location.why_incomplete(cfg) is None and hashed == []
    flipped = out / m.shards[5].name
    data = bytearray(flipped.read_bytes())
    data[2000] ^= 0xFF
    flipped.write_bytes(bytes(data))
    why = location.why_incomplete(cfg)
    assert why is not None and flipped.name in why and hashed == [flipped.name]
    build.run(cfg, workers=1)
    assert shard_bytes(out) == good and location.why_incomplete(cfg) is None


def test_different_spec_cannot_overwrite_a_dataset():
    build.run(cfg_of("data.dataset_name=ds"), workers=1)
    with pytest.raises(location.DataError, match="different dataset"):
        build.run(cfg_of("data.dataset_name=ds", "data.max_docs=6"), workers=1)


# --- local sources and bad inputs ---------------------------------------------------------------

def test_local_mixed_directory(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = pq.read_table(source_builtin.BUILTIN, columns=["text"]).column("text").to_pylist()[:6]
    pq.write_table(pa.table({"content": texts[:2]}), src / "a.parquet")
    (src / "b.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts[2:4]))
    (src / "sub" / "c.txt").write_text(texts[4])
    (src / "notes.md").write_text("ignored")
    cfg = load_config("micro", [f"data.source={src}", "data.text_column=content", "data.shard_tokens=20000",
                                "data.piece_bytes=20000"])
    m = build.run(cfg, workers=2)
    got = np.concatenate([np.asarray(read_shard(location.dataset_dir(cfg) / s.name)) for s in m.shards])
    assert np.array_equal(got, expected_tokens(texts[:5]))
    assert [f["name"] for f in m.source["files"]] == ["a.parquet", "b.jsonl", "sub/c.txt"]
    # max_docs cuts in the middle of the jsonl file
    cfg3 = load_config("micro", [f"data.source={src}", "data.text_column=content", "data.shard_tokens=20000",
                                 "data.max_docs=3"])
    m3 = build.run(cfg3, workers=1)
    got3 = np.concatenate([np.asarray(read_shard(location.dataset_dir(cfg3) / s.name)) for s in m3.shards])
    assert np.array_equal(got3, expected_tokens(texts[:3]))


def _bad(tmp_path, make, match, *ov, exc=(sources.SourceError, location.DataError)):
    src = tmp_path / "bad"
    src.mkdir(exist_ok=True)
    make(src)
    cfg = load_config("micro", [f"data.source={src}", "data.shard_tokens=20000", *ov])
    with pytest.raises(exc, match=match):
        build.run(cfg, workers=1)
    out = location.dataset_dir(cfg)
    assert not (out / "manifest.json").exists() and not list(out.glob("*.bin"))  # nothing half-written


def test_bad_inputs_fail_clearly(tmp_path, monkeypatch):
    cfg = load_config("micro", [f"data.source={tmp_path}/missing", "data.shard_tokens=20000"])
    with pytest.raises(sources.SourceError, match="does not exist"):
        build.run(cfg)
    _bad(tmp_path, lambda d: (d / "x.md").write_text("hi"),
         r"holds no .parquet, .jsonl, .json, .txt \(json, jsonl and txt also as .gz")
    _bad(tmp_path, lambda d: (d / "e.jsonl").write_text(""), "empty")
    _bad(tmp_path, lambda d: (d / "c.parquet").write_bytes(b"not parquet at all" * 10), "cannot read parquet")
    _bad(tmp_path, lambda d: pq.write_table(pa.table({"body": ["x"]}), d / "c.parquet"),
         r"no column 'text' \(columns: \['body'\]\)")
    _bad(tmp_path, lambda d: pq.write_table(pa.table({"text": [1, 2]}), d / "c.parquet"), "not text")


def test_bad_jsonl_and_tiny_sources(tmp_path):
    def broken(d):
        for p in d.iterdir():
            p.unlink()
        (d / "a.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')

    _bad(tmp_path, broken, "at byte 15: not valid JSON")

    def wrong_field(d):
        (d / "a.jsonl").write_text('{"body": "ok"}\n')

    _bad(tmp_path, wrong_field, "no field 'text'")

    def tiny(d):
        (d / "a.jsonl").write_text('{"text": "only a few tokens"}\n')

    _bad(tmp_path, tiny, "nothing left to train on")


def test_token_ids_beyond_uint16_rejected(monkeypatch):
    big = __import__("tiktoken").Encoding(name="wide", pat_str=r"\S+|\s+",
                                          mergeable_ranks={bytes([i]): 70000 + i for i in range(256)},
                                          special_tokens={})
    monkeypatch.setattr(tokenizing, "get_encoding", lambda: big)  # a tokenizer whose ids exceed uint16
    with pytest.raises(location.DataError, match="does not fit uint16"):
        tokenizing.encode_documents(["abc"], threads=1)


def test_not_enough_disk(monkeypatch):
    monkeypatch.setattr(planning, "free_disk", lambda path: 1000)  # a nearly full disk
    cfg = cfg_of()
    with pytest.raises(location.DataError, match="not enough free disk"):
        build.run(cfg)
    assert not location.dataset_dir(cfg).exists()


def test_a_full_disk_while_writing_is_a_clear_error_and_the_next_run_finishes(home, tmp_path):
    """A write that fails (a file-size limit stands in for a full disk, no root needed): exit 2, one
    error line, no traceback, no temp file; with room again the same command completes."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))  # 20K-token shards are 41 KB

    ov = [*SMALL, "data.num_workers=1"]
    proc = _cli(ov, home, preexec_fn=limit)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")][0].startswith("error: cannot write")
    assert "Traceback" not in err and not list(home.rglob(".*.tmp-*"))
    assert _cli(ov, home).wait(timeout=120) == 0
    assert location.why_incomplete(cfg_of(), full=True) is None


def test_cli_exit_codes(tmp_path):
    p = _cli([f"data.source={tmp_path}/nope"], tmp_path / "h")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "does not exist" in err and "Traceback" not in err
