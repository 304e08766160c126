"""The hardware faults a long job meets, injected into a real torchrun job (gloo, CPU): a rank that hangs,
a rank that straggles, a replica whose weights silently change. The job must survive each with nothing
lost, or stop with the exit code that names the trouble.

- hang: one rank of two is SIGSTOPped mid-run; the other's watchdog writes its stacks and exits 5,
  torchrun (--max-restarts, train.max_restarts) restarts both, and the run ends bit-identical to an
  uninterrupted one;
- straggler: rank 1 is slowed (GPTPIPE_TEST_FAULT=slow@1) and named in an event; an even job gets none;
- replicas: a bit flips in rank 2's weights (flip@5) and the next check rolls every rank back to the newest
  checkpoint, naming rank 2 by majority; a second flip on the same rank stops the run with exit 4;
- bit rot: a byte flips in a shard that keeps its size and mtime; the loader's background check finds it
  in the same epoch and the next data stage rebuilds it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from gptcore.launch import torchrun_cmd
from gptcore.metrics import read_metrics
from gptcore.training.watchdog import HANG_EXIT
from tests.test_train_utils import (
    descendants,
    final_weights,
    kill_tree,
    losses,
    python_cmd,
    rank_exit_codes,
    run,
    start,
    wait_for_step,
)

pytestmark = pytest.mark.slow
STEPS = 14


def overrides(ds: Path, run_dir: Path, nproc: int = 2, **extra) -> dict:
    # B=2, T=32, 2 micro-steps per rank per step
    return {"data.dataset_dir": str(ds), "train.run_dir": str(run_dir), "train.micro_batch": 2,
            "train.seq_len": 32, "train.total_batch_tokens": 2 * 32 * 2 * nproc, "train.max_steps": STEPS,
            "train.checkpoint_interval": 4, "train.keep_last": 10, "train.log_interval": 1,
            "optim.warmup_steps": 3, "eval.eval_interval": 0, "eval.sample_interval": 0, "eval.val_tokens": 128,
            **extra}


def events(run_dir: Path) -> list[str]:
    return [r["event"] for r in read_metrics(run_dir / "metrics.jsonl", "event")]


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    for pid in descendants(launcher_pid):
        try:
            environ = psutil.Process(pid).environ()
        except psutil.Error:
            continue
        if environ.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in environ:
            return pid
    return None


@pytest.fixture(scope="module")
def reference(ds, tmp_path_factory):
    """Two ranks, no trouble: the trajectory the faulty runs must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    r = run(torchrun_cmd("micro", overrides(ds, tmp / "run", **{"guard.straggler_ratio": 3}), 2), tmp, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp / "run"


def assert_same_weights(run_dir: Path, ref: Path) -> None:
    a, b = final_weights(run_dir, STEPS), final_weights(ref, STEPS)
    for k in b:
        assert torch.equal(a[k], b[k]), k


def test_a_stopped_rank_is_caught_by_the_watchdog_and_the_job_restarts(ds, reference, tmp_path):
    run_dir = tmp_path / "run"
    cmd = torchrun_cmd("micro", overrides(ds, run_dir, **{"train.hang_timeout_s": 6}), 2, max_restarts=1,
                       shutdown_seconds=5)
    proc = start(cmd, tmp_path, tmp_path / "log")
    try:
        wait_for_step(proc, run_dir / "metrics.jsonl", 6, timeout=180)
        victim = rank_pid(proc.pid, 1)
        assert victim is not None
        stopped_at = time.monotonic()
        # SIGSTOP rank 1, for good: rank 0 waits in its next all-reduce; torchrun must SIGKILL rank 1
        os.kill(victim, signal.SIGSTOP)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / "log").read_text()
    assert rc == 0, log[-4000:]
    # rank 0 reported the hang within the limit (+ its poll) and wrote its stacks
    stacks = list(run_dir.glob("hangs/*/rank0.txt"))
    assert len(stacks) == 1, log[-3000:]
    text = stacks[0].read_text()
    assert "made no progress" in text and "Thread" in text and "gptcore/training/trainer.py" in text, text[:2000]
    hang_events = [e for e in events(run_dir) if "made no progress" in e]
    assert len(hang_events) == 1 and f"exiting with {HANG_EXIT}" in hang_events[0]
    assert time.monotonic() - stopped_at < 120
    # torchrun restarted both ranks, which resumed from the newest checkpoint and finished
    assert "Restarting" in log or "restart" in log.lower(), log[-3000:]
    assert (run_dir / "DONE").is_file()
    assert_same_weights(run_dir, reference)
    got, want = losses(run_dir / "metrics.jsonl"), losses(reference / "metrics.jsonl")
    assert got == want


