"""Prefect stage: tokenize-and-shard. The `tokenize-piece` task (one source piece, skipped when already
verified) and the stage's one decision (`done`); flows/dataset.py maps the task over the pieces and cuts
the shards.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.config import RunConfig, as_config
from gptcore.data import location, planning, tokenizing


@task(name="tokenize-piece", retries=1, cache_policy=NO_CACHE)
def tokenize_piece_task(cfg: dict, piece: planning.Piece) -> tuple[int, int]:
    """Tokenize one piece (skips if already verified); returns its index and token count."""
    return piece.index, tokenizing.tokenize_piece(as_config(cfg), piece)


def done(cfg: RunConfig | dict) -> str | None:
    """Why the data stage has nothing to do (its dataset is complete and checks out), or None: this
    stage's one decision, asked by the flow (a Skipped task run) and by tokenize_dataset alike."""
    c = as_config(cfg)
    if location.why_incomplete(c) is not None:
        return None
    return f"{location.dataset_dir(c)} is complete (checked: {location.CHECKED})"
