"""GPT-2 pretraining: one process or many under torchrun (DDP), resumable exactly.

    python -m gptcore.train tiny-cpu train.max_steps=100
    torchrun --standalone --nproc_per_node=8 -m gptcore.train gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 -m gptcore.train ...

A run lives in <home>/runs/<run_name>/ (or train.run_dir). Starting the same command again continues
it from its latest checkpoint; a finished run (DONE) does nothing and prints RUN_DONE.

Exit codes: 0 = max_steps reached (RUN_DONE printed) or stopped cleanly with a checkpoint (time budget
train.max_minutes, SIGTERM/SIGINT to the trainer processes, or a <run_dir>/STOP file); 2 = bad input
(config, dataset, run identity, no intact checkpoint, another trainer holds the run directory, a run
directory or dataset that cannot be read or written): nothing half-written is kept; 3 = diverged (the
guard rolled back guard.max_rollbacks times in a row; the checkpoints are intact); anything else = a crash.

The trainer defends its run by itself, whoever launched it: it locks the run directory (train.lock),
resumes from the newest checkpoint that verifies whole (others are moved to checkpoints/rejected/), skips
non-finite steps and rolls back on repeated ones or a loss spike (gptcore/guard.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.nn.parallel import DistributedDataParallel as DDP

from gptcore import checkpoint, distributed, run_files
from gptcore.config import ConfigError, RunConfig, load_config
from gptcore.data import ShardLoader, open_dataset, verify_hashes
from gptcore.files import read_json, write_json
from gptcore.guard import OK, ROLLBACK, SKIP, FaultInjector, Guard
from gptcore.loss import make_loss
from gptcore.metrics import METRICS_FILE, JsonlLogger, NullLogger
from gptcore.model import GPT, peak_flops_guess
from gptcore.optim import build_optimizer, lr_at, set_lr, skips_on_device
from gptcore.run_files import DONE_FILE, RUN_FILE, latest, run_dir_for
from gptcore.runlock import LockHeld, RunLock
from gptcore.shard_format import Manifest, ShardError
from gptcore.sharding import dataset_dir

EXIT_OK, EXIT_BAD_INPUT, EXIT_DIVERGED = 0, 2, 3
SHARD_HASHES = "shard_hashes.json"  # the shards' verified sha256s, by (size, mtime, inode): no re-hash on restart
STOP_FILE = "STOP"  # create <run_dir>/STOP to stop a run gracefully (checkpoint, exit 0, torchrun too)
PEAK_ENV = "GPTPIPE_PEAK_FLOPS"  # peak FLOP/s per device for MFU (default: a table for known GPUs)


class RunError(RuntimeError):
    """The run directory does not fit this invocation; the message says why and what to do."""


# --- where things are -----------------------------------------------------------------------------

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


# --- stop requests ------------------------------------------------------------------------------

_STOP: dict = {"signal": None}


def _on_signal(signum, frame):  # only set a flag: every rank stops at the same step (see the loop)
    _STOP["signal"] = signum


# --- the run ------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """What `prepare` found: everything `train` needs, all checked before any process group exists."""
    run_dir: Path
    data_dir: Path
    manifest: Manifest
    env: distributed.Env
    model: GPT  # the initial weights, or the resumed checkpoint's
    ckpt: Path | None  # the checkpoint resumed from
    trainer_state: dict | None
    lock: RunLock | None  # rank 0 holds the run directory for the process's life


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return EXIT_OK if argv else EXIT_BAD_INPUT
    t_start = time.time()
    world = distributed.world_size()
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = load_config(argv[0], argv[1:], world_size=world)
        prep = prepare(cfg, rank)
    except (ConfigError, ShardError, RunError, LockHeld, run_files.CheckpointError, OSError) as e:
        return fail(e)
    if prep is None:
        return EXIT_OK
    # flag-only handlers for the run; the previous ones come back after it (main may run in-process: a
    # process forked later must not inherit a SIGTERM that does nothing)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return train(cfg, prep, t_start)
    # RunError: found only once the ranks talk (e.g. a run dir not shared between nodes); OSError after
    # the checks: e.g. the disk filled up, or a file turned into a directory
    except (RunError, Diverged, OSError) as e:
        return fail(e)
    finally:
        distributed.teardown()
        if prep.lock is not None:
            prep.lock.release()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _STOP["signal"] = None


def fail(e: Exception) -> int:
    """Print the one error line for a failure the trainer knows; returns its exit code."""
    why = str(e)
    if isinstance(e, OSError):
        why = (f"{type(e).__name__}: {e}. The run directory or the dataset cannot be read or written there: "
               "check that path (a file where a directory belongs, or the reverse), its permissions and the "
               "free disk, then run again: the run continues from its newest checkpoint")
    print(f"error: {why}", file=sys.stderr)
    return EXIT_DIVERGED if isinstance(e, Diverged) else EXIT_BAD_INPUT


def prepare(cfg: RunConfig, rank: int) -> Prepared | None:
    """Every check that can fail on bad input, before any process group or training step; rank 0 takes
    the run's lock before it writes anything. Returns None (after printing RUN_DONE) when the run has
    already finished."""
    run_dir, data_dir = run_dir_for(cfg), dataset_dir(cfg)
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
        if rank == 0:  # a damaged shard stops the run here (the other ranks are stopped by torchrun)
            verify_hashes(data_dir, manifest, run_dir / SHARD_HASHES)
        env = distributed.select(cfg.train)
        torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
        model = GPT(cfg.model).to(env.device)
        ckpt, trainer_state = resume_point(run_dir, model, master=rank == 0)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Prepared(run_dir, data_dir, manifest, env, model, ckpt, trainer_state, lock)


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


def newest_intact(run_dir: Path, model: GPT, master: bool, healthy_only: bool = False
                  ) -> tuple[Path | None, dict | None, list[str]]:
    """Load the newest checkpoint that verifies whole (with `healthy_only`, also written from a finite train
    loss) into `model`: (its directory, its trainer state, stuck). Rank 0 moves each one that fails to
    checkpoints/rejected/; `stuck` names those that failed and could not be moved. (None, None, stuck)
    when there is none."""
    stuck = []
    for ck in reversed(run_files.step_dirs(run_dir)):
        try:
            meta, state = checkpoint.load_for_resume(ck, model)
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


class Diverged(RuntimeError):
    """The guard rolled back too often in a row, or had no checkpoint to roll back to."""


def restore(ts: dict, optimizer, loader: ShardLoader, scaler, env: distributed.Env, data: bool = True) -> int:
    """Put a checkpoint's trainer state back (optimizer, RNG, scaler, and the data position if `data`);
    returns its step."""
    optimizer.load_state_dict(ts["optimizer"])
    if data:
        loader.load_state_dict(ts["loader"])
    if env.rank < len(ts["rng"]):  # a new world size: extra ranks keep their fresh seed
        rng = ts["rng"][env.rank]
        torch.set_rng_state(rng["torch"])
        if env.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], env.device)
    if scaler is not None and ts.get("scaler"):
        scaler.load_state_dict(ts["scaler"])
    return int(ts["step"])


@dataclass
class Loop:
    """What the training loop works with, set up once per invocation (see `set_up`)."""
    cfg: RunConfig
    env: distributed.Env
    run_dir: Path
    raw: GPT  # the plain model: checkpoints, sampling, rollback
    model: torch.nn.Module  # what trains: raw, wrapped in DDP and/or torch.compile
    optimizer: torch.optim.Optimizer
    loader: ShardLoader
    scaler: torch.amp.GradScaler | None
    logger: JsonlLogger | NullLogger
    evals: Evals
    guard: Guard
    step: int  # steps done; tokens seen = step * train.total_batch_tokens (part of the run identity)
    peak_flops: float | None  # all devices together, for MFU (None: unknown hardware)
    meta: dict  # what every checkpoint of this invocation records about the run


@dataclass
class Read:
    """What the host learned at one sync point about the steps since the previous one."""
    loss: float
    verdict: str  # guard verdict: OK, SKIP or ROLLBACK
    stop: bool  # some rank voted to stop


def set_up(cfg: RunConfig, prep: Prepared) -> Loop:
    """Optimizer, data loader, restored state, DDP / compile wrappers, run records and the metrics log."""
    env, run_dir, manifest, raw = prep.env, prep.run_dir, prep.manifest, prep.model
    raw.head_loss = make_loss(env.loss)  # train.loss; the trainer owns the fused loss's reusable buffers
    tc = cfg.train
    optimizer = build_optimizer(raw, cfg.optim, env.device.type)
    scaler = torch.amp.GradScaler(env.device.type) if env.dtype == torch.float16 else None
    loader = ShardLoader(prep.data_dir, tc.micro_batch, tc.seq_len, tc.total_batch_tokens, tc.seed, env.rank,
                         env.world, env.device, manifest=manifest)
    torch.manual_seed(tc.seed + env.rank)  # per-rank randomness (dropout) from here on
    step = 0
    if prep.trainer_state is not None:
        step = restore(prep.trainer_state, optimizer, loader, scaler, env)
    seen = distributed.all_gather_object(step)  # every rank must resume from the same checkpoint
    if len(set(seen)) > 1:
        raise RunError(f"ranks found different checkpoints in {run_dir} (steps {seen}); the run directory "
                       "must be on a filesystem shared by all nodes (or set train.run_dir to one)")
    model: torch.nn.Module = raw
    if env.ddp:
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        if tc.ddp_bf16_grads:  # halves the all-reduce bytes (multi-node); gradients summed in bf16
            model.register_comm_hook(None, distributed.allreduce_in_bf16)
    if env.compile:
        # DDP first, then compile: dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries, so
        # each bucket's all-reduce starts while the rest of backward still runs (compiled-then-wrapped,
        # the hooks would fire only after the whole compiled backward)
        model = torch.compile(model)
    logger = JsonlLogger(run_dir / METRICS_FILE) if env.master else NullLogger()
    if env.master:
        write_records(cfg, prep, step)
    peak_one = float(os.environ.get(PEAK_ENV) or 0) or peak_flops_guess(env.device)  # None: unknown GPU
    meta = {"config": cfg.to_dict(), "manifest_id": manifest.id, "run_name": cfg.run_name,
            "identity_hash": cfg.identity_hash()}
    return Loop(cfg, env, run_dir, raw, model, optimizer, loader, scaler, logger,
                Evals(cfg, env, prep.data_dir, logger), Guard(cfg.guard), step,
                peak_one * env.world if peak_one else None, meta)


def write_records(cfg: RunConfig, prep: Prepared, step: int) -> None:
    """run.json (the run's identity, once), config.json (this invocation's) and the start line (rank 0)."""
    run_dir, env = prep.run_dir, prep.env
    if not (run_dir / RUN_FILE).is_file():  # a new run (check_run accepted an existing one)
        write_json(run_dir / RUN_FILE, {
            "run_name": cfg.run_name, "identity_hash": cfg.identity_hash(), "manifest_id": prep.manifest.id,
            "preset": cfg.preset, "dataset_dir": str(prep.data_dir), "created": time.time()})
    write_json(run_dir / "config.json", cfg.to_dict())
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # a stop request was for the previous invocation
    how = f"resuming from {prep.ckpt.name}" if prep.ckpt else "starting"
    print(f"run {cfg.run_name} ({run_dir}): {how} at step {step}/{cfg.train.max_steps}; world={env.world} "
          f"accum={cfg.grad_accum_steps(env.world)} device={env.device} dtype={env.dtype} compile={env.compile} "
          f"loss={env.loss} params={prep.model.num_params():,} dataset={prep.data_dir} ({prep.manifest.id})",
          flush=True)


def stop_vote(loop: Loop, t_start: float) -> tuple[bool, bool]:
    """(this rank votes to stop, rank 0 saw a STOP file). The vote (a signal on any rank, rank 0's clock,
    STOP file or unwritable metrics) is reduced with the loss, so every rank sees it at the same step."""
    tc, master = loop.cfg.train, loop.env.master
    out_of_time = tc.max_minutes > 0 and (time.time() - t_start) > tc.max_minutes * 60
    stop_file = master and (loop.run_dir / STOP_FILE).exists()
    broken = master and loop.logger.error is not None  # metrics.jsonl cannot be written (a full disk?)
    return _STOP["signal"] is not None or (master and out_of_time) or stop_file or broken, stop_file


def read_and_log(loop: Loop, pending: list, dt: float) -> Read:
    """The one host sync of the steps in `pending` (the same steps on every rank): log each, and let the
    guard judge each."""
    cfg, env, guard = loop.cfg, loop.env, loop.guard
    rows = torch.stack([p[-1] for p in pending]).tolist()
    batch = cfg.train.total_batch_tokens
    tok_s = batch / dt
    mfu = {"train/mfu": loop.raw.estimate_mfu(tok_s, loop.peak_flops, cfg.train.seq_len)} if loop.peak_flops else {}
    read = Read(math.nan, OK, False)
    for (step, lr, epoch, _), (loss_total, n_bad, n_stop, norm) in zip(pending, rows, strict=True):
        loss, finite = loss_total / env.world, n_bad == 0
        read.loss, read.stop = loss, read.stop or n_stop > 0
        loop.logger.log(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm, "train/step_time": dt,
                               "train/tokens_per_s": tok_s, "train/tokens_seen": step * batch, "train/epoch": epoch,
                               **mfu})
        if read.verdict != ROLLBACK:
            read.verdict = guard.observe(loss, finite)
            if read.verdict == SKIP:
                event(loop, step, f"non-finite step skipped (loss {loss}, grad norm {norm}): no "
                      f"update applied ({guard.nonfinite}/{cfg.guard.max_nonfinite} before a rollback)")
    if env.master:
        step, lr = pending[-1][0], pending[-1][1]
        print(f"step {step:6d}/{cfg.train.max_steps} | loss {read.loss:.6f} | lr {lr:.3e} | norm {norm:.4f} | "
              f"{dt * 1000:.1f} ms | {tok_s:,.0f} tok/s", flush=True)
    return read


def save(loop: Loop, step: int, reason: str, train_loss: float) -> None:
    """Checkpoint the state after `step`. Collective: every rank contributes its RNG state."""
    env, failed = loop.env, None
    rng = {"torch": torch.get_rng_state()}  # every rank's, so dropout masks resume exactly
    if env.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.device)
    rngs = distributed.all_gather_object(rng)
    if env.master:
        state = {"optimizer": loop.optimizer.state_dict(), "loader": loop.loader.state_dict(), "rng": rngs,
                 "scaler": loop.scaler.state_dict() if loop.scaler is not None else {},
                 "step": step, "world": env.world}
        val, hs = loop.evals.results.get(step, (None, None))  # (None, None): no evaluation at this step
        try:
            path = checkpoint.save_checkpoint(loop.run_dir, step, loop.raw, state, {
                **loop.meta, "tokens_seen": step * loop.cfg.train.total_batch_tokens, "val_loss": val, "hellaswag": hs,
                "train_loss": train_loss, "reason": reason}, keep_last=loop.cfg.train.keep_last)
            print(f"checkpoint {path} ({reason})", flush=True)
        except run_files.CheckpointError as e:  # non-finite weights are never written
            event(loop, step, f"checkpoint not written: {e}")
        except (OSError, RuntimeError, SafetensorError) as e:  # e.g. a full disk (torch.save: RuntimeError)
            failed = unwritable(loop.run_dir, step, e)
    # every rank waits for rank 0's save here, and stops with it when it could not write
    failed = distributed.broadcast_object(failed if env.master else None)
    if failed:
        raise RunError(failed)
    loop.guard.checkpointed()


def unwritable(run_dir: Path, step: int, e: Exception) -> str:
    """What to say when a checkpoint could not be written (atomic_dir removed the partial one)."""
    last = run_files.newest_healthy(run_files.list_checkpoints(run_dir))
    return (f"checkpoint step {step} could not be written to {run_files.checkpoints_dir(run_dir)} "
            f"({type(e).__name__}: {e}); nothing half-written was kept. Make room on that disk (or lower "
            f"train.keep_last), then run again: it resumes from {last or 'the start'}")


def train(cfg: RunConfig, prep: Prepared, t_start: float) -> int:
    distributed.init_process_group(prep.env)
    loop = set_up(cfg, prep)
    tc, ev, env = cfg.train, cfg.eval, loop.env
    accum, faults = cfg.grad_accum_steps(env.world), FaultInjector()
    pending: list[tuple[int, float, int, torch.Tensor]] = []  # steps whose stats the host has not read
    t_read = time.time()
    try:
        while loop.step < tc.max_steps:
            lr = lr_at(loop.step, cfg)
            set_lr(loop.optimizer, lr)
            vote, stop_file = stop_vote(loop, t_start)
            faults.before_step(loop.raw)
            stats = train_step(loop.model, loop.optimizer, loop.loader, accum, env, loop.scaler,
                               cfg.optim.grad_clip, vote)
            loop.step += 1
            step = loop.step
            pending.append((step, lr, loop.loader.epoch, stats))
            last = step == tc.max_steps
            due_eval = last or (ev.eval_interval and step % ev.eval_interval == 0)
            due_sample = last or (ev.sample_interval and step % ev.sample_interval == 0)
            due_ckpt = step % tc.checkpoint_interval == 0
            if not (last or due_eval or due_sample or due_ckpt or step == 1 or step % tc.log_interval == 0):
                continue  # no host sync: the device runs on while the host prepares the next step
            now = time.time()
            read = read_and_log(loop, pending, (now - t_read) / len(pending))
            pending.clear()
            t_read = now
            if read.verdict == ROLLBACK:
                loop.step = roll_back(loop)
                t_read = time.time()
                continue
            if due_eval:
                loop.evals.run(loop.model, step, last)
            if env.master and due_sample:
                loop.evals.sample(loop.raw, step)
            troubled = loop.guard.nonfinite or loop.guard.spiking  # an interval checkpoint waits for a healthy step
            if last or read.stop or (due_ckpt and not troubled):
                save(loop, step, "end" if last else "stop" if read.stop else "interval", read.loss)
            if read.stop and not last:
                broken = distributed.broadcast_object(loop.logger.error if env.master else None)
                if broken:
                    raise RunError(f"{loop.run_dir / METRICS_FILE} cannot be written ({broken}); the run "
                                   f"checkpointed step {step} and stopped: make room on that disk and run again")
                why = f"signal {_STOP['signal']}" if _STOP["signal"] is not None else \
                    f"{STOP_FILE} file" if stop_file else f"time budget train.max_minutes={tc.max_minutes}"
                if env.master:
                    print(f"stopped at step {step}/{tc.max_steps} ({why}); run the same command to "
                          "continue", flush=True)
                return EXIT_OK
        if env.master:
            write_json(loop.run_dir / DONE_FILE, {"step": loop.step, "tokens_seen": loop.step * tc.total_batch_tokens,
                                               "time": time.time()})
            print(f"RUN_DONE run={cfg.run_name} step={loop.step} dir={loop.run_dir}", flush=True)
        return EXIT_OK
    finally:
        loop.logger.close()


def event(loop: Loop, step: int, text: str, **values) -> None:
    """A guard or checkpoint event: a metrics.jsonl row of kind "event" and a line on stdout (rank 0)."""
    loop.logger.log(step, {"event": text, **values}, kind="event")
    if loop.env.master:
        print(f"step {step:6d} | guard: {text}", flush=True)


def roll_back(loop: Loop) -> int:
    """Reload the newest good checkpoint (weights, optimizer, RNG) but keep the data position, so the
    batches since that checkpoint, which led into the trouble, are skipped. Raises Diverged when there is
    nothing to roll back to or it happened too often in a row."""
    cfg, run_dir, raw, loader, env, guard, step = (loop.cfg, loop.run_dir, loop.raw, loop.loader, loop.env,
                                                   loop.guard, loop.step)
    why = "non-finite steps" if guard.nonfinite else "loss spike"  # the guard's counts, before rolled_back resets them
    if not guard.rolled_back():
        raise Diverged(f"the run diverged again ({why} at step {step}) after {cfg.guard.max_rollbacks} "
                       "rollbacks with no checkpoint written in between; the checkpoints are intact. Lower "
                       "optim.max_lr (or raise optim.warmup_steps), check the data near loader position "
                       f"{loader.position}, then run the same command to continue from the newest checkpoint "
                       "(guard.max_rollbacks allows more tries)")
    # healthy only: a checkpoint written during the trouble is no way out of it
    ck, ts, _ = newest_intact(run_dir, raw, env.master, healthy_only=True)
    if ck is None:
        raise Diverged(f"the run diverged ({why} at step {step}) before it had a good checkpoint to roll back "
                       "to; lower optim.max_lr or raise optim.warmup_steps, or lower train.checkpoint_interval so a "
                       "rollback has somewhere to go")
    skipped = loader.position - int(ts["loader"]["position"])
    loop.optimizer.zero_grad(set_to_none=True)
    back = restore(ts, loop.optimizer, loader, loop.scaler, env, data=False)  # the checkpoint's step
    event(loop, step, f"{why}: rolled back to {ck.name}; the {skipped} sequences since it are "
          f"skipped (rollback {guard.rollbacks}/{cfg.guard.max_rollbacks})",
          **{"guard/rollback_from": step, "guard/rollback_to": back, "guard/skipped_sequences": skipped})
    return back


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: ShardLoader, accum: int,
               env: distributed.Env, scaler=None, grad_clip: float = 1.0, stop_vote: bool = False) -> torch.Tensor:
    """One optimizer step over `accum` micro-batches, with no host sync: returns the device tensor
    [loss summed over ranks, ranks with a non-finite loss or gradient, stop votes, this rank's gradient
    norm]. A step that is non-finite on any rank applies no update (the fused optimizer skips it on the
    device, as GradScaler does). The learning rate is set by the caller. (bench_train times this.)"""
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(accum):
        x, y = loader.next_batch()
        # under DDP, gradients are all-reduced only on the last micro-step
        sync = model.no_sync() if env.ddp and micro < accum - 1 else nullcontext()
        with sync:
            with env.autocast():
                _, loss = model(x, y, return_logits=False)
            loss = loss / accum  # the mean over the whole step's micro-batches
            loss_sum += loss.detach()
            (scaler.scale(loss) if scaler is not None else loss).backward()
    parts = getattr(optimizer, "optimizers", (optimizer,))  # optim.name=muon: AdamW + Muon
    if scaler is not None:
        for part in parts:
            scaler.unscale_(part)
    # inf: measure the norm without clipping
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    # one all-reduce, before the update: the loss, whether any rank's step is non-finite (fp16's GradScaler
    # handles overflowing gradients itself, so there only the loss counts) and the stop vote
    bad = ~torch.isfinite(loss_sum) if scaler is not None else ~(torch.isfinite(loss_sum) & torch.isfinite(norm))
    packed = torch.stack([loss_sum.float(), bad.float(), torch.full((), float(stop_vote), device=env.device)])
    distributed.all_reduce_sum(packed)
    if scaler is not None:
        for part in parts:
            scaler.step(part)  # skips the update itself when gradients overflowed
        scaler.update()
    else:
        skip_if_nonfinite(optimizer, packed[1])
    optimizer.zero_grad(set_to_none=True)
    return torch.cat([packed, norm.detach().float().view(1)])


def skip_if_nonfinite(optimizer: torch.optim.Optimizer, n_bad: torch.Tensor) -> None:
    """optimizer.step(), or no update when n_bad > 0. The fused AdamW and the Muon of gptcore.optim take
    the decision on the device (found_inf: no parameter, moment or step-count change); another optimizer
    needs a host sync."""
    if skips_on_device(optimizer):
        optimizer.found_inf = (n_bad > 0).float()
        optimizer.step()
        optimizer.found_inf = None
    elif n_bad.item() == 0:
        optimizer.step()


class Evals:
    """Validation loss, HellaSwag and text samples; remembers the latest results for the checkpoint."""

    def __init__(self, cfg: RunConfig, env: distributed.Env, data_dir: Path, logger):
        self.cfg, self.env, self.data_dir, self.logger = cfg, env, data_dir, logger
        self.results: dict[int, tuple[float | None, dict | None]] = {}
        self._examples = None  # HellaSwag examples, loaded at the first evaluation

    def run(self, model: torch.nn.Module, step: int, last: bool = False) -> None:
        from gptcore.evaluate import validation_loss
        env = self.env
        val = validation_loss(model, self.cfg, self.data_dir, env.device, env.autocast(), env.rank, env.world)
        self.logger.log(step, {"val/loss": val}, kind="eval")
        hs, every = None, self.cfg.eval.hellaswag_interval
        examples = self._hellaswag_examples() if last or (every and step % every == 0) else None
        if examples:
            from gptcore import hellaswag
            hs = hellaswag.evaluate(model, examples, env.device, env.autocast(), env.rank, env.world)
            self.logger.log(step, {f"hellaswag/{k}": v for k, v in hs.items()}, kind="eval")
        self.results = {step: (val, hs)}
        if env.master:
            extra = f" | hellaswag acc_norm {hs['acc_norm']:.4f} (n={hs['n']})" if hs else ""
            print(f"step {step:6d} | val loss {val:.4f}{extra}", flush=True)

    def _hellaswag_examples(self):
        if not self.cfg.eval.hellaswag:
            return None
        if self._examples is None:
            from gptcore import hellaswag
            # rank 0 reads (or downloads) and broadcasts: ranks need no shared home; a missing or bad
            # file skips HellaSwag on every rank (a benchmark must not stop a training run)
            try:
                examples, why = hellaswag.shared_examples(self.cfg, None, self.cfg.eval.hellaswag_limit,
                                                          self.env.master)
            except hellaswag.HellaSwagError as e:
                examples, why = None, str(e)
            if examples is None and self.env.master:
                print(f"warning: HellaSwag evaluation skipped: {why}", flush=True)
            self._examples = examples or []
        return self._examples

    def sample(self, raw: GPT, step: int) -> None:
        from gptcore.tokenizer import decode, encode
        e = self.cfg.eval
        prompt = torch.tensor([encode(e.sample_prompt)], dtype=torch.long, device=self.env.device)
        n = min(e.sample_tokens, raw.config.block_size - prompt.size(1))
        if n <= 0:
            return
        with self.env.autocast():
            out = raw.generate(prompt, n, temperature=1.0, top_k=50, seed=self.cfg.train.seed + step)
        text = decode(out[0].tolist())
        self.logger.log(step, {"text": text}, kind="sample")
        print(f"sample @ {step}: {text!r}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
