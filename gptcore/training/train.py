"""GPT-2 pretraining: one process or many under torchrun (DDP), resumable exactly.

    python -m gptcore.training.train tiny-cpu train.max_steps=100
    torchrun --standalone --nproc_per_node=8 -m gptcore.training.train gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 -m gptcore.training.train ...

A run lives in <home>/runs/<run_name>/ (or train.run_dir). Starting the same command again continues
it from its latest checkpoint; a finished run (DONE) does nothing and prints RUN_DONE.

Exit codes: 0 = max_steps reached (RUN_DONE printed) or stopped cleanly with a checkpoint (time budget
train.max_minutes, SIGTERM/SIGINT to the trainer processes, or a <run_dir>/STOP file); 2 = bad input
(config, dataset, run identity, no intact checkpoint, another trainer holds the run directory, a run
directory or dataset that cannot be read or written): nothing half-written is kept; 3 = diverged (the
guard rolled back guard.max_rollbacks times in a row; the checkpoints are intact); 4 = the replicas disagreed
twice on the same rank (drain that host); 5 = a rank made no progress (gptcore/training/watchdog.py: stacks in
<run_dir>/hangs/; torchrun restarts the job with train.max_restarts); 6 = the rank's torchrun agent died
(gptcore/training/orphan.py: it stops at once, without a checkpoint); 7 = a collective lost its peer (a host
died or a link went down: an `error:` line naming the peer's address and a metrics event; no verdict, the
checkpoints are intact); anything else = a crash.
Exits 2, 3 and 4 once training started are verdicts, recorded in <run_dir>/verdict.json (gptcore/training/verdict.py):
a torchrun restart of the same launch exits at once with the recorded code instead of replaying the same
end; the next launch moves the record aside (verdict.<time>.json) and runs. A start refused before training
(bad input found by the checks) writes nothing into the run directory: a restart only repeats the checks.

The trainer defends its run by itself, whoever launched it: it locks the run directory (train.lock),
resumes from the newest checkpoint that verifies whole (others are moved to checkpoints/rejected/), skips
non-finite steps and rolls back on repeated ones or a loss spike (gptcore/training/guard.py), writes checkpoints in
the background (train.async_checkpoint) and evaluates after each checkpoint, where a failed evaluation is
an event, never the end of the run.

This module is the entry point only: where a run starts is gptcore/training/resume.py, the loop
gptcore/training/trainer.py.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from gptcore import distributed
from gptcore.checkpoints import run_files
from gptcore.checkpoints.run_files import run_dir_for
from gptcore.config import ConfigError
from gptcore.data.shard_format import ShardError
from gptcore.overrides import load_config
from gptcore.runlock import LockHeld
from gptcore.training import orphan, verdict, watchdog
from gptcore.training.guard import stall_before_process_group
from gptcore.training.microbatch import NothingFits
from gptcore.training.replicas import ReplicasDisagree
from gptcore.training.resume import NotShared, RunError, agree_on_the_run_dir, prepare
from gptcore.training.trainer import STOP_FILE, STOP_SIGNAL, Diverged, Trainer
from gptcore.training.watchdog import Watchdog

EXIT_OK, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_REPLICAS = 0, 2, 3, 4  # 5: gptcore.training.watchdog.HANG_EXIT
EXIT_PEER_LOST = 7  # 6: gptcore.training.orphan.AGENT_LOST_EXIT
__all__ = ["main", "STOP_FILE"]


def _on_signal(signum, frame):  # only set a flag: every rank stops at the same step (Trainer.stop_vote)
    STOP_SIGNAL["signal"] = signum


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return EXIT_OK if argv else EXIT_BAD_INPUT
    t_start = time.time()
    orphan.watch_agent()  # a rank whose torchrun agent dies stops within seconds instead of training alone
    rank = int(os.environ.get("RANK", 0))
    # before CUDA starts: memory freed by an out-of-memory step (or the probe) is reused instead of
    # fragmenting the card; the user's own allocator settings win
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    known = (ConfigError, ShardError, RunError, LockHeld, run_files.CheckpointError, OSError)
    try:
        cfg = load_config(argv[0], argv[1:], world_size=distributed.world_size())
        run_dir = run_dir_for(cfg)
    except known as e:
        return fail(e)  # no run directory yet to record the verdict in: the exit code says it
    # one host: its restart count is the launch's attempt, known now; several: once their ranks agree on it
    one_host = distributed.world_size() == int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if one_host and (code := ended_by_verdict(run_dir)) is not None:
        return code
    try:
        prep = prepare(cfg, rank)
    except known as e:  # refused before training: the run directory stays as it was (no record either)
        return fail(e)
    if prep is None:  # finished: every rank must see so (a host whose run folder is not shared would wait)
        return agree_finished(cfg, run_dir) if distributed.world_size() > 1 else EXIT_OK
    if one_host:
        verdict.set_aside_stale(prep.run_dir)  # an earlier launch's verdict: this launch runs
    # flag-only handlers for the run; the previous ones come back after it (main may run in-process: a
    # process forked later must not inherit a SIGTERM that does nothing)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    # from here on a rank that never arrives (a stalled host, a link down) is a hang too: start-up is bounded
    watchdog = Watchdog(prep.run_dir, prep.env.rank, cfg.train.hang_timeout_s).start()
    watchdog.doing = "joining the process group"
    try:
        stall_before_process_group(prep.env.rank)  # test-only (GPTPIPE_TEST_FAULT=latejoin@R)
        distributed.init_process_group(prep.env, hang_limit(cfg), trace_dir=prep.run_dir / "hangs")
        if prep.env.world > 1:
            verdict.agree_attempt(distributed.sum_over_hosts(verdict.host_restarts(), prep.env))
            if not one_host:
                if prep.env.local_rank == 0:  # one line per host: what each host counted, what they agreed
                    print(f"attempt {verdict.this_launch()[1]} of this launch on {os.uname().nodename} (torchrun "
                          f"restarts counted on this host: {verdict.host_restarts()}; summed over the hosts)",
                          flush=True)
                if (code := ended_by_verdict(run_dir)) is not None:
                    return code
                verdict.set_aside_stale(prep.run_dir)
            watchdog.doing = "agreeing on the run directory"
            agree_on_the_run_dir(prep.run_dir, False, prep.env.master)
        return Trainer(prep, t_start, watchdog).run()
    except NotShared as e:  # refused before training: nothing recorded in the run directory
        return fail(e)
    # RunError: found only once the ranks talk (e.g. a run dir not shared between nodes); OSError after
    # the checks: e.g. the disk filled up, or a file turned into a directory
    except (RunError, Diverged, ReplicasDisagree, NothingFits, OSError) as e:
        return fail(e, prep.run_dir)
    except distributed.PeerLost as e:  # no verdict: a restart (torchrun's or a relaunch) is the remedy
        print(f"error: {e}. Its host died or the link between the hosts went down; the newest checkpoint is "
              "intact: relaunch every host (or the hosts left: the run continues at the smaller world size)",
              file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    finally:
        watchdog.stop()
        verdict.agree_attempt(None)
        distributed.teardown()
        if prep.lock is not None:
            prep.lock.release()
        for s, handler in previous.items():
            signal.signal(s, handler)
        STOP_SIGNAL["signal"] = None


def ended_by_verdict(run_dir) -> int | None:
    """The exit code of a verdict an earlier attempt of this launch recorded (a restart cannot change it)."""
    if (earlier := verdict.of_this_launch(run_dir)) is None:
        return None
    print(f"error: the run ended with a verdict in this launch: {earlier.summary()} (attempt {earlier.attempt}, "
          f"{earlier.time}); torchrun's restart cannot change it. Fix the cause, then launch again", file=sys.stderr)
    return earlier.code


def hang_limit(cfg) -> float:
    return cfg.train.hang_timeout_s or watchdog.CEILING_S


def agree_finished(cfg, run_dir) -> int:
    """A finished run relaunched on several ranks: they meet once to agree it is finished (NotShared, exit 2,
    on every rank when some do not see DONE), then exit 0."""
    env = distributed.select(cfg.train)
    watchdog = Watchdog(run_dir, env.rank, cfg.train.hang_timeout_s).start()  # a rank that never comes: a hang
    watchdog.doing = "agreeing the run is finished"
    try:
        distributed.init_process_group(env, hang_limit(cfg))
        # the collectives of a rank that starts training instead (its host does not see DONE), in its order
        verdict.agree_attempt(distributed.sum_over_hosts(verdict.host_restarts(), env))
        agree_on_the_run_dir(run_dir, True, env.master)
        return EXIT_OK
    except NotShared as e:
        return fail(e)
    finally:
        watchdog.stop()
        verdict.agree_attempt(None)
        distributed.teardown()


def fail(e: Exception, run_dir=None) -> int:
    """Print the one error line for a failure the trainer knows; returns its exit code, a verdict, which is
    recorded in `run_dir` (when known) for torchrun's restarts and the launcher to read."""
    why = str(e)
    if isinstance(e, OSError):
        why = (f"{type(e).__name__}: {e}. The run directory or the dataset cannot be read or written there: "
               "check that path (a file where a directory belongs, or the reverse), its permissions and the "
               "free disk, then run again: the run continues from its newest checkpoint")
    print(f"error: {why}", file=sys.stderr)
    code = EXIT_REPLICAS if isinstance(e, ReplicasDisagree) else EXIT_DIVERGED if isinstance(e, Diverged) \
        else EXIT_BAD_INPUT
    if run_dir is not None and not restart_helps(e):
        verdict.record(run_dir, code, why)
    return code


def restart_helps(e: Exception) -> bool:
    """The DDP out-of-memory exit (microbatch.retry_smaller: a RunError from torch's OutOfMemoryError) is
    exit 2 but no verdict: the restart starts at the smaller micro-batch that micro_batch.json keeps."""
    return isinstance(e.__cause__, torch.OutOfMemoryError)


if __name__ == "__main__":
    sys.exit(main())
