"""Where a training invocation starts: every check that can fail on bad input, then the newest checkpoint
that verifies whole.

`prepare` runs before any process group exists: the dataset (manifest and shard hashes), the run's
identity (run.json), whether the run is already DONE, the newest checkpoint's model and dataset, and the
run's lock (rank 0). `newest_intact` loads the newest checkpoint whose files, hashes and weights check out;
one that fails is moved to checkpoints/rejected/ with a why.txt, never deleted. The Trainer uses it again to
roll back, and `restore` puts a checkpoint's trainer state back.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from gptcore import distributed
from gptcore.checkpoints import checkpoint, run_files, sharded
from gptcore.checkpoints.run_files import DONE_FILE, RUN_FILE, latest, run_dir_for
from gptcore.config import RunConfig
from gptcore.data.build import rebuild_damaged
from gptcore.data.loader import ShardLoader, open_dataset, verify_hashes
from gptcore.data.location import SHARD_HASHES, dataset_dir  # the hash cache's name; the run dir keeps a copy
from gptcore.data.shard_format import Manifest
from gptcore.files import read_json
from gptcore.model import fp8
from gptcore.model.gpt import GPT, build_on
from gptcore.runlock import RunLock
from gptcore.training import parallel


class RunError(RuntimeError):
    """The run directory does not fit this invocation; the message says why and what to do."""


@dataclass
class Prepared:
    """What `prepare` found: everything the Trainer needs, all checked before any process group exists."""
    cfg: RunConfig
    run_dir: Path
    data_dir: Path
    manifest: Manifest
    env: distributed.Env
    model: GPT  # the initial weights, or the resumed checkpoint's
    ckpt: Path | None  # the checkpoint resumed from
    trainer_state: dict | None
    lock: RunLock | None  # rank 0 holds the run directory for the process's life
    fp8_recipe: str | None  # train.fp8 resolved (gptcore/model/fp8.py): None trains the matmuls in bf16


def prepare(cfg: RunConfig, rank: int) -> Prepared | None:
    """Every check that can fail on bad input, before any process group or training step; rank 0 takes
    the run's lock before it writes anything. Returns None (after printing RUN_DONE) when the run has
    already finished."""
    run_dir, data_dir = run_dir_for(cfg), dataset_dir(cfg)
    env = distributed.select(cfg.train)
    check_states_fit(cfg, env)
    fp8_recipe = fp8.recipe_for(cfg.train.fp8, cfg.preset, env.device, env.compile)  # refused where it cannot train
    manifest = open_dataset(data_dir)
    check_run(run_dir, cfg, manifest)
    if (run_dir / DONE_FILE).is_file():
        if rank == 0:
            done = read_json(run_dir / DONE_FILE, {})
            print(f"RUN_DONE run={cfg.run_name} step={done.get('step')} dir={run_dir}: already complete; "
                  "nothing to do", flush=True)
        return None
    check_checkpoints_fit(run_dir, cfg, manifest)
    lock = RunLock(run_dir).acquire() if rank == 0 else None
    try:
        if rank == 0:  # the other ranks wait for it in the process group's rendezvous
            verify_or_rebuild(cfg, data_dir, manifest, run_dir / SHARD_HASHES)
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        model = build_on(cfg.model, env.device)
        ckpt, trainer_state = resume_point(run_dir, model, master=rank == 0)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Prepared(cfg, run_dir, data_dir, manifest, env, model, ckpt, trainer_state, lock, fp8_recipe)


def check_states_fit(cfg: RunConfig, env: distributed.Env) -> None:
    """Refuse (bad input, exit 2) a model whose weights, gradients and optimizer state alone exceed this
    device's memory (the host's available RAM on CPU, the card's total on CUDA), before anything is built:
    `gpt2-1558m` on a 24 GB CPU would otherwise swap for hours or be killed. Activations come on top (the
    micro-batch probe sizes those)."""
    params = cfg.model.approx_params()  # GPT's count from the shape: nothing built at start-up
    # per card under FSDP2; on CPU the ranks share one host's memory, so sharding saves nothing there
    split = env.device.type == "cuda" and parallel.plan(cfg, env).kind == "fsdp"
    need = params * parallel.STATE_BYTES_PER_PARAM // (env.world if split else 1)
    if env.device.type == "cuda":
        have, where = torch.cuda.get_device_properties(env.device).total_memory, f"{env.device} has"
    else:
        have, where = psutil.virtual_memory().available, "this machine has"
    if need > have:
        raise RunError(
            f"{cfg.preset}: {params / 1e9:.2f}B parameters need {need / 2**30:.1f} GiB "
            f"{'per card ' if env.device.type == 'cuda' else ''}for their "
            f"weights, gradients and AdamW state ({parallel.STATE_BYTES_PER_PARAM} bytes each"
            f"{f', sharded over {env.world} ranks' if split else ''}) before any activation; {where} "
            f"{have / 2**30:.1f} GiB. Train it on GPUs with more memory or shard it over more of them "
            f"(train.parallel=fsdp), or smoke-test the pipeline at a tiny width of the same depth: "
            f"model.n_embd=64 model.n_head=4 (docs/training.md \"The GPT-2 family\")")


def verify_or_rebuild(cfg: RunConfig, data_dir: Path, manifest: Manifest, cache: Path) -> None:
    """Every shard's sha256 (cached by size, mtime and inode). A shard that no longer matches (bit rot that
    the trainer reported as an event earlier the same night, then a hang restart) is rebuilt byte-identical
    from the dataset's source before anything trains on it; where that cannot be done, ShardError names the
    shard, why, and the repair. Skipping it instead would change every later batch of the run."""
    bad = manifest.verify_hashes(data_dir, cache)
    if not bad:
        return
    why = rebuild_damaged(cfg, manifest, bad, say=lambda msg: print(msg, file=sys.stderr, flush=True))
    if why is None and not manifest.verify_hashes(data_dir, cache):
        print(f"shards {', '.join(bad[:5])} rebuilt from the source: identical to the manifest again",
              file=sys.stderr, flush=True)
        return
    verify_hashes(data_dir, manifest, cache, why=why or "the rebuilt shards still differ")


def check_run(run_dir: Path, cfg: RunConfig, manifest: Manifest) -> None:
    """RunError if the run's identity record (run.json; none yet for a new run) says the directory belongs
    to another trajectory (other model/optimizer/batch/seed/length or other data)."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        return
    try:
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict):
            raise ValueError(f"a JSON {type(rec).__name__}, not an object")
    except ValueError as e:
        raise RunError(f"{path} is corrupt ({e}); move the run directory away or use another run name") from e
    if rec.get("identity_hash") != cfg.identity_hash():
        raise RunError(f"run {run_dir} was started with another configuration (identity "
                       f"{rec.get('identity_hash')} vs {cfg.identity_hash()}: model, optimizer, batch, seed "
                       "or max_steps changed); use the original config or a new train.run_name")
    if rec.get("manifest_id") != manifest.id:
        raise RunError(f"run {run_dir} trained on dataset {rec.get('manifest_id')}, but the shards now have "
                       f"manifest id {manifest.id}; use the original dataset or a new train.run_name")


