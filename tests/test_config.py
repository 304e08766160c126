"""gptcore.config: presets, overrides (CLI strings and dicts), files, and errors that name the fix."""

import json
import math
import re
from dataclasses import asdict, replace

import pytest
import torch

from gptcore.config import ConfigError, ModelConfig, RunConfig
from gptcore.model.gpt import GPT
from gptcore.model.optim import build_optimizer, lr_at, set_lr
from gptcore.overrides import apply_overrides, from_dict, load_config
from gptcore.presets import model_preset, preset


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


GPT2_MODEL = {"block_size": 1024, "vocab_size": 50304, "n_layer": 12, "n_head": 12, "n_embd": 768,
              "dropout": 0.0, "bias": True}  # vocab: GPT-2's 50257 padded to a multiple of 64


def test_gpt2_124m_recipe_is_pinned():
    """build-nanogpt's recipe, number by number: an edit to the preset (or to the defaults it uses) fails
    here, not weeks into a run."""
    cfg = load_config("gpt2-124m")
    assert asdict(cfg.model) == GPT2_MODEL
    assert asdict(cfg.optim) == {
        "max_lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 715, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
        "eps": 1e-8, "grad_clip": 1.0, "name": "adamw", "schedule": "cosine", "decay_frac": 0.2,
        "muon_lr": 0.02, "muon_momentum": 0.95, "muon_weight_decay": 0.0, "muon_ns_dtype": "auto"}
    t = cfg.train
    # the micro-batch is chosen per device (gptcore/training/microbatch.py), up to build-nanogpt's 64 on an 80 GB card
    assert (t.total_batch_tokens, t.micro_batch, t.micro_batch_max, t.seq_len, t.max_steps, t.seed) == \
        (524_288, "auto", 64, 1024, 19_073, 1337)
    assert t.total_batch_tokens * t.max_steps == 9_999_745_024  # 524,288 * 19,073: ~10B tokens
    assert (cfg.data.source, cfg.data.hub.repo, cfg.data.hub.config) == ("hf", "HuggingFaceFW/fineweb-edu",
                                                                       "sample-10BT")

    # the schedule (gptcore.model.optim.lr_at, steps 0-based), by hand:
    #   warmup it < 715: 6e-4 * (it + 1) / 715  -> step 0: 6e-4/715 = 8.391608391608e-07; step 714: 6e-4
    #   cosine: 6e-5 + 0.5 * (1 + cos(pi * (it - 715) / (19073 - 715))) * (6e-4 - 6e-5), 19073-715 = 18358
    #     step 715: cos 0 = 1 -> 6e-4;  step 715 + 9179 = 9894: cos(pi/2) = 0 -> 6e-5 + 2.7e-4 = 3.3e-4
    #     last step 19072: 6e-5 + 5.4e-4 * sin^2(pi / (2*18358)) = 6e-5 + 3.9535e-12 = 6.000000395e-05
    #   from step 19073 (max_steps) on: min_lr 6e-5
    assert lr_at(0, cfg) == pytest.approx(8.391608391608e-07, rel=1e-12)
    assert lr_at(714, cfg) == pytest.approx(6e-4, rel=1e-12)
    assert lr_at(715, cfg) == pytest.approx(6e-4, rel=1e-12)
    assert lr_at(9894, cfg) == pytest.approx(3.3e-4, rel=1e-12)
    assert lr_at(19_072, cfg) == pytest.approx(6.000000395e-05, rel=1e-9)
    assert lr_at(19_073, cfg) == lr_at(30_000, cfg) == 6e-5

    # and the optimizer built from it (on the micro shape: the settings are the same for any model)
    opt = build_optimizer(GPT(model_preset("micro")), cfg.optim, "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [
        (6e-4, (0.9, 0.95), 1e-8, 0.1), (6e-4, (0.9, 0.95), 1e-8, 0.0)]  # no decay on biases / LayerNorms


