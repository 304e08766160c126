"""train.micro_batch=auto on a device with less memory than the preset assumes, with out-of-memory errors
injected where a smaller card would raise them (GPTPIPE_TEST_FAULT: oomabove@N for any forward pass of more
than N sequences, oom@k for one error inside the k-th step): the run chooses the largest micro-batch that
fits on every rank and trains exactly as a run given that size; a step that runs out of memory later is
retried with the same data at a smaller size; nothing that fits is a clear exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gptcore.checkpoints import run_files as R
from gptcore.data.loader import ShardLoader
from gptcore.distributed import Env, select
from gptcore.launch import torchrun_cmd
from gptcore.metrics import read_metrics
from gptcore.model.gpt import GPT
from gptcore.model.loss import make_loss
from gptcore.model.optim import build_optimizer
from gptcore.model.tokenizer import N_VOCAB
from gptcore.overrides import load_config
from gptcore.training.microbatch import CHOICE_FILE, candidates, probe, probe_tokens, retry_smaller, smaller
from gptcore.training.resume import RunError
from gptcore.training.train import restart_helps
from tests.test_train_utils import env, final_weights, losses, python_cmd, start

STEPS = 10


def overrides(ds, run_dir, world: int = 1, **extra) -> dict:
    # 8 sequences of 32 tokens per rank per step
    return {"data.dataset_dir": str(ds), "train.run_dir": str(run_dir), "train.seq_len": 32,
            "train.total_batch_tokens": 8 * 32 * world, "train.max_steps": STEPS, "train.checkpoint_interval": 5,
            "train.keep_last": 10, "optim.warmup_steps": 2, "eval.eval_interval": 0, "eval.sample_interval": 0,
            "eval.val_tokens": 128, **extra}


def args(o: dict) -> list[str]:
    return ["micro", *(f"{k}={v}" for k, v in o.items())]


def test_the_candidates_divide_the_share():
    assert candidates(48, 64) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert candidates(512, 64) == [64, 32, 16, 8, 4, 2, 1]
    assert smaller(64, 512) == 32 and smaller(12, 48) == 6 and smaller(3, 48) == 1 and smaller(1, 48) is None


def test_a_step_out_of_memory_is_retried_smaller_with_the_same_data(ds, tmp_path):
    """retry_smaller in-process: under auto the step's data is rewound and split smaller (an event, kept
    for the next start); an explicit size, or nothing smaller, is the error itself; under DDP a RunError
    that the launcher restarts (no verdict)."""
    cfg = load_config("micro", [f"data.dataset_dir={ds}", "train.micro_batch=4", "train.seq_len=32",
                                "train.total_batch_tokens=256", "train.device=cpu", "train.compile=false"])
    env = Env(rank=0, local_rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32, compile=False)
    loader = ShardLoader(ds, 4, 32, 256, cfg.train.seed, verify_reads=False)  # a share of 8 sequences
    before = loader.state_dict()
    first, _ = loader.next_batch()  # the step had begun: one micro-batch of 4 read, its gradient partial
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    optimizer = torch.optim.SGD([w], lr=0.1)
    events, error = [], torch.OutOfMemoryError("CUDA out of memory")

    def retry(auto=True, env=env):
        retry_smaller(error, auto, tmp_path, cfg, env, optimizer, loader, before, 7,
                      lambda step, text, who="guard", **values: events.append((step, text, who, values)))

    with pytest.raises(torch.OutOfMemoryError) as raised:
        retry(auto=False)  # an explicit train.micro_batch is the user's: not changed
    assert raised.value is error and cfg.train.micro_batch == 4 and not (tmp_path / CHOICE_FILE).exists()

    retry()
    assert events == [(7, "out of memory at micro-batch 4 (step 7): the step is retried with the same data at "
                          "micro-batch 2", "micro-batch", {"train/micro_batch": 2})]
    assert cfg.train.micro_batch == 2 and (loader.B, loader.accum) == (2, 4) and w.grad is None
    assert json.loads((tmp_path / CHOICE_FILE).read_text())["micro_batch"] == 2  # the next start begins there
    assert loader.state_dict() == before and torch.equal(loader.next_batch()[0], first[:2])  # the same data
    loader.load_state_dict(before)

    retry()
    assert cfg.train.micro_batch == 1 and len(events) == 2
    with pytest.raises(torch.OutOfMemoryError) as raised:
        retry()  # nothing smaller than 1
    assert raised.value is error and cfg.train.micro_batch == 1 and len(events) == 2

    cfg.train.micro_batch = 4
    ddp = Env(rank=0, local_rank=0, world=2, device=torch.device("cpu"), dtype=torch.float32, compile=False)
    with pytest.raises(RunError, match=r"out of memory at micro-batch 4 \(step 7\): .* at micro-batch 2 after a "
                                       r"restart \(train.max_restarts\): under DDP") as raised:
        retry(env=ddp)  # the other ranks wait in a collective: exit, for torchrun to restart smaller
    assert raised.value.__cause__ is error and restart_helps(raised.value)
    assert json.loads((tmp_path / CHOICE_FILE).read_text())["micro_batch"] == 2 and len(events) == 2


def test_the_probe_feeds_ids_the_loss_accepts():
    """The probe with the plain loss, which `auto` picks on CUDA: it drew its targets from the padded
    50,304-wide embedding, and the loss indexes targets into the 50,257 real columns. On CUDA that was a
    device assert that killed the context (the first gpt2-124m run on an H200); on CPU the same cause is an
    IndexError ("Target 50268 is out of bounds") or, at the padded width, an infinite loss."""
    cfg = load_config("micro", ["train.micro_batch=auto", "train.micro_batch_max=8", "train.seq_len=64",
                                "train.total_batch_tokens=512", "train.loss=plain", "train.device=cpu",
                                "train.compile=false"])
    assert cfg.model.vocab_size > N_VOCAB  # the padded embedding the old probe drew from
    env = select(cfg.train)
    torch.manual_seed(0)
    raw = GPT(cfg.model)
    raw.head_loss = make_loss(env.loss)
    assert probe(raw, build_optimizer(raw, cfg.optim, "cpu"), cfg, env) == (8, [])  # the old draw: IndexError
    x = probe_tokens(8, 64, seed=8)  # what the probe fed the model for its first candidate
    assert 0 <= int(x.min()) and int(x.max()) < N_VOCAB
    _, loss = raw(x[:, :-1], x[:, 1:], return_logits=False)
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_auto_chooses_what_fits_on_every_rank_and_trains_as_that_size(ds, tmp_path):
    """Two ranks on a 'card' where more than 4 sequences run out of memory: both choose 4 (not the
    preset's 8), and the run equals one told micro_batch=4."""
    auto, fixed = tmp_path / "auto", tmp_path / "fixed"
    p = start(torchrun_cmd("micro", overrides(ds, auto, 2, **{"train.micro_batch": "auto",
                                                              "train.micro_batch_max": 8}), 2),
              tmp_path, tmp_path / "auto.log", GPTPIPE_TEST_FAULT="oomabove@4")
    q_log = tmp_path / "fixed.log"
    assert p.wait(timeout=300) == 0, (tmp_path / "auto.log").read_text()[-3000:]
    q = start(torchrun_cmd("micro", overrides(ds, fixed, 2, **{"train.micro_batch": 4}), 2), tmp_path, q_log)
    assert q.wait(timeout=300) == 0, q_log.read_text()[-3000:]
    log = (tmp_path / "auto.log").read_text()
    assert "accum=2 micro_batch=4 (auto: 4 fits, 8 ran out of memory)" in log, log[-3000:]
    choice = json.loads((auto / CHOICE_FILE).read_text())
    assert choice["micro_batch"] == 4 and choice["fingerprint"]["world"] == 2
    assert losses(auto / "metrics.jsonl") == losses(fixed / "metrics.jsonl")
    a, b = final_weights(auto, STEPS), final_weights(fixed, STEPS)
    meta = R.read_meta(R.step_dir(auto, STEPS))
    assert meta["config"]["train"]["micro_batch"] == 4  # the checkpoint records the size it trained with
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    rows = read_metrics(auto / "metrics.jsonl", "train")
    assert {r["train/micro_batch"] for r in rows} == {4}


@pytest.mark.slow
def test_a_step_that_runs_out_of_memory_is_retried_with_the_same_data(ds, tmp_path):
    """One process, micro-batch 4 (accumulation 2); the 6th step runs out of memory in its second
    micro-step. It is retried at micro-batch 2 from the step's first sequence: every step once, and the
    run matches one at micro-batch 4 up to float summation order."""
    oom, ref = tmp_path / "oom", tmp_path / "ref"
    auto = {"train.micro_batch": "auto", "train.micro_batch_max": 4}
    p = start(python_cmd(args(overrides(ds, oom, **auto))), tmp_path, tmp_path / "oom.log",
              GPTPIPE_TEST_FAULT="oom@6")
    assert p.wait(timeout=300) == 0, (tmp_path / "oom.log").read_text()[-3000:]
    q = start(python_cmd(args(overrides(ds, ref, **{"train.micro_batch": 4}))), tmp_path, tmp_path / "ref.log")
    assert q.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    events = [r for r in read_metrics(oom / "metrics.jsonl", "event")]
    assert [e["event"] for e in events] == [
        "out of memory at micro-batch 4 (step 6): the step is retried with the same data at micro-batch 2; "
        "memory record in memory/oom-step6-rank0"]
    # what the user reads to see why (gptcore/training/memory.py): written before the retry
    record = json.loads((oom / "memory" / "oom-step6-rank0" / "record.json").read_text())
    assert record["error"].startswith("OutOfMemoryError: injected out of memory") and record["step"] == 6
    assert (record["micro_batch"], record["retry_at"]) == (4, 2) and record["rss_bytes"] > 50 * 2**20
    assert record["probe"] == [{"micro_batch": 4, "fits": True}]  # the probe's table of tried sizes
    assert [r["dir"] for r in read_metrics(oom / "metrics.jsonl", "memory")] == ["memory/oom-step6-rank0"]
    rows = read_metrics(oom / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # none lost, none doubled
    assert [r["train/micro_batch"] for r in rows] == [4] * 5 + [2] * 5
    got, want = losses(oom / "metrics.jsonl"), losses(ref / "metrics.jsonl")
    assert max(abs(got[s] - want[s]) for s in want) < 1e-5
    a, b = final_weights(oom, STEPS), final_weights(ref, STEPS)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0, msg=k)
    assert json.loads((oom / CHOICE_FILE).read_text())["micro_batch"] == 2  # the next start begins there

    # an explicit micro-batch is the user's: the same error ends the run, as before
    fixed = tmp_path / "fixed"
    r = start(python_cmd(args(overrides(ds, fixed, **{"train.micro_batch": 4}))), tmp_path, tmp_path / "fixed.log",
              GPTPIPE_TEST_FAULT="oom@3")
    assert r.wait(timeout=300) != 0
    assert "OutOfMemoryError" in (tmp_path / "fixed.log").read_text()


@pytest.mark.slow
def test_nothing_fits_is_a_clear_exit_2(ds, tmp_path):
    run_dir = tmp_path / "run"
    p = start(python_cmd(args(overrides(ds, run_dir, **{"train.micro_batch": "auto"}))), tmp_path,
              tmp_path / "log", GPTPIPE_TEST_FAULT="oomabove@0")
    assert p.wait(timeout=300) == 2
    out = (tmp_path / "log").read_text()
    assert "error: train.micro_batch=auto: not even 1 sequence(s) of train.seq_len=32 fit rank 0: the host's memory" \
        in out, out[-2000:]
    assert "Traceback" not in out
    assert not list((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else True
    record = json.loads((run_dir / "memory" / "oom-step0-rank0" / "record.json").read_text())
    assert record["probe"] == [{"micro_batch": m, "fits": False} for m in (8, 4, 2, 1)], record


@pytest.mark.slow
def test_the_probe_runs_compiled_as_the_gpu_job_does(ds, tmp_path):
    """train.compile=true (the GPU default): the probe compiles each size it tries, then leaves the
    trainer's compile to itself (torch.compiler.reset)."""
    run_dir = tmp_path / "run"
    o = overrides(ds, run_dir, **{"train.micro_batch": "auto", "train.micro_batch_max": 8, "train.compile": "true",
                                  "train.max_steps": 3})
    p = start(python_cmd(args(o)), tmp_path, tmp_path / "log", GPTPIPE_TEST_FAULT="oomabove@4")
    assert p.wait(timeout=600) == 0, (tmp_path / "log").read_text()[-3000:]
    log = (tmp_path / "log").read_text()
    assert "accum=2 micro_batch=4 (auto: 4 fits, 8 ran out of memory)" in log and "compile=True" in log
    assert "RUN_DONE" in log


def test_the_probe_steps_the_real_optimizer_and_leaves_everything_as_it_was():
    """The probe's step is the real one: the optimizer's state (AdamW's two moments) is held while the
    candidate's forward and backward run, as from the real run's second step on, and the optimizer steps.
    Afterwards no weight has moved, the optimizer is as new (no state, its learning rates back) and no
    gradient is left. On CUDA a size whose step peaks within 10% of the card is no fit."""
    from gptcore.training.microbatch import too_close

    cfg = load_config("micro", ["train.micro_batch=auto", "train.micro_batch_max=4", "train.seq_len=32",
                                "train.total_batch_tokens=256", "train.device=cpu", "train.compile=false"])
    env = select(cfg.train)
    torch.manual_seed(0)
    raw = GPT(cfg.model)
    raw.head_loss = make_loss(env.loss)
    optimizer = build_optimizer(raw, cfg.optim, "cpu")
    for g in optimizer.param_groups:
        g["lr"] = 3e-4
    before = {k: v.clone() for k, v in raw.state_dict().items()}
    held = []
    raw.register_forward_pre_hook(lambda m, a: held.append([set(st) for st in optimizer.state.values()]))
    assert probe(raw, optimizer, cfg, env) == (4, [])
    assert len(held) == 1 and len(held[0]) == len(list(raw.parameters()))
    assert all({"exp_avg", "exp_avg_sq"} <= keys for keys in held[0])
    assert all(torch.equal(v, before[k]) for k, v in raw.state_dict().items())
    assert not optimizer.state and all(g["lr"] == 3e-4 for g in optimizer.param_groups)
    assert all(p.grad is None for p in raw.parameters())
    gib = 2**30
    assert too_close(73 * gib, 80 * gib) and not too_close(71 * gib, 80 * gib)


@pytest.mark.slow
def test_the_probe_steps_the_ddp_model_so_its_first_real_step_fits(ds, tmp_path):
    """A card where the DDP step needs more memory than a plain forward (its gradient buckets, the
    optimizer's state): an injected allocation limit (tests/fixtures/ddp_memory/sitecustomize.py, loaded by
    Python at start-up, raising torch's OutOfMemoryError from torch's global module hooks) lets 2 sequences
    through DDP's forward and any number through a plain one. The probe steps the DDP-wrapped model, so it
    chooses 2 and the run trains to the end with no restart (torchrun --max-restarts=0). The probe used to
    step the plain model: it chose 8, the first DDP step ran out of memory and the launch failed.
    Each size that does not fit takes 6 s here (a compile of minutes on a large model), longer than the
    4 s hang limit: the probe beats before each size, with its own patience, so the watchdog lets it be."""
    run_dir = tmp_path / "run"
    o = overrides(ds, run_dir, 2, **{"train.micro_batch": "auto", "train.max_steps": 3, "train.hang_timeout_s": 4})
    fixture = Path(__file__).resolve().parent / "fixtures" / "ddp_memory"
    p = start(torchrun_cmd("micro", o, 2, max_restarts=0), tmp_path, tmp_path / "log",
              GPTPIPE_TEST_DDP_FITS="2", GPTPIPE_TEST_DDP_SLOW_S="6",
              PYTHONPATH=f"{fixture}{os.pathsep}{env()['PYTHONPATH']}")
    out_code = p.wait(timeout=300)
    log = (tmp_path / "log").read_text()
    assert out_code == 0, log[-3000:]
    assert "micro_batch=2 (auto: 2 fits, 8, 4 ran out of memory)" in log, log[-3000:]
    assert "injected (tests/fixtures/ddp_memory)" not in log and "made no progress" not in log and "RUN_DONE" in log
    assert json.loads((run_dir / CHOICE_FILE).read_text())["micro_batch"] == 2
