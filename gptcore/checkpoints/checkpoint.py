"""The one checkpoint writer and reader.

A checkpoint is a directory `<run_dir>/checkpoints/step_{step:08d}/` holding

    model.safetensors   the clean model weights (no `_orig_mod.` / `module.` prefixes; the tied
                        embedding stored once, as `transformer.wte.weight`, like Hugging Face GPT-2)
    trainer.pt          everything else needed to resume exactly: optimizer, data-loader position,
                        RNG states of every rank, GradScaler. Plain tensors/containers only, so it
                        loads with `torch.load(weights_only=True)` (no pickled code).
    meta.json           step, tokens seen, val and train loss, config, model config, manifest id, run
                        identity, sha256 of model.safetensors and of trainer.pt

A sharded step (FSDP2) holds `shards/` (each rank's part, written by the ranks with DCP) in place of
model.safetensors, and trainer.pt without the optimizer (which is in the shards): gptcore/checkpoints/
sharded.py. Everything below reads both formats; `consolidate` turns a sharded step into a whole model.

It is written into a temp dir beside it and renamed into place (files.atomic_dir), so a reader (or a resume after
SIGKILL) sees either a complete checkpoint or none; it is never written from non-finite weights.
Retention keeps the last `keep_last`, the best one by validation loss and the newest one whose train loss
was finite. Before a resume, `load_for_resume` checks a checkpoint whole (files, both hashes, loadable,
finite weights); one that fails is moved to `checkpoints/rejected/` with a `why.txt`, never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

from gptcore.checkpoints import sharded
from gptcore.checkpoints.run_files import (
    CONSOLIDATED_DIR,
    META_FILE,
    REJECTED_DIR,
    SHARDED,
    CheckpointError,
    best_checkpoint,
    checkpoints_dir,
    consolidation_source,
    is_sharded,
    list_checkpoints,
    newest_healthy,
    read_meta,
    read_part,
    step_dir,
)
from gptcore.config import ConfigError, model_config_from
from gptcore.files import READ_ERRORS, atomic_dir, file_sha256, hashed_write, publish_dir, start_dir, temp_name
from gptcore.model.gpt import GPT, clean_state_dict, empty_on_host, unwrap

MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
TIED = ("lm_head.weight", "transformer.wte.weight")  # (dropped on save, kept) - the same tensor


# --- weights ------------------------------------------------------------------------------------

def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's clean state dict (live tensors, wherever they are), the tied head weight left out:
    what model.safetensors holds. (A sharded model's checkpoint is written by its ranks: sharded.py.)"""
    return portable(unwrap(model).state_dict())


