"""Prefect stage: tokenize-and-shard. The `tokenize-piece` task (one source piece, skipped when already
verified); flows/dataset.py maps it over the pieces, cuts the shards, and is the pretrain flow's tokenize stage.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.data import planning, tokenizing
from gptcore.overrides import as_config


@task(name="tokenize-piece", retries=1, cache_policy=NO_CACHE)
def tokenize_piece_task(cfg: dict, piece: planning.Piece) -> tuple[int, int]:
    """Tokenize one piece (skips if already verified); returns its index and token count."""
    return piece.index, tokenizing.tokenize_piece(as_config(cfg), piece)

