"""The training loss head: final hidden states and the tied output weight -> cross-entropy, with no logits
tensor handed back. Two implementations with the same numbers, chosen by `train.loss` (not by device):

    plain   F.linear at the padded width (a multiple of 64: fast tensor-core matmuls), the padded columns
            set to -inf (not sliced off), F.cross_entropy. Under torch.compile the upcast, mask and loss
            fuse into a few kernels over the aligned width; the logits exist only inside the loss. `auto`
            picks it on CUDA. Why masked, not sliced: on an H200 the compiled loss over the sliced, unaligned
            50,257 columns took 13.65 ms of backward and 6.10 ms of forward per 64 x 1024 micro-step against
            5.32 ms and 5.09 ms at the aligned 50,304 (issue 43's profile): the slice alone made the whole
            step 4% slower than build-nanogpt. exp(-inf) = 0, so the loss and gradients are the sliced ones.
    fused   a chunked linear + cross-entropy that computes each chunk's loss and gradients at once and
            never holds the (tokens x vocab) logits. `auto` picks it on CPU, where materialising the
            logits and their gradient (~400 MB each, fresh pages every step) cost more than the matmuls.

Either way the padded vocabulary ids (50257..50303) take no probability and get no gradient. Plain
PyTorch only, so the CPU tests run both paths that GPUs can take.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gptcore.model.tokenizer import N_VOCAB

LOSS_CHUNK = 256  # rows per chunk of the fused loss (256 x 50304 fp32 logits = 51 MB)
EVAL_CHUNK = 1024  # rows per chunk of the evaluation loss (206 MB of fp32 logits)


def masked_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits at the weight's (padded) width, the padded columns -inf: no probability, no gradient."""
    logits = F.linear(x, weight).float()
    if logits.size(-1) <= N_VOCAB:
        return logits
    padding = torch.arange(logits.size(-1), device=logits.device) >= N_VOCAB
    return logits.masked_fill(padding, float("-inf"))


class PlainLoss:
    """cross_entropy(x @ weight.T with the padded columns masked)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        return F.cross_entropy(masked_logits(x, weight), targets, ignore_index=-1)


class FusedLoss:
    """The chunked loss. Holds its scratch buffers between steps (why: on CPU a fresh multi-MB tensor
    costs page faults on first touch, more than the softmax on it: docs/training.md). The
    trainer owns one per model; it is used only inside one forward call, so reuse across calls is safe."""

    def __init__(self, chunk: int = LOSS_CHUNK):
        self.chunk = chunk
        self.buffers: dict[tuple, torch.Tensor] = {}

    def buffer(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key, numel = (name, dtype, device), shape[0] * shape[1]
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        # eager under torch.compile (one graph break before the loss): compiled, each chunk's in-place
        # accumulation into the weight-sized gradient became a fresh weight-sized tensor plus a copy
        return FusedLinearCrossEntropy.apply(x, weight, targets, self, N_VOCAB)


def eval_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = EVAL_CHUNK) -> torch.Tensor:
    """The mean loss with no gradient (evaluation): chunks of rows, so only one chunk's logits exist at a
    time (a 64 x 1024 validation batch would otherwise hold 3.3 G logits)."""
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for i in range(0, x.size(0), chunk):
        logits = masked_logits(x[i:i + chunk], weight)
        total += F.cross_entropy(logits, targets[i:i + chunk], ignore_index=-1, reduction="sum")
    return total / (targets != -1).sum()


def make_loss(kind: str) -> PlainLoss | FusedLoss:
    """`kind` is train.loss after `auto` was resolved (gptcore.distributed.select)."""
    return FusedLoss() if kind == "fused" else PlainLoss()


class FusedLinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(x @ weight[:n_vocab].T, targets, ignore_index=-1) (the mean) for training, without the logits.

    The forward walks the rows in chunks and, for each chunk, computes the logits, the loss and at once
    the gradients (softmax - onehot) w.r.t. x and the weight; backward only scales the stored gradients by
    grad_output. Same numbers as F.linear + F.cross_entropy. Under autocast (bf16) the matmuls run in bf16
    and the softmax and the accumulated gradients in fp32, as autocast's own linear + loss do. Training
    only: it computes the gradients even when none are wanted, and backward runs once.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, owner: FusedLoss, n_vocab):
        # x: (N, C); weight: (V, C) with rows >= n_vocab padding (logit -inf: no probability, zero gradient);
        # targets: (N,) with -1 = ignore
        valid = targets != -1
        row_scale = valid / valid.sum()  # each row's weight in the mean over the non-ignored targets (0: ignored)
        safe_targets = targets.clamp(min=0)  # any valid index for the gather; ignored rows weigh 0
        dev_type = x.device.type
        mm_dtype = torch.get_autocast_dtype(dev_type) if torch.is_autocast_enabled(dev_type) else weight.dtype
        mixed = mm_dtype != torch.float32
        # all matmuls at the padded width (MKL is slower at the odd 50257; tensor cores want x64)
        w = weight.to(mm_dtype)  # the parameter itself when there is no autocast
        V, n, rows, dev = w.size(0), x.size(0), min(owner.chunk, x.size(0)), x.device
        logits = owner.buffer("logits", (rows, V), mm_dtype, dev)  # also the bf16 gradient if mixed
        probs = owner.buffer("probs", (rows, V), torch.float32, dev)
        upcast = owner.buffer("upcast", (rows, V), torch.float32, dev) if mixed else None
        grad_x = torch.empty_like(x)
        grad_w = torch.empty_like(weight)  # the first chunk writes it, the others add
        if mixed:  # the bf16 product of each chunk, and its fp32 copy to accumulate
            part = owner.buffer("part", w.shape, mm_dtype, dev)
            part32 = owner.buffer("part32", w.shape, torch.float32, dev)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        for i in range(0, n, rows):
            m = min(rows, n - i)
            xc, yc, sc = x[i:i + m].to(mm_dtype), safe_targets[i:i + m], row_scale[i:i + m]
            lc, p = logits[:m], probs[:m]
            torch.mm(xc, w.t(), out=lc)
            lc[:, n_vocab:] = float("-inf")  # padding: probability 0, so its gradient rows are exactly 0
            z = upcast[:m].copy_(lc) if mixed else lc  # fp32 logits for the softmax, even under autocast
            torch.softmax(z, dim=-1, out=p)
            # loss = -log p[target]; p underflows to 0 only past ~87 nats: those rows in log space instead
            p_t = p.gather(1, yc[:, None]).squeeze(1)
            nll = -torch.log(p_t)
            far = p_t == 0
            if far.any():
                z_far = z[far]
                nll[far] = torch.logsumexp(z_far, dim=-1) - z_far.gather(1, yc[far][:, None]).squeeze(1)
            loss += (nll * sc).sum()
            # d loss / d logits = (softmax - onehot) * row weight, in place of the probabilities
            p[torch.arange(m, device=dev), yc] -= 1.0
            g = lc.copy_(p.mul_(sc[:, None])) if mixed else p.mul_(sc[:, None])
            grad_x[i:i + m] = g @ w
            if mixed:  # bf16 matmul, fp32 accumulation
                torch.mm(g.t(), xc, out=part)
                if i == 0:
                    grad_w.copy_(part)
                else:
                    grad_w.add_(part32.copy_(part))
            elif i == 0:
                torch.mm(g.t(), xc, out=grad_w)
            else:
                grad_w.addmm_(g.t(), xc)
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        # in place: a weight-sized fresh tensor would cost page faults; backward runs once per forward
        return grad_x.mul_(grad_loss), grad_w.mul_(grad_loss), None, None, None
