"""FSDP2 (train.parallel=fsdp) with real torchrun + gloo on CPU, against the plain model on one rank.

The reference is one rank with accumulation 4 (test_ddp proves 2 DDP ranks equal it). FSDP on 2 ranks
(accumulation 2, gradients kept unsharded until the last micro-step) must train the same losses and
weights, and evaluate the same validation loss and HellaSwag on its whole-model replica; with activation
checkpointing too. Its checkpoints are whole: a killed FSDP run continues exactly on one rank, on DDP and
on FSDP past a rotted checkpoint; the guard rolls a sharded model back; the final checkpoint is one
consolidated model that exports to Hugging Face and generates.
"""

import json
import shutil
import sys
import time

import pytest
import torch

from gptcore.checkpoints import checkpoint as C
from gptcore.checkpoints import run_files as R
from gptcore.metrics import read_metrics
from tests.test_ddp import EVALS, STEPS, args, assert_same_run, evals_of
from tests.test_train_utils import (
    free_port,
    kill_tree,
    python_cmd,
    start,
    torchrun_cmd,
    wait_for_step,
)

pytestmark = pytest.mark.slow
FSDP = "train.parallel=fsdp"


def train(cmd, tmp, name, timeout=300, **extra_env) -> str:
    proc = start(cmd, tmp, tmp / f"{name}.log", **extra_env)
    code = proc.wait(timeout=timeout)
    log = (tmp / f"{name}.log").read_text()
    assert code == 0, log[-3000:]
    return log


def assert_same_training(run, ref, tol=1e-5):
    """test_ddp's check: the losses and final weights within `tol`; gradient norms within 1e-4 (FSDP2 sums
    each norm from its shards' partial norms: a different rounding, ~1e-5 relative, that Adam does not see)."""
    assert_same_run(run, ref, tol, norm_tol=1e-4)


@pytest.fixture(scope="module")
def one_rank(ds, tmp_path_factory):
    """The plain model on one rank, with the GPU job's evaluations (validation, HellaSwag, samples)."""
    tmp = tmp_path_factory.mktemp("onerank")
    log = train(python_cmd(args(ds, tmp / "run", *EVALS)), tmp, "one")
    assert "world=1 accum=4" in log and "parallel=single" in log
    return tmp / "run"


