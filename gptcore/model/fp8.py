"""FP8 training (`train.fp8`): torchao's float8 training swaps chosen nn.Linear layers for Float8Linear,
whose matmuls run in float8 with per-tensor (tensorwise) or per-row (rowwise) scales while the weights, the
optimizer and the checkpoints stay in their usual precision: a checkpoint of an FP8 run has the same keys,
shapes and dtypes as a bf16 run's, so either resumes the other.

    off         the default: every matmul in bf16
    tensorwise  torchao's fastest recipe (nanochat and torchtitan report their gains with it)
    rowwise     finer scales, more accurate, slower than tensorwise
    auto        tensorwise for a preset where a lease measured a gain (FP8_MEASURED_GAIN), else off

Where it pays: at GPT-2 124M's width (768) the float8 casts cost about what the faster matmuls save
(nanochat's d12 was slower with it); at the family's 774M (1280) and 1.5B (1600) the matmuls dominate. So
`auto` is off until a lease measures a gain for a preset (benchmarks/gpu_check.py, the fp8 row).

Which layers convert (`converts`): the Linear layers inside the transformer blocks (attention qkv and
projection, the MLP's two) whose in and out features are multiples of 16 (float8 matmuls need it). Not
the LM head: its weight is the tied token embedding, and the loss over 50,304 logits is where low precision
hurts most (torchtitan leaves its output layer out too).

Refused with a clear message, at start-up: on a CPU, without torch.compile (eager float8 is slower than
bf16: the casts are not fused), on a GPU before Ada/Hopper (compute capability < 8.9: no float8 tensor
cores), and without torchao installed (`pip install torchao==0.18.0`, the project's `fp8` extra).
"""

from __future__ import annotations

from importlib.util import find_spec

import torch
from torch import nn

from gptcore.security import ConfigError

# presets where a lease measured FP8 faster than bf16 at an equal loss (issue 68's fp8 row); empty until one
# has: `auto` then means off everywhere
FP8_MEASURED_GAIN: dict[str, str] = {}
TORCHAO = "torchao==0.18.0"


def converts(fqn: str, module: nn.Module) -> bool:
    """The filter: a Linear layer of a transformer block whose dimensions float8 matmuls accept."""
    return (isinstance(module, nn.Linear) and fqn.startswith("transformer.h.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def converted_layers(model: nn.Module) -> list[str]:
    """The names of the layers `converts` picks in `model` (on any device, the meta device included)."""
    return [fqn for fqn, m in model.named_modules() if converts(fqn, m)]


def recipe_for(fp8: str, preset: str, device: torch.device, compile_: bool) -> str | None:
    """The float8 recipe a run trains with (None: bf16 matmuls), or ConfigError saying why it cannot."""
    recipe = FP8_MEASURED_GAIN.get(preset) if fp8 == "auto" else None if fp8 == "off" else fp8
    if recipe is None:
        return None
    if device.type != "cuda":
        raise ConfigError(f"train.fp8={fp8} needs a CUDA GPU with float8 tensor cores (Ada or Hopper and later); "
                          f"this run is on {device.type}: use train.fp8=off")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"train.fp8={fp8}: {torch.cuda.get_device_name(device)} (compute capability "
                          f"{major}.{minor}) has no float8 tensor cores (needs 8.9+: L4, L40S, H100, H200, B200); "
                          "use train.fp8=off")
    if not compile_:
        raise ConfigError(f"train.fp8={fp8} needs train.compile=true (or auto on CUDA): eager float8 is slower "
                          "than bf16, its casts are fused only by torch.compile")
    if find_spec("torchao") is None:  # said before any process group, not as a traceback in every rank
        raise ConfigError(f"train.fp8={fp8} needs torchao: pip install {TORCHAO} (the project's `fp8` extra), "
                          "or use train.fp8=off")
    return recipe


def convert(model: nn.Module, recipe: str) -> list[str]:
    """Swap the filter's layers of `model` for torchao's Float8Linear with `recipe`, in place, before it is
    wrapped or compiled; returns the names converted."""
    # lazy: torchao only for a run that trains in float8 (an optional extra; recipe_for checked it is there)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = converted_layers(model)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda m, fqn: converts(fqn, m))
    return names
