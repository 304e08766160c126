"""GPT-2, exactly as OpenAI / Hugging Face define it, written to be read.

Pre-LayerNorm transformer blocks, GELU (tanh approximation), learned position embeddings, the token
embedding tied to the output head, init std 0.02 with the residual projections scaled by
1/sqrt(2 * n_layer). Attention goes through F.scaled_dot_product_attention, which picks flash attention
on a GPU. The vocabulary is padded (50257 -> 50304) for faster matmuls; the padded ids never win a
sample and never enter the loss.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptcore.config import ModelConfig
from gptcore.model.loss import PlainLoss, eval_loss
from gptcore.model.recompute import run_block
from gptcore.model.tokenizer import N_VOCAB


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.RESIDUAL_SCALE = True  # scaled init: see GPT._init_weights
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.RESIDUAL_SCALE = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.head_loss = PlainLoss()  # the training loss; the trainer sets the one train.loss chooses
        self.recompute = "none"  # activation checkpointing (gptcore/model/recompute.py); the trainer sets it
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE", False):
                # each block adds two residual branches; keep the residual stream's variance constant
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once (the tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                return_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Returns (logits over the real vocabulary, mean loss); targets equal to -1 are ignored. The logits
        have the real GPT-2 width (50257), so padding can never win or take probability. With
        return_logits=False (the training step) the loss comes from `self.head_loss` (gptcore/model/loss.py)
        and no logits tensor is returned or kept."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = run_block(block, x, self.recompute)
        x = self.transformer.ln_f(x)
        if targets is not None and not return_logits:  # no gradient wanted (evaluation): no gradient work
            head = self.head_loss if torch.is_grad_enabled() else eval_loss
            return None, head(x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))
        # the real-vocab rows of the tied weight only: contiguous logits, no logits-sized copy
        logits = F.linear(x, self.lm_head.weight[:N_VOCAB])
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # --- throughput -----------------------------------------------------------------------------

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): flops_per_token of this model's shape."""
        return flops_per_token(self.config, seq_len)

    def estimate_mfu(self, tokens_per_second: float, peak_flops: float, seq_len: int | None = None) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s (llm.c's count) over the hardware's peak FLOP/s
        (the card's datasheet dense bf16 peak in the trainer: peak_flops_guess)."""
        return self.flops_per_token(seq_len) * tokens_per_second / peak_flops

    # --- sampling -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, seed: int | None = None) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T). temperature=0 means greedy.
        Uses its own torch.Generator so sampling never disturbs (or depends on) the global RNG."""
        if idx.size(1) + max_new_tokens > self.config.block_size:
            raise ValueError(
                f"prompt of {idx.size(1)} tokens + {max_new_tokens} new tokens exceeds block_size "
                f"{self.config.block_size}; shorten the prompt or ask for fewer tokens")
        generator = torch.Generator(device=idx.device).manual_seed(0 if seed is None else seed)
        with evaluating(self):
            for _ in range(max_new_tokens):
                logits, _ = self(idx)
                logits = logits[:, -1, :].float()
                if temperature == 0:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    next_id = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat((idx, next_id), dim=1)
        return idx


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of a GPT of shape `cfg`, by llm.c's count: 6N + 6*L*C*T,
    N every parameter (the tied embedding once, the position embedding too), C the width, T the sequence
    length; from the shape alone (a 1.5B model need not be built to be counted). The one count behind every
    MFU the project reports (the trainer's log and MLflow, gpu_check, the docs), so ours and llm.c's are
    compared like with like. nanoGPT's count (PaLM appendix B: 6N + 12*L*C*T, N without the position
    embedding) is 6.5% higher at gpt2-124m, T=1024 (855.4M vs 803.5M FLOPs per token)."""
    T = seq_len or cfg.block_size
    return 6 * cfg.approx_params() + 6 * cfg.n_layer * cfg.n_embd * T


def mfu_text(fpt: float, tokens_per_s: list[float], card_peak: float | None,
             measured_rate: float | None = None) -> str:
    """MFU as the project reports it, for one or more sides ("39.9% vs 38.9%"): against the card's datasheet
    dense bf16 peak (`card_peak`, the headline: what llm.c and llm-foundry quote), then, when given, against
    the matmul rate measured in the same call (what the card reaches on a large bf16 matmul today). Both
    with flops_per_token's count (llm.c's); empty when neither peak is known (a CPU)."""
    def shares(peak: float) -> str:
        return " vs ".join(f"{fpt * t / peak:.1%}" for t in tokens_per_s)

    parts = []
    if card_peak:
        parts.append(f"MFU {shares(card_peak)} of the card's {card_peak / 1e12:,.0f} TFLOP/s (llm.c's count)")
    if measured_rate:
        parts.append(f"{shares(measured_rate)} of the {measured_rate / 1e12:.1f} TFLOP/s matmul rate measured now")
    return "; ".join(parts)


def build_on(cfg: ModelConfig, device: torch.device | str) -> GPT:
    """A GPT whose weights are created and initialised on `device` itself. Why not `GPT(cfg).to(device)`:
    that builds and initialises every weight in host memory first, on the one thread torchrun gives each
    rank (gpt2-1558m: 6.2 GB per rank, 15 s on this 2-core machine's thread), then copies it; on a GPU
    the same init takes a fraction of a second. Every rank still draws the same weights (torch.manual_seed
    seeds every device's generator); on CPU this is exactly GPT(cfg)."""
    with torch.device(device):
        return GPT(cfg)


def empty_on_host(cfg: ModelConfig) -> GPT:
    """A GPT with host memory for its weights and no initialisation, for a caller that loads every weight
    next (a checkpoint, strictly): drawing 124M random numbers only to overwrite them took 1.6 s per load
    here (gpt2-1558m: 15 s on one thread), paid by each stage that reads a checkpoint."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.transformer.wte.weight = model.lm_head.weight  # to_empty gave each module its own tensor: tie again
    return model


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip torch.compile's `_orig_mod.` and DDP's `module.` prefixes so checkpoints stay portable."""
    out = {}
    for k, v in state.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


@contextmanager
def evaluating(model: nn.Module):
    """The plain GPT inside any DDP / torch.compile wrapper, in eval mode for the block. Evaluation runs
    eagerly on it: no DDP forward bookkeeping (ranks may run different numbers of forwards), no compiled
    graphs for eval shapes, and the training graph's guards (train mode) hold again afterwards."""
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    try:
        yield inner
    finally:  # also when the block raises: a caller that goes on trains in train mode
        inner.train(was_training)


def unwrap(model: nn.Module) -> GPT:
    """The plain GPT inside DDP and/or torch.compile wrappers."""
    # no `a or b` here: truthiness of a compiled module calls len(), which raises
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# Dense (no sparsity) bf16 tensor-core peak FLOP/s by the name torch.cuda.get_device_name reports, most
# specific first (vendor datasheets; V100 has no bf16: its fp16 peak, which is what it trains in).
PEAK_FLOPS = (
    (r"GH200", 989e12), (r"H200.*NVL", 835e12), (r"H200", 989e12),
    (r"H100.*NVL", 835e12), (r"H100.*PCIE", 756e12), (r"H100", 989e12),  # H100 SXM ("H100 80GB HBM3")
    (r"H800.*PCIE", 756e12), (r"H800", 989e12),  # the export H100: the same compute, less interconnect
    (r"GB200", 2500e12), (r"B200", 2250e12),
    (r"A100", 312e12), (r"A800", 312e12),  # SXM4 and PCIe, 40 and 80 GB: the same tensor-core peak
    (r"L40S", 362e12), (r"\bL40\b", 181e12), (r"\bL4\b", 121e12),
    (r"A10G", 70e12), (r"\bA10\b", 125e12),
    (r"4090", 165e12),
    (r"V100", 125e12),
)


def peak_flops_for(name: str) -> float | None:
    """The table's peak for a CUDA device name, or None for a GPU it does not know."""
    for pattern, flops in PEAK_FLOPS:
        if re.search(pattern, name.upper()):
            return flops
    return None


def peak_flops_guess(device: torch.device) -> float | None:
    """Peak FLOP/s of one device for MFU; None (MFU not reported) for a CPU or an unknown GPU, after a
    one-time warning for the GPU that names GPTPIPE_PEAK_FLOPS."""
    if device.type != "cuda":
        # a CPU's peak depends on its cores, clock and vector units: any fixed figure gives an MFU that
        # means nothing (142% on a 2-core machine), so MFU on CPU needs GPTPIPE_PEAK_FLOPS
        return None
    name = torch.cuda.get_device_name(device)
    flops = peak_flops_for(name)
    if flops is None and not _WARNED.get(name):
        _WARNED[name] = True
        print(f"warning: no peak FLOP/s known for GPU {name!r}: MFU is not reported; set GPTPIPE_PEAK_FLOPS "
              "(dense bf16 FLOP/s of one GPU) to get it", flush=True)
    return flops


_WARNED: dict[str, bool] = {}

