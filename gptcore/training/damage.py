"""Shards that rot while a run trains on them: named once, and dropped from the hash caches.

The loaders re-hash each shard once an epoch in the background (gptcore/data/loader.py) and report those
whose bytes no longer hash to the manifest: bit rot that kept the file's size and mtime, which the hash
caches (files.cached_sha256) would otherwise vouch for. Training goes on: the damage is already in this
run, and stopping would not undo it. Dropping the shard from the caches makes the next trainer start
(resume.verify_or_rebuild) and the next data stage re-hash it, find it damaged and rebuild it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gptcore.files import read_json, write_json


class DamagedShards:
    """`hosts[r]` names rank r's host; `caches` are the hash caches to drop a damaged shard from (the
    dataset's and the run's, on rank 0 only: one writer per file); `event(step, text, who=...)` reports
    (the trainer's EventLog)."""

    def __init__(self, hosts: list[str], caches: list[Path], event: Callable[..., None]):
        self.hosts, self.caches, self.event = hosts, caches, event
        self.seen: set[str] = set()  # each shard is reported once, whichever ranks find it and how often

    def report(self, step: int, found: list[list[str]]) -> None:
        """`found[r]`: the shards rank r's loader found damaged since the last log step."""
        for rank, names in enumerate(found):
            for name in names:
                if name in self.seen:
                    continue
                self.seen.add(name)
                self.event(step, f"shard {name} (read by rank {rank} on host {self.hosts[rank]}) no longer "
                           "matches its sha256 in the manifest: its bytes changed on disk or in memory "
                           "without a new size or mtime (bit rot). This run goes on with it; the trainer's next "
                           "start (a restart) or the next data stage rebuilds it from its source (it is dropped "
                           "from the hash caches)", who="data")
                for cache in self.caches:
                    forget_hash(cache, name)


def forget_hash(cache: Path, name: str) -> None:
    """Drop `name` from a hash cache (files.cached_sha256's JSON), so its next check re-hashes it."""
    hashes = read_json(cache, {})
    if hashes.pop(name, None) is not None:
        try:
            write_json(cache, hashes)
        except OSError:  # a read-only dataset: the data stage's own check then hashes anyway on --full-verify
            pass
