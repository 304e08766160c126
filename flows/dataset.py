"""The `tokenize` flow: tokenize-and-shard, with the tokenize work mapped over source pieces. (Not named
tokenize.py: the deployment's entrypoint folder is on sys.path, where that name would shadow the standard
library's `tokenize` and break every process the flow run starts.)

    dataset_dir = tokenize_dataset(cfg)      # cfg: RunConfig or cfg.to_dict()

It plans the pieces (gptcore.data.planning.plan_pieces), maps `tokenize-piece` tasks (tasks/tokenize.py)
over the ones not yet done on the task runner (by default a ProcessPoolTaskRunner with data.num_workers
processes; pass a DaskTaskRunner / RayTaskRunner from prefect-dask / prefect-ray to spread pieces over
machines sharing GPTPIPE_HOME), and cuts the shards in order in the flow's own process as the pieces
before each shard's end complete (gptcore.data.cutting.ShardCutter). The result does not depend on how many
workers ran or in which order pieces finished. A finished dataset is verified and skipped. While it
works, the progress artifact `<dataset>-tokenize` counts the pieces done (integrations/progress.py).
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner
from prefect.utilities.annotations import unmapped

from gptcore.config import RunConfig, as_config
from gptcore.data import build, location
from integrations.progress import PieceProgress
from tasks.tokenize import done, tokenize_piece_task


def _piece_tasks(cfg: RunConfig, pieces: list, todo: list, piece_done) -> None:
    """build.build's workers: one tokenize-piece task per piece on the flow's task runner, handed to the
    shard cutter (here, in the flow's process) as they complete."""
    progress = PieceProgress(location.dataset_dir(cfg).name, len(todo), len(pieces), get_run_logger())
    for future in as_completed(tokenize_piece_task.map(unmapped(cfg.to_dict()), todo)):
        index, tokens = future.result()  # a failed piece raises here
        piece_done(index, tokens)
        progress.piece_done(tokens)


@flow(name="tokenize", task_runner=ProcessPoolTaskRunner(), log_prints=True)
def tokenize_flow(cfg: dict) -> str:
    c = as_config(cfg)
    build.build(c, _piece_tasks, say=get_run_logger().info)
    return str(location.dataset_dir(c))


def tokenize_dataset(cfg: RunConfig | dict, task_runner: TaskRunner | None = None) -> str:
    """Run the `tokenize` flow (as a subflow when called inside a flow); returns the dataset directory.
    Returns at once when the dataset is already complete (tasks.tokenize.done)."""
    c = as_config(cfg)
    if done(c) is not None:
        return str(location.dataset_dir(c))
    workers = c.data.num_workers or os.cpu_count() or 1
    runner = task_runner or ProcessPoolTaskRunner(max_workers=workers)
    return tokenize_flow.with_options(task_runner=runner)(c.to_dict())