def check_checkpoints_fit(run_dir: Path, cfg: RunConfig, manifest: Manifest) -> None:
    """The newest readable checkpoint must be of this model and dataset: otherwise this is the wrong
    config (RunError, nothing touched), not a damaged checkpoint to set aside."""
    ck, meta = latest(run_dir)  # a damaged one is passed over: resume_point deals with it
    if meta.get("model_config") not in (None, asdict(cfg.model)):
        raise RunError(f"checkpoint {ck} is of another model shape ({meta['model_config']}); use the "
                       "model config it was trained with, or a new train.run_name")
    if meta.get("manifest_id") not in (None, manifest.id):
        raise RunError(f"checkpoint {ck} was trained on another dataset ({meta['manifest_id']}, the "
                       f"shards now are {manifest.id}); use the original dataset or a new train.run_name")


def newest_intact(run_dir: Path, model: GPT, master: bool, healthy_only: bool = False, load: bool = True
                  ) -> tuple[Path | None, dict | None, list[str]]:
    """Load the newest checkpoint that verifies whole (with `healthy_only`, also written from a finite train
    loss) into `model`: (its directory, its trainer state, stuck). Rank 0 moves each one that fails to
    checkpoints/rejected/; `stuck` names those that failed and could not be moved. (None, None, stuck)
    when there is none."""
    stuck = []
    for ck in reversed(run_files.step_dirs(run_dir)):
        try:
            meta, state = checkpoint.load_for_resume(ck, model, load)
        except run_files.CheckpointError as e:
            if master:  # the other ranks only pass over it
                dest = checkpoint.reject(ck, str(e))
                if dest is None:
                    stuck.append(f"{ck.name}: {e} (left in place: it could not be moved to rejected/)")
                print(f"warning: checkpoint {ck.name} skipped: {e}; {f'moved to {dest}' if dest else 'left in place'}",
                      file=sys.stderr, flush=True)
            continue
        if not healthy_only or run_files.healthy(meta):
            return ck, state, stuck
    return None, None, stuck


def agreed_checkpoint(run_dir: Path, model: GPT, master: bool, healthy_only: bool = False
                      ) -> tuple[Path | None, dict | None]:
    """newest_intact, chosen once for every rank (collective): rank 0 verifies and chooses (moving bad ones
    to rejected/), the others load the one it chose. Ranks choosing on their own could read a directory
    rank 0 is moving, or, when one node reads a file differently, train from different weights (DDP
    copies weights only when it is built). A rank that cannot load rank 0's choice is a RunError on every
    rank."""
    # a sharded model is loaded by every rank together (a collective): rank 0 only checks its choice
    split = parallel.is_sharded(model)
    choice = newest_intact(run_dir, model, master, healthy_only, load=not split)[:2] if master else (None, None)
    name = distributed.broadcast_object(choice[0].name if choice[0] is not None else None)
    if name is None:
        return None, None
    ck, state, error = *choice, None
    if not master or split:
        ck = run_files.checkpoints_dir(run_dir) / name
        try:
            state = checkpoint.load_for_resume(ck, model, load=not split)[1]
        except run_files.CheckpointError as e:
            error = f"{ck}: {e}"
    failed = [f"rank {r}: {e}" for r, e in enumerate(distributed.all_gather_object(error)) if e]
    if failed:
        raise RunError(f"rank 0 chose checkpoint {name}, which other ranks cannot load ({'; '.join(failed)}); "
                       "the run directory must be the same shared filesystem on every node")
    if split:  # every rank has checked the files: now they load them together
        checkpoint.load_into(model, ck)
    return ck, state