def test_gpt2_124m_muon_recipe_is_pinned():
    """The Muon recipe as the preset has it (modded-nanogpt's first Muon records, docs/training.md)."""
    cfg = load_config("gpt2-124m-muon")
    assert cfg.preset == "gpt2-124m-muon" and asdict(cfg.model) == GPT2_MODEL
    assert asdict(cfg.optim) == {
        "max_lr": 0.0036, "min_lr": 0.0, "warmup_steps": 250, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.95,
        "eps": 1e-8, "grad_clip": 1.0, "name": "muon", "schedule": "wsd", "decay_frac": 0.3,
        "muon_lr": 0.02, "muon_momentum": 0.95, "muon_weight_decay": 0.0, "muon_ns_dtype": "auto"}
    t = cfg.train
    assert (t.total_batch_tokens, t.micro_batch, t.micro_batch_max, t.seq_len, t.max_steps, t.seed) == \
        (524_288, "auto", 64, 1024, 9_537, 1337)
    assert t.total_batch_tokens * t.max_steps == 5_000_134_656  # 524,288 * 9,537: ~5.0B tokens

    # warmup-stable-decay, by hand: decay_steps = round(0.3 * 9537) = round(2861.1) = 2861, from 9537 - 2861 = 6676
    #   warmup it < 250: 0.0036 * (it + 1) / 250 -> step 0: 1.44e-05; step 249: 0.0036
    #   stable 250 .. 6676: 0.0036 (step 6676 is decay step 0)
    #   decay: 0.0036 * (1 - (it - 6676) / 2861) -> step 8106: 0.0036 * 1431/2861 = 0.0018006291506466
    #     last step 9536: 0.0036 / 2861 = 1.258301293254e-06;  from 9537 on: min_lr 0
    assert lr_at(0, cfg) == pytest.approx(1.44e-05, rel=1e-12)
    assert lr_at(249, cfg) == pytest.approx(0.0036, rel=1e-12)
    assert lr_at(250, cfg) == lr_at(6675, cfg) == lr_at(6676, cfg) == 0.0036
    assert lr_at(8106, cfg) == pytest.approx(0.0018006291506466, rel=1e-12)
    assert lr_at(9536, cfg) == pytest.approx(1.258301293254e-06, rel=1e-12)
    assert lr_at(9537, cfg) == 0.0

    # the optimizer: AdamW (no decay) on the rest, Muon at 0.02 following the same schedule scaled by 0.02/0.0036
    opt = build_optimizer(GPT(model_preset("micro")), cfg.optim, "cpu")
    adam, muon = opt.optimizers
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in adam.param_groups] == [
        (0.0036, (0.9, 0.95), 0.0), (0.0036, (0.9, 0.95), 0.0)]
    (mg,) = muon.param_groups
    assert (mg["lr"], mg["momentum"], mg["weight_decay"], mg["nesterov"]) == (0.02, 0.95, 0.0, True)
    set_lr(opt, lr_at(8106, cfg))
    assert mg["lr"] == pytest.approx(0.02 * 1431 / 2861, rel=1e-12)  # 0.0100034952813701
    assert math.isclose(adam.param_groups[0]["lr"], 0.0018006291506466, rel_tol=1e-12)


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


def test_the_hub_source_has_its_own_section_and_old_keys_still_read():
    """data.hub.* is the "hf" source kind's section (3-level keys, from the CLI, Prefect's nested dicts and
    saved configs); the flat data.hf_* keys of earlier checkpoints and deployments still read, for a release."""
    cfg = load_config("micro", ["data.source=hf", "data.hub.repo=me/corpus", "data.hub.revision=abc"])
    assert (cfg.data.hub.repo, cfg.data.hub.revision, cfg.data.hub.split) == ("me/corpus", "abc", "train")
    assert load_config("micro", {"data": {"hub": {"config": "en"}}}).data.hub.config == "en"
    saved = cfg.to_dict()
    assert saved["data"]["hub"]["repo"] == "me/corpus" and from_dict(saved).data.hub == cfg.data.hub
    old = {**saved, "data": {**{k: v for k, v in saved["data"].items() if k != "hub"}, "hf_repo": "old/one",
                             "hf_split": "validation"}}
    assert (from_dict(old).data.hub.repo, from_dict(old).data.hub.split) == ("old/one", "validation")
    for bad in ("data.hub.nope=1", "data.hub=x", "data.text_column.x=1"):
        with pytest.raises(ConfigError, match="unknown config key"):
            load_config("micro", [bad])


def test_each_evaluation_owns_its_section_and_the_flat_keys_of_old_configs_still_read():
    """eval.<name>.<field> is the evaluation's own Settings (gptcore/evals registers the types): typed,
    checked, written whole into a saved config; the flat eval.* keys of earlier configs land in the sections."""
    import gptcore.evals  # noqa: F401 -- registers the evaluations' sections (a data stage's process need not)

    cfg = load_config("gpt2-124m", {"eval": {"hellaswag": {"limit": "50"}, "harness": {"dtype": "autocast"}}})
    assert (cfg.eval.options("hellaswag").limit, cfg.eval.options("harness").dtype) == (50, "autocast")
    assert cfg.eval.options("harness").task_list[:2] == ["arc_easy", "arc_challenge"]  # the preset's
    saved = cfg.to_dict()["eval"]
    assert saved["hellaswag"] == {"enabled": True, "interval": 1000, "path": "", "limit": 50,
                                  "exclude_contaminated": False} and saved["contamination"] == {"ngram": 13}
    old = {"preset": "micro", "eval": {"eval_interval": 10, "hellaswag": True, "hellaswag_limit": 7,
                                       "hellaswag_interval": 3, "exclude_contaminated": True,
                                       "harness_tasks": "piqa", "harness_limit": 4, "harness_dtype": "autocast",
                                       "contamination_ngram": 8}}
    e = from_dict(old).validate().eval
    assert (e.options("hellaswag").enabled, e.options("hellaswag").limit, e.options("hellaswag").interval) == \
        (True, 7, 3)
    assert e.options("hellaswag").exclude_contaminated and e.options("contamination").ngram == 8
    assert (e.options("harness").task_list, e.options("harness").limit, e.options("harness").dtype) == \
        (["piqa"], 4, "autocast")
    assert load_config("micro", ["eval.hellaswag_path=/x.jsonl"]).eval.options("hellaswag").path == "/x.jsonl"
    for bad, message in (("eval.hellaswag.limit=-1", "eval.hellaswag.interval and eval.hellaswag.limit must be"),
                         ("eval.contamination.ngram=-2", "eval.contamination.ngram must be >= 0"),
                         ("eval.harness.tasks.x=1", "eval.<name>.<field>"),
                         ("eval.hellaswagg.limit=1", "no evaluation named 'hellaswagg'"),
                         ("eval.limit=1",
                          r"eval.<evaluation>.<field> for \['bpb', 'contamination', 'harness', 'hellaswag'")):
        with pytest.raises(ConfigError, match=message):
            load_config("micro", [bad])


