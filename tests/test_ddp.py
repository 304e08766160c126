"""Distributed correctness with real torchrun + gloo on CPU.

One reference run (two torchrun agents, --nnodes=2, c10d rendezvous on 127.0.0.1, 1 rank each, so
2 ranks x accumulation 2) is compared against: 1 rank x accumulation 4; a SIGKILLed run started again
with the same command; and a run stopped on 2 ranks and resumed on 1.
"""

import sys

import pytest
import torch

from gptcore import checkpoint as C
from gptcore import run_files as R
from gptcore.train import STOP_FILE
from tests.test_train_utils import (
    free_port,
    kill_tree,
    losses,
    make_dataset,
    python_cmd,
    start,
    torchrun_cmd,
    wait_for_step,
)

pytestmark = pytest.mark.slow
STEPS = 14


def args(ds, run, *extra):
    # B=2, T=32, 256 tokens per step: accumulation 4 on 1 rank, 2 on 2 ranks (no_sync exercised)
    return ["micro", f"data.dataset_dir={ds}", f"train.run_dir={run}", "train.micro_batch=2",
            "train.seq_len=32", "train.total_batch_tokens=256", f"train.max_steps={STEPS}",
            "train.checkpoint_interval=4", "train.keep_last=10", "optim.warmup_steps=3",
            "eval.eval_interval=0", "eval.sample_interval=0", "eval.val_tokens=128", *extra]


def final_weights(run):
    model, meta = C.load_model(R.step_dir(run, STEPS))
    assert meta["step"] == STEPS
    return model.state_dict()


def assert_same_run(run, ref, tol):
    got, want = losses(run / "metrics.jsonl"), losses(ref / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= tol, f"max loss difference {worst}"
    a, b = final_weights(run), final_weights(ref)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=0, msg=k)
    assert (run / "DONE").is_file()


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("ds"))


@pytest.fixture(scope="module")
def reference(ds, tmp_path_factory):
    """Two torchrun agents (--nnodes=2) that rendezvous over c10d on 127.0.0.1 and train together."""
    tmp = tmp_path_factory.mktemp("ref")
    run = tmp / "run"
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-ddp",
           "--max-restarts=0", "-m", "gptcore.train", *args(ds, run)]
    agents = [start(cmd, tmp, tmp / f"agent{i}.log") for i in range(2)]
    try:
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    logs = "".join((tmp / f"agent{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs
    assert "world=2 accum=2" in logs and f"RUN_DONE run=micro step={STEPS}" in logs
    return run


def test_two_ranks_accum_k_equal_one_rank_accum_2k(ds, reference, tmp_path):
    run = tmp_path / "one"
    proc = start(python_cmd(args(ds, run)), tmp_path, tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()
    assert "world=1 accum=4" in (tmp_path / "log").read_text()
    assert_same_run(run, reference, 1e-5)


def test_sigkill_then_same_command_resumes_exactly(ds, reference, tmp_path):
    run = tmp_path / "killed"
    cmd = torchrun_cmd(args(ds, run))
    proc = start(cmd, tmp_path, tmp_path / "log1")
    killed_at = wait_for_step(proc, run / "metrics.jsonl", 6)
    kill_tree(proc)  # SIGKILL to torchrun and both workers at once
    assert killed_at < STEPS and not (run / "DONE").exists()
    resume_from = R.read_meta(R.latest_checkpoint(run))["step"]
    assert 4 <= resume_from <= killed_at
    proc = start(cmd, tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log2").read_text()
    assert f"resuming from step_{resume_from:08d}" in (tmp_path / "log2").read_text()
    assert_same_run(run, reference, 1e-6)


def test_stop_on_two_ranks_resume_on_one_continues_the_global_data_order(ds, reference, tmp_path):
    run = tmp_path / "resized"
    proc = start(torchrun_cmd(args(ds, run)), tmp_path, tmp_path / "log1")
    wait_for_step(proc, run / "metrics.jsonl", 5)
    (run / STOP_FILE).touch()  # graceful stop request: checkpoint, every rank and torchrun exit 0
    assert proc.wait(timeout=120) == 0, (tmp_path / "log1").read_text()
    stopped = R.read_meta(R.latest_checkpoint(run))["step"]
    assert stopped < STEPS and "stopped at step" in (tmp_path / "log1").read_text()
    state = C.load_trainer_state(R.latest_checkpoint(run))
    assert state["world"] == 2 and state["loader"]["position"] == stopped * 256 // 32
    assert len(state["rng"]) == 2  # every rank's RNG state
    proc = start(python_cmd(args(ds, run)), tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log2").read_text()
    assert "world=1 accum=4" in (tmp_path / "log2").read_text()
    assert_same_run(run, reference, 1e-5)


def test_compiled_ddp_trains_the_eager_ddp_trajectory(ds, reference, tmp_path):
    """DDP wrapped first, then torch.compile (DDPOptimizer splits the graph at bucket boundaries): the
    same losses as the eager 2-rank run, and checkpoints that load into a plain GPT."""
    run = tmp_path / "compiled"
    proc = start(torchrun_cmd(args(ds, run, "train.compile=true")), tmp_path, tmp_path / "log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "log").read_text()[-3000:]
    assert "world=2 accum=2" in (tmp_path / "log").read_text() and "compile=True" in (tmp_path / "log").read_text()
    assert_same_run(run, reference, 1e-4)


def test_bf16_gradient_compression_trains_close_to_fp32_all_reduce(ds, reference, tmp_path):
    run = tmp_path / "bf16grads"
    proc = start(torchrun_cmd(args(ds, run, "train.ddp_bf16_grads=true")), tmp_path, tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    got, want = losses(run / "metrics.jsonl"), losses(reference / "metrics.jsonl")
    assert sorted(got) == sorted(want)
    assert got != want  # the hook really ran (bf16 sums differ in the last bits)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-2


def test_an_unwritable_checkpoint_stops_both_ranks_without_a_hang(ds, tmp_path):
    """Rank 0 cannot write the step-4 checkpoint (a file-size limit stands in for a full disk): it tells
    rank 1, both exit with the error (no rank left waiting at the next collective), nothing is kept."""
    import resource
    import signal
    import subprocess

    from tests.test_train_utils import env

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the weights are ~6 MB

    run = tmp_path / "full"
    proc = subprocess.run(torchrun_cmd(args(ds, run)), cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("error: checkpoint step 4 could not be written") == 2, out[-3000:]  # both ranks
    assert not list((run / "checkpoints").iterdir())