def test_a_rank_that_never_joins_the_process_group_is_a_hang_of_start_up(ds, tmp_path):
    """Rank 1 stalls after the rendezvous, before it joins the process group (a host that never arrives): both
    ranks end with the hang exit within the limit, stacks on disk saying what each was doing, and nothing
    written (before: rank 0 waited in init_process_group for the process group's 30-minute timeout)."""
    run_dir, limit = tmp_path / "run", 6
    cmd = torchrun_cmd("micro", overrides(ds, run_dir, **{"train.hang_timeout_s": limit}), 2, shutdown_seconds=5)
    proc = start(cmd, tmp_path, tmp_path / "log", GPTPIPE_TEST_FAULT="latejoin@1")
    try:
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / "log").read_text()
    assert rc != 0 and rank_exit_codes(log) == {"0": str(HANG_EXIT), "1": str(HANG_EXIT)}, log[-4000:]
    [folder] = (run_dir / "hangs").iterdir()
    assert folder.name == "step00000000-attempt0"
    rank0, rank1 = ((folder / f"rank{r}.txt").read_text() for r in (0, 1))
    assert f"limit {limit}s) while joining the process group" in rank0 and "init_process_group" in rank0, rank0
    assert "stall_before_process_group" in rank1, rank1
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert not (run_dir / "metrics.jsonl").exists() or not losses(run_dir / "metrics.jsonl")


