"""Tokenize-and-shard: source text -> GPT-2 token shards (llm.c layout) + manifest.json.

    pieces = plan_pieces(cfg, source_dir)      # planning.py: fixed contiguous document ranges of the source
    for p in pieces: tokenize_piece(cfg, p)    # tokenizing.py: in parallel (processes / Prefect tasks), any order
    manifest = ShardCutter(cfg, pieces).finish()   # cutting.py: shards from the ordered concatenation of pieces

    manifest = build(cfg, tokenize)            # all of it: fetch, plan, `tokenize` runs the pieces (a process
                                               # pool in run(), Prefect tasks in tasks/tokenize.py), cut as they finish

Every document is preceded by EOT (50256), as in build-nanogpt. Shards hold exactly data.shard_tokens
tokens (the last one fewer); documents may span shards and no token is dropped. Shard 0 is `val`.

Why pieces: a piece is a range of documents fixed by the source alone (not by the number of workers),
so workers can finish in any order and the shards, cut afterwards from the pieces in order, are
byte-identical for 1 or N workers. Each piece file and each shard is written atomically and recorded
with its sha256, so a run killed at any point (even SIGKILL) redoes only what is missing or broken.
The manifest is written last: its presence means the dataset is complete.

Where a dataset lives and whether it is complete: location.py (what the trainer and evaluator import).
This module is the driver: the lock, fetch -> plan -> tokenize -> cut, the process pool and the CLI.

CLI: python -m gptcore.data.build <preset|file.toml> [data.key=value ...] [--full-verify]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from tqdm import tqdm

from gptcore.config import ConfigError, RunConfig
from gptcore.data import sources
from gptcore.data.cutting import ShardCutter, pieces_to_tokenize
from gptcore.data.location import (
    CHECKED,
    PIECES,
    PROGRESS,
    DataError,
    dataset_dir,
    dataset_name,
    listing_path,
    located,
    remember_hashes,
    why_incomplete,
)
from gptcore.data.planning import Piece, plan_pieces
from gptcore.data.shard_format import MANIFEST, Manifest, ShardError
from gptcore.data.tokenizing import tokenize_piece, worker_threads
from gptcore.files import read_json, remove_stale_temps
from gptcore.model.tokenizer import get_encoding
from gptcore.overrides import load_config
from gptcore.runlock import LockHeld, LocksUnsupported, RunLock


def discard_partial(cfg: RunConfig, listing_existed: bool) -> None:
    """After bad input: leave nothing half-made. Without a finished manifest the work area (piece files,
    progress) goes, and a local source's listing that this run created; a hub download stays (verified
    files, costly to fetch again)."""
    out = dataset_dir(cfg)
    if not (out / MANIFEST).is_file():
        shutil.rmtree(out / PIECES, ignore_errors=True)
        (out / PROGRESS).unlink(missing_ok=True)
        for shard in out.glob(f"{dataset_name(cfg)}_*.bin"):  # cut while later pieces were tokenized
            shard.unlink()
        remove_stale_temps(out)
        with suppress(OSError):  # removed only when empty
            out.rmdir()
    if not listing_existed and sources.source_kind(cfg).in_place:
        listing_path(cfg).unlink(missing_ok=True)
        with suppress(OSError):  # removed only when empty
            listing_path(cfg).parent.rmdir()


def build(cfg: RunConfig, tokenize, full_verify: bool = False, say=None) -> Manifest:
    """fetch -> plan -> tokenize the pieces not done yet -> cut shards as they complete -> manifest.
    `tokenize(cfg, pieces, todo, piece_done)` runs tokenize_piece on each piece of `todo` (a process pool,
    Prefect tasks on any task runner) and calls piece_done(index, tokens) as each finishes, in any order.
    Skips when complete (full_verify: re-hash every shard to decide, which also repairs silently
    corrupted ones). Bad input leaves nothing half-made behind (discard_partial). `say` reports (stderr)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = located(cfg)  # workers may run with another GPTPIPE_HOME / cwd
    out = dataset_dir(cfg)
    with build_lock(out, say):
        existed = listing_path(cfg).is_file()
        try:
            remove_stale_temps(out)  # what a killed run was writing
            source_dir = sources.fetch(cfg)
            why = why_incomplete(cfg, full=full_verify)
            if why is None:
                say(f"dataset {out} is complete; checked: {CHECKED}; nothing to do")
                return Manifest.load(out)
            say(f"dataset {out}: {why}; "
                f"{'building it' if why == 'no manifest yet' else 'rebuilding what that touches'}")
            pieces = plan_pieces(cfg, source_dir)
            todo = pieces_to_tokenize(cfg, pieces)
            say(f"{len(pieces)} pieces planned, {len(todo)} to tokenize")
            t0 = time.perf_counter()
            cutter = ShardCutter(cfg, pieces, todo)  # cuts each shard as soon as the pieces before its end are done
            tokenize(cfg, pieces, todo, lambda index, tokens: cutter.piece_done(index))
            manifest = cutter.finish()
        except (sources.SourceError, DataError, ShardError):
            discard_partial(cfg, existed)
            raise
        remember_hashes(out, manifest)
        dt = time.perf_counter() - t0
        say(f"dataset {out}: {manifest.total_tokens():,} tokens in {len(manifest.shards)} shards ({dt:.1f}s, "
            f"{manifest.total_tokens() / max(dt, 1e-9) / 1e6:.2f}M tok/s), manifest {manifest.id}")
        return manifest


