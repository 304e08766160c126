"""Prefect stage: tokenize-and-shard, with the tokenize work mapped over source pieces.

    dataset_dir = tokenize_dataset(cfg)      # cfg: RunConfig or cfg.to_dict()

The `tokenize` flow plans the pieces (gptcore.sharding.plan_pieces), maps `tokenize-piece` tasks over
the ones not yet done on the task runner (by default a ProcessPoolTaskRunner with data.num_workers
processes; pass a DaskTaskRunner / RayTaskRunner from prefect-dask / prefect-ray to spread pieces over
machines sharing GPTPIPE_HOME), and cuts the shards in order in the flow's own process as the pieces
before each shard's end complete (gptcore.sharding.ShardCutter). The result does not depend on how many
workers ran or in which order pieces finished. A finished dataset is verified and skipped. While it
works, the progress artifact `<dataset>-tokenize` counts the pieces done (tasks/progress.py).
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner
from prefect.utilities.annotations import unmapped

from gptcore import sharding, sources
from gptcore.config import RunConfig
from gptcore.shards import ShardError
from tasks.download import as_config
from tasks.progress import PieceProgress


@task(name="tokenize-piece", retries=1, cache_policy=NO_CACHE)
def tokenize_piece_task(cfg: dict, piece: sharding.Piece) -> tuple[int, int]:
    """Tokenize one piece (skips if already verified); returns its index and token count."""
    c = as_config(cfg)
    sharding.tokenize_piece(c, piece)
    return piece.index, sharding.piece_record(c, piece)["tokens"]


@flow(name="tokenize", task_runner=ProcessPoolTaskRunner(), log_prints=True)
def tokenize_flow(cfg: dict) -> str:
    logger = get_run_logger()
    c = sharding.pinned(as_config(cfg))  # workers may run with another GPTPIPE_HOME / cwd
    out = sharding.dataset_dir(c)
    why = sharding.why_incomplete(c)
    if why is None:
        logger.info("dataset %s is complete (checked: %s); skipping", out, sharding.CHECKED)
        return str(out)
    logger.info("dataset %s: %s", out, why)
    existed = sharding.listing_path(c).is_file()
    sharding.remove_stale_temps(out)  # what a killed run was writing
    try:
        pieces = sharding.plan_pieces(c, sources.fetch(c))
        todo = sharding.pieces_to_tokenize(c, pieces)
        logger.info("%d pieces planned, %d to tokenize", len(pieces), len(todo))
        progress = PieceProgress(out.name, len(todo), len(pieces), logger)
        cutter = sharding.ShardCutter(c, pieces, todo)  # here, in the flow: it cuts while pieces finish
        for future in as_completed(tokenize_piece_task.map(unmapped(c.to_dict()), todo)):
            index, tokens = future.result()  # a failed piece raises here
            cutter.piece_done(index)
            progress.piece_done(tokens)
        logger.info("tokenized %s tokens", f"{progress.tokens:,}")
        manifest_id = cutter.finish().id
    except (sources.SourceError, sharding.DataError, ShardError):
        sharding.discard_partial(c, existed)  # bad input leaves nothing half-made
        raise
    logger.info("dataset %s ready, manifest %s", out, manifest_id)
    return str(out)


def tokenize_dataset(cfg: RunConfig | dict, task_runner: TaskRunner | None = None) -> str:
    """Run the `tokenize` flow (as a subflow when called inside a flow); returns the dataset directory.
    Skips at once when the dataset is already complete."""
    c = as_config(cfg)
    if sharding.is_complete(c):
        return str(sharding.dataset_dir(c))
    workers = c.data.num_workers or os.cpu_count() or 1
    runner = task_runner or ProcessPoolTaskRunner(max_workers=workers)
    return tokenize_flow.with_options(task_runner=runner)(c.to_dict())
