"""The Trainer: GPT-2 pretraining on one process or many (DDP under torchrun), resumable exactly.

`Trainer.run` reads top to bottom: step -> log -> checkpoint -> evaluate -> sample -> stop. The parts it
holds each do one thing: the data loader, the divergence guard (gptcore/training/guard.py), the checkpoint writer
(gptcore/checkpoints/background.py: the ranks wait for a copy of the state, rank 0 writes in the background), the
evaluator (gptcore/training/train_eval.py: after the checkpoint, on the plain model, failures are events) and the
metrics log. Where a run starts from (checks, resume, fallback) is gptcore/training/resume.py.

Between host reads the loop never waits for the device: each step's statistics stay on the device until
the next log, eval or checkpoint step, where one read gets them all (`read_steps`).
"""

from __future__ import annotations

import math
import os
import socket
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from gptcore import distributed
from gptcore.checkpoints import sharded
from gptcore.checkpoints.background import FAILED, SKIPPED, Checkpointer
from gptcore.checkpoints.checkpoint import weights_of
from gptcore.checkpoints.run_files import DONE_FILE, EVAL_FILE, RUN_FILE, step_dir
from gptcore.data.loader import ShardLoader
from gptcore.files import write_json
from gptcore.metrics import METRICS_FILE, JsonlLogger, NullLogger
from gptcore.model import fp8
from gptcore.model.gpt import peak_flops_guess
from gptcore.model.loss import make_loss
from gptcore.model.optim import build_optimizer, lr_at, set_lr, skips_on_device
from gptcore.training import microbatch, parallel, verdict
from gptcore.training.cost import RunClock, checkpoint_cost, duration
from gptcore.training.damage import DamagedShards
from gptcore.training.guard import OK, ROLLBACK, SKIP, FaultInjector, Guard
from gptcore.training.memory import MemoryRecorder
from gptcore.training.profiling import StepProfiler
from gptcore.training.replicas import ComputeTimer, Disagreements, Stragglers, weights_checksum
from gptcore.training.resume import SHARD_HASHES, Prepared, RunError, agreed_checkpoint, restore
from gptcore.training.train_eval import Evaluator
from gptcore.training.watchdog import CEILING_S, Watchdog

STOP_FILE = "STOP"  # create <run_dir>/STOP to stop a run gracefully (checkpoint, exit 0, torchrun too)
EVAL_PATIENCE_S = CEILING_S  # the hang limit while evaluating (unless train.hang_timeout_s sets one)
WRITE_PATIENCE_S = CEILING_S  # ... while waiting for a checkpoint write (1.5 GB on slow shared storage)
PROBE_PATIENCE_S = CEILING_S  # ... per micro-batch size the probe tries (a fresh compile each: minutes)
PEAK_ENV = "GPTPIPE_PEAK_FLOPS"  # peak FLOP/s per device for MFU (default: a table for known GPUs)
STOP_SIGNAL: dict = {"signal": None}  # set by gptcore.training.train's signal handler; read at every step


class Diverged(RuntimeError):
    """The guard rolled back too often in a row, or had no checkpoint to roll back to."""


class StepStats(NamedTuple):
    """One step's statistics, in the order train_step packs them into its device tensor."""
    loss_sum: float  # the step's mean loss, summed over ranks
    nonfinite_ranks: float  # ranks whose loss or gradient was not finite
    stop_votes: float  # ranks that asked to stop
    grad_norm: float  # this rank's gradient norm before clipping


@dataclass
class Pending:
    """A step whose statistics the host has not read yet."""
    step: int
    lr: float
    epoch: int
    stats: torch.Tensor  # StepStats, on the device


@dataclass
class Read:
    """What the host learned at one sync point about the steps since the previous one."""
    loss: float  # the newest step's
    verdict: str  # guard verdict: OK, SKIP or ROLLBACK
    stop: bool  # some rank voted to stop


@dataclass
class Due:
    """What the step just taken calls for."""
    last: bool
    checkpoint: bool
    eval: bool
    sample: bool
    consistency: bool  # compare the replicas' weights
    read: bool  # a host sync: log rows, guard verdicts, stop votes


