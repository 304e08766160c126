"""GPT-2 pretraining: one process or many under torchrun (DDP), resumable exactly.

    python -m gptcore.train tiny-cpu train.max_steps=100
    torchrun --standalone --nproc_per_node=8 -m gptcore.train gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 -m gptcore.train ...

A run lives in <home>/runs/<run_name>/ (or train.run_dir). Starting the same command again continues
it from its latest checkpoint; a finished run (DONE) does nothing and prints RUN_DONE.

Exit codes: 0 = max_steps reached (RUN_DONE printed) or stopped cleanly with a checkpoint (time budget
train.max_minutes, SIGTERM/SIGINT to the trainer processes, or a <run_dir>/STOP file); 2 = bad input
(config, dataset, run identity, checkpoint): nothing was written; anything else = a crash.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gptcore import checkpoint, distributed
from gptcore.config import ConfigError, RunConfig, load_config, pipeline_home
from gptcore.data import ShardLoader, open_dataset
from gptcore.metrics import JsonlLogger, NullLogger
from gptcore.model import GPT, peak_flops_guess
from gptcore.shards import Manifest, ShardError, atomic_write_bytes

EXIT_OK, EXIT_BAD_INPUT = 0, 2
STOP_FILE = "STOP"  # create <run_dir>/STOP to stop a run gracefully (checkpoint, exit 0, torchrun too)
PEAK_ENV = "GPTPIPE_PEAK_FLOPS"  # peak FLOP/s per device for MFU (default: a table for known GPUs)


class RunError(RuntimeError):
    """The run directory does not fit this invocation; the message says why and what to do."""


def lr_at(it: int, cfg: RunConfig) -> float:
    """Linear warmup to max_lr, then cosine decay to min_lr at max_steps (build-nanogpt)."""
    o, max_steps = cfg.optim, cfg.train.max_steps
    if it < o.warmup_steps:
        return o.max_lr * (it + 1) / o.warmup_steps
    if it >= max_steps:
        return o.min_lr
    ratio = (it - o.warmup_steps) / max(1, max_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.max_lr - o.min_lr)


# --- where things are -----------------------------------------------------------------------------

def run_dir_for(cfg: RunConfig) -> Path:
    return Path(cfg.train.run_dir).expanduser().resolve() if cfg.train.run_dir else \
        pipeline_home() / "runs" / cfg.run_name


def dataset_dir_for(cfg: RunConfig) -> Path:
    if cfg.data.dataset_dir:
        return Path(cfg.data.dataset_dir).expanduser().resolve()
    from gptcore.sharding import dataset_dir  # the data stage decides the layout
    return dataset_dir(cfg)


def check_run(run_dir: Path, cfg: RunConfig, manifest: Manifest) -> dict | None:
    """The run's identity record, or None for a new run; RunError if the directory belongs to another
    trajectory (other model/optimizer/batch/seed/length or other data)."""
    path = run_dir / "run.json"
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except ValueError as e:
        raise RunError(f"{path} is corrupt ({e}); move the run directory away or use another run name") from e
    if rec.get("identity_hash") != cfg.identity_hash():
        raise RunError(f"run {run_dir} was started with another configuration (identity "
                       f"{rec.get('identity_hash')} vs {cfg.identity_hash()}: model, optimizer, batch, seed "
                       "or max_steps changed); use the original config or a new train.run_name")
    if rec.get("manifest_id") != manifest.id:
        raise RunError(f"run {run_dir} trained on dataset {rec.get('manifest_id')}, but the shards now have "
                       f"manifest id {manifest.id}; use the original dataset or a new train.run_name")
    return rec


def write_json(path: Path, obj: dict) -> None:
    atomic_write_bytes(path, [json.dumps(obj, indent=1, default=str).encode()])


# --- RNG state (every rank's, so dropout masks resume exactly) ---------------------------------------

def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# --- stop requests ------------------------------------------------------------------------------

_STOP: dict = {"signal": None}


def _on_signal(signum, frame):  # only set a flag: every rank stops at the same step (see the loop)
    _STOP["signal"] = signum


# --- the run ------------------------------------------------------------------------------------

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
    except (ConfigError, ShardError, RunError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if prep is None:
        return EXIT_OK
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        return train(cfg, prep, t_start)
    except RunError as e:  # found only once the ranks talk (e.g. a run dir not shared between nodes)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        distributed.teardown()


def prepare(cfg: RunConfig, rank: int) -> dict | None:
    """Every check that can fail on bad input, before any process group, file write or training step.
    Returns None (after printing RUN_DONE) when the run has already finished."""
    run_dir, data_dir = run_dir_for(cfg), dataset_dir_for(cfg)
    manifest = open_dataset(data_dir)
    record = check_run(run_dir, cfg, manifest)
    if (run_dir / "DONE").is_file():
        if rank == 0:
            done = json.loads((run_dir / "DONE").read_text() or "{}")
            print(f"RUN_DONE run={cfg.run_name} step={done.get('step')} dir={run_dir}: already complete; "
                  "nothing to do", flush=True)
        return None
    env = distributed.select(cfg.train)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = GPT(cfg.model).to(env.device)
    ckpt = checkpoint.latest_checkpoint(run_dir)
    trainer_state = None
    if ckpt is not None:
        checkpoint.load_weights(model, ckpt / checkpoint.MODEL_FILE)  # shape mismatch -> CheckpointError
        trainer_state = checkpoint.load_trainer_state(ckpt)
        if trainer_state.get("loader", {}).get("manifest_id") != manifest.id:
            raise RunError(f"checkpoint {ckpt} was trained on another dataset; use the original dataset "
                           "or a new train.run_name")
    return {"run_dir": run_dir, "data_dir": data_dir, "manifest": manifest, "record": record, "env": env,
            "model": model, "ckpt": ckpt, "trainer_state": trainer_state}


def train(cfg: RunConfig, prep: dict, t_start: float) -> int:
    env: distributed.Env = prep["env"]
    distributed.init_process_group(env)
    run_dir, data_dir, manifest = prep["run_dir"], prep["data_dir"], prep["manifest"]
    raw: GPT = prep["model"]
    tc, B, T = cfg.train, cfg.train.micro_batch, cfg.train.seq_len
    accum = cfg.grad_accum_steps(env.world)

    optimizer = raw.configure_optimizer(cfg.optim.weight_decay, cfg.optim.max_lr,
                                        (cfg.optim.beta1, cfg.optim.beta2), cfg.optim.eps, env.device.type)
    scaler = torch.amp.GradScaler(env.device.type) if env.dtype == torch.float16 else None
    loader = ShardLoader(data_dir, B, T, tc.total_batch_tokens, tc.seed, env.rank, env.world, env.device,
                         manifest=manifest)
    torch.manual_seed(tc.seed + env.rank)  # per-rank randomness (dropout) from here on
    step, tokens_seen = 0, 0
    ts = prep["trainer_state"]
    if ts is not None:
        optimizer.load_state_dict(ts["optimizer"])
        loader.load_state_dict(ts["loader"])
        step, tokens_seen = int(ts["step"]), int(ts["tokens_seen"])
        if env.rank < len(ts["rng"]):  # a new world size: extra ranks keep their fresh seed
            set_rng_state(ts["rng"][env.rank], env.device)
        if scaler is not None and ts.get("scaler"):
            scaler.load_state_dict(ts["scaler"])

    seen = distributed.all_gather_object(step)  # every rank must resume from the same checkpoint
    if len(set(seen)) > 1:
        raise RunError(f"ranks found different checkpoints in {run_dir} (steps {seen}); the run directory "
                       "must be on a filesystem shared by all nodes (or set train.run_dir to one)")
    model: torch.nn.Module = raw
    if env.compile:
        model = torch.compile(model)
    if env.ddp:
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)

    logger = NullLogger()
    if env.master:
        run_dir.mkdir(parents=True, exist_ok=True)
        if prep["record"] is None:
            write_json(run_dir / "run.json", {
                "run_name": cfg.run_name, "identity_hash": cfg.identity_hash(), "manifest_id": manifest.id,
                "preset": cfg.preset, "dataset_dir": str(data_dir), "created": time.time()})
        write_json(run_dir / "config.json", cfg.to_dict())
        (run_dir / STOP_FILE).unlink(missing_ok=True)  # a stop request was for the previous invocation
        logger = JsonlLogger(run_dir / "metrics.jsonl")
        how = f"resuming from {prep['ckpt'].name}" if prep["ckpt"] else "starting"
        print(f"run {cfg.run_name} ({run_dir}): {how} at step {step}/{tc.max_steps}; world={env.world} "
              f"accum={accum} device={env.device} dtype={env.dtype} compile={env.compile} "
              f"params={raw.num_params():,} dataset={data_dir} ({manifest.id})", flush=True)

    peak = float(os.environ.get(PEAK_ENV) or peak_flops_guess(env.device)) * env.world
    flops_per_token = raw.flops_per_token(T)
    evals = Evals(cfg, env, data_dir, logger)
    meta_base = {"config": cfg.to_dict(), "manifest_id": manifest.id, "run_name": cfg.run_name,
                 "identity_hash": cfg.identity_hash()}

    def save(reason: str) -> None:  # collective: every rank contributes its RNG state
        rngs = distributed.all_gather_object(rng_state(env.device))
        if env.master:
            state = {"optimizer": optimizer.state_dict(), "loader": loader.state_dict(), "rng": rngs,
                     "scaler": scaler.state_dict() if scaler is not None else {}, "step": step,
                     "tokens_seen": tokens_seen, "world": env.world}
            val, hs = evals.results_at(step)
            path = checkpoint.save_checkpoint(run_dir, step, raw, state, {
                **meta_base, "tokens_seen": tokens_seen, "val_loss": val, "hellaswag": hs, "reason": reason},
                keep_last=tc.keep_last)
            print(f"checkpoint {path} ({reason})", flush=True)
        distributed.barrier()

    try:
        while step < tc.max_steps:
            t0 = time.time()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, norm = train_step(model, optimizer, loader, accum, env, scaler, cfg.optim.grad_clip)
            step += 1
            tokens_seen += tc.total_batch_tokens
            # one all-reduce: the loss for logging, and the stop vote (a signal on any rank, or rank 0's
            # clock), so every rank stops after the same step
            out_of_time = tc.max_minutes > 0 and (time.time() - t_start) > tc.max_minutes * 60
            stop_file = env.master and (run_dir / STOP_FILE).exists()
            stop_vote = 1.0 if (_STOP["signal"] is not None or (env.master and out_of_time) or stop_file) \
                else 0.0
            packed = torch.stack([loss_sum.float(), torch.tensor(stop_vote, device=env.device)])
            distributed.all_reduce_sum(packed)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.time() - t0
            loss_val, stop = packed[0].item() / env.world, packed[1].item() > 0
            tok_s = tc.total_batch_tokens / dt
            logger.log(step, {"train/loss": loss_val, "train/lr": lr, "train/grad_norm": norm.item(),
                              "train/step_time": dt, "train/tokens_per_s": tok_s,
                              "train/mfu": flops_per_token * tok_s / peak, "train/tokens_seen": tokens_seen,
                              "train/epoch": loader.epoch})
            if env.master and (step % tc.log_interval == 0 or step == 1 or step == tc.max_steps):
                print(f"step {step:6d}/{tc.max_steps} | loss {loss_val:.6f} | lr {lr:.3e} | norm "
                      f"{norm.item():.4f} | {dt * 1000:.1f} ms | {tok_s:,.0f} tok/s", flush=True)
            last = step == tc.max_steps
            if last or (cfg.eval.eval_interval and step % cfg.eval.eval_interval == 0):
                evals.run(model, step)
            if env.master and (last or (cfg.eval.sample_interval and step % cfg.eval.sample_interval == 0)):
                evals.sample(raw, step)
            if last or stop or step % tc.checkpoint_interval == 0:
                save("end" if last else "stop" if stop else "interval")
            if stop and not last:
                why = f"signal {_STOP['signal']}" if _STOP["signal"] is not None else \
                    f"{STOP_FILE} file" if stop_file else f"time budget train.max_minutes={tc.max_minutes}"
                if env.master:
                    print(f"stopped at step {step}/{tc.max_steps} ({why}); run the same command to "
                          "continue", flush=True)
                return EXIT_OK
        if env.master:
            write_json(run_dir / "DONE", {"step": step, "tokens_seen": tokens_seen, "time": time.time()})
            print(f"RUN_DONE run={cfg.run_name} step={step} dir={run_dir}", flush=True)
        return EXIT_OK
    finally:
        logger.close()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: ShardLoader, accum: int,
               env: distributed.Env, scaler=None, grad_clip: float = 1.0) -> tuple[torch.Tensor, ...]:
    """One optimizer step over `accum` micro-batches; returns (this rank's mean loss, grad norm).
    The learning rate is set by the caller. (benchmarks/bench_train.py times exactly this function.)"""
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
    if scaler is not None:
        scaler.unscale_(optimizer)
    # inf: measure the norm without clipping
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, norm


class Evals:
    """Validation loss, HellaSwag and text samples; remembers the latest results for the checkpoint."""

    def __init__(self, cfg: RunConfig, env: distributed.Env, data_dir: Path, logger):
        self.cfg, self.env, self.data_dir, self.logger = cfg, env, data_dir, logger
        self.results: dict[int, tuple[float | None, dict | None]] = {}
        self._examples = None  # HellaSwag examples, loaded at the first evaluation

    def results_at(self, step: int) -> tuple[float | None, dict | None]:
        return self.results.get(step, (None, None))

    def run(self, model: torch.nn.Module, step: int) -> None:
        from gptcore.evaluate import validation_loss
        env = self.env
        val = validation_loss(model, self.cfg, self.data_dir, env.device, env.autocast(), env.rank, env.world)
        self.logger.log(step, {"val/loss": val}, kind="eval")
        hs = None
        examples = self._hellaswag_examples()
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
            # rank 0 downloads (or finds the cache); the others follow only if that worked
            path = hellaswag.ensure_dataset(self.cfg) if self.env.master else None
            ok = distributed.broadcast_object(path is not None)
            if ok and not self.env.master:
                path = hellaswag.ensure_dataset(self.cfg)
            self._examples = hellaswag.load_examples(path, self.cfg.eval.hellaswag_limit) if ok else []
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
