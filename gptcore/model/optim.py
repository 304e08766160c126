"""The optimizers and the learning-rate schedule.

    optim.name = adamw   AdamW on every parameter (build-nanogpt; the default)
    optim.name = muon    torch.optim.Muon on the transformer blocks' 2-D weights (attention and MLP
                         projections), AdamW on the rest: the tied embedding / head, position embedding,
                         biases, LayerNorms (Muon is for hidden matrices; Keller Jordan, "Muon", 2024)
    optim.schedule = cosine | wsd   (lr_at)

Both optimizers step together behind one interface (`Combined`), and both states are in the checkpoint,
so exact resume, world-size change and the divergence guard work as with AdamW alone.
"""

from __future__ import annotations

import math

import torch

from gptcore.config import OptimConfig, RunConfig
from gptcore.distributed import native_bf16


def lr_at(it: int, cfg: RunConfig) -> float:
    """The learning rate of step `it` (0-based), peak optim.max_lr:
    cosine: linear warmup to max_lr, then cosine decay to min_lr at max_steps (build-nanogpt);
    wsd:    linear warmup, constant max_lr, then linear decay to min_lr over the last decay_frac of
            max_steps (warmup-stable-decay, "trapezoidal")."""
    o, max_steps = cfg.optim, cfg.train.max_steps
    if it < o.warmup_steps:
        return o.max_lr * (it + 1) / o.warmup_steps
    if it >= max_steps:
        return o.min_lr
    if o.schedule == "wsd":
        decay_steps = max(1, round(o.decay_frac * max_steps))
        into = it - (max_steps - decay_steps)
        return o.max_lr if into < 0 else o.max_lr + (o.min_lr - o.max_lr) * into / decay_steps
    ratio = (it - o.warmup_steps) / max(1, max_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.max_lr - o.min_lr)


def set_lr(optimizer, lr: float) -> None:
    """Every group follows the schedule; a group with `lr_scale` (the Muon part) at its own peak."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def newton_schulz_dtype(setting: str, device_type: str) -> torch.dtype:
    """bfloat16 where matmuls in it are fast (GPUs with native bf16); float32 elsewhere: on CPUs and
    V100/T4 bf16 matmuls are emulated and torch.optim.Muon's fixed bf16 is far slower than fp32
    (docs/training.md)."""
    if setting != "auto":
        return getattr(torch, setting)
    return torch.bfloat16 if native_bf16(device_type) else torch.float32


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same hyperparameters, same state: one momentum buffer per matrix) with the
    Newton-Schulz iteration's precision chosen by the caller (torch's runs it in bfloat16 always), and a
    `found_inf` like the fused AdamW's: a tensor that, when non-zero, makes the step change nothing,
    decided on the device (no host sync per step). GradScaler (fp16) sets the same `found_inf` instead of
    reading its overflow flag on the host, because of `_step_supports_amp_scaling`; the trainer unscales
    the gradients before (for clipping), so GradScaler's `grad_scale` is then None."""

    _step_supports_amp_scaling = True

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kw):
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon here takes no closure"
        assert getattr(self, "grad_scale", None) is None, "unscale the gradients (GradScaler.unscale_) first"
        found_inf = getattr(self, "found_inf", None)  # GradScaler deletes the attribute after its step
        keep = None if found_inf is None else (found_inf == 0)
        for g in self.param_groups:
            a, b, c = g["ns_coefficients"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                if "momentum_buffer" not in self.state[p]:  # (setdefault would allocate one every step)
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf = self.state[p]["momentum_buffer"]
                # a skipped step: the gradient is replaced by the buffer itself, so nothing moves (and a
                # NaN gradient reaches neither the buffer nor the weights)
                grad = p.grad if keep is None else torch.where(keep, p.grad, buf)
                buf.lerp_(grad, 1 - g["momentum"])
                update = grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                update = orthogonalize(update, a, b, c, g["ns_steps"], g["eps"], self.ns_dtype).to(p.dtype)
                # torch.optim.Muon's "original" scaling: sqrt(max(1, rows / cols))
                lr = g["lr"] * math.sqrt(max(1.0, p.size(0) / p.size(1)))
                if keep is None:
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    p.add_(update, alpha=-lr)
                else:
                    on = keep.to(p.dtype)
                    p.mul_(1 - g["lr"] * g["weight_decay"] * on)
                    p.sub_(update * (lr * on))


def orthogonalize(g: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (an approximate U V^T of g = U S V^T),
    in `dtype`."""
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Combined:
    """AdamW and Muon as one optimizer for the trainer: `param_groups` lists both, `step`/`zero_grad` run
    both, and the state dict holds both."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        self.found_inf: torch.Tensor | None = None  # passed on to both (see skips_on_device)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.found_inf = self.found_inf
            o.step()
            o.found_inf = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"combined": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if "combined" not in state or len(state["combined"]) != len(self.optimizers):
            raise ValueError("the checkpoint's optimizer state is not of optim.name=muon; resume it with the "
                             "optimizer it was trained with")
        for o, s in zip(self.optimizers, state["combined"], strict=True):
            o.load_state_dict(s)


def skips_on_device(optimizer) -> bool:
    """True if `optimizer.found_inf` (a device tensor) can veto a step without a host sync: the fused
    AdamW, this module's Muon, or both together."""
    parts = getattr(optimizer, "optimizers", (optimizer,))
    return all(isinstance(o, Muon) or o.defaults.get("fused") for o in parts)


def adamw(params, o: OptimConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW at optim.max_lr with decay on >=2-D tensors only (matmul weights, embeddings), none on
    biases/norms; the fused kernel (one pass over each tensor, on CUDA and CPU)."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.max_lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=device_type in ("cuda", "cpu"))


def build_optimizer(model, o: OptimConfig, device_type: str):
    """AdamW over every parameter (optim.name=adamw), or Muon + AdamW (optim.name=muon)."""
    if o.name == "adamw":
        return adamw(model.parameters(), o, device_type)
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2 and ".h." in f".{n}"]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]  # (adamw leaves out frozen ones)
    muon = Muon([{"params": hidden, "lr_scale": o.muon_lr / o.max_lr}], lr=o.muon_lr, momentum=o.muon_momentum,
                weight_decay=o.muon_weight_decay, nesterov=True,
                ns_dtype=newton_schulz_dtype(o.muon_ns_dtype, device_type))
    return Combined(adamw(rest, o, device_type), muon)