def portable(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as model.safetensors holds it: no wrapper prefixes, the tied head weight left out."""
    sd = clean_state_dict(state)
    sd.pop(TIED[0], None)
    return {k: v.detach() for k, v in sd.items()}


def load_weights(model: torch.nn.Module, path: Path, load: bool = True) -> dict[str, torch.Tensor]:
    """Load model.safetensors into `model` (plain, compiled, DDP-wrapped or sharded by FSDP2: each rank
    keeps its shard); a shape or key mismatch raises CheckpointError naming the tensors, before anything
    is changed. Returns the file's tensors. `load=False`: only the checks (loading into a sharded model
    is a collective, which one rank choosing a checkpoint must not start alone)."""
    try:
        sd = load_file(str(path))
    except READ_ERRORS as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is damaged: "
                              "resume from another checkpoint (the trainer does so by itself)") from e
    if TIED[1] in sd:
        sd[TIED[0]] = sd[TIED[1]]
    target = unwrap(model)
    own = target.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    wrong = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
             for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{path} does not fit this model (a checkpoint from another model shape?): "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatch {wrong[:5]}; "
            "use the model config the checkpoint was trained with, or start a new run name")
    if load and isinstance(target, FSDPModule):  # the whole tensors in, each rank's shard of them kept
        set_model_state_dict(target, sd, options=StateDictOptions(full_state_dict=True, strict=True))
    elif load:
        target.load_state_dict(sd, strict=True)
    return sd


# --- writing ------------------------------------------------------------------------------------

def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, trainer_state: dict, meta: dict,
                    keep_last: int = 3) -> Path:
    """Write one checkpoint of a live model atomically and apply retention; returns its directory."""
    weights = {k: v.to("cpu").contiguous() for k, v in weights_of(model).items()}
    return write_checkpoint(run_dir, step, weights, trainer_state, {
        **meta, "model_config": asdict(unwrap(model).config)}, keep_last)


def write_checkpoint(run_dir: Path, step: int, weights: dict[str, torch.Tensor] | None, trainer_state: dict,
                     meta: dict, keep_last: int = 3, before_prune=None, staged: Path | None = None) -> Path:
    """The one checkpoint writer: CPU `weights` (weights_of) and trainer state into a directory built under
    a temp name and swapped in; each file hashed while it is written (no read-back). `meta` supplies the
    run fields (config, model_config, manifest_id, ...); step, the sha256s and time are added.
    CheckpointError (nothing written) for non-finite weights. A sharded step: `weights` None and `staged`
    the temp directory (files.start_dir) whose shards/ the ranks have written (sharded.start_save); its
    files are hashed here. `before_prune(path)` runs once the checkpoint is in place (the async writer
    attaches evaluation results there); then retention is applied."""
    path = step_dir(run_dir, step)
    bad = non_finite(weights) if weights is not None else []
    if bad:
        raise CheckpointError(f"refusing to write step {step}: non-finite values in {bad[:5]}")
    tmp = staged or start_dir(path)
    try:
        if weights is not None:
            meta = {**meta, "model_sha256": hashed_write(
                tmp / MODEL_FILE, lambda f: f.write(save(weights, metadata={"format": "pt"})))}
        else:
            meta = {**meta, "format": SHARDED, "shards_sha256": sharded.hashes(tmp)}
        trainer_sha = hashed_write(tmp / TRAINER_FILE, lambda f: torch.save(trainer_state, f))
        _slow_storage_for_tests()
        meta = {**meta, "step": step, "trainer_sha256": trainer_sha, "time": time.time()}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, default=str))
        publish_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if before_prune is not None:
        before_prune(path)
    prune(run_dir, keep_last)
    return path


def _slow_storage_for_tests() -> None:
    """Tests stand in for slow shared storage: GPTPIPE_TEST_CHECKPOINT_DELAY=<seconds> per checkpoint."""
    delay = float(os.environ.get("GPTPIPE_TEST_CHECKPOINT_DELAY") or 0)
    if delay > 0:
        print(f"checkpoint write delayed {delay:.0f}s (GPTPIPE_TEST_CHECKPOINT_DELAY)", flush=True)
        time.sleep(delay)


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete checkpoints except the last `keep_last`, the best by val loss and the newest whose train
    loss was finite (the rollback target if the newer ones came from a diverging run)."""
    ckpts = list_checkpoints(run_dir)
    keep = set(ckpts[-keep_last:]) if keep_last > 0 else set()
    for c in [best_checkpoint(run_dir), newest_healthy(ckpts)]:
        if c is not None:
            keep.add(c)
    for c in [p for p in ckpts if p not in keep]:
        # rename first so a half-deleted directory is never mistaken for a checkpoint
        trash = temp_name(c.with_name(f"{c.name}.del"))  # removed by the next save if this one is killed
        os.replace(c, trash)
        shutil.rmtree(trash, ignore_errors=True)


# --- reading ------------------------------------------------------------------------------------

def load_trainer_state(ckpt_dir: Path) -> dict:
    return read_part(Path(ckpt_dir) / TRAINER_FILE, lambda p: torch.load(p, map_location="cpu", weights_only=True),
                     f"{ckpt_dir} has no {TRAINER_FILE}: it holds weights only and cannot resume training; start "
                     "a new run from it or pick another checkpoint",
                     "the file is damaged: resume from another checkpoint")


# --- resuming: verify whole, fall back, keep what failed -------------------------------------------

def _same_hash(path: Path, expected, what: str) -> None:
    if not isinstance(expected, str) or len(expected) != 64:
        raise CheckpointError(f"{META_FILE} records no sha256 for {what}, so it cannot be verified")
    if file_sha256(path) != expected:
        raise CheckpointError(f"{what} does not match the sha256 in {META_FILE} (damaged or half-copied)")


def load_for_resume(ckpt_dir: Path, model: torch.nn.Module, load: bool = True) -> tuple[dict, dict]:
    """Check `ckpt_dir` whole and load its weights into `model`; returns (meta, trainer state).
    CheckpointError says what is wrong: a file missing, a hash mismatch, unreadable, non-finite weights.
    An OSError while reading is one too (e.g. rank 0 moved the directory to rejected/ meanwhile)."""
    try:
        return _load_for_resume(ckpt_dir, model, load)
    except OSError as e:
        raise CheckpointError(f"cannot be read: {type(e).__name__}: {e}") from e


def _load_for_resume(ckpt_dir: Path, model: torch.nn.Module, load: bool) -> tuple[dict, dict]:
    meta = read_meta(ckpt_dir)
    if is_sharded(meta):
        return meta, _load_sharded(ckpt_dir, meta, model, load)
    for name in (MODEL_FILE, TRAINER_FILE):
        if not (ckpt_dir / name).is_file():
            raise CheckpointError(f"{name} is missing")
    _same_hash(ckpt_dir / MODEL_FILE, meta.get("model_sha256"), MODEL_FILE)
    if "trainer_sha256" in meta:  # checkpoints written before it was recorded have only the model hash
        _same_hash(ckpt_dir / TRAINER_FILE, meta["trainer_sha256"], TRAINER_FILE)
    bad = non_finite(load_weights(model, ckpt_dir / MODEL_FILE, load))  # the file's tensors: what the model holds now
    if bad:
        raise CheckpointError(f"non-finite weights in {bad[:5]}")
    return meta, load_trainer_state(ckpt_dir)


