"""The trainer as one plain process: schedule, bad input, finished runs, SIGTERM, time budget."""

import json
import math
import shutil
import signal

import pytest
import torch

from gptcore.checkpoints import checkpoint as C
from gptcore.checkpoints import run_files as R
from gptcore.metrics import read_metrics
from gptcore.model.optim import lr_at
from gptcore.overrides import load_config
from gptcore.training.cost import SMOOTHING
from gptcore.training.train import main
from tests.test_train_utils import kill_tree, losses, make_dataset, python_cmd, start, wait_for_step, wait_for_text


def args(ds, run, *extra):
    return ["micro", f"data.dataset_dir={ds}", f"train.run_dir={run}", "train.micro_batch=2",
            "train.seq_len=32", "train.total_batch_tokens=128", "train.max_steps=6",
            "train.checkpoint_interval=4",
            "eval.eval_interval=0", "eval.sample_interval=0", "eval.val_tokens=128", *extra]


def snapshot(d):
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")}


@pytest.fixture(scope="module")
def finished(ds, tmp_path_factory):
    """A run trained to the end in this process (2 optimizer steps' worth of micro-batches each)."""
    run = tmp_path_factory.mktemp("runs") / "done"
    assert main(args(ds, run)) == 0
    return run


def test_lr_warmup_then_cosine_to_min():
    cfg = load_config("micro", ["train.max_steps=100", "optim.warmup_steps=10"])
    o = cfg.optim
    assert lr_at(0, cfg) == pytest.approx(o.max_lr / 10)
    assert lr_at(9, cfg) == pytest.approx(o.max_lr)
    assert lr_at(55, cfg) == pytest.approx((o.max_lr + o.min_lr) / 2)
    assert lr_at(100, cfg) == pytest.approx(o.min_lr) and lr_at(500, cfg) == o.min_lr
    assert all(lr_at(i, cfg) >= lr_at(i + 1, cfg) for i in range(10, 100))


def test_finished_run_layout_and_metrics(finished, capsys):
    assert (finished / "DONE").is_file()
    run = json.loads((finished / "run.json").read_text())
    cfg = json.loads((finished / "config.json").read_text())
    assert run["identity_hash"] == load_config("micro", args("x", "y")[1:]).identity_hash()
    assert cfg["train"]["max_steps"] == 6
    rows = read_metrics(finished / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    keys = {"train/loss", "train/lr", "train/grad_norm", "train/step_time", "train/tokens_per_s",
            "train/tokens_seen"}
    assert keys <= set(train[0]) and train[-1]["train/tokens_seen"] == 6 * 128
    assert not any("train/mfu" in r for r in train)  # a CPU has no known peak: no MFU without GPTPIPE_PEAK_FLOPS
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert train[-1]["train/loss"] < train[0]["train/loss"]  # it learns
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [6] and math.isfinite(evals[0]["val/loss"])
    samples = [r for r in rows if r["kind"] == "sample"]
    assert samples and isinstance(samples[0]["text"], str) and samples[0]["text"].startswith("Hello")
    ckpts = [p.name for p in R.list_checkpoints(finished)]
    assert ckpts == ["step_00000004", "step_00000006"]
    meta = R.read_meta(finished / "checkpoints" / "step_00000006")
    assert meta["tokens_seen"] == 6 * 128 and "val_loss" not in meta  # evaluated after the checkpoint:
    ev = json.loads((finished / "checkpoints" / "step_00000006" / "eval.json").read_text())  # its results
    assert ev["val_loss"] == evals[0]["val/loss"] and ev["step"] == 6 and ev["by"] == "trainer"
    assert meta["identity_hash"] == run["identity_hash"] and meta["manifest_id"] == run["manifest_id"]
    state = C.load_trainer_state(finished / "checkpoints" / "step_00000006")
    assert state["loader"]["position"] == 6 * 128 // 32 and state["step"] == 6


def test_mfu_on_cpu_is_reported_against_the_peak_given_in_GPTPIPE_PEAK_FLOPS(ds, tmp_path, monkeypatch):
    from gptcore.model.gpt import flops_per_token

    monkeypatch.setenv("GPTPIPE_PEAK_FLOPS", "1e9")
    run = tmp_path / "mfu"
    assert main(args(ds, run, "train.max_steps=2", "train.checkpoint_interval=2")) == 0
    train = read_metrics(run / "metrics.jsonl", "train")
    fpt = flops_per_token(load_config("micro").model, 32)
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["train/mfu"] == pytest.approx(fpt * r["train/tokens_per_s"] / 1e9, rel=1e-9) for r in train)