def rebuild_damaged(cfg: RunConfig, manifest: Manifest, bad: list[str], say=None) -> str | None:
    """Rebuild shards `bad` of `manifest`'s dataset in place, byte-identical, from the source it was made
    from (the trainer's start after a damaged-shard event: its hang restart the same night would otherwise
    stop on the damage). Refuses (returns why) unless cfg's data settings and the source are still the ones
    the manifest records: a rebuild from anything else would be another dataset, and this one's run would
    then refuse it. One tokenizer process: it runs inside a trainer, where forking is not safe."""
    m, d = manifest, cfg.data
    if (m.shard_tokens, m.source.get("source"), m.source.get("text_column"), m.source.get("max_docs")) != (
            d.shard_tokens, d.source, d.text_column, d.max_docs):
        return "this run's data settings are not the ones the dataset was made with"
    try:
        if (change := sources.source_kind(cfg).changed(cfg, m.source, listing_path(cfg).parent)) is not None:
            return f"its source changed since ({change})"
        (say or print)(f"shards {', '.join(bad[:5])} no longer match their sha256: rebuilding them from the source")
        rebuilt = build(cfg, lambda *a: _pool_tokenize(*a, workers=1), full_verify=True, say=say)
    except (sources.SourceError, DataError, ShardError, OSError) as e:
        return f"rebuilding failed ({type(e).__name__}: {e})"
    return None if rebuilt.id == m.id else f"the rebuilt dataset differs (manifest id {rebuilt.id}, not {m.id})"


@contextmanager
def build_lock(out: Path, say):
    """One build per dataset directory (e.g. two nightly deployments sharing a dataset): the second waits
    for the first, then finds the dataset complete. Before, each took the other's pieces for damage and
    both failed, throwing the work away. An flock, dropped by the kernel when its holder dies."""
    lock = RunLock(out.parent, name=f".{out.name}.build.lock", remove=True)
    try:
        lock.acquire()
    except LocksUnsupported:
        say(f"warning: the filesystem of {out} has no file locks: two builds of it at once are not prevented")
    except LockHeld:
        say(f"waiting for another build of {out} to finish (holder: {read_json(lock.path, {}) or 'unknown'})")
        lock.timeout = float("inf")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()  # nothing to release when the filesystem could not lock


# --- plain-python workers (no Prefect): python -m gptcore.data.build ----------------------------------

def _tokenize_job(args):
    cfg, piece, threads = args
    return piece.index, tokenize_piece(cfg, piece, threads)


def run(cfg: RunConfig, workers: int | None = None, full_verify: bool = False) -> Manifest:
    """build() with the pieces tokenized on a process pool of `workers` (default data.num_workers, or one
    per core) and a progress bar."""
    return build(cfg, lambda *a: _pool_tokenize(*a, workers=workers), full_verify)


def _pool_tokenize(cfg: RunConfig, pieces: list[Piece], todo: list[Piece], piece_done, workers: int | None):
    workers = min(workers or cfg.data.num_workers or os.cpu_count() or 1, max(1, len(todo)))
    jobs = [(cfg, p, worker_threads(cfg, workers)) for p in todo]
    with tqdm(total=int(sum(p.est_bytes for p in todo) / 4.2), unit="tok", unit_scale=True, desc="tokenize",
              disable=None) as bar, ExitStack() as stack:
        results = map(_tokenize_job, jobs)
        if workers > 1:
            from gptcore.data import build  # the job must pickle as gptcore.data.build.*, not __main__.*
            # fork: workers inherit the imported modules and the GPT-2 encoding built here, so they start
            # in milliseconds instead of re-importing and re-building it. The parent has only read parquet
            # metadata so far (no arrow compute threads that fork could strand).
            get_encoding()
            pool = stack.enter_context(mp.get_context("fork" if sys.platform == "linux" else "spawn").Pool(workers))
            results = pool.imap_unordered(build._tokenize_job, jobs)
        for i, n in results:
            piece_done(i, n)
            bar.update(n)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    full = "--full-verify" in argv
    argv = [a for a in argv if a != "--full-verify"]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        run(load_config(argv[0], argv[1:]), full_verify=full)
    except (ConfigError, sources.SourceError, DataError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing: e.g. the disk filled up after the free-space check
        print(f"error: cannot write the dataset: {e}. Nothing half-written was kept and finished pieces and "
              "shards stay for the next run: make room on that disk (or move the file that stands where a "
              "directory belongs) and run again", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
