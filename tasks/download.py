"""Prefect stage: make the training text available locally (hub download, local dir, or built-in).

The work is gptcore.data.sources.fetch: file-by-file, verified, idempotent (a second run only checks sizes
and mtimes, without touching the network), so retries are cheap and safe.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.config import RunConfig
from gptcore.data import sources
from gptcore.overrides import as_config


@task(name="download", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def download_task(cfg: RunConfig | dict) -> str:
    """Returns the source directory (holding source.json) as a string."""
    return str(sources.fetch(as_config(cfg)))
