"""Prefect stage: make the training text available locally (hub download, local dir, or built-in).

The work is gptcore.data.sources.fetch: file-by-file, verified, idempotent (a second run only checks sizes
and mtimes, without touching the network), so retries are cheap and safe. The stage is skipped while the
dataset tokenized from the source is complete: its shards are what training reads, so a re-run neither
fetches nor re-checks a source it does not need (which may have been cleaned up after tokenizing).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.config import RunConfig
from gptcore.data import location, sources
from gptcore.overrides import as_config
from tasks.stage import FlowRun, Stage


@task(name="download", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def download_task(cfg: RunConfig | dict) -> str:
    """Returns the source directory (holding source.json) as a string."""
    return str(sources.fetch(as_config(cfg)))


class DownloadStage(Stage):
    """The source's files, fetched and verified (stored: the dataset made from them is complete)."""
    name = "download"

    def stored(self, run: FlowRun) -> str | None:
        return "" if location.why_incomplete(run.cfg) is None else None

    def work(self, run: FlowRun) -> str:
        return download_task(run.cfg.to_dict())

    def reason(self, run: FlowRun, source_dir: str, ran: bool) -> str:
        return f"source in {source_dir}" if ran else \
            f"not needed: the dataset {location.dataset_dir(run.cfg)} is complete"


STAGE = DownloadStage()