def test_a_few_steps_lower_the_loss_by_more_than_noise(ds, tmp_path):
    """Training must change the model. The micro model untrained scores ~10.6 on this data (a model whose
    every step is vetoed, or whose optimizer updates nothing, stays there: batches differ by only ~0.1);
    20 steps at lr 1e-2 reach ~9.3. The margin (0.8 nats) is far above batch noise and far below what
    training gives, so a broken update fails and a slower machine does not."""
    run = tmp_path / "learns"
    assert main(args(ds, run, "train.max_steps=20", "optim.max_lr=1e-2", "optim.min_lr=1e-3",
                      "train.checkpoint_interval=20", "eval.eval_interval=20", "eval.val_tokens=512")) == 0
    rows = read_metrics(run / "metrics.jsonl")
    first = [r["train/loss"] for r in rows if r["kind"] == "train"][0]
    val = [r["val/loss"] for r in rows if r["kind"] == "eval"]
    assert first > 10.4, first  # the first step's loss is an untrained model's
    assert len(val) == 1 and val[0] < first - 0.8, (first, val)


def test_finished_run_started_again_does_nothing(finished, ds, capsys):
    before = snapshot(finished)
    assert main(args(ds, finished)) == 0
    assert "RUN_DONE" in capsys.readouterr().out
    assert snapshot(finished) == before


