"""Validation loss over a fixed slice of the val split: the trainer's val/loss and the standalone command's.

validation_loss reads the first `cfg.eval.val_tokens` tokens of the val shards as (B, T) batches of
`train.micro_batch x train.seq_len` (gptcore.data.loader.val_batches): the same batches every time, so val/loss
is comparable across steps and runs. Batch i goes to rank i % world; the per-rank sums are all-reduced,
so the number does not depend on the world size.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch

from gptcore import distributed
from gptcore.config import RunConfig
from gptcore.data.loader import val_batches
from gptcore.model.gpt import evaluating

log = logging.getLogger(__name__)


@torch.no_grad()
def validation_sums(model: torch.nn.Module, cfg: RunConfig, manifest_dir: Path, device,
                    autocast_ctx=None, rank: int = 0, world: int = 1, forward=None) -> torch.Tensor:
    """This rank's [sum of batch mean losses, batch count] (float64, on `device`), on the plain model through
    the loss path (no logits kept); no collective, so a rank that fails here cannot leave others waiting.
    `forward`: what runs each batch instead of the plain model (the trainer's compiled validation forward,
    a torch.compile of the same plain model, called while it is in eval mode)."""
    B, T = cfg.train.resolved_micro_batch(), cfg.train.seq_len
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with evaluating(model) as plain:
        for x, y in val_batches(manifest_dir, B, T, cfg.eval.val_tokens, rank, world):
            x, y = x.to(device), y.to(device)
            with autocast_ctx or nullcontext():
                _, loss = (plain if forward is None else forward)(x, y, return_logits=False)
            total[0] += loss.double()
            total[1] += 1
    return total


def mean_loss(total: torch.Tensor, cfg: RunConfig) -> float:
    """The validation loss from the all-reduced [sum, count] of validation_sums."""
    B, T = cfg.train.resolved_micro_batch(), cfg.train.seq_len
    wanted = max(1, cfg.eval.val_tokens // (B * T))
    if total[1] < wanted:
        log.warning("eval.val_tokens=%d but the val split holds only %d full batches (%d tokens); "
                    "used those", cfg.eval.val_tokens, int(total[1]), int(total[1]) * B * T)
    # every batch has B*T tokens, so the mean of batch means is the mean over tokens
    return float(total[0] / total[1]) if total[1] else float("nan")  # nan: a rank alone with no batch


def validation_loss(model: torch.nn.Module, cfg: RunConfig, manifest_dir: Path, device,
                    autocast_ctx=None, rank: int = 0, world: int = 1) -> float:
    """Mean next-token loss over the first cfg.eval.val_tokens val tokens (same batches every call)."""
    total = validation_sums(model, cfg, manifest_dir, device, autocast_ctx, rank, world)
    if world > 1:  # world=1 inside a DDP job (rank 0 evaluating alone) must not wait for the others
        distributed.all_reduce_sum(total)
    return mean_loss(total, cfg)
