"""gptcore.config: presets, overrides (CLI strings and dicts), files, and errors that name the fix."""

import json

import pytest

from gptcore.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    apply_overrides,
    from_dict,
    load_config,
    model_preset,
    preset,
)


def test_presets_validate_and_have_the_documented_shapes():
    for name in ("gpt2-124m", "tiny-cpu", "micro"):
        cfg = load_config(name)
        assert cfg.preset == name and cfg.run_name == name
    big = load_config("gpt2-124m")
    m = big.model
    assert (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size) == (12, 12, 768, 50304, 1024)
    assert big.train.total_batch_tokens == 524_288 and big.grad_accum_steps(1) == 8
    assert big.grad_accum_steps(8) == 1
    assert model_preset("gpt2") is not model_preset("gpt2")  # copies: editing one never leaks


def test_unknown_preset():
    with pytest.raises(ConfigError, match=r"unknown preset 'gpt5'.*gpt2-124m.*\.toml"):
        load_config("gpt5")
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        model_preset("huge")


def test_n_embd_not_divisible_by_n_head():
    with pytest.raises(ConfigError, match=r"model.n_embd=33 is not divisible by model.n_head=2"):
        load_config("micro", ["model.n_embd=33"])
    with pytest.raises(ConfigError, match="not divisible"):
        ModelConfig(n_embd=100, n_head=3).validate()


def test_zero_heads_is_a_config_error():
    # n_head is checked positive before n_embd % n_head divides by it (was a ZeroDivisionError)
    with pytest.raises(ConfigError, match="model.n_head must be positive, got 0"):
        load_config("micro", ["model.n_head=0"])


def test_total_batch_must_divide_into_micro_batches():
    with pytest.raises(ConfigError, match=r"total_batch_tokens=300 is not divisible by .*4\*32\*1 = 128"):
        load_config("micro", ["train.total_batch_tokens=300"])
    # 256 tokens = 2 micro-steps on one rank, but not splittable over 3 ranks
    assert load_config("micro").grad_accum_steps(1) == 2
    with pytest.raises(ConfigError, match=r"world_size = 4\*32\*3 = 384.*adjust"):
        load_config("micro", world_size=3)


@pytest.mark.parametrize("override, pattern", [
    ("model.n_layr=3", r"unknown config key 'model.n_layr'; model has \[.*'n_layer'"),
    ("modle.n_layer=3", r"unknown config key 'modle.n_layer'; keys look like section.name"),
    ("n_layer=3", "unknown config key 'n_layer'"),
    ("model.n_layer", "not of the form section.key=value"),
    ("model.n_layer=three", r"model.n_layer='three' is not a valid int"),
    ("model.dropout=lots", "model.dropout='lots' is not a valid float"),
    ("model.bias=maybe", "model.bias='maybe' is not a valid bool"),
    ("train.device=tpu", "train.device='tpu'; use auto, cpu or cuda"),
    ("train.seq_len=128", "train.seq_len=128 exceeds model.block_size=64"),
    ("preset=tiny-cpu", "'preset' cannot be overridden"),
])
def test_bad_overrides(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("micro", [override])


def test_overrides_from_cli_strings_and_dicts():
    cli = load_config("micro", ["model.n_layer=3", "model.dropout=0.1", "model.bias=false",
                                "train.max_steps=1_000", "optim.max_lr=2e-3", "train.run_name=exp"])
    assert (cli.model.n_layer, cli.model.dropout, cli.model.bias) == (3, 0.1, False)
    assert cli.train.max_steps == 1000 and cli.optim.max_lr == 2e-3 and cli.run_name == "exp"
    assert isinstance(cli.optim.max_lr, float) and isinstance(cli.train.max_steps, int)
    flat = load_config("micro", {"model.n_layer": 3, "optim.max_lr": 2e-3, "model.bias": False})
    nested = load_config("micro", {"model": {"n_layer": 3, "bias": False}, "optim": {"max_lr": 2e-3}})
    assert flat.to_dict() == nested.to_dict()
    assert flat.model.n_layer == cli.model.n_layer == 3
    with pytest.raises(ConfigError, match="model.n_layer=True is not a valid int"):
        load_config("micro", {"model.n_layer": True})
    with pytest.raises(ConfigError, match="unknown config key 'model.depth'"):
        load_config("micro", {"model": {"depth": 3}})


def test_toml_and_json_files(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('preset = "micro"\n[model]\nn_layer = 3\n[train]\nmax_steps = 7\nrun_name = "from-file"\n'
                 '[optim]\nmax_lr = 1\n')
    cfg = load_config(str(f), ["train.max_steps=9"])  # CLI overrides win over the file
    assert cfg.preset == "micro" and cfg.model.n_layer == 3 and cfg.train.max_steps == 9
    assert cfg.run_name == "from-file" and cfg.optim.max_lr == 1.0 and isinstance(cfg.optim.max_lr, float)
    assert cfg.model.n_embd == preset("micro").model.n_embd  # the rest comes from the preset

    j = tmp_path / "run.json"
    j.write_text(json.dumps({"preset": "tiny-cpu", "model": {"n_layer": 2}}))
    assert load_config(str(j)).model.n_layer == 2

    bad = tmp_path / "bad.toml"
    bad.write_text('preset = "micro"\n[model]\nwidth = 3\n')
    with pytest.raises(ConfigError, match="unknown config key 'model.width'"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))
    (tmp_path / "p.toml").write_text('preset = "nope"\n')
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        load_config(str(tmp_path / "p.toml"))


def test_round_trip_and_identity_hash():
    cfg = load_config("micro", ["model.n_layer=3"])
    again = from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert isinstance(again, RunConfig) and again.to_dict() == cfg.to_dict()
    assert again.identity_hash() == cfg.identity_hash()
    # budget/device/cadence do not change a run's identity; the trajectory-defining fields do
    same = apply_overrides(from_dict(cfg.to_dict()), ["train.device=cpu", "train.max_minutes=5",
                                                      "eval.eval_interval=3"])
    assert same.identity_hash() == cfg.identity_hash()
    for ov in ("model.n_layer=4", "train.seed=1", "optim.max_lr=1e-2", "train.max_steps=21"):
        assert apply_overrides(from_dict(cfg.to_dict()), [ov]).identity_hash() != cfg.identity_hash(), ov