@pytest.mark.parametrize("override, message", [
    ("train.total_batch_tokens=100", "not divisible"),
    ("model.n_head=3", "n_embd"),
    ("train.nonsense=1", "unknown config key"),
    # bad input for this machine: refused at start-up with exit 2 (it was a traceback and exit 1 from every rank)
    pytest.param("train.device=cuda", "train.device=cuda but no CUDA device is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_config_exits_2_before_any_write(ds, tmp_path, capsys, override, message):
    assert main(args(ds, tmp_path / "run", override)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_missing_or_foreign_shards_exit_2(tmp_path, capsys):
    d = make_dataset(tmp_path / "ds")
    (d / "test_train_000002.bin").unlink()
    assert main(args(d, tmp_path / "run")) == 2
    assert "test_train_000002.bin" in capsys.readouterr().err
    d = make_dataset(tmp_path / "ds2", tokenizer="o200k_base")
    assert main(args(d, tmp_path / "run")) == 2
    assert "tokenizer=o200k_base" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_other_config_or_dataset_for_an_existing_run_is_refused(finished, ds, tmp_path, capsys):
    before = snapshot(finished)
    assert main(args(ds, finished, "optim.max_lr=0.01")) == 2
    assert "another configuration" in capsys.readouterr().err
    other = make_dataset(tmp_path / "other", seed=1)
    assert main(args(other, finished)) == 2
    assert "dataset" in capsys.readouterr().err
    assert snapshot(finished) == before


def test_checkpoint_of_another_model_shape_is_refused(finished, ds, tmp_path, capsys):
    run = tmp_path / "copied"
    shutil.copytree(finished / "checkpoints", run / "checkpoints")  # checkpoints without run identity
    before = snapshot(run)
    assert main(args(ds, run, "model.n_layer=3")) == 2
    assert "another model shape" in capsys.readouterr().err
    assert snapshot(run) == before  # no run.json, config.json, metrics written


def test_time_budget_stops_with_a_checkpoint(ds, tmp_path, capsys):
    run = tmp_path / "budget"
    assert main(args(ds, run, "train.max_minutes=0.000001")) == 0
    out = capsys.readouterr().out
    assert "time budget" in out and "RUN_DONE" not in out
    assert not (run / "DONE").exists()
    assert [p.name for p in R.list_checkpoints(run)] == ["step_00000001"]
    assert R.read_meta(R.latest_checkpoint(run))["reason"] == "stop"


def test_sigterm_checkpoints_exits_0_and_the_run_continues(ds, tmp_path):
    run = tmp_path / "term"
    a = args(ds, run, "train.max_steps=400", "train.checkpoint_interval=1000")
    proc = start(python_cmd(a), tmp_path, tmp_path / "log1")
    step = wait_for_step(proc, run / "metrics.jsonl", 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = (tmp_path / "log1").read_text()
    assert "stopped at step" in log and "signal 15" in log
    ck = R.latest_checkpoint(run)
    stopped = R.read_meta(ck)["step"]
    assert stopped >= step and R.read_meta(ck)["reason"] == "stop" and not (run / "DONE").exists()
    # the same command continues from there (short: lower the end with a time budget instead)
    proc = start(python_cmd(a + ["train.max_minutes=0.000001"]), tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=60) == 0
    assert f"resuming from step_{stopped:08d}" in (tmp_path / "log2").read_text()
    rows = read_metrics(run / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, stopped + 2))  # appended, not truncated
    assert set(losses(run / "metrics.jsonl")) == set(range(1, stopped + 2))
    kill_tree(proc)


def test_a_failed_evaluation_is_tried_again_and_never_changes_the_training(finished, ds, tmp_path, monkeypatch):
    """Evaluations at steps 2, 4 and 6: the first raises, the third runs out of memory (test-only faults).
    Each is an event; the one between succeeds and is attached to the step-4 checkpoint; the run finishes
    with every checkpoint and exactly the weights of the run that evaluated only at the end."""
    import torch

    monkeypatch.setenv("GPTPIPE_TEST_FAULT", "evalfail@1,evaloom@3")
    run = tmp_path / "retry"
    assert main(args(ds, run, "eval.eval_interval=2")) == 0
    events = read_metrics(run / "metrics.jsonl", "event")
    assert [e["step"] for e in events] == [2, 6] and "RuntimeError: injected" in events[0]["event"]
    assert "OutOfMemoryError" in events[1]["event"] and "tried again" in events[1]["event"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", "eval")] == [4]
    ev = json.loads((R.step_dir(run, 4) / R.EVAL_FILE).read_text())
    assert ev["step"] == 4 and math.isfinite(ev["val_loss"])
    assert not (R.step_dir(run, 6) / R.EVAL_FILE).exists()  # its evaluation failed: the flow evaluates it
    assert losses(run / "metrics.jsonl") == losses(finished / "metrics.jsonl")
    a, b = C.load_model(R.step_dir(run, 6))[0].state_dict(), C.load_model(R.step_dir(finished, 6))[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_sigterm_during_a_background_write_finishes_it_then_writes_the_stop_checkpoint(ds, tmp_path):
    """Each checkpoint write takes 6 s (a test-only delay). SIGTERM while step 4 is being written: that
    write completes, the stop checkpoint follows, both verify whole, exit 0."""
    run = tmp_path / "term"
    log = tmp_path / "log"
    proc = start(python_cmd(args(ds, run, "train.max_steps=100000")), tmp_path, log,
                 GPTPIPE_TEST_CHECKPOINT_DELAY="6")
    try:
        wait_for_text(log, "checkpoint write delayed")  # step 4's write is in flight
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()
    finally:  # never leave a 100000-step trainer behind a failed assertion
        if proc.poll() is None:
            kill_tree(proc)
    # the write in flight at the signal: step 4's, or a later interval's when the machine is loaded (the
    # writer thread's "delayed" line can come steps late: CI, 2026-11-29); then the stop checkpoint
    ckpts = R.list_checkpoints(run)
    assert len(ckpts) == 2, log.read_text()
    flight, stop = R.read_meta(ckpts[0]), R.read_meta(ckpts[1])
    assert flight["reason"] == "interval" and flight["step"] % 4 == 0, flight
    assert stop["reason"] == "stop" and stop["step"] > flight["step"] and "stopped at step" in log.read_text()
    for ck in ckpts:
        C.load_for_resume(ck, C.load_model(ck)[0])  # complete and verified


def test_bf16_autocast_on_cpu_trains_like_fp32(finished, ds, tmp_path):
    """train.dtype=bfloat16 on CPU (autocast, bf16 matmuls) runs the same schedule on the same data as
    the fp32 run, with losses equal to bf16 precision."""
    run = tmp_path / "bf16"
    assert main(args(ds, run, "train.dtype=bfloat16")) == 0
    bf16, fp32 = losses(run / "metrics.jsonl"), losses(finished / "metrics.jsonl")
    assert sorted(bf16) == sorted(fp32) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in bf16.values())
    assert bf16 != fp32  # really ran in bf16
    assert list(bf16.values()) == pytest.approx(list(fp32.values()), rel=1e-2)
    assert R.latest_checkpoint(run) is not None  # checkpoints as usual


@pytest.mark.slow  # torch.compile of the micro model: ~20 s on an idle 2-core machine, more under load
def test_compiled_training_matches_eager(finished, ds, tmp_path):
    """train.compile=true (torch.compile, with the fused CPU loss left eager behind a graph break) trains
    the same trajectory as the eager run, to fp32 rounding, and its checkpoints load into a plain GPT."""
    run = tmp_path / "compiled"
    assert main(args(ds, run, "train.compile=true")) == 0
    compiled, eager = losses(run / "metrics.jsonl"), losses(finished / "metrics.jsonl")
    assert sorted(compiled) == sorted(eager) == [1, 2, 3, 4, 5, 6]
    assert list(compiled.values()) == pytest.approx(list(eager.values()), rel=1e-4)
    model, _ = C.load_model(R.latest_checkpoint(run))  # no _orig_mod. prefixes in the state dict
    assert model.config.n_layer == 2


def test_plain_loss_head_trains_the_fused_trajectory(finished, ds, tmp_path):
    """train.loss=plain (what CUDA runs by default) and the CPU default (fused) train the same run."""
    run = tmp_path / "plain"
    assert main(args(ds, run, "train.loss=plain")) == 0
    plain, fused = losses(run / "metrics.jsonl"), losses(finished / "metrics.jsonl")
    assert sorted(plain) == sorted(fused) == [1, 2, 3, 4, 5, 6]
    assert list(plain.values()) == pytest.approx(list(fused.values()), rel=1e-5)


@pytest.mark.slow  # counts host syncs through whole training runs (the fp16 one compiles GradScaler paths)
@pytest.mark.parametrize("recipe", [[], ["optim.name=muon", "optim.schedule=wsd"],
                                    ["optim.name=muon", "train.dtype=float16"]], ids=["adamw", "muon", "muon-fp16"])
def test_no_host_sync_inside_a_step_except_at_log_eval_and_checkpoint_steps(ds, tmp_path, monkeypatch, recipe):
    """With the loss head CUDA runs (plain), the only host reads of device values between two steps
    happen after log, eval and checkpoint steps: every Tensor.item/tolist/cpu/numpy/bool/float/int call
    is counted, per step."""
    import torch

    import gptcore.training.trainer as T

    syncs, steps = [0], []
    real_step = T.train_step

    def counting_step(*a, **k):
        steps.append(syncs[0])  # host reads since the previous step began
        syncs[0] = 0
        return real_step(*a, **k)

    def counted(name):
        real = getattr(torch.Tensor, name)

        def f(self, *a, **k):
            syncs[0] += 1
            return real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, f)

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        counted(name)
    monkeypatch.setattr(T, "train_step", counting_step)
    run = tmp_path / "nosync"
    assert main(args(ds, run, "train.loss=plain", "train.max_steps=12", "train.log_interval=4",
                     "train.checkpoint_interval=100", *recipe)) == 0
    after = dict(enumerate(steps[1:], start=1))  # reads made after step s, before step s + 1
    assert len(after) == 11
    assert {s for s, n in after.items() if n} == {1, 4, 8}, after  # log steps (12, the last, ends the run)
    rows = read_metrics(run / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, 13))  # every step still logged, in batches


def test_auto_dtype_uses_bf16_only_where_the_gpu_has_it_natively(monkeypatch):
    """V100/T4 report bf16 only through emulation (slow, and Inductor will not compile it): auto picks
    fp16 + GradScaler there, bf16 on Ampere and newer, fp32 on CPU, and an explicit choice is kept."""
    import torch

    from gptcore.distributed import select_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert select_dtype("auto", cuda) == torch.float16  # emulated only
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert select_dtype("auto", cuda) == torch.bfloat16  # native
    assert select_dtype("auto", cpu) == torch.float32
    assert select_dtype("bfloat16", cpu) == torch.bfloat16


def test_an_evaluation_with_its_own_switch_interval_and_settings_is_one_class_and_one_line(ds, tmp_path):
    """Adding an evaluation with its own settings is one module and one registry line: this one, defined
    and registered here, gets its config section (eval.scaled.*: switch, interval, a setting of its own),
    typed and checked, off by default; switched on, the trainer runs it at its own interval with its
    setting, and the run's config.json keeps the section."""
    from dataclasses import dataclass

    from gptcore import evals
    from gptcore.config import ConfigError
    from gptcore.overrides import from_dict

    @dataclass
    class ScaledSettings:
        enabled: bool = False
        interval: int = 0
        scale: float = 1.0

    class Scaled(evals.Evaluation):
        name = "scaled"
        Settings = ScaledSettings

        def settings(self, cfg) -> dict:
            return {"scale": self.options(cfg).scale}

        def run(self, ctx: evals.Context) -> dict:
            return {"score": self.options(ctx.cfg).scale * 2}

    with pytest.raises(ConfigError, match="no evaluation named 'scaled'"):
        load_config("micro", ["eval.scaled.enabled=true"])
    evals.register(Scaled())
    try:
        assert "scaled" not in [ev.name for ev in evals.enabled(load_config("micro"))]  # off by default
        for bad, message in (("eval.scaled.scale=big", "eval.scaled.scale='big' is not a valid float"),
                             ("eval.scaled.colour=red", r"unknown config key 'eval.scaled.colour'; eval.scaled has")):
            with pytest.raises(ConfigError, match=message):
                load_config("micro", [bad])
        on = ["eval.scaled.enabled=true", "eval.scaled.interval=4", "eval.scaled.scale=2.5"]
        run = tmp_path / "scaled"
        assert main(args(ds, run, "eval.eval_interval=2", *on)) == 0
        saved = json.loads((run / "config.json").read_text())
        assert saved["eval"]["scaled"] == {"enabled": True, "interval": 4, "scale": 2.5}
        assert from_dict(saved).eval.options("scaled").scale == 2.5
        rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl", "eval")}
        assert sorted(rows) == [2, 4, 6] and "scaled/score" not in rows[2]  # its own interval: 4, and the end
        assert rows[4]["scaled/score"] == rows[6]["scaled/score"] == 5.0
        stored = json.loads((R.step_dir(run, 4) / R.EVAL_FILE).read_text())
        assert stored["scaled"] == {"score": 5.0} and stored["settings"]["evaluations"]["scaled"] == {"scale": 2.5}
    finally:
        evals.unregister("scaled")
    assert "scaled" not in load_config("micro").to_dict()["eval"]


def test_eta_gpu_hours_and_cost_agree_with_the_runs_own_clock_and_carry_across_invocations(ds, tmp_path, capsys):
    """train.price_per_gpu_hour=2.5: every train row has the ETA, the GPU-hours and the cost so far and
    projected. The GPU-hours grow as the rows' own timestamps (1 device: hours x 3600 = seconds, within
    10%), the ETA at the halfway step is the steps left at the smoothed time per step of the run's own step
    timer (an ETA of the whole run instead of what is left would be 2x off), the cost is the hours times the
    price. Stopped and
    continued, the second invocation starts from the hours its checkpoint recorded."""
    run = tmp_path / "priced"
    extra = ("train.price_per_gpu_hour=2.5", "train.max_steps=24", "train.checkpoint_interval=12",
             "train.log_interval=1")
    assert main(args(ds, run, *extra, "train.max_minutes=0.000001")) == 0  # stops after its first step
    first = R.latest_checkpoint(run)
    recorded = C.load_trainer_state(first)["gpu_hours"]
    assert recorded > 0
    assert main(args(ds, run, *extra)) == 0
    assert "ETA " in capsys.readouterr().out
    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl", "train")}
    assert sorted(rows) == list(range(1, 25))
    for r in rows.values():
        assert r["train/cost_usd"] == pytest.approx(r["train/gpu_hours"] * 2.5)
        assert r["train/cost_projected_usd"] == pytest.approx((r["train/gpu_hours"] + r["train/eta_s"] / 3600) * 2.5)
    assert rows[2]["train/gpu_hours"] >= recorded  # the second invocation continues the first's hours
    a, b = rows[4], rows[24]
    assert (b["train/gpu_hours"] - a["train/gpu_hours"]) * 3600 == pytest.approx(b["time"] - a["time"], rel=0.1)
    # the ETA is what is left at the run's own step timer: at step 12 of 24, 12 steps at the smoothed time per
    # step of this invocation's reads (steps 2-12) as the rows record it (an ETA of the whole run would be 2x);
    # from the steps already taken, so the other worker's load later in the run cannot make it look wrong
    smoothed = None
    for s in range(2, 13):
        dt = rows[s]["train/step_time"]
        smoothed = dt if smoothed is None else SMOOTHING * dt + (1 - SMOOTHING) * smoothed
    half = rows[12]
    assert half["train/eta_s"] == pytest.approx(12 * smoothed, rel=1e-6)
    assert rows[24]["train/eta_s"] == 0
    plain = tmp_path / "unpriced"
    assert main(args(ds, plain)) == 0
    last = read_metrics(plain / "metrics.jsonl", "train")[-1]
    assert "train/eta_s" in last and "train/cost_usd" not in last  # no price: no cost


def test_a_model_whose_states_exceed_the_machine_is_refused_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """gpt2-1558m's width at 80 layers (2.3B parameters: ~35 GiB of weights, gradients and AdamW state) is
    refused at once with exit 2 where the machine has less memory available (this 24 GiB kind), naming what
    it needs, what the machine has and the smoke-test widths; nothing is written. At the documented smoke
    width the same preset passes the check (and stops at the next one: no dataset here)."""
    import psutil

    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    deep = ["gpt2-1558m", "model.n_layer=80", "model.n_embd=1536", "model.n_head=16", "train.device=cpu"]
    assert main(deep) == 2
    err = capsys.readouterr().err
    if psutil.virtual_memory().available < 35 * 2**30:  # every machine of this project's kind (24 GiB)
        assert "gpt2-1558m: 2.3" in err and "B parameters need 3" in err and "this machine has" in err, err
        assert "model.n_embd=64 model.n_head=4" in err
    else:  # a bigger machine: the check lets it through to the next one
        assert "parameters need" not in err and "dataset directory" in err, err
    assert not list(tmp_path.rglob("*.json"))
    assert main(["gpt2-1558m", "model.n_embd=64", "model.n_head=4", "train.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "parameters need" not in err and "dataset directory" in err, err
