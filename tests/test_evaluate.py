"""Validation loss, the standalone `python -m gptcore.evals.evaluate` command (plain and under torchrun), and
the evaluate stage's idempotent eval.json."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gptcore.checkpoints import checkpoint
from gptcore.data.shard_format import Manifest, ShardError, ShardInfo, write_shard
from gptcore.evals.evaluate import main as evaluate_main
from gptcore.evals.scorers import hellaswag
from gptcore.evals.validation import validation_loss
from gptcore.model.gpt import GPT
from gptcore.overrides import load_config
from tasks.evaluate import evaluate_dir, missing_parts

FIXTURE = Path(__file__).parent / "fixtures" / "hellaswag_mini.jsonl"
REPO = Path(__file__).resolve().parent.parent
# micro: B=4, T=32 -> 128 tokens per batch; 5 batches of validation
OVERRIDES = ["data.dataset_name=evaltest", "eval.val_tokens=640", f"eval.hellaswag.path={FIXTURE}",
             "eval.hellaswag.enabled=true"]


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))


def make_dataset(directory: Path, val_sizes=(400, 500), train_tokens=1000, seed=0) -> np.ndarray:
    """A dataset dir with val shards of the given sizes; returns the val tokens concatenated."""
    rng = np.random.default_rng(seed)
    shards, val = [], []
    for i, n in enumerate(val_sizes):
        t = rng.integers(0, 50257, n)
        name = f"t_val_{i:06d}.bin"
        shards.append(ShardInfo(name, "val", n, write_shard(directory / name, t)))
        val.append(t)
    t = rng.integers(0, 50257, train_tokens)
    name = f"t_train_{len(val_sizes):06d}.bin"
    shards.append(ShardInfo(name, "train", train_tokens, write_shard(directory / name, t)))
    Manifest(shard_tokens=max(val_sizes), shards=shards).save(directory)
    return np.concatenate(val)


def micro_model(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(load_config("micro").model).eval()


# --- validation loss -----------------------------------------------------------------------------

def test_validation_loss_is_the_mean_over_fixed_batches(tmp_path):
    val = make_dataset(tmp_path)  # 900 val tokens over 2 shards: batches cross the shard boundary
    cfg = load_config("micro", OVERRIDES)
    model = micro_model()
    # independent computation: one forward over all 5 batches at once, mean over every token
    n = 5 * 128
    x = torch.from_numpy(val[:n].astype(np.int64)).view(-1, 32)
    y = torch.from_numpy(val[1:n + 1].astype(np.int64)).view(-1, 32)
    with torch.no_grad():
        _, expected = model(x, y)
    got = validation_loss(model, cfg, tmp_path, "cpu")
    assert got == pytest.approx(expected.item(), rel=1e-5)
    assert validation_loss(model, cfg, tmp_path, "cpu") == got  # the same batches every time
    cfg.eval.val_tokens = 128  # fewer tokens: only the first batch
    with torch.no_grad():
        _, first = model(x[:4], y[:4])
    assert validation_loss(model, cfg, tmp_path, "cpu") == pytest.approx(first.item(), rel=1e-5)


@pytest.mark.slow  # Inductor compiles C++ (g++)
def test_the_trainers_validation_runs_compiled_where_training_compiles_and_falls_back_to_eager(tmp_path):
    """Validation (one fixed shape) runs through a torch.compile of the plain model where training compiles
    (eager validation cost 5.7% of gpt2-124m's wall time on an H100, docs/gpu/2026-11-26-h100): the same
    loss as eager, with the model left in train mode; a compiled forward that fails gives way to eager for
    the rest of the invocation, with an event, and the same numbers."""
    from gptcore.distributed import Env
    from gptcore.metrics import NullLogger
    from gptcore.training.guard import FaultInjector
    from gptcore.training.train_eval import Evaluator

    make_dataset(tmp_path)
    cfg = load_config("micro", OVERRIDES)
    model = micro_model().train()
    eager = validation_loss(model, cfg, tmp_path, "cpu")
    events = []
    env = Env(0, 0, 1, torch.device("cpu"), torch.float32, compile=True)
    ev = Evaluator(cfg, env, tmp_path, model, NullLogger(), lambda step, text, who="guard": events.append(text),
                   FaultInjector("", 0))
    assert ev.compiled_val is not None and ev.compiled_val._orig_mod is model  # the same weights, compiled
    compiled = ev.validation(4)
    assert float(compiled[0] / compiled[1]) == pytest.approx(eager, abs=1e-5) and model.training
    assert events == []

    def broken(*_, **__):
        raise RuntimeError("inductor could not compile this")
    ev.compiled_val = broken
    fallback = ev.validation(8)
    assert float(fallback[0] / fallback[1]) == pytest.approx(eager, rel=1e-6)
    assert ev.compiled_val is None and len(events) == 1
    assert "compiled forward failed (RuntimeError: inductor could not compile this)" in events[0]
    assert "eagerly for the rest of this invocation" in events[0]
    ev.validation(12)
    assert len(events) == 1  # eager from then on: no second event
    no_compile = Evaluator(cfg, Env(0, 0, 1, torch.device("cpu"), torch.float32, compile=False), tmp_path, model,
                           NullLogger(), events.append, FaultInjector("", 0))
    assert no_compile.compiled_val is None


def test_validation_loss_split_across_ranks_sums_to_the_whole(tmp_path):
    make_dataset(tmp_path)
    cfg = load_config("micro", OVERRIDES)
    model = micro_model()
    whole = validation_loss(model, cfg, tmp_path, "cpu")
    # without a process group each rank returns the mean of its own batches (0,2,4 and 1,3)
    r0 = validation_loss(model, cfg, tmp_path, "cpu", rank=0, world=2)
    r1 = validation_loss(model, cfg, tmp_path, "cpu", rank=1, world=2)
    assert (3 * r0 + 2 * r1) / 5 == pytest.approx(whole, rel=1e-6)
    assert model.training is False


def test_validation_loss_short_split(tmp_path, caplog):
    make_dataset(tmp_path, val_sizes=(300,))  # 2 full batches of 128 (+1 target token)
    cfg = load_config("micro", OVERRIDES)
    with caplog.at_level(logging.WARNING, logger="gptcore.evals.validation"):
        validation_loss(micro_model(), cfg, tmp_path, "cpu")
    assert "only 2 full batches" in caplog.text
    tiny = tmp_path / "tiny"
    make_dataset(tiny, val_sizes=(100,))
    with pytest.raises(ShardError, match="fewer than one batch"):
        validation_loss(micro_model(), cfg, tiny, "cpu")


def test_validation_loss_restores_training_mode(tmp_path):
    make_dataset(tmp_path)
    model = micro_model().train()
    validation_loss(model, load_config("micro", OVERRIDES), tmp_path, "cpu")
    assert model.training


# --- standalone command and the evaluate stage ----------------------------------------------------

def make_run(home: Path, steps=(5, 10)) -> tuple[Path, GPT]:
    """A run dir with checkpoints (the newest holds seed-1 weights) and its dataset."""
    cfg = load_config("micro", OVERRIDES)
    make_dataset(home / "shards" / "evaltest")
    run_dir = home / "runs" / "micro"
    for i, step in enumerate(steps):
        model = micro_model(i)
        checkpoint.save_checkpoint(run_dir, step, model, {}, {"config": cfg.to_dict(), "run_name": "micro"})
    return run_dir, model


def run_cli(args, capsys) -> tuple[int, str, str]:
    """`python -m gptcore.evals.evaluate ARGS` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = evaluate_main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_torchrun(args, timeout=180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", "-m", "gptcore.evals.evaluate", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def in_process(model: GPT, home: Path) -> dict:
    cfg = load_config("micro", OVERRIDES)
    examples = [hellaswag.make_example(*r) for r in hellaswag.read_records(FIXTURE)]
    return {"val_loss": validation_loss(model, cfg, home / "shards" / "evaltest", "cpu"),
            "hellaswag": hellaswag.evaluate(model, examples, "cpu")}


@pytest.mark.slow
def test_cli_on_run_dir_plain_and_torchrun(tmp_path, capsys):
    home = tmp_path / "home"
    run_dir, newest = make_run(home)
    expected = in_process(newest, home)
    code, stdout, stderr = run_cli([str(run_dir), "--val", "--device", "cpu"], capsys)
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["kind"] == "checkpoint" and out["step"] == 10  # the newest checkpoint
    assert out["hellaswag"] == expected["hellaswag"]
    assert out["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    # two ranks (gloo): the same numbers, printed once
    res2 = run_torchrun([str(run_dir), "--val"])
    assert res2.returncode == 0, res2.stderr
    out2 = json.loads(res2.stdout)
    assert out2["hellaswag"] == expected["hellaswag"]
    assert out2["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)


def test_hf_export_dir_cli_and_stage(tmp_path, capsys):
    from gptcore.model.hf import export_hf

    model = micro_model(3)
    hf_dir = export_hf(model, tmp_path / "hf")
    expected = hellaswag.evaluate(model, [hellaswag.make_example(*r) for r in hellaswag.read_records(FIXTURE)], "cpu")
    code, stdout, stderr = run_cli([str(hf_dir), "--hellaswag", str(FIXTURE), "--device", "cpu"], capsys)
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["kind"] == "hf" and out["hellaswag"] == expected
    cfg = load_config("micro", OVERRIDES)
    result = evaluate_dir(str(hf_dir), cfg.to_dict(), val=False, device="cpu")
    assert result["hellaswag"] == expected and (hf_dir / "eval.json").is_file()


def test_cli_errors_are_clear(tmp_path, capsys):
    code, _, err = run_cli([str(tmp_path)], capsys)
    assert code == 2 and "neither a checkpoint" in err
    home = tmp_path / "home"
    run_dir, _ = make_run(home, steps=(5,))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(FIXTURE.read_text()[:-40])  # truncated mid-line
    code, out, err = run_cli([str(run_dir), "--hellaswag", str(bad)], capsys)
    assert code == 2 and f"{bad} line 7" in err and out == ""
    # --val on a checkpoint whose dataset is gone: the shard error, not a traceback
    import shutil
    shutil.rmtree(home / "shards")
    code, _, err = run_cli([str(run_dir), "--val", "--no-hellaswag"], capsys)
    assert code == 2 and "tokenize" in err
    if not torch.cuda.is_available():  # --device cuda on a machine without one: exit 2, not a traceback
        code, _, err = run_cli([str(run_dir), "--device", "cuda"], capsys)
        assert code == 2 and "train.device=cuda but no CUDA device is visible" in err


def test_evaluate_stage_writes_eval_json_once(tmp_path):
    home = tmp_path / "home"
    run_dir, newest = make_run(home)
    expected = in_process(newest, home)
    result = evaluate_dir(str(run_dir), device="cpu")
    out = run_dir / "checkpoints" / "step_00000010" / "eval.json"
    assert json.loads(out.read_text()) == result
    assert result["hellaswag"] == expected["hellaswag"] and result["step"] == 10
    assert result["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no temp file left
    # a second call returns the stored result without evaluating (the weights are not even needed)
    weights = out.parent / checkpoint.MODEL_FILE
    weights.rename(weights.with_suffix(".moved"))
    assert evaluate_dir(str(run_dir), device="cpu") == result
    weights.with_suffix(".moved").rename(weights)
    # different settings -> evaluated again
    cfg = load_config("micro", OVERRIDES + ["eval.hellaswag.limit=3"])
    again = evaluate_dir(str(out.parent), cfg.to_dict(), device="cpu")
    assert again["hellaswag"]["n"] == 3 and json.loads(out.read_text())["hellaswag"]["n"] == 3


def test_evaluate_stage_reports_unreachable_hellaswag(tmp_path, monkeypatch):
    home = tmp_path / "home"
    run_dir, _ = make_run(home, steps=(5,))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(hellaswag.URL_ENV, f"http://127.0.0.1:{port}/x.jsonl")
    cfg = load_config("micro", [o for o in OVERRIDES if "hellaswag.path" not in o])
    result = evaluate_dir(str(run_dir), cfg.to_dict(), device="cpu")
    assert "cannot download" in result["hellaswag"]["skipped"] and "val_loss" in result
    # the skip counts as done, for the flow and the task alike (a re-run stays a no-op) ...
    cfg.eval.sections.setdefault("hellaswag", {})["path"] = str(FIXTURE)
    assert missing_parts(run_dir / "checkpoints" / "step_00000005", cfg) == []
    assert "skipped" in evaluate_dir(str(run_dir), cfg.to_dict(), device="cpu")["hellaswag"]
    # ... until asked to score it again, once its dataset is available; the validation loss is kept
    again = evaluate_dir(str(run_dir), cfg.to_dict(), device="cpu", redo=["hellaswag"])
    assert again["hellaswag"]["n"] == 7 and again["val_loss"] == result["val_loss"]


EVAL_PROC = """
import json, logging, sys
from tasks.evaluate import evaluate_dir
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
print("RESULT", json.dumps(evaluate_dir(sys.argv[1], device="cpu", log=logging.getLogger("x"))), flush=True)
"""


def test_two_evaluations_of_one_checkpoint_at_once_evaluate_it_once(tmp_path):
    """Two processes (two flow runs of one training run) evaluating the same checkpoint: one evaluates,
    the other waits on the checkpoint's eval.lock and then returns the stored result."""
    home = tmp_path / "home"
    run_dir, _ = make_run(home)
    env = {**os.environ, "GPTPIPE_HOME": str(home), "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", EVAL_PROC, str(run_dir)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("already evaluated" in o for o in outs) == 1, outs
    assert sum(o.count("\nevaluated ") + o.startswith("evaluated ") for o in outs) == 1, outs
    results = [json.loads(o.split("RESULT ", 1)[1]) for o in outs]
    assert results[0] == results[1]
