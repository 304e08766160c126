"""The trainer defends its own run (real trainer processes, CPU): verified resume with fallback, the
divergence guard with rollback, its own lock, and a shutdown grace that covers a slow stop checkpoint."""

from __future__ import annotations

import json
import math
import resource
import shutil
import signal
import subprocess

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from gptcore.checkpoints import checkpoint as C
from gptcore.checkpoints import run_files as R
from gptcore.files import file_sha256
from gptcore.metrics import read_metrics
from gptcore.training.train import main
from tests.test_train_utils import REPO, descendants, env, python_cmd, start, wait_for_step

SEQS_PER_STEP = 4  # total_batch_tokens / seq_len below


def args(ds, run, *extra):
    return ["micro", f"data.dataset_dir={ds}", f"train.run_dir={run}", "train.micro_batch=2",
            "train.seq_len=32", "train.total_batch_tokens=128", "train.max_steps=12",
            "train.checkpoint_interval=4", "train.keep_last=10",
            "eval.eval_interval=0", "eval.sample_interval=0", "eval.val_tokens=128", *extra]


def run_proc(cmd, cwd, timeout=180, **extra_env):
    return subprocess.run(cmd, cwd=cwd, env={**env(), **extra_env}, capture_output=True, text=True,
                          timeout=timeout)


def final_weights(run):
    return file_sha256(R.latest_checkpoint(run) / C.MODEL_FILE)


def events(run):
    return [r["event"] for r in read_metrics(run / "metrics.jsonl", "event")]


@pytest.fixture(scope="module")
def trained(ds, tmp_path_factory):
    """A finished run with checkpoints at steps 4, 8 and 12."""
    run = tmp_path_factory.mktemp("runs") / "base"
    assert main(args(ds, run)) == 0
    assert [p.name for p in R.list_checkpoints(run)] == ["step_00000004", "step_00000008", "step_00000012"]
    return run


def cut_back_to(trained, dest, newest_step):
    """A copy of the run as it was when `newest_step` was its newest checkpoint (not finished)."""
    shutil.copytree(trained, dest)
    (dest / "DONE").unlink()
    for ck in R.list_checkpoints(dest):
        if int(ck.name[5:]) > newest_step:
            shutil.rmtree(ck)
    return dest


@pytest.fixture(scope="module")
def from_step4(trained, ds, tmp_path_factory):
    """The reference: the run resumed from step 4 and trained to the end, uninterrupted."""
    run = cut_back_to(trained, tmp_path_factory.mktemp("ref") / "run", 4)
    proc = run_proc(python_cmd(args(ds, run)), run.parent)  # a process like the ones compared with it
    assert proc.returncode == 0, proc.stderr
    return final_weights(run)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_bytes(path):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def nan_weights_with_matching_hash(ck):
    """NaNs in the weights of a checkpoint whose meta.json agrees with them (as a diverged run would
    have written before the guard existed): only the finite check can catch it."""
    sd = load_file(ck / C.MODEL_FILE)
    sd["transformer.ln_f.weight"][:] = float("nan")
    save_file(sd, str(ck / C.MODEL_FILE), metadata={"format": "pt"})
    meta = json.loads((ck / R.META_FILE).read_text())
    meta["model_sha256"] = file_sha256(ck / C.MODEL_FILE)
    (ck / R.META_FILE).write_text(json.dumps(meta))


