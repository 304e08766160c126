"""train.fp8 (gptcore/model/fp8.py) on CPU: the setting is validated, refused where float8 cannot train or
cannot pay (CPU, no compile, a card before Ada/Hopper), the filter picks the blocks' matmuls of every preset
and never the tied LM head, and an FP8 model's checkpoint is a bf16 model's: each loads the other's strictly
through the project's own checkpoint writer and loader (issue 68, the CPU parts of item 5)."""

from __future__ import annotations

import pytest
import torch

from gptcore.checkpoints import checkpoint as C
from gptcore.config import ModelConfig
from gptcore.model import fp8
from gptcore.model.gpt import GPT
from gptcore.overrides import load_config
from gptcore.presets import model_preset
from gptcore.security import ConfigError
from gptcore.training.train import main


def test_the_setting_is_validated_once_at_the_edge():
    assert load_config("micro", ["train.fp8=rowwise"]).train.fp8 == "rowwise"
    assert load_config("gpt2-1558m").train.fp8 == "off"  # default off for every preset
    with pytest.raises(ConfigError, match=r"train.fp8='float8'; use off, auto, tensorwise or rowwise"):
        load_config("micro", ["train.fp8=float8"])


@pytest.fixture
def card(monkeypatch):
    """A CUDA device as recipe_for sees it (name and compute capability), on this CPU machine."""
    def use(name: str, capability: tuple[int, int]):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        return torch.device("cuda", 0)
    return use


def test_it_is_refused_where_float8_cannot_train_or_pay(card, monkeypatch):
    cpu = torch.device("cpu")
    assert fp8.recipe_for("off", "gpt2-1558m", cpu, False) is None
    assert fp8.recipe_for("auto", "gpt2-1558m", cpu, False) is None  # no lease measured a gain: auto is off
    with pytest.raises(ConfigError, match="needs a CUDA GPU with float8 tensor cores .* this run is on cpu: "
                                          "use train.fp8=off"):
        fp8.recipe_for("tensorwise", "gpt2-1558m", cpu, False)
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no float8 "
                                          r"tensor cores \(needs 8.9\+"):
        fp8.recipe_for("rowwise", "gpt2-774m", card("NVIDIA A100-SXM4-80GB", (8, 0)), True)
    h100 = card("NVIDIA H100 80GB HBM3", (9, 0))
    with pytest.raises(ConfigError, match="needs train.compile=true .* eager float8 is slower than bf16"):
        fp8.recipe_for("tensorwise", "gpt2-1558m", h100, False)
    assert fp8.recipe_for("tensorwise", "gpt2-1558m", h100, True) == "tensorwise"
    assert fp8.recipe_for("rowwise", "gpt2-124m", card("NVIDIA L40S", (8, 9)), True) == "rowwise"
    monkeypatch.setattr(fp8, "find_spec", lambda name: None)  # a GPU image without torchao
    with pytest.raises(ConfigError, match=r"needs torchao: pip install torchao==0.18.0"):
        fp8.recipe_for("tensorwise", "gpt2-1558m", h100, True)


def test_auto_turns_on_only_where_a_lease_measured_a_gain(card, monkeypatch):
    h100 = card("NVIDIA H100 80GB HBM3", (9, 0))
    assert fp8.FP8_MEASURED_GAIN == {}  # none yet: filled from a lease's fp8 row, with its evidence
    monkeypatch.setitem(fp8.FP8_MEASURED_GAIN, "gpt2-1558m", "tensorwise")
    assert fp8.recipe_for("auto", "gpt2-1558m", h100, True) == "tensorwise"
    assert fp8.recipe_for("auto", "gpt2-124m", h100, True) is None


@pytest.mark.parametrize("preset, layers", [("gpt2", 12), ("gpt2-medium", 24), ("gpt2-large", 36), ("gpt2-xl", 48)])
def test_the_filter_converts_each_blocks_four_matmuls_and_never_the_tied_head(preset, layers):
    with torch.device("meta"):
        model = GPT(model_preset(preset))
    names = fp8.converted_layers(model)
    assert len(names) == 4 * layers
    assert {n.split(".", 3)[3] for n in names} == {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
    assert "lm_head" not in names
    # a width float8 matmuls do not take (40: not a multiple of 16) is left in bf16
    with torch.device("meta"):
        odd = GPT(ModelConfig(**{**vars(model_preset("micro")), "n_embd": 40, "n_head": 5}))
    assert fp8.converted_layers(odd) == []


def test_an_fp8_checkpoint_and_a_bf16_one_load_into_each_other(tmp_path):
    """Float8Linear keeps its weight as the Linear's own parameter: the state dict has the same keys, shapes
    and dtypes, so a run switched between train.fp8=tensorwise and off resumes from the other's checkpoint."""
    cfg = model_preset("micro")
    torch.manual_seed(0)
    plain = GPT(cfg)
    converted = GPT(cfg)
    converted.load_state_dict(plain.state_dict())
    names = fp8.convert(converted, "tensorwise")
    assert names and all(type(converted.get_submodule(n)).__name__ == "Float8Linear" for n in names)
    assert type(converted.lm_head).__name__ == "Linear"
    assert converted.lm_head.weight is converted.transformer.wte.weight  # the tie survives the swap
    a, b = plain.state_dict(), converted.state_dict()
    assert list(a) == list(b) and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    meta = {"run_name": "fp8-roundtrip"}
    ckpt = C.save_checkpoint(tmp_path / "fp8", 4, converted, {"step": 4}, meta)
    back, _ = C.load_model(ckpt)  # a bf16 model from the FP8 run's checkpoint
    assert all(torch.equal(back.state_dict()[k], a[k]) for k in a)
    with torch.no_grad():  # the other way: the bf16 run's checkpoint into a converted model
        for p in plain.parameters():
            p.add_(0.5)
    ckpt = C.save_checkpoint(tmp_path / "bf16", 8, plain, {"step": 8}, meta)
    C.load_weights(converted, ckpt / C.MODEL_FILE)
    assert all(torch.equal(converted.state_dict()[k], plain.state_dict()[k]) for k in a)


def test_the_trainer_refuses_fp8_on_cpu_at_start_up_with_exit_2(ds, tmp_path, capsys):
    run = tmp_path / "fp8-cpu"
    rc = main(["micro", f"data.dataset_dir={ds}", f"train.run_dir={run}", "train.micro_batch=2",
               "train.seq_len=32", "train.total_batch_tokens=128", "train.max_steps=2", "eval.eval_interval=0",
               "eval.sample_interval=0", "eval.val_tokens=128", "train.fp8=tensorwise"])
    assert rc == 2
    err = capsys.readouterr()
    assert "train.fp8=tensorwise needs a CUDA GPU" in err.out + err.err
    assert not run.exists()  # refused before anything is written