def test_a_slow_rank_is_named(ds, reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(torchrun_cmd("micro", overrides(ds, run_dir, **{"guard.straggler_logs": 2}), 2), tmp_path,
                 tmp_path / "log", GPTPIPE_TEST_FAULT="slow@1")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    named = [e for e in events(run_dir) if e.startswith("straggler")]
    # once per streak (noise on this 2-core machine can break a streak and start another): only rank 1
    assert named and all(e.startswith("straggler: rank 1 on host ") for e in named), named
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    slowest = [row["straggler/slowest_rank"] for row in rows if "straggler/slowest_rank" in row]
    assert len(slowest) == STEPS and slowest.count(1) >= STEPS - 1, slowest
    # the reference (no fault, a 3x rule against noise on a busy machine) names nobody
    assert not [e for e in events(reference) if e.startswith("straggler")]
    assert all("straggler/slowest_s" in row for row in read_metrics(reference / "metrics.jsonl", "train"))


def test_a_replica_that_drifts_is_rolled_back_then_its_host_named(ds, tmp_path):
    # three ranks: the odd one is known by majority
    three = tmp_path / "three"
    proc = start(torchrun_cmd("micro", overrides(ds, three / "run", 3, **{"guard.consistency_interval": 2}), 3),
                 tmp_path, tmp_path / "log3", GPTPIPE_TEST_FAULT="flip@5")
    assert proc.wait(timeout=400) == 0, (tmp_path / "log3").read_text()[-3000:]
    found = [e for e in events(three / "run") if "replicas disagree" in e]
    assert len(found) == 2, found  # the event, then the rollback it caused
    assert found[0].startswith("replicas disagree at step 6: the weights of rank 2 on host ") and "majority" in found[0]
    assert found[1].startswith("replicas disagree: rolled back to ")
    rollback = [r for r in read_metrics(three / "run" / "metrics.jsonl", "event") if "guard/rollback_to" in r]
    assert [(r["guard/rollback_from"], r["guard/rollback_to"]) for r in rollback] == [(6, 4)]
    assert (three / "run" / "DONE").is_file()  # and the checks after it, the last at step 14, agreed

    # the same rank again: exit 4, naming the host to drain
    again = tmp_path / "again"
    proc = start(torchrun_cmd("micro", overrides(ds, again / "run", 3, **{"guard.consistency_interval": 2}), 3),
                 tmp_path, tmp_path / "log4", GPTPIPE_TEST_FAULT="flip@5,flip@9")
    rc = proc.wait(timeout=400)
    out = (tmp_path / "log4").read_text()
    assert rc == 1, out[-3000:]
    codes = rank_exit_codes(out)
    assert "4" in codes.values() and set(codes.values()) <= {"4", "-15"}, (codes, out[-3000:])
    assert "replicas' weights differ again" in out and "drain host(s)" in out


SMALL = ["data.shard_tokens=20000", "data.max_docs=8", "data.piece_bytes=150000"]


def rotted_dataset(home: Path):
    """A built dataset (GPTPIPE_HOME=home) one of whose train shards, the first one read, had a byte flipped
    in place: same size, mtime and inode, so the cached check at start-up cannot see it. Returns (cfg, its
    directory, the shards' good bytes, the damaged shard)."""
    from gptcore.data import build, location
    from gptcore.data.loader import ShardLoader
    from gptcore.overrides import load_config

    cfg = load_config("micro", SMALL)
    m = build.run(cfg, workers=1)
    out = location.dataset_dir(cfg)
    good = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    first = ShardLoader(out, 2, 32, 256, cfg.train.seed, manifest=m).locate(0)[1]
    victim = out / m.split("train")[first].name
    st = victim.stat()
    with open(victim, "r+b") as f:  # in place: same inode
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert location.why_incomplete(cfg) is None  # the cached check: size, mtime and inode unchanged
    return cfg, out, good, victim


def rotted_run(home: Path, run_dir: Path, monkeypatch):
    """rotted_dataset under GPTPIPE_HOME=home, and a run directory that verified its shards on an earlier
    night: it holds their hashes by (size, mtime, inode), so its trainer's start-up check passes too."""
    from gptcore.data import location

    monkeypatch.setenv("GPTPIPE_HOME", str(home))
    cfg, out, good, victim = rotted_dataset(home)
    run_dir.mkdir()
    (run_dir / "shard_hashes.json").write_bytes((out / location.SHARD_HASHES).read_bytes())
    return cfg, out, good, victim


def rot_run_args(run_dir: Path, steps: int) -> list[str]:
    """The trainer's arguments for a run on rotted_dataset's shards."""
    return ["micro", *SMALL, f"train.run_dir={run_dir}", "train.micro_batch=2", "train.seq_len=32",
            "train.total_batch_tokens=256", f"train.max_steps={steps}", "train.log_interval=1",
            f"train.checkpoint_interval={steps}", "eval.eval_interval=0", "eval.sample_interval=0",
            "eval.val_tokens=128"]


def test_a_shard_that_rots_in_place_is_caught_within_the_epoch_and_rebuilt(tmp_path, monkeypatch):
    """A byte flips in a train shard and the file keeps its size, mtime and inode (what failing disks and
    memory do): the trainer's cached check at start-up cannot see it, the loader's background check of the
    shard's first read does, as an event; the next data stage rebuilds it byte-identical."""
    from gptcore.data import build, location

    home, run_dir = tmp_path / "home", tmp_path / "run"
    cfg, out, good, victim = rotted_run(home, run_dir, monkeypatch)
    p = start([sys.executable, "-m", "gptcore.training.train", *rot_run_args(run_dir, 8)], tmp_path, tmp_path / "log",
              GPTPIPE_HOME=str(home))
    assert p.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    found = [e for e in events(run_dir) if "no longer matches its sha256" in e]
    assert len(found) == 1 and found[0].startswith(f"shard {victim.name} (read by rank 0 on host "), found
    assert (run_dir / "DONE").is_file()  # the run went on

    why = location.why_incomplete(cfg)  # the next data stage sees it ...
    assert why is not None and victim.name in why
    build.run(cfg, workers=1)  # ... and rebuilds it
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == good


def test_a_restart_after_a_damaged_shard_rebuilds_it_and_trains_on(tmp_path, monkeypatch):
    """The same night: the damage is reported mid-run, then the job stops before the next data stage (here a
    STOP file; at night a hang and its restart). The next start finds the shard damaged, rebuilds it
    byte-identical from its source before anything trains on it, and the run goes on to the end. (Before,
    rank 0 refused the start with exit 2, and the night was lost.)"""
    home, run_dir = tmp_path / "home", tmp_path / "run"
    _, out, good, victim = rotted_run(home, run_dir, monkeypatch)
    cmd = [sys.executable, "-m", "gptcore.training.train", *rot_run_args(run_dir, 200)]
    p = start(cmd, tmp_path, tmp_path / "log1", GPTPIPE_HOME=str(home))
    deadline = time.time() + 120
    while not any("no longer matches its sha256" in e for e in events(run_dir)):
        assert p.poll() is None and time.time() < deadline, (tmp_path / "log1").read_text()[-3000:]
        time.sleep(0.05)
    (run_dir / "STOP").touch()
    assert p.wait(timeout=120) == 0, (tmp_path / "log1").read_text()[-3000:]
    assert not (run_dir / "DONE").exists()

    p = start(cmd, tmp_path, tmp_path / "log2", GPTPIPE_HOME=str(home))
    log = (tmp_path / "log2")
    assert p.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert f"shards {victim.name} rebuilt from the source" in log.read_text()
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == good
    assert (run_dir / "DONE").is_file()


def test_a_stop_checkpoint_is_checked_before_rank_0_writes_it(ds, tmp_path):
    """A nightly run ends with a stop checkpoint at an arbitrary step, which rank 0 alone writes and the next
    start broadcasts. Rank 0's weights drift (a bit flips) at a step that is no consistency step, and the
    time budget stops the run right there: the stop checkpoint is checked first and the drift rolled back,
    so what is written equals what a run whose drift was on another rank writes (without the check, rank
    0's flipped weights were written)."""
    def o(run_dir, **extra):  # a consistency check only every 100 steps; 3 ranks: the odd one is known
        return overrides(ds, run_dir, 3, **{"guard.consistency_interval": 100, "train.max_minutes": 0.0001,
                                            **extra})

    night1 = tmp_path / "night1"
    # night 1: the budget is spent before the first step: a stop checkpoint at step 1
    assert run(torchrun_cmd("micro", o(night1), 3), tmp_path, timeout=400).returncode == 0
    assert [int(p.name[5:]) for p in sorted((night1 / "checkpoints").glob("step_*"))] == [1]
    written = {}
    for fault, odd in (("flip0@1", 0), ("flip@1", 2)):  # the drift on rank 0, then on rank 2
        run_dir = tmp_path / f"rank{odd}"
        shutil.copytree(night1, run_dir)
        # night 2: one rank drifts before its first step (step 2), and the stop comes at that step
        proc = start(torchrun_cmd("micro", o(run_dir), 3), tmp_path, tmp_path / f"log{odd}", GPTPIPE_TEST_FAULT=fault)
        assert proc.wait(timeout=400) == 0, (tmp_path / f"log{odd}").read_text()[-3000:]
        found = [e for e in events(run_dir) if "replicas disagree" in e]
        assert found and found[0].startswith(f"replicas disagree at step 2: the weights of rank {odd} on host "), found
        written[odd] = final_weights(run_dir, 2)
    for k in written[2]:
        assert torch.equal(written[0][k], written[2][k]), k


def single(ds: Path, run_dir: Path, **extra) -> list[str]:
    """`python -m gptcore.training.train micro ...` in one process (the watchdog is the same without torchrun)."""
    return python_cmd(["micro", *(f"{k}={v}" for k, v in overrides(ds, run_dir, 1, **extra).items())])


def ended(cmd: list[str], tmp_path: Path, timeout: float, **extra_env: str) -> tuple[int, str]:
    """Run `cmd` to its end (its process tree killed if it outlives `timeout`): (exit code, its output)."""
    proc = start(cmd, tmp_path, tmp_path / "log", **extra_env)
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return rc, (tmp_path / "log").read_text()


def test_a_rank_that_holds_the_gil_is_ended_by_the_c_backstop(ds, tmp_path):
    """The main thread stuck in a C call that holds the GIL (as a page fault on a hung network filesystem
    does): the Python watchdog thread never runs; faulthandler's C thread prints every stack to stderr and
    ends the process (status 1) soon after the limit, where before it waited for ever."""
    t0 = time.monotonic()
    rc, out = ended(single(ds, tmp_path / "run", **{"train.hang_timeout_s": 3}), tmp_path, 120,
                    GPTPIPE_TEST_FAULT="gil@3")
    assert rc == 1, out[-3000:]
    assert "Timeout (" in out and "most recent call first" in out and "before_step" in out, out[-3000:]
    assert time.monotonic() - t0 < 100


def test_a_hang_on_a_hung_file_system_still_exits(ds, tmp_path):
    """The hang file's path blocks when opened (a FIFO with no reader stands in for a hung file system, a
    write stuck in the kernel): the stacks are on stderr first, and the process exits with the hang code
    after the bounded wait for the write."""
    run_dir = tmp_path / "run"
    folder = run_dir / "hangs" / "step00000002-attempt0"  # the hang's one folder: its step, torchrun's attempt
    folder.mkdir(parents=True)
    os.mkfifo(folder / "rank0.txt")
    rc, out = ended(single(ds, run_dir, **{"train.hang_timeout_s": 3}), tmp_path, 120, GPTPIPE_TEST_FAULT="stall@3")
    assert rc == HANG_EXIT, out[-3000:]
    assert out.index("made no progress") < out.index("before_step")  # the stacks, on stderr
    assert "did not finish in 10s" in out and "exiting without it" in out, out[-3000:]


def test_a_slow_final_checkpoint_write_is_progress(ds, tmp_path):
    """The end of a run waits for its last checkpoint's write (slow storage, 8 s here) with no step to
    beat: that wait has its own patience, so a derived limit of 2 s (the floor lowered for the test) does
    not take it for a hang."""
    run_dir = tmp_path / "run"
    rc, out = ended(single(ds, run_dir, **{"train.max_steps": 4, "train.checkpoint_interval": 100}), tmp_path, 300,
                    GPTPIPE_TEST_HANG_FLOOR_S="2", GPTPIPE_TEST_CHECKPOINT_DELAY="8")
    assert rc == 0 and "made no progress" not in out, out[-3000:]
    assert (run_dir / "DONE").is_file() and "checkpoint write delayed 8s" in out


def test_a_run_whose_final_weights_are_not_finite_is_not_done(ds, tmp_path):
    """The weights turn non-finite at the last step (too late for the guard's rollback): the final checkpoint
    is refused, so the run is not DONE; it ends diverged (exit 3) and the newest good checkpoint stays the
    one the next start resumes from (it used to write DONE and exit 0)."""
    run_dir = tmp_path / "run"
    rc, out = ended(single(ds, run_dir), tmp_path, 300, GPTPIPE_TEST_FAULT=f"nan@{STEPS}")
    assert rc == 3, out[-3000:]
    assert not (run_dir / "DONE").exists()
    assert "reached max_steps=14 with non-finite weights" in out
    assert sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")) == [4, 8, 12]


def test_a_damaged_shard_of_another_source_is_not_rebuilt_but_named(tmp_path, monkeypatch):
    """A rebuild from other data settings would make another dataset: the start refuses (ShardError, exit 2)
    and says why it did not rebuild, with nothing written to the shards."""
    from gptcore.data.shard_format import Manifest, ShardError
    from gptcore.overrides import load_config
    from gptcore.training.resume import verify_or_rebuild

    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    _, out, good, victim = rotted_dataset(tmp_path / "home")
    other = load_config("micro", [*SMALL[:1], "data.max_docs=7", SMALL[2], f"data.dataset_dir={out}"])
    damaged = victim.read_bytes()
    with pytest.raises(ShardError, match="was not rebuilt: this run's data settings are not the ones"):
        verify_or_rebuild(other, out, Manifest.load(out), tmp_path / "cache.json")
    assert victim.read_bytes() == damaged != good[victim.name]