@pytest.fixture(scope="module")
def sharded(ds, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    log = train(torchrun_cmd(args(ds, tmp / "run", *EVALS, FSDP)), tmp, "fsdp")
    assert "world=2 accum=2" in log and "parallel=fsdp (train.parallel=fsdp)" in log
    return tmp / "run"


def test_fsdp_on_two_ranks_trains_and_evaluates_like_one_rank(one_rank, sharded):
    assert_same_training(sharded, one_rank)
    got, want = evals_of(sharded), evals_of(one_rank)
    assert sorted(got) == sorted(want) == [4, 8, 12, 14]
    for s in want:  # evaluated on the whole-model replica: the unsharded model's numbers
        assert got[s]["val/loss"] == pytest.approx(want[s]["val/loss"], abs=1e-5), s
        assert got[s]["hellaswag/n"] == 7
        assert (got[s]["hellaswag/acc"], got[s]["hellaswag/acc_norm"]) == \
            (want[s]["hellaswag/acc"], want[s]["hellaswag/acc_norm"]), s
        ev = json.loads((R.step_dir(sharded, s) / R.EVAL_FILE).read_text())
        assert ev["val_loss"] == got[s]["val/loss"]
    assert sorted(r["step"] for r in read_metrics(sharded / "metrics.jsonl", "sample")) == [4, 8, 12, 14]
    overhead = read_metrics(sharded / "metrics.jsonl", "overhead")
    assert any("time/eval_replica_s" in r for r in overhead)  # the replica's refresh is timed apart


@pytest.mark.parametrize("mode, compiled", [("selective", True), ("full", False)])
def test_activation_checkpointing_under_fsdp_trains_the_same_losses(ds, one_rank, tmp_path, mode, compiled):
    """Also torch.compile per block under FSDP2 (as GPUs run it): within 1e-4 of the eager single rank. The
    eager one sizes its micro-batch with the probe (micro_batch=auto) on a 'card' where more than 2
    sequences run out of memory (test-only fault): both ranks probe the sharded model in step and choose 2."""
    auto = [] if compiled else ["train.micro_batch=auto", "train.micro_batch_max=4"]
    log = train(torchrun_cmd(args(ds, tmp_path / "run", FSDP, f"train.activation_checkpointing={mode}",
                                  f"train.compile={str(compiled).lower()}", *auto)), tmp_path, "ac", timeout=600,
                **({} if compiled else {"GPTPIPE_TEST_FAULT": "oomabove@2"}))
    assert f"activation_checkpointing={mode}" in log and f"compile={compiled}" in log
    if not compiled:
        assert "micro_batch=2 (auto: 2 fits, 4 ran out of memory)" in log, log[-2000:]
    assert_same_training(tmp_path / "run", one_rank, tol=1e-4 if compiled else 1e-5)


def test_a_killed_fsdp_run_continues_exactly_on_one_rank_on_ddp_and_past_a_rotted_shard(ds, one_rank, tmp_path):
    """SIGKILL a 2-rank FSDP run once its step-8 checkpoint is on disk. Its checkpoints are sharded (each
    rank wrote its own part with DCP, every file hashed), and three copies of it continue: on one rank and on
    2 DDP ranks (both read the whole tensors from the shards, AdamW state too), and on FSDP with rank 1's
    shard of step 8 rotted (that step goes to rejected/ with its why, step 4 is used); each ends where the
    uninterrupted run did."""
    killed = tmp_path / "killed"
    # both ranks a little slower (test-only fault), so the kill lands well before the run ends
    proc = start(torchrun_cmd(args(ds, killed, FSDP)), tmp_path, tmp_path / "killed.log",
                 GPTPIPE_TEST_FAULT="slow@0,slow@1")
    wait_for_step(proc, killed / "metrics.jsonl", 9)
    deadline = time.monotonic() + 120
    while R.latest_checkpoint(killed) is None or R.read_meta(R.latest_checkpoint(killed))["step"] < 8:
        assert time.monotonic() < deadline and proc.poll() is None, "no step-8 checkpoint landed"
        time.sleep(0.02)
    kill_tree(proc)
    assert not (killed / "DONE").exists()
    newest = R.latest_checkpoint(killed)
    meta, state = R.read_meta(newest), C.load_trainer_state(newest)
    assert meta["format"] == "sharded" and state["world"] == 2 and "optimizer" not in state  # it is in the shards
    assert sorted(meta["shards_sha256"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (newest / C.MODEL_FILE).exists()
    runs = {name: tmp_path / name for name in ("one", "ddp", "rotted")}
    for run in runs.values():
        shutil.copytree(killed, run)
    weights = R.step_dir(runs["rotted"], 8) / "shards" / "__1_0.distcp"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    logs = {"one": train(python_cmd(args(ds, runs["one"])), tmp_path, "one"),
            "ddp": train(torchrun_cmd(args(ds, runs["ddp"], "train.parallel=ddp")), tmp_path, "ddp"),
            "rotted": train(torchrun_cmd(args(ds, runs["rotted"], FSDP)), tmp_path, "rotted")}
    assert "resuming from step_00000008" in logs["one"] and "parallel=single" in logs["one"]
    assert "resuming from step_00000008" in logs["ddp"] and "parallel=ddp" in logs["ddp"]
    assert "resuming from step_00000004" in logs["rotted"] and "parallel=fsdp" in logs["rotted"]
    why = (R.checkpoints_dir(runs["rotted"]) / R.REJECTED_DIR / "step_00000008" / "why.txt").read_text()
    assert "shards/__1_0.distcp does not match the sha256" in why
    for run in runs.values():
        assert_same_training(run, one_rank)


def test_the_guard_rolls_a_sharded_model_back(ds, tmp_path):
    """A loss spike under FSDP: the newest good checkpoint's whole weights and optimizer state go back into
    every rank's shards, the run skips the bad batches and finishes."""
    guard = ["guard.spike_window=3", "guard.spike_steps=2", "guard.spike_min_delta=0.5"]
    train(torchrun_cmd(args(ds, tmp_path / "run", FSDP, *guard)), tmp_path, "spike", GPTPIPE_TEST_FAULT="spike@7")
    ev = read_metrics(tmp_path / "run" / "metrics.jsonl", "event")
    assert [e["guard/rollback_to"] for e in ev if "guard/rollback_to" in e] == [4], ev
    assert (tmp_path / "run" / "DONE").is_file()
    final = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")[-1]["train/loss"]
    assert final < 10.6  # trained on from the rolled-back weights, not from the spiked ones (~30x off)


def test_the_consolidated_model_of_an_fsdp_run_exports_to_hf_and_generates(sharded, tmp_path):
    from transformers import GPT2LMHeadModel  # a heavy import, only for this test

    from gptcore.model.hf import export_hf

    ck = R.latest_checkpoint(sharded)
    model, meta = C.load_model(ck)
    assert meta["step"] == STEPS
    out = export_hf(model, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    prompt = torch.tensor([[15496, 11, 314, 1101]])
    mine = model.generate(prompt, max_new_tokens=8, temperature=0.0)
    theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=50256,
                         attention_mask=torch.ones_like(prompt))
    assert torch.equal(mine, theirs)


def hsdp(tmp_path, *extra, **extra_env) -> str:
    """Two torchrun agents (--nnodes=2, c10d on 127.0.0.1) with 2 ranks each: FSDP2 on a (2 replicas x 2
    shards) mesh, gradients reduce-scattered within a node and all-reduced across nodes. Their logs."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-hsdp",
           "--max-restarts=0", "-m", "gptcore.training.train", *extra]
    agents = [start(cmd, tmp_path, tmp_path / f"agent{i}.log", **extra_env) for i in range(2)]
    try:
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    logs = "".join((tmp_path / f"agent{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs[-3000:]
    assert "world=4 accum=1" in logs and "HSDP: 2 replicas x 2 shards" in logs
    return logs


def test_hsdp_across_two_nodes_replicates_shards_and_trains_the_same_losses(ds, one_rank, tmp_path):
    hsdp(tmp_path, *args(ds, tmp_path / "run", FSDP))
    assert_same_training(tmp_path / "run", one_rank)


def test_hsdp_compares_the_replicas_of_each_shard_and_rolls_a_drifting_one_back(ds, tmp_path):
    """A bit flips in the last rank's shard (flip@5: rank 3, shard 1 on node 2): the next consistency check
    finds shard 1's two replicas (ranks 1 and 3) apart, and every rank rolls back to step 4's checkpoint;
    the checks after it agree (pure FSDP has no replicas to compare: docs/training.md says so)."""
    run = tmp_path / "run"
    logs = hsdp(tmp_path, *args(ds, run, FSDP, "guard.consistency_interval=2"), GPTPIPE_TEST_FAULT="flip@5")
    found = [r["event"] for r in read_metrics(run / "metrics.jsonl", "event") if "replicas disagree" in r["event"]]
    assert len(found) == 2, (found, logs[-3000:])
    assert found[0].startswith("replicas disagree at step 6: the weights of rank 1 on host ") and \
        "rank 3 on host" in found[0] and "differ from each other" in found[0], found
    rollback = [r for r in read_metrics(run / "metrics.jsonl", "event") if "guard/rollback_to" in r]
    assert [(r["guard/rollback_from"], r["guard/rollback_to"]) for r in rollback] == [(6, 4)]
    assert (run / "DONE").is_file()