def resume_point(run_dir: Path, model: GPT, master: bool) -> tuple[Path | None, dict | None]:
    """Load the newest checkpoint that verifies whole into `model` (newest_intact). (None, None) for a run
    with no checkpoint yet; RunError if the run had checkpoints and none is intact (starting over would
    silently throw the run away)."""
    ck, state, stuck = newest_intact(run_dir, model, master)
    if ck is not None:
        return ck, state
    gone = run_files.rejected(run_dir)
    if gone or stuck:
        why = "; ".join([*(f"{p.name}: {_why(p)}" for p in gone), *stuck])
        raise RunError(f"run {run_dir} has no intact checkpoint to resume from (rejected: {why}). Each is "
                       f"kept in {run_files.checkpoints_dir(run_dir) / run_files.REJECTED_DIR} with a "
                       "why.txt: put a good copy back into checkpoints/, or start over with a new "
                       "train.run_name (or by moving that directory away)")
    return None, None


def _why(rejected_dir: Path) -> str:
    try:
        return (rejected_dir / "why.txt").read_text().strip().split(": ", 1)[-1]
    except OSError:
        return "no why.txt"


def restore(ts: dict, optimizer, loader: ShardLoader, scaler, env: distributed.Env, data: bool = True,
            model: torch.nn.Module | None = None) -> int:
    """Put a checkpoint's trainer state back (optimizer, RNG, scaler, and the data position if `data`);
    returns its step. `model`: the one the optimizer steps (a sharded one takes its shard of each moment)."""
    if "optimizer_shards" in ts:  # a sharded step's: read from its shards, into this run's layout
        sharded.load_optimizer(model, optimizer, Path(ts["optimizer_shards"]))
    elif model is not None and parallel.is_sharded(model):
        parallel.load_optimizer(model, optimizer, ts["optimizer"])
    else:
        optimizer.load_state_dict(ts["optimizer"])
    if data:
        loader.load_state_dict(ts["loader"])
    if env.rank < len(ts["rng"]):  # a new world size: extra ranks keep their fresh seed
        rng = ts["rng"][env.rank]
        # clones: the checkpoint stores each rank's state as a view into one buffer (checkpoints/background.py)
        # and torch.set_rng_state crashes the process (SIGSEGV) on a view that does not start its storage
        torch.set_rng_state(rng["torch"].clone())
        if env.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"].clone(), env.device)
    if scaler is not None and ts.get("scaler"):
        scaler.load_state_dict(ts["scaler"])
    return int(ts["step"])


class NotShared(RunError):
    """The ranks do not see one run directory: refused before anything is written (exit 2, no verdict)."""


def agree_on_the_run_dir(run_dir: Path, done_here: bool, master: bool, patience_s: float = 10.0) -> None:
    """With the process group up, before anything trains: every rank sees the same run directory. Every rank
    must agree on whether the run is finished (DONE), and rank 0 writes a probe file there that every rank
    must see (for up to `patience_s`: a network filesystem may show a new file a moment late). A directory
    that is not one shared filesystem (each host its own copy) is refused on every host with NotShared,
    instead of being noticed only at a resume, or a relaunch after DONE hanging: the host that saw DONE
    exited while the others waited for it in the process group (#66)."""
    hosts, done = zip(*distributed.all_gather_object((socket.gethostname(), done_here)), strict=True)
    fix = "Mount the same shared filesystem at this path on every host (docs/docker.md, \"Shared storage\")"
    if len(set(done)) > 1:
        saw = [f"rank {r} on {h}" for r, (h, d) in enumerate(zip(hosts, done, strict=True)) if d]
        raise NotShared(f"the run directory {run_dir} is not one shared filesystem: {', '.join(saw)} found the "
                        f"run finished (DONE) and the other ranks did not. {fix}")
    if all(done):
        return
    probe = run_dir / distributed.broadcast_object(f".shared-probe-{uuid.uuid4().hex}" if master else None)
    if master:
        probe.write_text("rank 0 wrote this to see that every rank shares the run directory\n")
    distributed.barrier()
    end = time.monotonic() + patience_s
    while not probe.is_file() and time.monotonic() < end:
        time.sleep(0.5)
    seen = distributed.all_gather_object(probe.is_file())
    if master:
        probe.unlink(missing_ok=True)
    if not all(seen):
        missing = [f"rank {r} on {h}" for r, (h, s) in enumerate(zip(hosts, seen, strict=True)) if not s]
        raise NotShared(f"the run directory {run_dir} is not one shared filesystem: rank 0 on {hosts[0]} wrote "
                        f"{probe.name} there and {', '.join(missing)} cannot see it. {fix}")