DAMAGE = {
    "truncated model.safetensors": lambda ck: truncate(ck / C.MODEL_FILE),
    "truncated trainer.pt": lambda ck: truncate(ck / C.TRAINER_FILE),
    "flipped bytes, size kept": lambda ck: flip_bytes(ck / C.MODEL_FILE),
    "flipped bytes in trainer.pt": lambda ck: flip_bytes(ck / C.TRAINER_FILE),
    "NaN weights": nan_weights_with_matching_hash,
    "missing meta.json": lambda ck: (ck / R.META_FILE).unlink(),
    "empty directory": lambda ck: [p.unlink() for p in ck.iterdir()],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_and_is_kept(damage, trained, ds, from_step4, tmp_path):
    run = cut_back_to(trained, tmp_path / "run", 8)
    DAMAGE[damage](run / "checkpoints" / "step_00000008")
    proc = run_proc(python_cmd(args(ds, run)), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "checkpoint step_00000008 skipped" in proc.stderr
    assert "resuming from step_00000004 at step 4/12" in proc.stdout
    # the result is exactly the uninterrupted run from step 4
    assert final_weights(run) == from_step4
    kept = run / "checkpoints" / "rejected" / "step_00000008"
    assert kept.is_dir() and (kept / "why.txt").read_text().strip()
    if damage != "empty directory":
        assert len(list(kept.iterdir())) >= 2  # the damaged files are there to look at, not deleted


def test_no_intact_checkpoint_is_a_clear_error_every_time(trained, ds, tmp_path):
    run = cut_back_to(trained, tmp_path / "run", 8)
    truncate(run / "checkpoints" / "step_00000008" / C.MODEL_FILE)
    flip_bytes(run / "checkpoints" / "step_00000004" / C.TRAINER_FILE)
    for _ in range(2):  # and again: never a silent restart from step 0
        proc = run_proc(python_cmd(args(ds, run)), tmp_path)
        assert proc.returncode == 2, proc.stderr
        err = proc.stderr
        assert "Traceback" not in err and "error: run" in err and "no intact checkpoint" in err
        assert "step_00000008: " in err and "step_00000004: " in err and "sha256" in err
        assert not R.list_checkpoints(run)
        assert [p.name for p in R.rejected(run)] == ["step_00000004", "step_00000008"]
    rows = read_metrics(run / "metrics.jsonl", "train")
    assert max(r["step"] for r in rows) == 12  # the old history is untouched


def _file_size_limit(limit: int):
    """For a child process: writes past `limit` bytes fail (EFBIG) as they would on a full disk,
    without needing root to mount a small filesystem."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_checkpoint_that_cannot_be_written_stops_every_rank_clearly_and_loses_nothing(
        trained, ds, from_step4, tmp_path):
    """Resumed from step 4, the step-8 checkpoint cannot be written (a full disk): exit 2 with one error
    line naming the checkpoint to resume from, no traceback, no partial checkpoint. With room again, the
    run continues from step 4 and ends with the same weights as an uninterrupted one."""
    run = cut_back_to(trained, tmp_path / "run", 4)
    proc = subprocess.run(python_cmd(args(ds, run)), cwd=run.parent, env=env(), capture_output=True, text=True,
                          timeout=180, preexec_fn=_file_size_limit(200_000))  # the weights are ~6 MB
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "checkpoint step 8 could not be written" in errors[0], proc.stderr
    assert str(run / "checkpoints" / "step_00000004") in errors[0] and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]  # no temp left
    proc = run_proc(python_cmd(args(ds, run)), run.parent)
    assert proc.returncode == 0, proc.stderr
    assert final_weights(run) == from_step4


def test_metrics_that_cannot_be_written_stop_the_run_at_the_next_step(ds, tmp_path):
    """metrics.jsonl hits the limit mid-interval: a warning, every rank votes to stop, the stop checkpoint
    (which cannot be written either: a full disk) ends the run with exit 2, no traceback. The next run,
    with room again, trains to the end (the torn last line of metrics.jsonl is closed first)."""
    run = tmp_path / "run"
    cmd = python_cmd(args(ds, run, "train.max_steps=200", "train.checkpoint_interval=1000"))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=180,
                          preexec_fn=_file_size_limit(8_000))
    assert proc.returncode == 2, proc.stderr
    assert "metrics.jsonl cannot be written" in proc.stdout and "stopping at the next step" in proc.stdout
    assert "error: checkpoint step" in proc.stderr and "Traceback" not in proc.stderr
    stopped_at = max(r["step"] for r in read_metrics(run / "metrics.jsonl", "train"))
    assert 1 < stopped_at < 200
    assert run_proc(cmd, tmp_path).returncode == 0
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl", "train")) == 200


def test_checkpoint_read_errors_are_checkpoint_errors(trained, tmp_path):
    ck = shutil.copytree(trained / "checkpoints" / "step_00000012", tmp_path / "step_00000012")
    truncate(ck / C.TRAINER_FILE)
    with pytest.raises(R.CheckpointError, match="trainer.pt cannot be read"):
        C.load_trainer_state(ck)
    truncate(ck / C.MODEL_FILE)
    with pytest.raises(R.CheckpointError, match="model.safetensors cannot be read"):
        C.load_weights(torch.nn.Linear(1, 1), ck / C.MODEL_FILE)
    (ck / R.META_FILE).write_text("{not json")
    with pytest.raises(R.CheckpointError, match=r"meta.json cannot be read \(JSONDecodeError: .*checkpoint is corrupt"):
        R.read_meta(ck)


def test_non_finite_steps_are_skipped_then_rolled_back(ds, tmp_path):
    run = tmp_path / "nan"
    # NaN weights before the 7th step: steps 7, 8, 9 are non-finite (skipped, and the step-8 checkpoint
    # waits), the third triggers a rollback to step 4 that skips the data of steps 5-9
    proc = run_proc(python_cmd(args(ds, run, "train.max_steps=16")), tmp_path, GPTPIPE_TEST_FAULT="nan@7")
    assert proc.returncode == 0, proc.stderr
    ev = events(run)
    assert len(ev) == 3 and all("non-finite step skipped" in e for e in ev[:2]), ev
    assert "rolled back to step_00000004" in ev[2] and f"the {5 * SEQS_PER_STEP} sequences" in ev[2]
    assert "guard: non-finite steps: rolled back" in proc.stdout
    row = read_metrics(run / "metrics.jsonl", "event")[2]
    assert (row["guard/rollback_from"], row["guard/rollback_to"]) == (9, 4)
    assert (run / "DONE").is_file()
    state = C.load_trainer_state(R.latest_checkpoint(run))
    assert state["step"] == 16 and state["loader"]["position"] == (16 + 5) * SEQS_PER_STEP
    for ck in R.list_checkpoints(run):  # every checkpoint verifies whole: finite weights, hashes
        C.load_for_resume(ck, C.load_model(ck)[0])
    train = {r["step"]: r["train/loss"] for r in read_metrics(run / "metrics.jsonl", "train")}
    assert all(math.isfinite(v) for v in train.values())  # steps 5-9 were trained again, healthy


def test_a_loss_spike_rolls_back(ds, tmp_path):
    run = tmp_path / "spike"
    guard = ["guard.spike_window=3", "guard.spike_steps=2", "guard.spike_min_delta=0.5"]
    proc = run_proc(python_cmd(args(ds, run, "train.max_steps=16", *guard)), tmp_path,
                    GPTPIPE_TEST_FAULT="spike@7")
    assert proc.returncode == 0, proc.stderr
    ev = read_metrics(run / "metrics.jsonl", "event")
    assert len(ev) == 1 and "loss spike: rolled back to step_00000004" in ev[0]["event"], ev
    assert (ev[0]["guard/rollback_from"], ev[0]["guard/rollback_to"]) == (8, 4)
    assert (run / "DONE").is_file()
    # without the guard's rule the same fault leaves the loss far up (the test would be vacuous otherwise)
    off = tmp_path / "off"
    proc = run_proc(python_cmd(args(ds, off, "train.max_steps=16", "guard.spike_window=0")), tmp_path,
                    GPTPIPE_TEST_FAULT="spike@7")
    assert proc.returncode == 0 and not events(off)
    on, unguarded = (read_metrics(r / "metrics.jsonl", "train")[-1]["train/loss"] for r in (run, off))
    assert unguarded > on + 1.0


def test_repeated_divergence_stops_with_exit_3_and_keeps_the_good_checkpoint(ds, tmp_path):
    run = tmp_path / "doomed"
    # every rollback meets new NaNs before the next checkpoint: calls 7, 10 and 13 (see the nan test)
    proc = run_proc(python_cmd(args(ds, run, "train.max_steps=16", "guard.max_rollbacks=2")), tmp_path,
                    GPTPIPE_TEST_FAULT="nan@7,nan@10,nan@13")
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "error: the run diverged again" in proc.stderr and "guard.max_rollbacks" in proc.stderr
    assert sum("rolled back" in e for e in events(run)) == 2
    assert [p.name for p in R.list_checkpoints(run)] == ["step_00000004"] and not R.rejected(run)
    assert not (run / "DONE").exists()
    # the next invocation (no fault) continues from the good checkpoint and finishes
    proc = run_proc(python_cmd(args(ds, run, "train.max_steps=16")), tmp_path)
    assert proc.returncode == 0 and "resuming from step_00000004" in proc.stdout, proc.stderr


def test_retention_keeps_the_newest_healthy_checkpoint(tmp_path):
    from tests.test_checkpoint import save, trained_model

    m, opt = trained_model()
    for step, loss in [(1, 5.0), (2, float("nan")), (3, float("inf"))]:
        state = {"optimizer": opt.state_dict(), "loader": {}, "step": step, "rng": [], "scaler": {}}
        C.save_checkpoint(tmp_path, step, m, state, {"train_loss": loss}, keep_last=1)
    assert [p.name for p in R.list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003"]
    with torch.no_grad():
        m.transformer.ln_f.weight[0] = float("nan")
    with pytest.raises(R.CheckpointError, match="non-finite"):
        save(tmp_path, 4, m, opt)
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()


def test_two_trainers_on_one_run_dir(ds, tmp_path):
    run = tmp_path / "shared"
    a = args(ds, run, "train.max_steps=100000", "train.checkpoint_interval=100000")
    first = start(python_cmd(a), tmp_path, tmp_path / "first.log")
    try:
        wait_for_step(first, run / "metrics.jsonl", 2)
        # refused, not queued: the first holds the lock for 100000 steps, so a second trainer that waited
        # for it would never return (the timeout only bounds that hang; a slow start on a busy machine is fine)
        second = run_proc(python_cmd(a), tmp_path, timeout=180)
        assert second.returncode == 2, second.stderr
        holder = json.loads((run / "train.lock").read_text())
        assert holder["pid"] == first.pid and holder["host"] and holder["since"]
        assert "error: another trainer holds" in second.stderr and f'"pid": {first.pid}' in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first one trains on
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
    rows = read_metrics(run / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # one writer


def test_sigterm_during_a_slow_stop_checkpoint_waits_for_it(ds, tmp_path):
    """What cancelling a flow run does (tasks.train.end_group on the torchrun tree), while the checkpoint
    write takes longer than torchrun's default 30 s shutdown timeout: the launcher's torchrun command
    allows for it, the stop checkpoint completes and nothing is left running."""
    import logging

    from tasks.train import GRACE_SECONDS, end_group, torchrun_cmd

    run = tmp_path / "slow"
    overrides = {k: v for k, _, v in (x.partition("=") for x in args(ds, run)[1:])}
    overrides.update({"train.max_steps": 100000, "train.checkpoint_interval": 100000})
    cmd = torchrun_cmd("micro", overrides, 1)
    assert "--shutdown-timeout=300" in cmd
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env(), "GPTPIPE_TEST_CHECKPOINT_DELAY": "35"},
                            stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wait_for_step(proc, run / "metrics.jsonl", 2)
    trainers = descendants(proc.pid)
    end_group(proc, GRACE_SECONDS, logging.getLogger("test"))
    log = (tmp_path / "log").read_text()
    # the stop checkpoint was the slow one (not a vacuous pass), and the trainer lived to finish it
    assert "checkpoint write delayed 35s" in log and "stopped at step" in log, log[-2000:]
    ck = R.latest_checkpoint(run)
    assert ck is not None and R.read_meta(ck)["reason"] == "stop"
    C.load_for_resume(ck, C.load_model(ck)[0])  # complete and verified
    assert not [p for p in trainers if running(p)], "orphaned trainer processes"


def running(pid: int) -> bool:
    try:  # a zombie has exited, it only waits to be reaped
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- what a month of nightly runs meets in the run directory: an error line or a fallback, never a traceback


def test_a_hellaswag_file_that_is_not_utf8_skips_the_benchmark_not_the_run(ds, tmp_path):
    """Before: a UnicodeDecodeError at the last eval step, before the end checkpoint, so every nightly
    run resumed, trained the last steps again and crashed again."""
    bad = tmp_path / "hellaswag_val.jsonl"
    bad.write_bytes(b'{"ctx": "a\xff", "endings": ["a", "b", "c", "d"], "label": 0}\n')
    run = tmp_path / "run"
    proc = run_proc(python_cmd(args(ds, run, "train.max_steps=4", "eval.hellaswag.enabled=true",
                                    f"eval.hellaswag.path={bad}")), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "hellaswag evaluation skipped" in proc.stdout.lower() and "not UTF-8" in proc.stdout
    assert (run / "DONE").is_file() and "Traceback" not in proc.stderr


@pytest.mark.parametrize("breakage", ["run_dir is a file", "config.json is a directory", "DONE is a directory"])
def test_an_unusable_run_directory_is_one_error_line_and_keeps_the_checkpoints(breakage, trained, ds, tmp_path):
    run = cut_back_to(trained, tmp_path / "run", 8)
    if breakage == "run_dir is a file":
        run = tmp_path / "a-file"
        run.write_text("not a directory")
    else:
        (run / breakage.split()[0]).unlink(missing_ok=True)
        (run / breakage.split()[0]).mkdir()
    before = sorted(p.name for p in (run / "checkpoints").iterdir()) if run.is_dir() else []
    proc = run_proc(python_cmd(args(ds, run)), tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "cannot be read or written" in errors[0] and "Traceback" not in proc.stderr
    if run.is_dir():  # DONE: the run trained to the end first; its checkpoints are all there
        assert set(before) <= {p.name for p in (run / "checkpoints").iterdir()}


def test_a_run_json_that_is_not_an_object_is_corrupt_not_a_traceback(trained, ds, tmp_path, capsys):
    run = cut_back_to(trained, tmp_path / "run", 8)
    (run / "run.json").write_text("[]")
    assert main(args(ds, run)) == 2
    assert "run.json is corrupt" in capsys.readouterr().err


@pytest.mark.parametrize("text", ['{"preset": "micro", "train": {"max_steps": 6', "[1, 2]"])
def test_a_config_file_that_does_not_parse_is_a_config_error(tmp_path, capsys, text):
    cfg = tmp_path / "bad.json"
    cfg.write_text(text)
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config file") and str(cfg) in err


def test_a_checkpoint_that_cannot_be_moved_aside_is_skipped_in_place(trained, ds, from_step4, tmp_path):
    """checkpoints/rejected is a file (so the damaged step 8 cannot be moved there) and a stray file is
    named like a checkpoint: the run still resumes from step 4 and ends like an uninterrupted one."""
    run = cut_back_to(trained, tmp_path / "run", 8)
    truncate(run / "checkpoints" / "step_00000008" / C.MODEL_FILE)
    (run / "checkpoints" / "rejected").write_text("in the way")
    (run / "checkpoints" / "step_00000099").write_text("not a checkpoint")
    proc = run_proc(python_cmd(args(ds, run)), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint step_00000008 skipped" in proc.stderr and "left in place" in proc.stderr
    assert "resuming from step_00000004 at step 4/12" in proc.stdout
    assert final_weights(run) == from_step4


def test_the_flow_reads_past_a_newest_checkpoint_whose_meta_is_damaged(trained, tmp_path):
    """run_state decides what the flow skips: a truncated meta.json must not stop the flow before the
    trainer can resume from the checkpoint before it."""
    run = shutil.copytree(trained, tmp_path / "run")
    (run / "checkpoints" / "step_00000012" / R.META_FILE).write_text('{"step": 1')
    (run / "run.json").write_text("[1]")  # not an object: no identity, so DONE does not count
    from gptcore.checkpoints.run_files import run_state

    state = run_state(run, "some-identity")
    assert state["checkpoint"].endswith("step_00000008") and state["step"] == 8 and not state["done"]


def test_read_json_falls_back_on_a_value_of_another_type(tmp_path):
    from gptcore.files import read_json

    p = tmp_path / "x.json"
    for text, want in (("[]", {}), ("null", {}), ('{"a": 1}', {"a": 1}), ("{", {})):
        p.write_text(text)
        assert read_json(p, {}) == want
    p.write_text("[1]")
    assert read_json(p) == [1]  # no default given: any JSON value
