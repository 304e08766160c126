"""The pipeline's settings: one typed dataclass per section (model, data, optim, train, eval and each
evaluation's own section, guard) in one `RunConfig`, each with its checks, and the cross-field rules,
validated once at the edge (before any work starts). Everything downstream receives a validated
`RunConfig` and trusts it. The named presets are gptcore/presets.py; a config from a preset, a TOML/JSON
file and `section.key=value` overrides is gptcore/overrides.py (`load_config`).
"""

from __future__ import annotations

import hashlib
import json
import typing
from dataclasses import asdict, dataclass, field, fields

from gptcore.coerce import coerce

# ConfigError is the security checks' error too, so it lives below this module (no import circle)
from gptcore.security import NAME_KEYS, ConfigError, check_name

# Caps on a model's shape: gpt2-xl (48 layers, 25 heads, 1600 wide, 1.6B parameters) and room around it,
# but nothing that would exhaust a worker's memory while the model is being built (checked before that)
MODEL_LIMITS = {"block_size": 32_768, "vocab_size": 262_144, "n_layer": 128, "n_head": 128, "n_embd": 8_192}
MAX_PARAMS = 2_500_000_000  # 10 GB of fp32 weights


@dataclass
class ModelConfig:
    block_size: int = 1024  # max sequence length (learned position embeddings)
    vocab_size: int = 50304  # 50257 padded up to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in Linear and LayerNorm

    def validate(self) -> None:
        """Also the check a checkpoint's or a registered version's model_config passes before GPT allocates
        anything: a meta.json is data someone else may have written, so absurd shapes are refused here."""
        for name, cap in MODEL_LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"model.{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ConfigError(f"model.{name} must be positive, got {value}")
            if value > cap:
                raise ConfigError(f"model.{name}={value:,} is over this pipeline's limit of {cap:,}; use a smaller "
                                  "shape (gpt2-xl fits well within the limits)")
        if self.n_embd % self.n_head != 0:  # n_head > 0 checked above
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head (e.g. 768 with 12 heads)")
        if self.vocab_size < 50257:
            raise ConfigError(f"model.vocab_size={self.vocab_size} is smaller than the GPT-2 vocabulary "
                              "(50257); use 50257 or the padded 50304")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.approx_params() > MAX_PARAMS:
            raise ConfigError(f"model: n_layer={self.n_layer}, n_embd={self.n_embd}, vocab_size={self.vocab_size}, "
                              f"block_size={self.block_size} make about {self.approx_params() / 1e9:.1f}B parameters, "
                              f"over this pipeline's limit of {MAX_PARAMS / 1e9:.1f}B (gpt2-xl has 1.6B); use a "
                              "smaller shape")

    def approx_params(self) -> int:
        """gptcore.model.gpt.GPT's parameter count from the shape alone (tied embedding once), nothing allocated:
        per block 12 n^2 of matmul weights, and 13 n of biases and LayerNorms (2 n of LayerNorm weights only
        without biases)."""
        n, per_vector = self.n_embd, 2 if self.bias else 1  # a LayerNorm's weight (and bias)
        vectors = 13 * n if self.bias else 2 * n
        return (self.vocab_size + self.block_size) * n + self.n_layer * (12 * n * n + vectors) + per_vector * n


