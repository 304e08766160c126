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
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner
from prefect.utilities.annotations import unmapped

from gptcore.config import ConfigError, RunConfig
from gptcore.data import build, location
from gptcore.data.shard_format import Manifest
from gptcore.overrides import as_config
from integrations.progress import PieceProgress, artifact_key
from tasks.stage import FlowRun, Stage
from tasks.tokenize import tokenize_piece_task


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
    Returns at once when the dataset is already complete (what the tokenize stage's `stored` asks)."""
    c = as_config(cfg)
    if location.why_incomplete(c) is None:
        return str(location.dataset_dir(c))
    workers = c.data.num_workers or os.cpu_count() or 1
    runner = task_runner or ProcessPoolTaskRunner(max_workers=workers)
    return tokenize_flow.with_options(task_runner=runner)(c.to_dict())


def dask_runner(address: str):
    """prefect-dask's runner for an existing Dask cluster; None (the local process pool) for ""."""
    if not address:
        return None
    try:
        from prefect_dask import DaskTaskRunner  # an optional extra: only a run given a Dask cluster needs it
    except ImportError as e:
        raise ConfigError(f"dask_address={address!r} needs prefect-dask on the worker: pip install -e '.[dask]'") from e
    return DaskTaskRunner(address=address)


# --- the pretrain flow's tokenize stage (tasks/stage.py) ------------------------------------------------

@dataclass
class Dataset:
    dir: str
    rows: list[dict]  # one per shard: the shard table artifact
    tokens: dict[str, int]  # per split


def describe(dataset_dir: str) -> Dataset:
    rows = [{"shard": s.name, "split": s.split, "tokens": s.tokens, "sha256": s.sha256[:12]}
            for s in Manifest.load(Path(dataset_dir)).shards]
    return Dataset(dataset_dir, rows, {split: sum(r["tokens"] for r in rows if r["split"] == split)
                                       for split in ("train", "val")})


class TokenizeStage(Stage):
    """tokenize-and-shard the downloaded source: stored when the dataset's manifest is complete and its
    shards check out; tokenized on the Dask cluster at `dask_address` when one is given; the shard table
    artifact."""
    name = "tokenize"

    def stored(self, run: FlowRun) -> Dataset | None:
        complete = location.why_incomplete(run.cfg) is None
        return describe(str(location.dataset_dir(run.cfg))) if complete else None

    def work(self, run: FlowRun) -> Dataset:
        return describe(tokenize_dataset(run.cfg.to_dict(), task_runner=dask_runner(run.dask_address)))

    def reason(self, run: FlowRun, d: Dataset, ran: bool) -> str:
        head = f"{len(d.rows)} shards, {d.tokens['train']:,} train tokens"
        return f"{head} in {d.dir}" if ran else f"{head}; {d.dir} is complete (checked: {location.CHECKED})"

    def keep(self, run: FlowRun, d: Dataset) -> None:
        create_table_artifact(d.rows, key=artifact_key(run.cfg.run_name, "shards"),
                              description=f"Shards of {d.dir} ({d.tokens['train']:,} train / {d.tokens['val']:,} "
                                          "val tokens)")
        run.dataset_dir, run.tokens = d.dir, d.tokens


STAGE = TokenizeStage()
