"""Activation checkpointing: run a transformer block so that backward recomputes what forward did not keep.

    none       every activation kept (fastest; the most memory)
    selective  the outputs of the matmuls and of attention kept, the cheap ops between them (LayerNorm,
               GELU, dropout, residual adds) recomputed: most of full's saving on the elementwise
               activations for a few percent of compute (Korthikanti et al. 2022, "Reducing Activation
               Recomputation in Large Transformer Models"; torch's selective checkpoint API)
    full       only each block's input kept; the whole block runs again in backward (~1/3 more compute)

Recomputation restores the RNG state, so dropout draws the same masks twice and the losses equal `none`'s.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

_aten = torch.ops.aten
# what `selective` keeps: the expensive outputs. Linear layers reach aten as mm / addmm; SDPA as one of
# its backends' ops (whichever exists in this torch).
SAVED = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
         *(getattr(_aten, name).default for name in (
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
           if hasattr(_aten, name))}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(block: torch.nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    """`block(x)`, recomputed in backward as `mode` says (no recomputation without a backward to do it)."""
    if mode == "none" or not (block.training and torch.is_grad_enabled()):
        return block(x)
    if mode == "full":
        return checkpoint(block, x, use_reentrant=False)
    return checkpoint(block, x, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_matmuls))
