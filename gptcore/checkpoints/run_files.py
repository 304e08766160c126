"""What a run directory holds, read without torch: the flow decides what to skip in milliseconds, and
only the stages that do work import torch.

    <run_dir>/run.json                      the run's identity (config hash, manifest id), written at start
    <run_dir>/DONE                          written when the run reached max_steps
    <run_dir>/checkpoints/step_00001000/    one checkpoint (gptcore.checkpoints.checkpoint writes and verifies them);
                                            its eval.json (val loss, each evaluation) is added once evaluated
    <run_dir>/checkpoints/rejected/         checkpoints that failed verification, each with a why.txt
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from gptcore.config import RunConfig
from gptcore.files import READ_ERRORS, pipeline_home, read_json

RUN_FILE = "run.json"
DONE_FILE = "DONE"
META_FILE = "meta.json"
MICRO_BATCH_FILE = "micro_batch.json"  # train.micro_batch=auto's choice (gptcore/training/microbatch.py)
EVAL_FILE = "eval.json"  # a checkpoint's evaluation: written by the trainer after the checkpoint, or the flow
REJECTED_DIR = "rejected"
SHARDED = "sharded"  # meta.json's "format" of a sharded step (FSDP2; a whole checkpoint records none)
SHARDS_DIR = "shards"  # a sharded step's DCP files (gptcore/checkpoints/sharded.py)
CONSOLIDATED_DIR = "consolidated"  # a sharded step's whole model, once registered (checkpoint.consolidate)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def is_sharded(meta: dict) -> bool:
    """Whether a step's meta.json describes a sharded step (gptcore/checkpoints/sharded.py)."""
    return meta.get("format") == SHARDED


def consolidation_source(meta: dict) -> dict:
    """What a sharded step's consolidated model was made from (its consolidated/meta.json records it):
    reused while this is the same, made again otherwise."""
    return {k: meta.get(k) for k in ("shards_sha256", "trainer_sha256")}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model; the message says what."""


def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.train.run_dir).expanduser().resolve() if cfg.train.run_dir else \
        pipeline_home() / "runs" / cfg.run_name


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:08d}"


def step_dirs(run_dir: Path) -> list[Path]:
    """Every step_* directory, complete or not, oldest first (what a resume has to choose from)."""
    d = checkpoints_dir(run_dir)
    return sorted(p for p in d.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()) if d.is_dir() else []


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (those with meta.json), oldest step first."""
    return [p for p in step_dirs(run_dir) if (p / META_FILE).is_file()]


def rejected(run_dir: Path) -> list[Path]:
    d = checkpoints_dir(run_dir) / REJECTED_DIR
    return sorted(p for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


def read_part(path: Path, read: Callable[[Path], object], missing: str, damaged: str):
    """`read(path)` for one file of a checkpoint; CheckpointError when it is not there (`missing`: what
    that means and the fix) or cannot be read (the error, then `damaged`: the fix)."""
    if not path.is_file():
        raise CheckpointError(missing)
    try:
        return read(path)
    except READ_ERRORS as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); {damaged}") from e


def read_meta(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / META_FILE
    meta = read_part(path, lambda p: json.loads(p.read_text()),
                     f"{ckpt_dir} is not a checkpoint: no {META_FILE}; pass a directory like "
                     "<home>/runs/<run>/checkpoints/step_00001000", "the checkpoint is corrupt")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds no JSON object; the checkpoint is corrupt")
    return meta


def finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def healthy(meta: dict) -> bool:
    """Written from a step with a finite train loss (or before the guard recorded one)."""
    return meta.get("train_loss") is None or finite(meta["train_loss"])


def readable(ckpts) -> Iterator[tuple[Path, dict]]:
    """(checkpoint, its meta) for each of `ckpts` whose meta.json reads, in their order: a damaged one is
    passed over (it is the trainer's to reject: the flow must not stop on it before the trainer can resume
    from the one before)."""
    for c in ckpts:
        try:
            yield c, read_meta(c)
        except CheckpointError:
            continue


def newest_healthy(ckpts: list[Path]) -> Path | None:
    """The newest of `ckpts` that is healthy (see `healthy`)."""
    return next((c for c, meta in readable(reversed(ckpts)) if healthy(meta)), None)


def latest(run_dir: Path) -> tuple[Path | None, dict]:
    """The newest complete checkpoint whose meta.json reads, and its meta; (None, {}) when there is none."""
    return next(readable(reversed(list_checkpoints(run_dir))), (None, {}))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose meta.json reads (see `readable`)."""
    return latest(run_dir)[0]


def checkpoint_of(path: Path) -> Path:
    """A run directory means its newest checkpoint; any other path (a checkpoint, an HF export) itself."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"run directory {path} has no complete checkpoint yet; train first")
        return ckpt
    return path


def val_loss_of(ckpt: Path, meta: dict) -> float | None:
    """A checkpoint's val loss: its eval.json's (the trainer evaluates after the checkpoint is written), or
    the one meta.json recorded (checkpoints written before); None when neither holds a finite one."""
    for value in (read_json(Path(ckpt) / EVAL_FILE, {}).get("val_loss"), meta.get("val_loss")):
        if finite(value):
            return value
    return None


def best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint with the lowest recorded val loss (latest step wins ties); the latest checkpoint
    if none has a val loss; None if there are no checkpoints."""
    ckpts = list_checkpoints(run_dir)
    scored = [(v, -int(c.name[5:]), c) for c, m in readable(ckpts) if (v := val_loss_of(c, m)) is not None]
    if scored:
        return min(scored)[2]
    return ckpts[-1] if ckpts else None


def run_state(run_dir: Path, identity_hash: str | None = None) -> dict:
    """What is on disk: newest checkpoint and its step, and whether the run is DONE (for this identity,
    when given: a DONE left by a different trajectory does not count)."""
    run_dir = Path(run_dir)
    ckpt, meta = latest(run_dir)
    step = meta.get("step")
    done = (run_dir / DONE_FILE).exists() and ckpt is not None
    if done and identity_hash:
        done = read_json(run_dir / RUN_FILE, {}).get("identity_hash") == identity_hash
    return {"run_dir": str(run_dir), "checkpoint": str(ckpt) if ckpt else None, "step": step, "done": done}


def out_of_memory_choice(run_dir: Path) -> int | None:
    """The micro-batch a rank fell back to after running out of memory (micro_batch.json, written by the
    trainer under train.micro_batch=auto), or None: for a launcher, which must not import torch."""
    kept = read_json(Path(run_dir) / MICRO_BATCH_FILE) or {}
    return int(kept["micro_batch"]) if kept.get("after_out_of_memory") else None
