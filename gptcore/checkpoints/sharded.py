"""Sharded checkpoints: under FSDP2 every rank writes its own shard with Distributed Checkpoint (DCP).

A sharded step is a checkpoint directory like any other (same name, same atomic swap, same retention and
fallback), holding

    shards/         DCP's files: `__<rank>_0.distcp` per rank and `.metadata` (each tensor's global shape
                    and where its pieces lie). The weights under `model.*`, AdamW's state under `optim.*`,
                    both keyed by parameter name, so one rank, DDP or FSDP on any world size can load them.
    trainer.pt      the rest of the trainer state (data position, every rank's RNG, ...), no optimizer
    meta.json       as for a whole checkpoint, plus `format: "sharded"` and `shards_sha256` {file: sha256}

Why sharded: a whole checkpoint gathers every weight and both AdamW moments onto rank 0 (~18 GB at 1.5B) and
rank 0 writes them alone; sharded, each rank copies 1/world of it off the device and writes that.

Asynchronous: `start_save` snapshots this rank's shard into CPU memory (all the ranks wait for) and hands
the write to DCP's background thread, whose collectives run on a gloo group of their own (`saving_group`),
apart from training's. Rank 0's Checkpointer waits for the save to finish on every rank (DCP's last step is
a collective), hashes every file, writes trainer.pt and meta.json and renames the directory into place: a
step counts once it is whole, and a rotted shard is caught by its hash before anything loads it.

The registry, HF export, evaluation and generation need one model: checkpoint.load_model reads a sharded
step's weights into a plain GPT in one CPU process (no process group, no GPU), and checkpoint.consolidate
writes them once as a whole checkpoint's model.safetensors + meta.json (the register stage does, for the
versions it registers: the trainer's critical path never gathers the model).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gptcore import distributed
from gptcore.checkpoints.run_files import META_FILE, SHARDS_DIR, CheckpointError
from gptcore.files import READ_ERRORS, file_sha256
from gptcore.model.gpt import unwrap


def saving_group():
    """A gloo process group for DCP's background saves (collective: every rank calls it once). Training's
    collectives run on the default group meanwhile; sharing it between two threads would interleave them."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


# --- writing --------------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def start_save(tmp: Path, model: torch.nn.Module, optimizer, group) -> Future | None:
    """Every rank (collective): copy this rank's shard of the weights and AdamW state to CPU memory, then
    write it into <tmp>/shards in the background; returns the save's Future. None on every rank, with
    nothing written, when any rank's shard holds a NaN or an infinity (a checkpoint is never written from
    non-finite weights)."""
    target = unwrap(model)
    weights, optim = get_state_dict(target, optimizer)
    checks = [torch.isfinite(_local(v)).all() for v in weights.values() if v.is_floating_point()]
    finite = bool(torch.stack(checks).all()) if checks else True  # one host read, not one per tensor
    if not all(distributed.all_gather_object(finite)):
        return None
    return dcp.async_save({"model": weights, "optim": optim}, checkpoint_id=str(Path(tmp) / SHARDS_DIR),
                          process_group=group)


def hashes(ckpt_dir: Path) -> dict[str, str]:
    """sha256 of every file under <ckpt_dir>/shards (meta.json's `shards_sha256`)."""
    return {f.name: file_sha256(f) for f in sorted((Path(ckpt_dir) / SHARDS_DIR).iterdir()) if f.is_file()}


# --- reading --------------------------------------------------------------------------------------

def verify(ckpt_dir: Path, meta: dict) -> None:
    """CheckpointError unless every shard file meta.json lists is there with its recorded sha256."""
    expected = meta.get("shards_sha256")
    if not isinstance(expected, dict) or not expected:
        raise CheckpointError(f"{META_FILE} records no sha256 for the shard files, so they cannot be verified")
    for name, sha in sorted(expected.items()):
        path = Path(ckpt_dir) / SHARDS_DIR / name
        if not path.is_file():
            raise CheckpointError(f"{SHARDS_DIR}/{name} is missing")
        if file_sha256(path) != sha:
            raise CheckpointError(f"{SHARDS_DIR}/{name} does not match the sha256 in {META_FILE} "
                                  "(damaged or half-copied)")


def check_fits(ckpt_dir: Path, model: torch.nn.Module) -> None:
    """CheckpointError naming the tensors when the step's weights do not fit `model`, before anything loads."""
    shards = Path(ckpt_dir) / SHARDS_DIR
    try:
        stored = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    except READ_ERRORS as e:
        raise CheckpointError(f"{shards}/.metadata cannot be read ({type(e).__name__}: {e}); the step is "
                              "damaged: resume from another checkpoint") from e
    saved = {k.removeprefix("model."): tuple(m.size) for k, m in stored.items()
             if k.startswith("model.") and hasattr(m, "size")}
    own = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}  # a DTensor's shape is global
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    wrong = [f"{k}: checkpoint {saved[k]} vs model {own[k]}" for k in own if k in saved and saved[k] != own[k]]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{ckpt_dir} does not fit this model (a checkpoint from another model shape?): missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, shape mismatch {wrong[:5]}; use the model config "
            "the checkpoint was trained with, or start a new run name")


def load_weights(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """A sharded step's weights into `model`: a sharded model reads its own pieces (collective: every rank
    calls it); a plain one (one rank, DDP, a CPU copy for the registry) reads the whole tensors into its
    own storage, in this process alone. check_fits first."""
    target = unwrap(model)
    if isinstance(target, FSDPModule):
        state = get_model_state_dict(target)
        _read({"model": state}, ckpt_dir, alone=False)
        set_model_state_dict(target, state)
    else:
        _read({"model": target.state_dict()}, ckpt_dir, alone=True)


def load_optimizer(model: torch.nn.Module, optimizer, ckpt_dir: Path) -> None:
    """A sharded step's AdamW state into `optimizer` (of `model`'s parameters), resharded to this run's
    layout; collective under FSDP, this process alone otherwise."""
    target = unwrap(model)
    state = get_optimizer_state_dict(target, optimizer)  # the tensors to read into (it creates them if new)
    _read({"optim": state}, ckpt_dir, alone=not isinstance(target, FSDPModule))
    set_optimizer_state_dict(target, optimizer, state)


def _read(state: dict, ckpt_dir: Path, alone: bool) -> None:
    """dcp.load into `state`'s tensors: with every rank (a collective) or in this process `alone`."""
    with warnings.catch_warnings():  # DCP warns at every load in one process, which is what `alone` asks
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(Path(ckpt_dir) / SHARDS_DIR), no_dist=alone)
