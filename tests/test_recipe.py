"""The opt-in recipe (optim.name=muon, optim.schedule=wsd): the schedule against its formula, the Muon
step against torch.optim.Muon, the parameter split, and real trainer processes: SIGKILL resume, 2 ranks
equal to 1, the divergence guard."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from gptcore.checkpoints import run_files as R
from gptcore.config import ConfigError, OptimConfig
from gptcore.metrics import read_metrics
from gptcore.model.gpt import GPT
from gptcore.model.optim import (
    Combined,
    Muon,
    adamw,
    build_optimizer,
    lr_at,
    newton_schulz_dtype,
    orthogonalize,
    set_lr,
)
from gptcore.overrides import load_config
from gptcore.presets import model_preset
from tests.test_ddp import STEPS as DDP_STEPS
from tests.test_ddp import args as ddp_args
from tests.test_ddp import assert_same_run
from tests.test_train_utils import (
    env,
    kill_tree,
    losses,
    python_cmd,
    start,
    torchrun_cmd,
    wait_for_step,
)

STEPS = DDP_STEPS  # tests/test_ddp.assert_same_run compares runs of this length
MUON = ["optim.name=muon", "optim.schedule=wsd", "optim.decay_frac=0.25", "optim.muon_lr=0.02"]


def test_wsd_schedule_at_its_boundaries():
    cfg = load_config("micro", ["train.max_steps=100", "optim.warmup_steps=10", "optim.schedule=wsd",
                                "optim.decay_frac=0.2", "optim.max_lr=1e-3", "optim.min_lr=1e-4"])
    # warmup: (it + 1) / warmup * max; stable: max until step 80; decay: linear to min over steps 80..100
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == lr_at(79, cfg) == 1e-3
    assert lr_at(80, cfg) == 1e-3  # the first decay step is still at the peak
    assert lr_at(90, cfg) == pytest.approx(1e-3 + (1e-4 - 1e-3) * 10 / 20)
    assert lr_at(99, cfg) == pytest.approx(1e-3 + (1e-4 - 1e-3) * 19 / 20)
    assert lr_at(100, cfg) == lr_at(150, cfg) == 1e-4
    with pytest.raises(ConfigError, match="decay_frac"):
        load_config("micro", ["optim.decay_frac=0"])
    with pytest.raises(ConfigError, match="adamw or muon"):
        load_config("micro", ["optim.name=sgd"])
    with pytest.raises(ConfigError, match="max_lr must be > 0"):
        load_config("micro", ["optim.name=muon", "optim.max_lr=0", "optim.min_lr=0"])


def test_default_recipe_keeps_its_run_identity():
    # the recipe settings enter the identity only when chosen: a month-long AdamW run keeps resuming
    assert load_config("gpt2-124m").identity_hash() == "5195e14ca788e17d"
    assert load_config("micro").identity_hash() == "5173246de69b27c6"
    assert load_config("micro", ["optim.name=muon"]).identity_hash() != load_config("micro").identity_hash()
    assert load_config("micro", ["optim.muon_lr=0.5"]).identity_hash() == load_config("micro").identity_hash()


def test_muon_gets_the_blocks_matrices_and_adamw_the_rest():
    model = GPT(model_preset("micro"))
    opt = build_optimizer(model, load_config("micro", MUON).optim, "cpu")
    adamw, muon = opt.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {n for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
    assert in_muon.isdisjoint(in_adamw) and in_muon | in_adamw == set(names.values())
    assert "transformer.wte.weight" in in_adamw  # the tied embedding / head is not a hidden matrix
    set_lr(opt, 1e-3 * 0.5)  # the schedule at half its peak: Muon follows at half of its own peak
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5)
    assert {g["lr"] for g in adamw.param_groups} == {1e-3 * 0.5}


def test_muon_step_is_torch_muon_in_the_chosen_precision():
    torch.manual_seed(0)
    w = [torch.randn(48, 16), torch.randn(16, 40)]
    grads = [[torch.randn_like(p) for p in w] for _ in range(3)]
    ours, ref = [p.clone().requires_grad_() for p in w], [p.clone().requires_grad_() for p in w]
    kw = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "nesterov": True}
    a, b = Muon(ours, ns_dtype=torch.bfloat16, **kw), torch.optim.Muon(ref, **kw)
    for g in grads:
        for p, q, gi in zip(ours, ref, g, strict=True):
            p.grad, q.grad = gi.clone(), gi.clone()
        a.step(), b.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)  # bf16: exactly torch's update
    # float32 (the CPU choice) approximates the same orthogonalization
    g = torch.randn(64, 32)
    x32, x16 = (orthogonalize(g, 3.4445, -4.775, 2.0315, 5, 1e-7, d) for d in (torch.float32, torch.bfloat16))
    assert x32.dtype == torch.float32 and (x32 - x16.float()).abs().max() < 0.05
    s = torch.linalg.svdvals(x32)
    assert 0.5 < s.min() and s.max() < 1.5  # near-orthogonal: singular values around 1
    assert newton_schulz_dtype("auto", "cpu") == torch.float32
    assert newton_schulz_dtype("bfloat16", "cpu") == torch.bfloat16


@pytest.mark.parametrize("native", [True, False], ids=["ampere+", "v100-t4"])
def test_newton_schulz_runs_in_bf16_only_on_native_bf16_gpus(monkeypatch, native):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    assert newton_schulz_dtype("auto", "cuda") == (torch.bfloat16 if native else torch.float32)


def test_a_vetoed_muon_step_changes_nothing_and_needs_no_host_sync():
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    oa, ob = Muon([a], ns_dtype=torch.float32, lr=0.02), Muon([b], ns_dtype=torch.float32, lr=0.02)
    g1, g2 = torch.randn_like(w), torch.randn_like(w)
    a.grad, b.grad = g1.clone(), g1.clone()
    oa.step(), ob.step()
    a.grad = torch.full_like(w, float("nan"))  # a diverged step on `a` only, vetoed on the device
    oa.found_inf = torch.ones(())
    oa.step()
    oa.found_inf = None
    a.grad, b.grad = g2.clone(), g2.clone()
    oa.step(), ob.step()
    torch.testing.assert_close(a, b, atol=0, rtol=0)  # as if the vetoed step never happened
    torch.testing.assert_close(oa.state[a]["momentum_buffer"], ob.state[b]["momentum_buffer"], atol=0, rtol=0)


def test_gradscaler_vetoes_an_overflowed_muon_step_on_the_device(monkeypatch):
    """fp16 (V100/T4): GradScaler hands Muon its overflow flag as `found_inf` instead of reading it on the
    host; an overflowed step changes neither weights nor momentum, a finite one is the plain step, and
    the momentum buffer is allocated once, not every step."""
    torch.manual_seed(0)
    w, g1, g2 = torch.randn(32, 16), torch.randn(32, 16), torch.randn(32, 16)
    a, b = w.clone().requires_grad_(), w.clone().requires_grad_()
    oa, ob = Muon([a], ns_dtype=torch.float32, lr=0.02), Muon([b], ns_dtype=torch.float32, lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("a host read in the scaled step"))
    for grad in (g1, torch.full_like(w, float("inf")), g2):
        a.grad = scaler.scale(grad)
        scaler.unscale_(oa)  # as the trainer does, for clipping
        scaler.step(oa)
        scaler.update()
    monkeypatch.undo()
    b.grad = g1.clone()
    ob.step()
    monkeypatch.setattr(torch, "zeros_like", lambda *x, **k: pytest.fail("a new momentum buffer"))
    b.grad = g2.clone()
    ob.step()
    monkeypatch.undo()
    assert scaler.get_scale() == 2.0  # the overflow halved the scale
    torch.testing.assert_close(a, b)  # as if the overflowed step never happened
    torch.testing.assert_close(oa.state[a]["momentum_buffer"], ob.state[b]["momentum_buffer"])


def test_combined_state_round_trips_and_refuses_an_adamw_state():
    model = GPT(model_preset("micro"))
    opt = build_optimizer(model, load_config("micro", MUON).optim, "cpu")
    x = torch.randint(0, 100, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    state = opt.state_dict()
    again = build_optimizer(model, load_config("micro", MUON).optim, "cpu")
    again.load_state_dict(state)
    assert isinstance(again, Combined) and len(again.optimizers[1].state) == len(opt.optimizers[1].state) > 0
    adamw_state = adamw(model.parameters(), OptimConfig(max_lr=1e-3), "cpu").state_dict()
    with pytest.raises(ValueError, match="optim.name=muon"):
        again.load_state_dict(adamw_state)


# --- real trainer processes --------------------------------------------------------------------------

def args(ds, run, *extra):
    return ddp_args(ds, run, *MUON, *extra)  # tests/test_ddp.py's small run, with the new recipe


@pytest.fixture(scope="module")
def reference(ds, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    proc = start(python_cmd(args(ds, tmp / "run")), tmp, tmp / "log")
    assert proc.wait(timeout=300) == 0, (tmp / "log").read_text()
    return tmp / "run"


@pytest.mark.slow
def test_muon_sigkill_then_same_command_resumes_exactly(ds, reference, tmp_path):
    run, cmd = tmp_path / "killed", python_cmd(args(ds, tmp_path / "killed"))
    proc = start(cmd, tmp_path, tmp_path / "log1")
    killed_at = wait_for_step(proc, run / "metrics.jsonl", 6)
    kill_tree(proc)
    assert killed_at < STEPS and R.latest_checkpoint(run) is not None
    proc = start(cmd, tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log2").read_text()
    assert "resuming from step_" in (tmp_path / "log2").read_text()
    assert_same_run(run, reference, 0.0)  # bit-exact: both optimizers' states came back from the checkpoint


@pytest.mark.slow
def test_muon_on_two_ranks_trains_the_one_rank_trajectory(ds, reference, tmp_path):
    run = tmp_path / "ddp"
    proc = start(torchrun_cmd(args(ds, run)), tmp_path, tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()
    assert "world=2 accum=2" in (tmp_path / "log").read_text()
    assert_same_run(run, reference, 1e-5)


@pytest.mark.slow
def test_the_guard_skips_and_rolls_back_with_muon(ds, tmp_path):
    run = tmp_path / "nan"
    r = subprocess.run(python_cmd(args(ds, run, "train.max_steps=16")), cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**env(), "GPTPIPE_TEST_FAULT": "nan@7"})
    assert r.returncode == 0, r.stderr
    ev = [row["event"] for row in read_metrics(run / "metrics.jsonl", "event")]
    assert len(ev) == 3 and "rolled back to step_00000004" in ev[2], ev
    assert (run / "DONE").is_file()
    assert all(math.isfinite(v) for v in losses(run / "metrics.jsonl").values())