def test_an_evaluations_validation_part_depends_on_the_tokens_it_covers():
    """eval.json's "val" settings: the tokens the validation loss covers, so the trainer's own evaluation
    (micro_batch=auto replaced by its choice, e.g. 16) and the flow's (auto read as micro_batch_max, 64)
    agree, and the flow does not evaluate the validation loss of a nightly checkpoint a second time."""
    from gptcore.evals.record import eval_settings

    auto, chosen = load_config("gpt2-124m"), load_config("gpt2-124m", ["train.micro_batch=16"])
    assert auto.train.micro_batch == "auto" and auto.train.resolved_micro_batch() == 64
    assert eval_settings(auto, True)["val"] == eval_settings(chosen, True)["val"] == \
        {"tokens": 10 * 2**20, "seq_len": 1024}
    fewer = load_config("gpt2-124m", ["eval.val_tokens=1000000"])
    assert eval_settings(fewer, True)["val"]["tokens"] == 15 * 64 * 1024  # whole batches only
    assert eval_settings(fewer, False)["val"] is None


def test_a_recorded_model_config_is_checked_before_anything_is_built():
    """meta.json's model_config (a checkpoint's, a registered version's) passes the model section's checks
    plus caps that allow gpt2-xl but refuse shapes that would exhaust a worker's memory; all from the numbers,
    nothing allocated (the caps' parameter count is GPT's own)."""
    from gptcore.config import MAX_PARAMS, model_config_from
    from gptcore.presets import MODEL_PRESETS

    for name, shape in MODEL_PRESETS.items():
        assert model_config_from(asdict(shape)) == shape, name
    micro = MODEL_PRESETS["micro"]
    assert micro.approx_params() == GPT(micro).num_params()
    bare = replace(micro, bias=False)  # bias-free shapes count exactly too (the FLOP count uses it)
    assert bare.approx_params() == GPT(bare).num_params()
    bad = {"n_layer": (0, "model.n_layer must be positive, got 0"),
           "n_head": (True, "model.n_head must be an integer, got True"),
           "n_embd": ("768", "model.n_embd must be an integer, got '768'"),
           "block_size": (10 ** 9, "model.block_size=1,000,000,000 is over this pipeline's limit of 32,768"),
           "vocab_size": (2 ** 40, "model.vocab_size=1,099,511,627,776 is over")}
    for key, (value, message) in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            model_config_from({**asdict(micro), key: value})
    # every field within its cap, the whole far over: 128 layers 8192 wide is ~103B parameters
    big = {**asdict(micro), "n_layer": 128, "n_head": 64, "n_embd": 8192}
    with pytest.raises(ConfigError, match=rf"about 103\.\dB parameters, over this pipeline's limit of "
                                          rf"{MAX_PARAMS / 1e9:.1f}B"):
        model_config_from(big)
    with pytest.raises(ConfigError, match=r"unknown fields \['evil'\]"):
        model_config_from({**asdict(micro), "evil": 1})
    with pytest.raises(ConfigError, match="must be an object"):
        model_config_from(None)


def test_the_flows_resolved_config_is_what_the_trainer_loads():
    """One config handoff: the flow resolves preset + overrides once; the train task writes that config to
    the file the trainers load (tasks.train.launch_config) and every other stage takes cfg.to_dict()
    (gptcore.overrides.as_config). Both give back the same config, the same run identity."""
    from gptcore.overrides import as_config
    from tasks.train import launch_config

    cfg = load_config("tiny-cpu", {"train.max_steps": 70, "optim.max_lr": 1e-3, "eval.harness.tasks": "arc_easy",
                                   "train.run_name": "handoff"})
    with launch_config(cfg) as path:
        loaded = load_config(str(path), world_size=1)
    assert loaded.to_dict() == cfg.to_dict() and loaded.identity_hash() == cfg.identity_hash()
    assert not path.exists()  # the launch file goes with its launch
    assert as_config(cfg.to_dict()).to_dict() == cfg.to_dict()