def model_config_from(d) -> ModelConfig:
    """A checkpoint's or registered version's recorded model_config (meta.json), checked like a config's
    model section; ConfigError naming what is wrong."""
    if not isinstance(d, dict):
        raise ConfigError(f"model_config must be an object of ModelConfig fields, got {type(d).__name__}")
    unknown = sorted(set(d) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise ConfigError(f"model_config has unknown fields {unknown}")
    cfg = ModelConfig(**d)
    cfg.validate()
    return cfg


@dataclass
class HubConfig:
    """The "hf" source kind's section, data.hub.* (gptcore/data/source_hub.py reads and checks it)."""
    repo: str = "HuggingFaceFW/fineweb-edu"
    config: str = "sample-10BT"  # "" = the dataset's default config
    split: str = "train"  # only this split is tokenized (the val shard is held out of it)
    revision: str = "main"  # a branch, tag or commit sha; the listing and manifest record the sha it resolved to


@dataclass
class DataConfig:
    # Where text comes from: "builtin" (the small offline corpus), "hf" (a Hugging Face hub dataset),
    # or a local directory / glob of parquet, jsonl or txt files (gptcore/data/sources.py: SOURCE_KINDS).
    source: str = "builtin"
    hub: HubConfig = field(default_factory=HubConfig)  # data.source=hf: which dataset, config, split, revision
    text_column: str = "text"
    shard_tokens: int = 100_000_000  # tokens per shard file (llm.c layout, uint16)
    dataset_name: str = ""  # shard directory name under <home>/shards; "" = derived from the source
    max_docs: int = 0  # 0 = all documents (useful to cap a hub download for a smoke run)
    num_workers: int = 0  # tokenize processes; 0 = one per core
    dataset_dir: str = ""  # train on this shard directory; "" = gptcore.data.location.dataset_dir(cfg)
    piece_bytes: int = 32_000_000  # source text per tokenize piece (unit of parallel work and of resume)
    strict_utf8: bool = False  # .txt sources: fail on invalid UTF-8 instead of replacing it (and warning)

    def validate(self) -> None:
        if self.shard_tokens < 1024:
            raise ConfigError(f"data.shard_tokens={self.shard_tokens} is too small; use >= 1024")
        if self.piece_bytes < 1 or self.num_workers < 0 or self.max_docs < 0:
            raise ConfigError("data.piece_bytes must be >= 1, data.num_workers and data.max_docs >= 0")
        if not self.source:
            raise ConfigError("data.source is empty; use 'builtin', 'hf', or a local path/glob")
        # each source kind checks its own settings (gptcore/data/sources.py: SourceKind.validate)


@dataclass
class OptimConfig:
    max_lr: float = 6e-4  # with name=muon: the AdamW part's (embeddings, biases, LayerNorms)
    min_lr: float = 6e-5
    warmup_steps: int = 715
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    name: str = "adamw"  # adamw | muon (Muon for the blocks' 2-D weights, AdamW for the rest: gptcore/model/optim.py)
    schedule: str = "cosine"  # cosine (build-nanogpt) | wsd (warmup, constant, linear decay to min_lr)
    decay_frac: float = 0.2  # wsd: the last fraction of max_steps decays linearly
    muon_lr: float = 0.02  # peak lr of the Muon part; follows the same schedule (scaled by muon_lr/max_lr)
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_ns_dtype: str = "auto"  # Newton-Schulz precision: auto = bf16 on native-bf16 GPUs, else fp32

    def validate(self) -> None:
        if not 0 <= self.min_lr <= self.max_lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be in [0, optim.max_lr={self.max_lr}]")
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps must be >= 0")
        if self.name not in ("adamw", "muon"):
            raise ConfigError(f"optim.name={self.name!r}: choose adamw or muon")
        if self.schedule not in ("cosine", "wsd"):
            raise ConfigError(f"optim.schedule={self.schedule!r}: choose cosine or wsd")
        if not 0 < self.decay_frac <= 1:
            raise ConfigError(f"optim.decay_frac={self.decay_frac} must be in (0, 1]")
        if self.name == "muon" and self.max_lr <= 0:
            raise ConfigError("optim.max_lr must be > 0 with optim.name=muon (the Muon part's schedule is "
                              "optim.muon_lr scaled by lr / max_lr)")
        if self.muon_lr <= 0 or not 0 <= self.muon_momentum < 1 or self.muon_weight_decay < 0:
            raise ConfigError("optim.muon_lr must be > 0, optim.muon_momentum in [0, 1), "
                              "optim.muon_weight_decay >= 0")
        if self.muon_ns_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"optim.muon_ns_dtype={self.muon_ns_dtype!r}: choose auto, float32 or bfloat16")

    def identity(self) -> dict:
        """The fields that shape the trajectory: a recipe's own settings only when it is chosen, so that
        runs of the default recipe keep the identity they had before these settings existed."""
        d = asdict(self)
        d.pop("muon_ns_dtype")  # precision, like train.dtype: may differ between invocations (GPU, CPU)
        if self.name == "adamw":
            for k in ("name", "muon_lr", "muon_momentum", "muon_weight_decay"):
                d.pop(k)
        if self.schedule == "cosine":
            d.pop("schedule"), d.pop("decay_frac")
        return d