class EventLog:
    """Guard, checkpoint and evaluation events: a metrics.jsonl row of kind "event" and a line on stdout
    (rank 0). Its own object, not a Trainer method, so the evaluator holding it makes no reference cycle:
    a cycle kept the DDP module alive past the process group's teardown, and gloo aborted the process."""

    def __init__(self, logger: JsonlLogger | NullLogger, master: bool):
        self.logger, self.master = logger, master

    def __call__(self, step: int, text: str, who: str = "guard", **values) -> None:
        self.logger.log(step, {"event": text, **values}, kind="event")
        if self.master:
            print(f"step {step:6d} | {who}: {text}", flush=True)


class Trainer:
    def __init__(self, prep: Prepared, t_start: float, watchdog: Watchdog):
        cfg, env, raw = prep.cfg, prep.env, prep.model
        self.cfg, self.env, self.run_dir, self.raw, self.t_start = cfg, env, prep.run_dir, raw, t_start
        # started by train.main before the process group: a peer that never joins the collectives below is a hang
        self.watchdog = watchdog
        self.watchdog.beat("setting up")
        try:
            self.setup(prep)
        except BaseException:
            self.watchdog.stop()  # its C backstop would end the process (a test's) long after this error
            raise

    def setup(self, prep: Prepared) -> None:
        """Everything the loop holds, built while the watchdog runs (the probe and the collectives may hang)."""
        cfg, env, raw = prep.cfg, prep.env, prep.model
        tc = cfg.train
        self.faults = FaultInjector(env.rank, env.world)  # test-only trouble (GPTPIPE_TEST_FAULT)
        self.faults.install(raw)
        raw.head_loss = make_loss(env.loss)  # train.loss; the trainer owns the fused loss's reusable buffers
        raw.recompute = tc.activation_checkpointing
        # float8 layers swapped in before any wrapper or compile sees the model; the weights (and so the
        # optimizer and the checkpoints) stay as they were: None/[] when the run trains its matmuls in bf16
        self.fp8_recipe = prep.fp8_recipe
        self.fp8_layers = fp8.convert(raw, self.fp8_recipe) if self.fp8_recipe else []
        self.plan = parallel.plan(cfg, env)  # single, ddp or fsdp, and why
        # the ranks whose weights can be compared: DDP's replicas, HSDP's replicas of each shard
        self.replica_groups = parallel.replica_groups(self.plan.kind, env)
        self.replicated = bool(self.replica_groups)
        # after sharding: FSDP2 replaces the parameters by DTensors, which the optimizer must hold
        distributed_model = parallel.wrap(raw, self.plan.kind, env, tc.ddp_bf16_grads)
        # under FSDP a whole copy on every rank, refreshed before each evaluation: evaluations and samples run
        # on it as they run on the plain model under DDP. Made before the probe, which must count its memory.
        self.replica = parallel.EvalReplica(raw, env.device) if self.plan.kind == "fsdp" else None
        self.optimizer = build_optimizer(raw, cfg.optim, env.device.type)
        self.scaler = torch.amp.GradScaler(env.device.type) if env.dtype == torch.float16 else None
        self.auto_micro = tc.micro_batch == microbatch.AUTO
        self.micro_how = "set"
        # the allocator's history (CUDA) from before the probe; a record at every out-of-memory error
        self.memory = MemoryRecorder(prep.run_dir, env.rank, env.device)
        if self.auto_micro:  # from here on this invocation's config holds the choice (eval, records)
            try:
                tc.micro_batch, self.micro_how, failed = microbatch.choose(
                    prep.run_dir, distributed_model, self.optimizer, cfg, env,
                    beat=lambda micro: self.watchdog.beat(f"probing micro-batch {micro}", patience=PROBE_PATIENCE_S))
            except microbatch.NothingFits as e:
                self.memory.probed(None, microbatch.candidates(microbatch.share(cfg, env.world), tc.micro_batch_max),
                                   "probed")
                self.memory.out_of_memory(0, e, tc.micro_batch)
                raise
            self.memory.probed(tc.micro_batch, failed, self.micro_how)
        self.loader = ShardLoader(prep.data_dir, tc.micro_batch, tc.seq_len, tc.total_batch_tokens, tc.seed,
                                  env.rank, env.world, env.device, manifest=prep.manifest,
                                  verify_reads=env.local_rank == 0)  # one hashing loader per node
        torch.manual_seed(tc.seed + env.rank)  # per-rank randomness (dropout) from here on
        self.step = 0  # steps done; tokens seen = step * train.total_batch_tokens (part of the run identity)
        # ETA and GPU-hours (cost): the hours the resumed checkpoint had recorded carry on
        self.clock = RunClock(env.world, tc.price_per_gpu_hour, self.t_start,
                              float((prep.trainer_state or {}).get("gpu_hours", 0.0)))
        if prep.trainer_state is not None:
            self.step = restore(prep.trainer_state, self.optimizer, self.loader, self.scaler, env, model=raw)
            # the optimizer holds its own copy now: the loaded one (~1 GB per rank at 124M) goes
            prep.trainer_state = None
        self.hosts = distributed.all_gather_object(socket.gethostname())  # names events use for ranks
        seen = distributed.all_gather_object(self.step)  # every rank must resume from the same checkpoint
        if len(set(seen)) > 1:
            raise RunError(f"ranks found different checkpoints in {self.run_dir} (steps {seen}); the run "
                           "directory must be on a filesystem shared by all nodes (or set train.run_dir to one)")
        self.model = self.compiled(distributed_model)
        self.logger = JsonlLogger(self.run_dir / METRICS_FILE) if env.master else NullLogger()
        if env.master:
            fp8_how = f"{self.fp8_recipe} ({len(self.fp8_layers)} layers)" if self.fp8_recipe else "off"
            write_records(prep, self.step, self.micro_how, self.plan, fp8_how)
        peak_one = float(os.environ.get(PEAK_ENV) or 0) or peak_flops_guess(env.device)  # None: CPU, unknown GPU
        self.peak_flops = peak_one * env.world if peak_one else None  # all devices together, for MFU
        self.meta = {"config": cfg.to_dict(), "model_config": asdict(cfg.model), "manifest_id": prep.manifest.id,
                     "run_name": cfg.run_name, "identity_hash": cfg.identity_hash()}  # in every checkpoint
        self.guard, self.event = Guard(cfg.guard), EventLog(self.logger, env.master)
        self.watchdog.on_hang = self.event
        self.timer = ComputeTimer(env.device)  # this rank's own compute time, for the straggler check
        self.stragglers = Stragglers(cfg.guard.straggler_ratio, cfg.guard.straggler_logs, self.hosts, self.event)
        self.disagreements = Disagreements(self.hosts, self.event)  # the replicas' weight checksums
        # shards the loaders' background checks find damaged; rank 0 drops them from both hash caches
        self.damaged = DamagedShards(self.hosts, [prep.data_dir / SHARD_HASHES, self.run_dir / SHARD_HASHES]
                                     if env.master else [], self.event)
        self.checkpointer = Checkpointer(self.run_dir, tc.keep_last, background=tc.async_checkpoint)
        # sharded checkpoints' background saves talk on a group of their own (collective: made by every rank)
        self.saving_group = sharded.saving_group() if parallel.is_sharded(raw) else None
        self.evaluator = Evaluator(cfg, env, prep.data_dir, self.replica.model if self.replica else raw,
                                   self.logger, self.event, self.faults)
        self.profiler = StepProfiler(self.run_dir, env.rank, env.device, tc.profile_steps, self.step,
                                     self.logger.log, self.event)  # `touch <run_dir>/PROFILE`
        self.pending: list[Pending] = []
        self.unconfirmed: int | None = None  # the step of a checkpoint whose write every rank has not confirmed
        self.saved_step: int | None = None  # the step of the newest checkpoint this invocation saved
        self.skipped_step: int | None = None  # the step of a checkpoint not written (non-finite weights)
        self.stop_file = False  # rank 0 saw a STOP file
        self.t_read = time.time()

    def compiled(self, model: torch.nn.Module) -> torch.nn.Module:
        """What trains: parallel.wrap's model, through torch.compile when the run compiles."""
        if self.env.compile and parallel.is_sharded(model):
            # per block, in place (the state dict's names stay): FSDP2's all-gathers and reduce-scatters run
            # between the compiled blocks
            for block in model.transformer.h:
                block.compile()
        elif self.env.compile:
            # DDP first, then compile: dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries, so
            # each bucket's all-reduce starts while the rest of backward still runs (compiled-then-wrapped,
            # the hooks would fire only after the whole compiled backward)
            model = torch.compile(model)
        return model

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train to max_steps or a stop request; exit code 0 (RunError / Diverged for the caller)."""
        try:
            while self.step < self.cfg.train.max_steps:
                self.take_step()
                due = self.due()
                if not due.read:
                    continue  # no host sync: the device runs on while the host prepares the next step
                read = self.read_steps()
                if read.verdict == ROLLBACK:
                    self.roll_back()
                    continue
                stopping = read.stop and not due.last  # checkpoint and go: the flow evaluates that checkpoint
                # a stop checkpoint is checked too: rank 0 alone writes it, and the next start broadcasts
                # rank 0's weights, so drift on rank 0 would become permanent
                every = self.cfg.guard.consistency_interval
                checked = due.consistency or (stopping and self.replicated and bool(every))
                if checked and self.replicas_differ():
                    continue
                spent: dict[str, float] = {}
                troubled = self.guard.nonfinite or self.guard.spiking  # an interval checkpoint waits for a healthy step
                if due.last or stopping or (due.checkpoint and not troubled):
                    # apart: waiting for the previous write (only when saves come faster than the disk
                    # writes them) and the copy off the device, the part every save blocks training for
                    with timed(spent, "checkpoint_wait", self.watchdog):
                        self.confirm_checkpoint(wait=True)
                    with timed(spent, "checkpoint", self.watchdog):
                        self.checkpoint("end" if due.last else "stop" if stopping else "interval", read.loss)
                if self.replica is not None and (due.eval or due.sample) and not stopping:
                    with timed(spent, "eval_replica", self.watchdog):
                        self.replica.refresh()  # collective: the current weights, whole, on every rank
                if due.eval and not stopping:
                    # evaluations are not paced by steps (harness tasks run on rank 0 while the others wait)
                    with timed(spent, "eval", self.watchdog, patience=EVAL_PATIENCE_S):
                        self.evaluate(due.last)
                if due.sample and not stopping and self.env.master:
                    with timed(spent, "sample", self.watchdog):
                        self.evaluator.sample(self.step)
                self.log_time_spent(spent)
                if stopping:
                    return self.stopped()
            return self.finished()
        except RuntimeError as e:
            if not distributed.lost_peer(e):
                raise
            # a host died or the link went down: say so once, with the peer's address, not a gloo traceback
            why = next((ln.strip() for ln in str(e).splitlines() if distributed.PEER_GONE.search(ln)), str(e)[:300])
            text = f"lost contact with another rank at step {self.step}: {why}"
            self.event(self.step, text, who="peers")
            raise distributed.PeerLost(text) from e
        finally:
            self.watchdog.stop()
            self.checkpointer.close()  # a write in flight ends before the process does
            self.logger.close()

    def due(self) -> Due:
        step, tc, ev = self.step, self.cfg.train, self.cfg.eval
        last = step == tc.max_steps
        checkpoint = step % tc.checkpoint_interval == 0
        evaluate = last or bool(ev.eval_interval and step % ev.eval_interval == 0)
        sample = last or bool(ev.sample_interval and step % ev.sample_interval == 0)
        every = self.cfg.guard.consistency_interval
        # and before every checkpoint: rank 0 alone writes it, and its replica may be the odd one
        consistency = self.replicated and bool(every) and (last or checkpoint or step % every == 0)
        read = last or checkpoint or evaluate or sample or consistency or step == 1 or step % tc.log_interval == 0
        return Due(last, checkpoint, evaluate, sample, consistency, read)

    # --- step and log -----------------------------------------------------------------------------

    def take_step(self) -> None:
        lr = lr_at(self.step, self.cfg)
        set_lr(self.optimizer, lr)
        vote = self.stop_vote()
        self.faults.before_step(self.raw)
        before = self.loader.state_dict()
        self.profiler.before(self.step + 1)
        while True:
            try:
                stats = train_step(self.model, self.optimizer, self.loader, self.loader.accum, self.env,
                                   self.scaler, self.cfg.optim.grad_clip, vote, self.timer)
                break
            except torch.OutOfMemoryError as e:  # train.micro_batch=auto: the same data at a smaller size
                share = microbatch.share(self.cfg, self.env.world)
                retry = microbatch.smaller(self.cfg.train.micro_batch, share) if self.auto_micro else None
                # first, while the failed step's memory is still as it was: the record (and CUDA snapshot)
                folder = self.memory.out_of_memory(self.step + 1, e, self.cfg.train.micro_batch, retry)
                self.logger.log(self.step + 1, {"dir": str(folder.relative_to(self.run_dir))}, kind="memory")
                microbatch.retry_smaller(e, self.auto_micro, self.run_dir, self.cfg, self.env, self.optimizer,
                                         self.loader, before, self.step + 1, self.event,
                                         record=str(folder.relative_to(self.run_dir)))
        self.step += 1
        self.profiler.after(self.step)
        self.memory.after_step(self.step)
        self.watchdog.beat("training", step=self.step)
        self.pending.append(Pending(self.step, lr, self.loader.epoch, stats))

    def stop_vote(self) -> bool:
        """This rank votes to stop: a signal on any rank, rank 0's clock, a STOP file or unwritable metrics.
        The vote is reduced with the loss, so every rank sees it at the same step."""
        tc, master = self.cfg.train, self.env.master
        out_of_time = tc.max_minutes > 0 and (time.time() - self.t_start) > tc.max_minutes * 60
        stop_file = master and (self.run_dir / STOP_FILE).exists()
        self.stop_file = self.stop_file or stop_file
        broken = master and self.logger.error is not None  # metrics.jsonl cannot be written (a full disk?)
        return STOP_SIGNAL["signal"] is not None or (master and out_of_time) or stop_file or broken

    def read_steps(self) -> Read:
        """The one host sync of the pending steps (the same steps on every rank): log each, let the guard
        judge each, and learn how a checkpoint write in flight ended."""
        cfg, env, guard = self.cfg, self.env, self.guard
        rows = [StepStats(*r) for r in torch.stack([p.stats for p in self.pending]).tolist()]
        now = time.time()  # after the read: the host has waited for the device, so dt is the steps' real time
        dt = (now - self.t_read) / len(self.pending)
        self.watchdog.beat("training", step_time=dt)
        # what each rank learned since the last read: its own compute time, shards that failed their check
        mine = (self.timer.take() / len(self.pending), self.loader.damaged())
        heard = distributed.all_gather_object(mine) if env.ddp else [mine]
        ranks = self.stragglers.observe(self.pending[-1].step, [t for t, _ in heard])
        self.damaged.report(self.pending[-1].step, [d for _, d in heard])
        batch = cfg.train.total_batch_tokens
        tok_s = batch / dt
        rates = self.clock.row(self.pending[-1].step, cfg.train.max_steps, dt, now)
        if self.peak_flops:
            rates["train/mfu"] = self.raw.estimate_mfu(tok_s, self.peak_flops, cfg.train.seq_len)
        if env.device.type == "cuda":  # the allocator's own count, host side: no device sync
            # the peak since the previous row, then a new count: a spike shows at the steps (or the evaluation
            # or checkpoint between two rows) where it happened, and a span's peak is the max of its rows
            rates["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(env.device) / 2**30
            torch.cuda.reset_peak_memory_stats(env.device)
        read = Read(math.nan, OK, False)
        for p, s in zip(self.pending, rows, strict=True):
            read.loss, read.stop = s.loss_sum / env.world, read.stop or s.stop_votes > 0
            self.logger.log(p.step, {"train/loss": read.loss, "train/lr": p.lr, "train/grad_norm": s.grad_norm,
                                     "train/step_time": dt, "train/tokens_per_s": tok_s,
                                     "train/tokens_seen": p.step * batch, "train/epoch": p.epoch, **rates,
                                     "train/micro_batch": self.loader.B,
                                     **(ranks if p is self.pending[-1] else {})})
            if read.verdict != ROLLBACK:
                read.verdict = guard.observe(read.loss, s.nonfinite_ranks == 0)
                if read.verdict == SKIP:
                    self.event(p.step, f"non-finite step skipped (loss {read.loss}, grad norm {s.grad_norm}): no "
                               f"update applied ({guard.nonfinite}/{cfg.guard.max_nonfinite} before a rollback)")
        if env.master:
            p, s = self.pending[-1], rows[-1]
            cost = f" | ${rates['train/cost_usd']:,.2f} of ${rates['train/cost_projected_usd']:,.2f}" \
                if "train/cost_usd" in rates else ""
            print(f"step {p.step:6d}/{cfg.train.max_steps} | loss {read.loss:.6f} | lr {p.lr:.3e} | norm "
                  f"{s.grad_norm:.4f} | {dt * 1000:.1f} ms | {tok_s:,.0f} tok/s | ETA "
                  f"{duration(rates['train/eta_s'])}{cost}", flush=True)
        self.pending.clear()
        self.t_read = now
        self.confirm_checkpoint(wait=False)
        return read

    def replicas_differ(self) -> bool:
        """Compare the ranks' weight checksums (collective). Equal: False. A rank that differs for the first
        time: an event, a rollback to the newest good checkpoint (every rank loads the same weights), True.
        A rank that differs again: ReplicasDisagree, naming its host (replicas.Disagreements)."""
        sums = distributed.all_gather_object(int(weights_checksum(self.raw).item()))
        if not self.disagreements.check(self.step, sums, self.replica_groups):
            return False
        self.roll_back(why="replicas disagree")
        return True

    def log_time_spent(self, spent: dict[str, float]) -> None:
        """Time outside training steps at this sync point, as metrics; step times leave it out."""
        if spent:
            self.logger.log(self.step, {f"time/{k}_s": v for k, v in spent.items()}, kind="overhead")
            self.t_read = time.time()

    # --- checkpoint, evaluate -----------------------------------------------------------------------

    def checkpoint(self, reason: str, train_loss: float) -> None:
        """Checkpoint the state after this step: the ranks wait for rank 0's copy of it, not for the disk
        (train.async_checkpoint). Collective: every rank contributes its RNG state. The previous write is
        confirmed first by the caller (run(), which times that wait apart): at most one write in flight."""
        env = self.env
        rng = {"torch": torch.get_rng_state()}  # every rank's, so dropout masks resume exactly
        if env.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(env.device)
        rngs = distributed.all_gather_object(rng)
        state = meta = None
        if env.master:
            state = {"loader": self.loader.state_dict(), "rng": rngs,
                     "scaler": self.scaler.state_dict() if self.scaler is not None else {},
                     "step": self.step, "world": env.world, "gpu_hours": self.clock.gpu_hours()}
            meta = {**self.meta, "tokens_seen": self.step * self.cfg.train.total_batch_tokens,
                    "train_loss": train_loss, "reason": reason,
                    **checkpoint_cost(self.clock.gpu_hours(), self.cfg.train.price_per_gpu_hour)}
        if parallel.is_sharded(self.raw):  # every rank writes its own shard (the optimizer's too)
            staged = distributed.broadcast_object(self.checkpointer.staging_dir(self.step) if env.master else None)
            saving = sharded.start_save(staged, self.raw, self.optimizer, self.saving_group)  # collective
            self.checkpointer.save_sharded(self.step, saving, staged, state, meta, env.master)
        elif env.master:
            self.checkpointer.save(self.step, weights_of(self.raw),
                                   {"optimizer": self.optimizer.state_dict(), **state}, meta)
        self.unconfirmed = self.saved_step = self.step
        if not self.cfg.train.async_checkpoint:
            self.confirm_checkpoint(wait=True)

    def confirm_checkpoint(self, wait: bool) -> None:
        """Every rank learns how rank 0's newest checkpoint write ended (collective, while one is unconfirmed):
        a failed write stops every rank with the same error; a skipped one (non-finite weights) is an event."""
        if self.unconfirmed is None:
            return
        if wait:  # rank 0 waits for its writer, the others in the broadcast: progress, with its own patience
            self.watchdog.beat("waiting for a checkpoint write", patience=WRITE_PATIENCE_S)
        out = distributed.broadcast_object(self.checkpointer.outcome(wait) if self.env.master else None)
        if wait:
            self.checkpointer.wait()  # every rank's own part of a sharded save has ended too
            self.watchdog.beat("training")
        if out is None:
            return  # still being written
        self.unconfirmed = None
        if out.status == FAILED:
            raise RunError(out.text)
        if out.status == SKIPPED:
            self.event(out.step, f"checkpoint not written: {out.text}", who="checkpoint")
            self.skipped_step = out.step
            return
        if self.env.master:
            print(f"checkpoint {out.text} written in {out.seconds:.2f} s", flush=True)
            self.logger.log(out.step, {"time/checkpoint_write_s": out.seconds}, kind="checkpoint")
        self.guard.checkpointed()

    def evaluate(self, last: bool) -> None:
        """Validation (and HellaSwag when due) after the checkpoint of this step; the results are attached to
        that checkpoint as its eval.json."""
        record = self.evaluator.evaluate(self.step, last)
        if record is not None and self.env.master and self.saved_step == self.step:
            self.checkpointer.attach(self.step, EVAL_FILE, {**record, "target": str(step_dir(self.run_dir, self.step)),
                                                            "manifest_id": self.meta["manifest_id"]})

    def roll_back(self, why: str | None = None) -> None:
        """Reload the newest good checkpoint (weights, optimizer, RNG) but keep the data position, so the
        batches since that checkpoint, which led into the trouble, are skipped. Raises Diverged when there is
        nothing to roll back to or it happened too often in a row."""
        self.confirm_checkpoint(wait=True)  # a write in flight is on disk (or known lost) before choosing
        cfg, loader, guard, step = self.cfg, self.loader, self.guard, self.step
        # read before rolled_back resets the counts
        why = why or ("non-finite steps" if guard.nonfinite else "loss spike")
        if not guard.rolled_back():
            raise Diverged(f"the run diverged again ({why} at step {step}) after {cfg.guard.max_rollbacks} "
                           "rollbacks with no checkpoint written in between; the checkpoints are intact. Lower "
                           "optim.max_lr (or raise optim.warmup_steps), check the data near loader position "
                           f"{loader.position}, then run the same command to continue from the newest checkpoint "
                           "(guard.max_rollbacks allows more tries)")
        # healthy only: a checkpoint written during the trouble is no way out of it
        ck, ts = agreed_checkpoint(self.run_dir, self.raw, self.env.master, healthy_only=True)
        if ck is None:
            raise Diverged(f"the run diverged ({why} at step {step}) before it had a good checkpoint to roll "
                           "back to; lower optim.max_lr or raise optim.warmup_steps, or lower "
                           "train.checkpoint_interval so a rollback has somewhere to go")
        skipped = loader.position - int(ts["loader"]["position"])
        self.optimizer.zero_grad(set_to_none=True)
        # the checkpoint's step
        self.step = restore(ts, self.optimizer, loader, self.scaler, self.env, data=False, model=self.raw)
        self.event(step, f"{why}: rolled back to {ck.name}; the {skipped} sequences since it are "
                   f"skipped (rollback {guard.rollbacks}/{cfg.guard.max_rollbacks})",
                   **{"guard/rollback_from": step, "guard/rollback_to": self.step, "guard/skipped_sequences": skipped})
        self.t_read = time.time()

    # --- the end ----------------------------------------------------------------------------------

    def stopped(self) -> int:
        """A stop request (signal, STOP file, time budget): its checkpoint is on disk, then exit 0."""
        self.confirm_checkpoint(wait=True)
        env, tc = self.env, self.cfg.train
        broken = distributed.broadcast_object(self.logger.error if env.master else None)
        if broken:
            raise RunError(f"{self.run_dir / METRICS_FILE} cannot be written ({broken}); the run checkpointed "
                           f"step {self.step} and stopped: make room on that disk and run again")
        why = f"signal {STOP_SIGNAL['signal']}" if STOP_SIGNAL["signal"] is not None else \
            f"{STOP_FILE} file" if self.stop_file else f"time budget train.max_minutes={tc.max_minutes}"
        if env.master:
            print(f"stopped at step {self.step}/{tc.max_steps} ({why}); run the same command to continue", flush=True)
        distributed.barrier()  # no rank tears the group down while another still finishes a collective
        return 0

    def finished(self) -> int:
        """max_steps reached: the last checkpoint is on disk, then DONE. Final weights that are not finite
        (their checkpoint was not written) are no finished run: Diverged, and the next start resumes from
        the newest good checkpoint."""
        self.confirm_checkpoint(wait=True)
        if self.skipped_step == self.step:
            raise Diverged(f"the run reached max_steps={self.step} with non-finite weights, so its last "
                           "checkpoint was not written and it is not done; lower optim.max_lr (or raise "
                           "optim.warmup_steps), then run the same command: it resumes from the newest good "
                           "checkpoint")
        if self.env.master:
            write_json(self.run_dir / DONE_FILE, {"step": self.step, "time": time.time(),
                                                  "tokens_seen": self.step * self.cfg.train.total_batch_tokens})
            print(f"RUN_DONE run={self.cfg.run_name} step={self.step} dir={self.run_dir}", flush=True)
        distributed.barrier()  # no rank tears the group down while another still finishes a collective
        return 0


class timed:
    """`with timed(spent, "eval", watchdog):` adds the block's wall time to spent["eval"]; its start and end
    are progress for the hang watchdog."""

    def __init__(self, spent: dict[str, float], name: str, watchdog: Watchdog | None = None, patience: float = 0.0):
        self.spent, self.name, self.watchdog, self.patience = spent, name, watchdog, patience

    def __enter__(self):
        self.t0 = time.time()
        if self.watchdog is not None:
            self.watchdog.beat(self.name, patience=self.patience)

    def __exit__(self, *exc):
        self.spent[self.name] = self.spent.get(self.name, 0.0) + time.time() - self.t0
        if self.watchdog is not None:
            self.watchdog.beat("training")


def write_records(prep: Prepared, step: int, micro_how: str = "set", plan: parallel.Plan | None = None,
                  fp8_how: str = "off") -> None:
    """run.json (the run's identity, once), config.json (this invocation's) and the start line (rank 0)."""
    cfg, run_dir, env = prep.cfg, prep.run_dir, prep.env
    if not (run_dir / RUN_FILE).is_file():  # a new run (check_run accepted an existing one)
        write_json(run_dir / RUN_FILE, {
            "run_name": cfg.run_name, "identity_hash": cfg.identity_hash(), "manifest_id": prep.manifest.id,
            "preset": cfg.preset, "dataset_dir": str(prep.data_dir), "created": time.time()})
    write_json(run_dir / "config.json", cfg.to_dict())
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # a stop request was for the previous invocation
    how = f"resuming from {prep.ckpt.name}" if prep.ckpt else "starting"
    print(f"run {cfg.run_name} ({run_dir}): {how} at step {step}/{cfg.train.max_steps}; world={env.world} "
          f"accum={cfg.grad_accum_steps(env.world)} micro_batch={cfg.train.micro_batch} ({micro_how}) "
          f"attempt={verdict.this_launch()[1]} device={env.device} dtype={env.dtype} compile={env.compile} "
          f"loss={env.loss} "
          f"parallel={plan.kind if plan else 'single'} ({plan.why if plan else 'one rank'}) "
          f"activation_checkpointing={cfg.train.activation_checkpointing} fp8={fp8_how} "
          f"params={prep.model.num_params():,} dataset={prep.data_dir} ({prep.manifest.id})",
          flush=True)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: ShardLoader, accum: int,
               env: distributed.Env, scaler=None, grad_clip: float = 1.0, stop_vote: bool = False,
               timer: ComputeTimer | None = None) -> torch.Tensor:
    """One optimizer step over `accum` micro-batches, with no host sync: returns StepStats as one device
    tensor. A step that is non-finite on any rank applies no update (the fused optimizer skips it on the
    device, as GradScaler does). The learning rate is set by the caller. `timer` times this rank's own work
    (no collective runs in it). (bench_train times this.)"""
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(accum):
        x, y = loader.next_batch()
        # gradients are all-reduced (DDP) or reduce-scattered (FSDP2) only on the last micro-step
        all_reduces = env.ddp and micro == accum - 1
        with parallel.gradient_sync(model, all_reduces) if env.ddp else nullcontext():
            # `timer`: this rank's own work, where no collective waits for another rank: every forward, and
            # every backward but the one whose gradient all-reduce waits for the slowest rank
            with timer or nullcontext():
                with env.autocast():
                    _, loss = model(x, y, return_logits=False)
                loss = loss / accum  # the mean over the whole step's micro-batches
                loss_sum += loss.detach()
                if not all_reduces:
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            if all_reduces:
                (scaler.scale(loss) if scaler is not None else loss).backward()
    parts = getattr(optimizer, "optimizers", (optimizer,))  # optim.name=muon: AdamW + Muon
    if scaler is not None:
        for part in parts:
            scaler.unscale_(part)
    # inf: measure the norm without clipping
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if isinstance(norm, DTensor):  # sharded gradients (an HSDP mesh): the norm over all of them
        norm = norm.full_tensor()
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
    return torch.cat([packed, norm.detach().float().view(1)])  # StepStats' order


def skip_if_nonfinite(optimizer: torch.optim.Optimizer, n_bad: torch.Tensor) -> None:
    """optimizer.step(), or no update when n_bad > 0. The fused AdamW and the Muon of gptcore.model.optim take
    the decision on the device (found_inf: no parameter, moment or step-count change); another optimizer
    needs a host sync."""
    if skips_on_device(optimizer):
        optimizer.found_inf = (n_bad > 0).float()
        optimizer.step()
        optimizer.found_inf = None
    elif n_bad.item() == 0:
        optimizer.step()
