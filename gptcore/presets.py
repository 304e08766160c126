"""The named configurations: the GPT-2 model shapes (MODEL_PRESETS) and the run presets (PRESETS), each
with its recipe's source. `load_config` (gptcore/overrides.py) starts from one of them.

    gpt2-124m        build-nanogpt's GPT-2 124M on FineWeb-Edu 10B (the reference)
    gpt2-124m-muon   the same model with Muon + a warmup-stable-decay schedule, half the tokens
    gpt2-350m/774m/1558m   llm.c's recipes for GPT-2 medium, large and xl
    tiny-cpu, micro  small shapes that train on a CPU: the demo's and the tests'
"""

from __future__ import annotations

from dataclasses import replace

from gptcore.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)

# The four OpenAI GPT-2 sizes plus small shapes that train on a CPU in seconds to minutes.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "gpt2": ModelConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": ModelConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": ModelConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": ModelConfig(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "tiny-cpu": ModelConfig(block_size=256, n_layer=4, n_head=4, n_embd=128),
    "micro": ModelConfig(block_size=64, n_layer=2, n_head=2, n_embd=32),  # tests
}


def model_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return replace(MODEL_PRESETS[name])


def _gpt2_124m() -> RunConfig:
    # build-nanogpt's recipe: 0.5M-token batches, 6e-4 cosine to 6e-5, 715 warmup, 19,073 steps ~ 10B tokens.
    # micro_batch auto: 64 (build-nanogpt's, for an 80 GB card) where it fits, less on smaller cards
    # the harness's share of the suite GPT-2 reproductions report (HellaSwag is the project's own scorer)
    return RunConfig(preset="gpt2-124m", model=model_preset("gpt2"), data=DataConfig(source="hf"),
                     train=TrainConfig(micro_batch="auto"),
                     eval=EvalConfig(sections={
                         "harness": {"tasks": "arc_easy,arc_challenge,piqa,winogrande,lambada_openai"},
                         "contamination": {"ngram": 13}}))


def _gpt2_124m_muon() -> RunConfig:
    # The same GPT-2 and data with Muon + warmup-stable-decay at half the token budget (~5.0B tokens).
    # Values from modded-nanogpt's first Muon records (Oct 2024; sources in docs/training.md "Recipes").
    cfg = _gpt2_124m()
    cfg.preset = "gpt2-124m-muon"
    cfg.optim = OptimConfig(name="muon", schedule="wsd", max_lr=0.0036, min_lr=0.0, warmup_steps=250,
                            decay_frac=0.3, weight_decay=0.0, muon_lr=0.02, muon_momentum=0.95,
                            muon_weight_decay=0.0)
    cfg.train.max_steps = 9_537  # 5.0B tokens at 0.5M tokens/step
    return cfg


def _gpt2_family(preset: str, model: str, micro_batch_max: int, total_batch_tokens: int, max_lr: float,
                 min_lr: float, max_steps: int) -> RunConfig:
    # The larger GPT-2s as llm.c trained them (karpathy/llm.c scripts/run_gpt2_{350M,774M,1558M}.sh): AdamW
    # (0.9, 0.95), weight decay 0.1, clip 1.0, cosine after 700 warmup steps, FineWeb-Edu's 100B-token sample
    # (their runs take 31-150B tokens). micro_batch auto, at most llm.c's per-GPU size on an 80 GB card.
    cfg = _gpt2_124m()
    cfg.preset, cfg.model = preset, model_preset(model)
    cfg.data.hub.config = "sample-100BT"
    cfg.optim = OptimConfig(max_lr=max_lr, min_lr=min_lr, warmup_steps=700, weight_decay=0.1)
    cfg.train = TrainConfig(micro_batch="auto", micro_batch_max=micro_batch_max,
                            total_batch_tokens=total_batch_tokens, max_steps=max_steps)
    return cfg


def _gpt2_350m() -> RunConfig:  # llm.c: -b 64 -d 524288 -l 3e-4 -q 0.0 -x 60000 (31.5B tokens)
    return _gpt2_family("gpt2-350m", "gpt2-medium", 64, 524_288, 3e-4, 0.0, 60_000)


def _gpt2_774m() -> RunConfig:  # llm.c: -b 32 -d 524288 -l 2.5e-4 -q 0.0 -x 286102 (150B tokens)
    return _gpt2_family("gpt2-774m", "gpt2-large", 32, 524_288, 2.5e-4, 0.0, 286_102)


def _gpt2_1558m() -> RunConfig:  # llm.c: -b 16 -d 1048576 -l 6e-4 -q 0.1 -x 32000 (33.6B tokens)
    return _gpt2_family("gpt2-1558m", "gpt2-xl", 16, 1_048_576, 6e-4, 6e-5, 32_000)


def _tiny_cpu() -> RunConfig:
    # Learns visibly on a 2-core CPU in a few minutes on the built-in corpus: the demo's recipe (the `tiny`
    # deployment runs it as is), 120 steps of 2,048 tokens, so the whole demo stays well under 10 minutes.
    return RunConfig(
        preset="tiny-cpu", model=model_preset("tiny-cpu"),
        # 100K-token shards: the val split (shard 0) is 100K tokens and ~1.46M are left to train on
        data=DataConfig(source="builtin", shard_tokens=100_000),
        optim=OptimConfig(max_lr=3e-3, min_lr=3e-4, warmup_steps=10, weight_decay=0.1),
        train=TrainConfig(total_batch_tokens=8 * 256, micro_batch=8, seq_len=256, max_steps=120,
                          checkpoint_interval=40, keep_last=2, log_interval=10),
        # HellaSwag (200 examples) only on the final checkpoint: it costs more than the rest of an eval
        eval=EvalConfig(eval_interval=60, val_tokens=64 * 256, sample_interval=60, sample_tokens=48,
                        sections={"hellaswag": {"interval": 0, "limit": 200}}))


def _micro() -> RunConfig:
    # For tests: a model that does a step in milliseconds.
    return RunConfig(
        preset="micro", model=model_preset("micro"),
        data=DataConfig(source="builtin", shard_tokens=100_000),
        optim=OptimConfig(max_lr=1e-3, min_lr=1e-4, warmup_steps=2),
        train=TrainConfig(total_batch_tokens=8 * 32, micro_batch=4, seq_len=32, max_steps=20,
                          checkpoint_interval=5, keep_last=2, log_interval=1),
        eval=EvalConfig(eval_interval=10, val_tokens=8 * 32, sample_interval=10, sample_tokens=8,
                        sections={"hellaswag": {"enabled": False}}))


PRESETS = {"gpt2-124m": _gpt2_124m, "gpt2-124m-muon": _gpt2_124m_muon, "gpt2-350m": _gpt2_350m,
           "gpt2-774m": _gpt2_774m, "gpt2-1558m": _gpt2_1558m, "tiny-cpu": _tiny_cpu, "micro": _micro}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} or pass a .toml/.json file")
    return PRESETS[name]()