@dataclass
class TrainConfig:
    run_name: str = ""  # the run's stable identity; "" = the preset name
    total_batch_tokens: int = 524_288  # tokens per optimizer step, across all ranks and micro-steps
    # B: sequences per rank per micro-step, or "auto": the largest that fits the device, at most
    # micro_batch_max (gptcore/training/microbatch.py; the GPU presets' default)
    micro_batch: int | str = 64
    micro_batch_max: int = 64
    seq_len: int = 1024  # T: tokens per sequence (<= model.block_size)
    max_steps: int = 19_073  # ~10B tokens at 0.5M tokens/step
    seed: int = 1337
    max_minutes: float = 0.0  # time budget for this invocation (nightly runs); 0 = unlimited
    checkpoint_interval: int = 1000
    keep_last: int = 3  # checkpoints kept besides the best-by-val-loss one
    async_checkpoint: bool = True  # ranks wait only for the copy off the device; rank 0 writes in the background
    log_interval: int = 10  # steps between host reads of the step stats (console line; metrics rows are per step)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on capable GPUs, fp16 on older, fp32 on CPU) | float32 | bfloat16 | float16
    compile: str = "auto"  # auto (on for CUDA) | true | false
    loss: str = "auto"  # auto (fused on CPU, plain on CUDA) | fused | plain: gptcore/model/loss.py
    ddp_bf16_grads: bool = False  # DDP all-reduces gradients in bf16 (halves traffic across nodes)
    # how the model spreads over the ranks (gptcore/training/parallel.py): ddp (a whole replica per rank),
    # fsdp (FSDP2: each rank a shard of weights, gradients and optimizer state; HSDP across nodes), or auto
    # (DDP while the weights and their AdamW state fit a rank comfortably, FSDP2 otherwise)
    parallel: str = "auto"
    # recompute activations in backward instead of keeping them (gptcore/model/recompute.py): none, selective
    # (keep the matmul and attention outputs, recompute the cheap ops between them) or full (every block)
    activation_checkpointing: str = "none"
    # float8 matmuls in the transformer blocks (gptcore/model/fp8.py, torchao): off, tensorwise, rowwise, or
    # auto (on only for a preset where a lease measured a gain); CUDA with compute capability 8.9+ and compile
    fp8: str = "off"
    run_dir: str = ""  # where the run lives; "" = <home>/runs/<run_name>
    system_metrics_interval: float = 10.0  # s between MLflow system-metric samples (CPU, memory, GPU); 0 = off
    # a rank with no step, evaluation or checkpoint progress this long writes its stacks and exits (5), for
    # torchrun to restart the job from its newest checkpoint (gptcore/training/watchdog.py); 0 = derived from the
    # run's median step time (5-20 min). Set it above your longest evaluation.
    hang_timeout_s: float = 0.0
    max_restarts: int = 1  # torchrun restarts of every rank after one fails (a hang, a crash), per launch
    # torch.profiler on every rank for this many steps after each launch's first (0 = off); `touch
    # <run_dir>/PROFILE` asks for one while the run trains (gptcore/training/profiling.py)
    profile_steps: int = 0
    # $ per GPU-hour: the run's cost so far and projected (train/cost_usd, gptcore/training/cost.py); 0 = off
    price_per_gpu_hour: float = 0.0

    def resolved_micro_batch(self) -> int:
        """micro_batch, or for "auto" before a trainer chose (an evaluation outside training) micro_batch_max.
        The trainer replaces "auto" by its choice in its own config."""
        return self.micro_batch_max if self.micro_batch == "auto" else int(self.micro_batch)

    def validate(self) -> None:
        choices = {"device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16", "float16"),
                   "compile": ("auto", "true", "false"), "loss": ("auto", "fused", "plain"),
                   "parallel": ("auto", "ddp", "fsdp"), "activation_checkpointing": ("none", "selective", "full"),
                   "fp8": ("off", "auto", "tensorwise", "rowwise")}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:  # e.g. "train.loss='x'; use auto, fused or plain"
                raise ConfigError(f"train.{name}={value!r}; use {', '.join(allowed[:-1])} or {allowed[-1]}")
        if self.micro_batch != "auto" and not (isinstance(self.micro_batch, int) and self.micro_batch > 0):
            raise ConfigError(f"train.micro_batch must be a positive number of sequences or auto, got "
                              f"{self.micro_batch!r}")
        for name in ("total_batch_tokens", "micro_batch_max", "seq_len", "max_steps", "checkpoint_interval",
                     "keep_last", "log_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.max_minutes < 0:
            raise ConfigError("train.max_minutes must be >= 0 (0 = no time budget)")
        if self.system_metrics_interval < 0:
            raise ConfigError("train.system_metrics_interval must be >= 0 seconds (0 = no system metrics)")
        if not self.price_per_gpu_hour >= 0:
            raise ConfigError(f"train.price_per_gpu_hour must be >= 0 dollars (0 = no cost shown), got "
                              f"{self.price_per_gpu_hour}")
        if self.profile_steps < 0:
            raise ConfigError(f"train.profile_steps must be >= 0 steps (0 = no profile at launch), got "
                              f"{self.profile_steps}")
        if self.hang_timeout_s < 0 or self.max_restarts < 0:
            raise ConfigError(f"train.hang_timeout_s (0 = derived from the step time) and train.max_restarts "
                              f"must be >= 0, got {self.hang_timeout_s} and {self.max_restarts}")


# --- each evaluation's own section: eval.<name>.<field> ------------------------------------------

# An evaluation owns its settings (eval.hellaswag.limit=200, eval.harness.tasks=arc_easy). Their types are the
# evaluations' own `Settings` dataclasses, which gptcore/evals registers here when it is imported: config sits
# below the evaluations and cannot import them. A process that has imported gptcore.evals (the flow's check,
# the trainer, evaluate) checks every section: the evaluation exists, its fields, their types and its own
# `validate()`. One that has not (a data stage) carries the sections through as they were given.
EVAL_SECTIONS: dict[str, type] = {}


def eval_section(name: str, settings: type | None) -> None:
    """Register (a dataclass) or drop (None) evaluation `name`'s settings type."""
    if settings is None:
        EVAL_SECTIONS.pop(name, None)
    else:
        EVAL_SECTIONS[name] = settings


@dataclass
class EvalConfig:
    """The trainer's own evaluation loop (validation loss, samples, failure budget), and each registered
    evaluation's section in `sections` (written and read as eval.<name>.<field>; `options(name)`)."""
    eval_interval: int = 250  # steps between validation-loss evaluations; 0 = only at the end
    val_tokens: int = 10_485_760  # fixed number of validation tokens (same batches every time)
    sample_interval: int = 250  # steps between text samples; 0 = only at the end
    sample_prompt: str = "Hello, I'm a language model,"
    sample_tokens: int = 32
    max_failures: int = 3  # evaluations failing in a row before evaluation is off for this invocation; 0 = never
    # {"hellaswag": {"limit": 200}}: the values given (a preset's, an override's; a saved config's are whole);
    # the rest are each evaluation's own defaults
    sections: dict[str, dict] = field(default_factory=dict)

    def options(self, name: str):
        """Evaluation `name`'s settings: its Settings dataclass with this config's values, checked."""
        if name not in EVAL_SECTIONS:
            raise ConfigError(f"eval.{name}: no evaluation named {name!r}; evaluations: {sorted(EVAL_SECTIONS)}")
        options = EVAL_SECTIONS[name](**{k: eval_option(name, k, v) for k, v in self.sections.get(name, {}).items()})
        if hasattr(options, "validate"):
            options.validate()
        return options

    def validate(self) -> None:
        for name in ("eval_interval", "val_tokens", "sample_interval", "sample_tokens", "max_failures"):
            if getattr(self, name) < 0:
                raise ConfigError(f"eval.{name} must be >= 0, got {getattr(self, name)}")
        if EVAL_SECTIONS:  # the evaluations are known in this process: every section is checked
            for name in sorted(set(self.sections) | set(EVAL_SECTIONS)):
                self.options(name)


@dataclass
class GuardConfig:
    """The divergence guard (docs/training.md "Divergence guard"). Not part of the run's identity: it
    may change between invocations. A non-finite step never updates the weights; repeated non-finite
    steps or a sustained loss spike roll back to the newest good checkpoint and skip the data since."""
    max_nonfinite: int = 3  # consecutive non-finite steps (each skipped) that trigger a rollback
    spike_window: int = 200  # healthy steps of loss history the spike rule compares with; 0 = no spike rule
    spike_sigmas: float = 6.0  # a step spikes when loss > mean + max(sigmas * std, min_delta) of the window
    spike_min_delta: float = 0.5  # nats: the smallest rise that counts, whatever the window's spread
    spike_steps: int = 10  # consecutive spiking steps that trigger a rollback
    max_rollbacks: int = 3  # rollbacks with no checkpoint written between them before the run gives up
    # replicas (DDP): every N steps the ranks compare a bitwise checksum of their weights; a rank that
    # disagrees is rolled back with the others, and disagreeing again stops the run (exit 4); 0 = off
    consistency_interval: int = 100
    # stragglers: a rank whose own compute time is over straggler_ratio x the median of the ranks' at
    # straggler_logs log steps in a row is named in an event
    straggler_ratio: float = 1.3
    straggler_logs: int = 3

    def validate(self) -> None:
        if self.consistency_interval < 0 or self.straggler_ratio <= 1 or self.straggler_logs < 1:
            raise ConfigError("guard.consistency_interval must be >= 0 (0 = off), guard.straggler_ratio > 1 and "
                              f"guard.straggler_logs >= 1; got {self.consistency_interval}, "
                              f"{self.straggler_ratio} and {self.straggler_logs}")
        for name in ("max_nonfinite", "spike_steps", "max_rollbacks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"guard.{name} must be >= 1, got {getattr(self, name)}")
        if self.spike_window < 0 or self.spike_sigmas <= 0 or self.spike_min_delta < 0:
            raise ConfigError("guard.spike_window must be >= 0, guard.spike_sigmas > 0 and "
                              "guard.spike_min_delta >= 0")


@dataclass
class RunConfig:
    preset: str = "gpt2-124m"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def run_name(self) -> str:
        return self.train.run_name or self.preset

    def validate(self, world_size: int = 1) -> RunConfig:
        """Check every section and the cross-field rules; returns self so calls can chain."""
        for section in (self.model, self.data, self.optim, self.train, self.eval, self.guard):
            section.validate()
        t = self.train
        if t.seq_len > self.model.block_size:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.block_size={self.model.block_size}")
        micro = 1 if t.micro_batch == "auto" else t.micro_batch  # auto: any divisor of the share will do
        per_micro = micro * t.seq_len * world_size
        if t.total_batch_tokens % per_micro != 0:
            raise ConfigError(
                f"train.total_batch_tokens={t.total_batch_tokens} is not divisible by micro_batch*seq_len*"
                f"world_size = {micro}*{t.seq_len}*{world_size} = {per_micro}; adjust "
                "train.micro_batch or train.total_batch_tokens")
        if t.parallel == "fsdp" and self.optim.name == "muon":
            raise ConfigError("train.parallel=fsdp with optim.name=muon: Muon orthogonalizes whole matrices, and "
                              "under FSDP2 each rank holds a shard of each; use optim.name=adamw with fsdp, or "
                              "train.parallel=ddp (auto picks DDP for Muon)")
        if t.parallel == "fsdp" and t.dtype == "float16":
            raise ConfigError("train.parallel=fsdp with train.dtype=float16: fp16 needs a gradient scaler that "
                              "knows the shards; use bfloat16 (or auto) with fsdp, or train.parallel=ddp")
        if self.optim.warmup_steps > t.max_steps:
            raise ConfigError(f"optim.warmup_steps={self.optim.warmup_steps} exceeds "
                              f"train.max_steps={t.max_steps}")
        for key, value in zip(NAME_KEYS, (t.run_name, self.data.dataset_name), strict=True):
            if value:  # "" = the default (the preset's name, or one derived from the source)
                check_name(key, value)
        return self

    def grad_accum_steps(self, world_size: int = 1) -> int:
        micro = self.train.resolved_micro_batch()
        return self.train.total_batch_tokens // (micro * self.train.seq_len * world_size)

    def to_dict(self) -> dict:
        """Plain JSON-able values; each evaluation's section under eval.<name> (all its fields where the
        evaluation is known in this process, else the values given)."""
        d = asdict(self)
        given = d["eval"].pop("sections")
        for name in sorted(set(given) | set(EVAL_SECTIONS)):
            d["eval"][name] = asdict(self.eval.options(name)) if name in EVAL_SECTIONS else given[name]
        return d

    def identity_hash(self) -> str:
        """Hash of what defines a training trajectory (model, data, optimizer, batch, seed, length).
        Budget, device, logging and eval cadence may change between invocations of the same run."""
        t = self.train
        ident = {"model": asdict(self.model), "optim": self.optim.identity(),
                 "data": {"source": self.data.source, "shard_tokens": self.data.shard_tokens,
                          "dataset_name": self.data.dataset_name},
                 "train": {"total_batch_tokens": t.total_batch_tokens, "seq_len": t.seq_len,
                           "max_steps": t.max_steps, "seed": t.seed}}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


# --- an evaluation's field from text (overrides, presets, saved configs): typed through the registry ---

def eval_option(name: str, option: str, value):
    """`value` typed as evaluation `name`'s field `option`; ConfigError for an evaluation or a field it lacks."""
    key = f"eval.{name}.{option}"
    if name not in EVAL_SECTIONS:
        raise ConfigError(f"unknown config key {key!r}: no evaluation named {name!r}; evaluations: "
                          f"{sorted(EVAL_SECTIONS)}")
    hints = typing.get_type_hints(EVAL_SECTIONS[name])
    if option not in hints:
        raise ConfigError(f"unknown config key {key!r}; eval.{name} has {sorted(hints)}")
    return coerce(value, hints[option], key)