def _load_sharded(ckpt_dir: Path, meta: dict, model: torch.nn.Module, load: bool) -> dict:
    """_load_for_resume of a sharded step. Its weights are not read back for non-finite values: none were
    written (sharded.start_save checks every rank's shard first) and every file's hash matches."""
    if not (ckpt_dir / TRAINER_FILE).is_file():
        raise CheckpointError(f"{TRAINER_FILE} is missing")
    sharded.verify(ckpt_dir, meta)
    _same_hash(ckpt_dir / TRAINER_FILE, meta.get("trainer_sha256"), TRAINER_FILE)
    sharded.check_fits(ckpt_dir, model)
    state = load_trainer_state(ckpt_dir)
    if load:
        sharded.load_weights(model, ckpt_dir)
    # restore() reads the optimizer's state from the shards once the optimizer exists
    return {**state, "optimizer_shards": str(ckpt_dir)}


def load_into(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """A verified checkpoint's weights into `model`, whichever format the step has (collective for a
    sharded model: every rank calls it)."""
    if is_sharded(read_meta(ckpt_dir)):
        sharded.load_weights(model, ckpt_dir)
    else:
        load_weights(model, ckpt_dir / MODEL_FILE)


def reject(ckpt_dir: Path, why: str) -> Path | None:
    """Move a checkpoint that failed verification to checkpoints/rejected/ with a why.txt; never delete.
    None when it cannot be moved (e.g. `rejected` is a file, a read-only disk): it stays where it is."""
    dest_dir = checkpoints_dir(ckpt_dir.parent.parent) / REJECTED_DIR
    try:
        dest_dir.mkdir(exist_ok=True)
        dest, n = dest_dir / ckpt_dir.name, 1
        while dest.exists():
            n += 1
            dest = dest_dir / f"{ckpt_dir.name}-{n}"
        os.replace(ckpt_dir, dest)
        (dest / "why.txt").write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {why}\n")
    except OSError:
        return None
    return dest


def load_model(ckpt_dir: Path, device="cpu", verify: bool = True) -> tuple[GPT, dict]:
    """The GPT stored in a checkpoint (weights only; trainer.pt not needed), in eval mode, and its meta."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    try:  # the shape is checked before anything is allocated: meta.json may come from a registry version
        model_cfg = model_config_from(meta.get("model_config"))
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{ckpt_dir}/{META_FILE} has no usable model_config ({e}); the checkpoint is "
                              "corrupt or was not written by this pipeline") from e
    model = empty_on_host(model_cfg)  # every weight is loaded below, strictly
    if is_sharded(meta):  # the whole model from every rank's shard, in this process alone
        if verify:
            sharded.verify(ckpt_dir, meta)
        sharded.check_fits(ckpt_dir, model)
        sharded.load_weights(model, ckpt_dir)
        return model.to(device).eval(), meta
    weights = ckpt_dir / MODEL_FILE
    if not weights.is_file():
        raise CheckpointError(f"{ckpt_dir} has no {MODEL_FILE}; the checkpoint is incomplete")
    if verify and meta.get("model_sha256") and file_sha256(weights) != meta["model_sha256"]:
        raise CheckpointError(f"{weights} does not match the sha256 in {META_FILE}: the file is corrupt")
    load_weights(model, weights)
    return model.to(device).eval(), meta


def consolidate(ckpt_dir: Path) -> Path:
    """The directory holding a checkpoint's whole model as model.safetensors + meta.json (what the
    registry logs): the step itself when it is whole; for a sharded step <step>/consolidated/, written once
    (atomically, from the verified shards, on the CPU) and reused while the shards it came from are the
    same. Its meta.json is the step's with the consolidated file's model_sha256 and no shard list."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    if not is_sharded(meta):
        return ckpt_dir
    out = ckpt_dir / CONSOLIDATED_DIR
    source = consolidation_source(meta)
    if (out / META_FILE).is_file() and (out / MODEL_FILE).is_file():
        done = read_meta(out)
        if done.get("consolidated_from") == source and file_sha256(out / MODEL_FILE) == done.get("model_sha256"):
            return out
    model, _ = load_model(ckpt_dir, verify=True)
    with atomic_dir(out) as tmp:
        sha = hashed_write(tmp / MODEL_FILE, lambda f: f.write(save(weights_of(model), metadata={"format": "pt"})))
        whole = {k: v for k, v in meta.items() if k not in ("format", "shards_sha256")}
        (tmp / META_FILE).write_text(json.dumps({**whole, "model_sha256": sha, "consolidated_from": source},
                                                indent=1, default=str))
    return out
