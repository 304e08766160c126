"""Validation loss over a fixed slice of the val split, and the standalone evaluation command.

validation_loss reads the first `cfg.eval.val_tokens` tokens of the val shards as (B, T) batches of
`train.micro_batch x train.seq_len`: the same batches every time, so val/loss is comparable across steps
and runs. Batch i goes to rank i % world; the per-rank sums are all-reduced, so the number does not
depend on the world size.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from gptcore.config import RunConfig
from gptcore.shards import Manifest, ShardError, read_shard

log = logging.getLogger(__name__)


def val_token_slice(manifest_dir: Path, n_tokens: int) -> np.ndarray:
    """The first n_tokens of the val split (shards in manifest order), or fewer if the split is shorter."""
    manifest_dir = Path(manifest_dir)
    shards = Manifest.load(manifest_dir).split("val")
    if not shards:
        raise ShardError(f"dataset {manifest_dir} has no val shard; re-run the tokenize stage")
    parts, have = [], 0
    for s in shards:
        if have >= n_tokens:
            break
        tokens = read_shard(manifest_dir / s.name)
        parts.append(np.asarray(tokens[: n_tokens - have]))
        have += len(parts[-1])
    return np.concatenate(parts)


def _unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    # Evaluation does no backward pass; calling the inner module avoids DDP's forward bookkeeping
    # (ranks may run different numbers of forwards here). A torch.compile wrapper is kept.
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@torch.no_grad()
def validation_loss(model: torch.nn.Module, cfg: RunConfig, manifest_dir: Path, device,
                    autocast_ctx=None, rank: int = 0, world: int = 1) -> float:
    """Mean next-token loss over the first cfg.eval.val_tokens val tokens (same batches every call)."""
    B, T = cfg.train.micro_batch, cfg.train.seq_len
    n_batches = max(1, cfg.eval.val_tokens // (B * T))
    tokens = val_token_slice(manifest_dir, n_batches * B * T + 1)  # +1: the last target
    available = (len(tokens) - 1) // (B * T)
    if available < 1:
        raise ShardError(f"the val split of {manifest_dir} has {len(tokens)} tokens, fewer than one batch "
                         f"of train.micro_batch*train.seq_len+1 = {B * T + 1}; use a smaller micro_batch/"
                         "seq_len or a larger dataset")
    if available < n_batches:
        log.warning("eval.val_tokens=%d but the val split holds only %d full batches (%d tokens); "
                    "using those", cfg.eval.val_tokens, available, available * B * T)
        n_batches = available
    inner = _unwrap_ddp(model)
    was_training = inner.training
    inner.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of batch losses, batch count]
    for i in range(rank, n_batches, world):
        buf = torch.from_numpy(tokens[i * B * T: (i + 1) * B * T + 1].astype(np.int64))
        x = buf[:-1].view(B, T).to(device)
        y = buf[1:].view(B, T).to(device)
        with autocast_ctx or nullcontext():
            _, loss = inner(x, y)
        total[0] += loss.double()
        total[1] += 1
    inner.train(was_training)
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    # every batch has B*T tokens, so the mean of batch means is the mean over tokens
    return float(total[0] / total[1])
