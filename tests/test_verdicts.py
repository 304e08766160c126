"""A verdict ends the job; a restart cannot change it (issue 44, item 2). Real torchrun jobs (gloo, CPU), the
divergence injected with GPTPIPE_TEST_FAULT (gptcore/training/guard.py): every rollback meets new NaNs, so the
guard gives up with exit 3 (diverged), and a restarted process (its fault counter reset) would replay the
same batches into the same end.

- under torchrun --max-restarts=2, the restarted workers exit at once with code 3 naming the verdict
  (recorded in <run_dir>/verdict.json): no training step is replayed;
- the next launch (a new torchrun, the fault gone) moves the record aside and finishes the run, also
  when it reuses the launch's run id (a fixed --rdzv-id, as docker/torchrun-multinode.sh passes);
- the Prefect train task's launcher (tasks.train.run_trainer) raises a TrainError that names the verdict,
  "diverged (exit 3)", and launches torchrun once;
- what a restart does help is restarted, by the launcher now: the DDP out-of-memory exit (exit 2, but no
  verdict) resumes at the smaller micro-batch; a torchrun stopped by SIGTERM is not launched again.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gptcore import launch
from gptcore.checkpoints import run_files as R
from gptcore.files import read_json
from gptcore.metrics import read_metrics
from gptcore.training import verdict
from tests.test_train_utils import REPO, descendants, env, free_port

pytestmark = pytest.mark.slow
NPROC, STEPS = 2, 16
FAULT = "nan@7,nan@10,nan@13"  # three rollbacks' worth of NaNs before the next checkpoint: see test_guard
VERDICT_LINE = "error: the run ended with a verdict in this launch"
DIVERGED_LINE = "error: the run diverged again"


def overrides(ds: Path, run_dir: Path, **extra) -> dict:
    return {"data.dataset_dir": str(ds), "train.run_dir": str(run_dir), "train.micro_batch": 2,
            "train.seq_len": 32, "train.total_batch_tokens": 2 * 32 * NPROC, "train.max_steps": STEPS,
            "train.checkpoint_interval": 4, "train.keep_last": 10, "guard.max_rollbacks": 2,
            "eval.eval_interval": 0, "eval.sample_interval": 0, "eval.val_tokens": 128, **extra}


def run(cmd: list[str], cwd: Path, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env={**env(), **extra_env}, capture_output=True, text=True, timeout=600)


def rollbacks(run_dir: Path) -> int:
    return sum("rolled back" in r["event"] for r in read_metrics(run_dir / "metrics.jsonl", "event"))


class Recorder(logging.Handler):
    """The task's log, as lines (the launcher logs the trainer's output and its own decisions there)."""

    def __init__(self, name: str):
        super().__init__()
        self.lines: list[str] = []
        self.log = logging.getLogger(name)
        self.log.addHandler(self)
        self.log.setLevel(logging.INFO)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:  # occurrences: two ranks' unbuffered lines may share one log line
        return sum(line.count(text) for line in self.lines)


@pytest.fixture(scope="module")
def diverged(ds, tmp_path_factory):
    """A two-rank job that diverges under torchrun with two restarts to spend: (run dir, its output)."""
    tmp = tmp_path_factory.mktemp("diverged")
    cmd = launch.torchrun_cmd("micro", overrides(ds, tmp / "run"), NPROC, max_restarts=2)
    return tmp / "run", run(cmd, tmp, GPTPIPE_TEST_FAULT=FAULT)


@pytest.fixture(scope="module")
def diverged_once(ds, tmp_path_factory):
    """The state a diverged launch leaves (torchrun without restarts): the run dir."""
    tmp = tmp_path_factory.mktemp("once")
    r = run(launch.torchrun_cmd("micro", overrides(ds, tmp / "run"), NPROC), tmp, GPTPIPE_TEST_FAULT=FAULT)
    assert r.returncode == 1 and DIVERGED_LINE in r.stderr, (r.stdout + r.stderr)[-3000:]
    return tmp / "run"


def test_a_restart_after_a_verdict_exits_at_once_with_its_code(diverged):
    run_dir, r = diverged
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]  # torchrun's own code, whatever its workers' (the record says 3)
    # the divergence was trained once: each rank said so once, the guard rolled back twice, not 2 x 3 times
    assert out.count(DIVERGED_LINE) == NPROC, out[-5000:]
    assert rollbacks(run_dir) == 2
    # each of the two restarts: every rank refused at once, naming the verdict, before any step
    assert out.count(VERDICT_LINE) == 2 * NPROC, out[-5000:]
    assert "diverged (exit 3)" in out and "torchrun's restart cannot change it" in out
    v = verdict.read(run_dir)
    assert v is not None and (v.code, v.verdict, v.attempt) == (3, "diverged", 0), v
    assert v.launch and "the run diverged again" in v.text
    assert [p.name for p in R.list_checkpoints(run_dir)] == ["step_00000004"]  # intact, none written since


@pytest.mark.parametrize("same_run_id", [False, True], ids=["new-run-id", "fixed-run-id"])
def test_the_next_launch_moves_the_verdict_aside_and_finishes(diverged_once, ds, tmp_path, same_run_id):
    run_dir = shutil.copytree(diverged_once, tmp_path / "run")  # (copy2 keeps the record's time)
    earlier = verdict.read(run_dir)
    assert earlier is not None and earlier.code == 3, "the diverged launch recorded no verdict"
    cmd = launch.torchrun_cmd("micro", overrides(ds, run_dir), NPROC, max_restarts=2)
    if same_run_id:  # a fixed --rdzv-id: the new launch has the old one's TORCHELASTIC_RUN_ID, at attempt 0
        at = cmd.index("--standalone")
        cmd[at:at + 1] = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                          f"--rdzv-id={earlier.launch}"]
    r = run(cmd, tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert VERDICT_LINE not in r.stderr and "resuming from step_00000004" in r.stdout
    assert (run_dir / "DONE").is_file() and not (run_dir / verdict.VERDICT_FILE).exists()
    kept = list(run_dir.glob("verdict.*.json"))
    assert len(kept) == 1 and read_json(kept[0], {}).get("code") == 3  # what ended the earlier launch


def test_the_prefect_launcher_fails_naming_the_verdict_and_does_not_restart(ds, tmp_path, monkeypatch):
    from tasks.train import TrainError, run_trainer

    run_dir, rec = tmp_path / "run", Recorder(f"verdict-{tmp_path.name}")
    monkeypatch.chdir(REPO)  # where the flow run's process runs torchrun
    task_env = {**env(), "GPTPIPE_TEST_FAULT": FAULT, "GPTPIPE_LAUNCHED_BY": '{"flow_run_id": "test"}'}
    with pytest.raises(TrainError) as e:
        run_trainer("micro", overrides(ds, run_dir), NPROC, 2, run_dir, rec.log, task_env)
    assert str(e.value).startswith("diverged (exit 3): the run diverged again"), e.value
    assert rec.count("launching:") == 1 and rec.count("(a hang or crash): restart") == 0, rec.lines
    assert rollbacks(run_dir) == 2 and rec.count(DIVERGED_LINE) == NPROC, rec.lines[-40:]


def test_a_ddp_out_of_memory_exit_is_no_verdict_and_the_launcher_restarts_it(ds, tmp_path, monkeypatch):
    """Exit 2 from a rank that ran out of memory under DDP (gptcore/training/microbatch.py retry_smaller) is no
    verdict: the smaller size is kept for the restart, which the Prefect task's launcher makes and logs (the
    fault's call count starts again in the new process, past the step it hit: resumed from step 5, the run
    ends at step 10)."""
    from tasks.train import run_trainer

    run_dir, rec = tmp_path / "run", Recorder(f"oom-{tmp_path.name}")
    monkeypatch.chdir(REPO)
    ov = overrides(ds, run_dir, **{"train.micro_batch": "auto", "train.total_batch_tokens": 4 * 32 * NPROC,
                                   "train.max_steps": 10, "train.checkpoint_interval": 5})
    # max_restarts=0: the out-of-memory restart spends none of the restarts kept for hangs
    rc, _ = run_trainer("micro", ov, NPROC, 0, run_dir, rec.log, {**env(), "GPTPIPE_TEST_FAULT": "oom@6"})
    assert rc == 0, rec.lines[-40:]
    assert rec.count("under DDP the other ranks wait") and not rec.count(VERDICT_LINE)
    assert rec.count("out of memory under DDP: restarting at micro-batch 2 (not counted") == 1, rec.lines[-40:]
    assert not rec.count("a hang or crash")
    assert (run_dir / "DONE").is_file() and not (run_dir / verdict.VERDICT_FILE).exists()


def test_the_prefect_launcher_restarts_no_torchrun_that_was_told_to_stop(ds, tmp_path, monkeypatch):
    """SIGTERM to the torchrun agent (not through the task): the workers write a stop checkpoint and exit
    0, torchrun exits 1, and the launcher, which now does the restarts, must not start the run again."""
    from tasks.train import run_trainer

    run_dir, rec = tmp_path / "run", Recorder(f"stop-{tmp_path.name}")
    monkeypatch.chdir(REPO)
    ov = overrides(ds, run_dir, **{"train.max_steps": 100000, "train.checkpoint_interval": 100000})
    ended = {}
    t = threading.Thread(target=lambda: ended.update(rc=run_trainer("micro", ov, NPROC, 2, run_dir, rec.log,
                                                                       env())[0]))
    t.start()
    try:
        deadline = time.time() + 180
        while not read_metrics(run_dir / "metrics.jsonl", "train") and t.is_alive() and time.time() < deadline:
            time.sleep(0.1)
        agent = next(p for p in descendants(os.getpid()) if "torch.distributed.run" in _cmdline(p))
        os.kill(agent, signal.SIGTERM)
        t.join(timeout=120)
    finally:
        if t.is_alive():  # launched again (the failure this test is for): the STOP file ends that run too
            (run_dir / "STOP").touch()
            t.join(timeout=300)
    assert ended.get("rc") == 1, rec.lines[-30:]
    assert rec.count("launching:") == 1 and rec.count("not restarted") == 1, rec.lines[-30:]
    assert R.read_meta(R.latest_checkpoint(run_dir))["reason"] == "stop"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_prefect_launcher_names_a_hang_once_its_restarts_are_spent(ds, tmp_path, monkeypatch):
    """torchrun exits 1 whatever its ranks' codes: the launcher learns of a hang (the watchdog's exit 5) from
    its folder of stacks and, once train.max_restarts are spent (none here), fails the task with an error
    that starts with the hang's name and code, the rank, and where its stacks are (it said only "torchrun
    exited with code 1" before)."""
    from gptcore.training.watchdog import HANG_EXIT
    from tasks.train import TrainError, run_trainer

    run_dir, rec = tmp_path / "run", Recorder(f"hang-{tmp_path.name}")
    monkeypatch.chdir(REPO)
    ov = overrides(ds, run_dir, **{"train.hang_timeout_s": 3})
    with pytest.raises(TrainError) as e:  # rank 0 stalls at step 3; the other rank waits for it
        run_trainer("micro", ov, NPROC, 0, run_dir, rec.log, {**env(), "GPTPIPE_TEST_FAULT": "stall@3"})
    text = str(e.value)
    assert text.startswith(f"hang (exit {HANG_EXIT}): rank "), text
    assert "made no progress" in text and f"stacks in {run_dir / 'hangs' / 'step00000002-attempt0'}" in text, text
    assert "train.max_restarts=0 restart(s) spent" in text
    assert rec.count("launching:") == 1 and rec.count(f"hang (exit {HANG_EXIT}): rank") == 1, rec.lines[-30:]
