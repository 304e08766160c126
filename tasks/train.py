"""The train stage: run `torchrun -m gptcore.training.train` as a child process of the flow run.

    train_task(load_config("tiny-cpu", {"train.max_steps": 50}).to_dict(), run_name="tiny-cpu", nproc=1)
    -> {"run_dir", "checkpoint", "step", "done", "returncode", "seconds", "resumed_from"}

What the launcher guarantees:
- torchrun runs in its own process group (start_new_session) with a parent-death signal: if the flow
  run's process dies, even by SIGKILL, torchrun gets SIGTERM and the trainer checkpoints and exits.
  A failed or cancelled task (any exception here, including Prefect's termination on cancel) sends
  SIGTERM to the whole group, then SIGKILL after a grace period. No orphaned trainers.
- Its stdout/stderr lines go into the Prefect run logs; a non-zero exit raises with the log's tail.
- One trainer per run directory: a Prefect global concurrency limit `train-<run_name>` (limit 1) makes a
  second flow run wait (then fail with a clear message); the ground truth is the trainer's own lock on
  `<run_dir>/train.lock` (gptcore.runlock), which also holds when the Prefect server is unreachable, a
  lease expired, or someone runs torchrun by hand.
- torchrun gets --shutdown-timeout SHUTDOWN_SECONDS (where it has the flag: torch >= 2.12; 30 s fixed on
  2.11, gptcore.launch), and this task waits longer than that before its SIGKILL, so a SIGTERM (cancel,
  preemption) always ends with a complete stop checkpoint.
- While training, integrations.tracking.Shipper ships metrics.jsonl to MLflow from a background thread.
- Restarts are this task's, not torchrun's (which restarts every non-zero exit, then exits 1 whatever the
  trainer's code): torchrun runs with --max-restarts=0, and after a hang or a crash it is launched again,
  up to train.max_restarts times. A rank that ran out of memory under DDP (train.micro_batch=auto) keeps a
  smaller micro-batch in micro_batch.json and exits: that restart is free (a step down in size, at most
  MAX_SMALLER_RESTARTS), so the restarts kept for hangs are still there for the night. A verdict (the
  trainer's <run_dir>/verdict.json, gptcore/training/verdict.py: bad input 2, diverged 3, replicas disagree 4) is
  never restarted: it fails the task with a TrainError that starts with its name and code, e.g.
  "diverged (exit 3): ...". A hang (the watchdog's exit 5, stacks in <run_dir>/hangs/<folder>) is restarted;
  once the restarts are spent the TrainError starts "hang (exit 5): ..." and names the rank and the folder.
"""

from __future__ import annotations

# lazy imports: prefect's client and the shipper only when a run is launched (the skip decision reads files)
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from gptcore.checkpoints.run_files import out_of_memory_choice, run_dir_for, run_state
from gptcore.config import RunConfig
from gptcore.files import write_json
from gptcore.launch import SHUTDOWN_SECONDS, torchrun_cmd
from gptcore.overrides import as_config
from gptcore.training import verdict
from gptcore.training.watchdog import HANG_EXIT
from integrations import processes
from tasks.stage import FlowRun, Stage

TRAIN_LOG = "train.log"  # the trainer's stdout/stderr, appended per invocation
GRACE_SECONDS = SHUTDOWN_SECONDS + 30.0  # this task's SIGKILL comes only after torchrun's has had its turn
LEASE_SECONDS = 60  # Prefect's minimum; a killed holder's slot is reclaimed this long after its death
MAX_SMALLER_RESTARTS = 7  # restarts at a smaller micro-batch after an out-of-memory step (64 -> 1 halves 6 times)
SIGNALLED = "SignalException"  # in torchrun's last line when it was told to stop (SIGTERM/SIGINT): exit 1

# Runs the command with PR_SET_PDEATHSIG=SIGTERM: the kernel signals it when the launching thread dies.
# (A tiny exec wrapper instead of preexec_fn, which is unsafe in a threaded process.)
_PDEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit('launcher died before the trainer started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class TrainError(RuntimeError):
    """Training could not run or failed; the message says why and what to do."""


# --- one trainer per run directory -----------------------------------------------------------------

def prefect_slot(run_name: str, timeout: float):
    """A Prefect global concurrency limit named after the run (limit 1, created on first use): a second
    flow run of the same training run waits here, visible in the UI, then fails with a clear message."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = f"train-{run_name}"
    with get_client(sync_client=True) as c:
        try:  # upsert is read-then-create, not atomic: a concurrent flow run of this run may create it first
            c.upsert_global_concurrency_limit_by_name(name, 1)
        except ObjectAlreadyExists:
            pass  # created by that other flow run, with the same limit
    return name, concurrency(name, occupy=1, timeout_seconds=timeout, lease_duration=LEASE_SECONDS,
                             strict=True, raise_on_lease_renewal_failure=False)


# --- the child process -------------------------------------------------------------------------------

def end_group(proc: subprocess.Popen, grace: float, log) -> None:
    """SIGTERM torchrun's process group and its trainers (they checkpoint and exit); SIGKILL whatever is
    left after `grace` seconds."""
    tree = processes.tree_of(proc.pid)
    if processes.alive(tree):
        log.warning("stopping the trainer (SIGTERM to torchrun %d and %d child process(es); SIGKILL after "
                    "%.0fs)", proc.pid, len(tree) - 1, grace)
    if not processes.stop_tree(proc.pid, tree, grace, poll=proc.poll):
        log.error("trainer did not exit within %.0fs of SIGTERM; sent SIGKILL", grace)
    proc.wait()


def launch(cmd: list[str], run_dir: Path, log, env: dict, on_tick) -> tuple[int, list[str]]:
    """Run the trainer, streaming its output to `log` and calling `on_tick` as it goes; returns (exit code,
    last lines).

    The trainer writes to <run_dir>/train.log (appended), which this thread tails: if the flow run's
    process dies, the trainer's prints do not hit a broken pipe, so it can still checkpoint and exit."""
    tail: collections.deque[str] = collections.deque(maxlen=60)
    full = [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd]
    env = dict(env, PYTHONUNBUFFERED="1")
    log.info("launching: %s", " ".join(cmd))
    log_path = run_dir / TRAIN_LOG
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        offset = out.tell()
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            buf = b""
            while True:
                exited = proc.poll() is not None  # read once more after exit: nothing is lost
                chunk = f.read(1 << 16)
                if chunk:
                    *lines, buf = (buf + chunk).split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace").rstrip()
                        if line:
                            tail.append(line)
                            log.info(line)
                elif exited:
                    break
                else:
                    time.sleep(0.2)
                on_tick()
    finally:  # also on cancellation / termination signals / a failing logger: never leave the group
        end_group(proc, GRACE_SECONDS, log)
    return proc.returncode, list(tail)


def run_trainer(preset: str, overrides: dict | None, nproc: int, max_restarts: int, run_dir: Path, log,
                env: dict, on_tick=lambda: None) -> tuple[int, list[str]]:
    """Launch torchrun without its own restarts and launch it again after a hang or a crash, up to
    `max_restarts` times; returns the last (exit code, last lines). A verdict that this launch recorded in
    <run_dir>/verdict.json raises TrainError at once: a restart would replay the same batches into it."""
    cmd, restarts, smaller = torchrun_cmd(preset, overrides, nproc, max_restarts=0), 0, 0
    while True:
        before = verdict.read(run_dir)  # an earlier launch's, which this launch's trainer moves aside
        micro_before = out_of_memory_choice(run_dir)
        hangs_before = hang_folders(run_dir)
        rc, tail = launch(cmd, run_dir, log, env, on_tick)
        if rc == 0:
            return rc, tail
        hung = sorted(hang_folders(run_dir) - hangs_before)
        micro_after = out_of_memory_choice(run_dir)
        if micro_after is not None and micro_after != micro_before and smaller < MAX_SMALLER_RESTARTS:
            # a rank ran out of memory under DDP and kept a smaller micro-batch for the next start: that
            # restart is a step down in size, not a hang's, and spends none of train.max_restarts
            smaller += 1
            log.warning("out of memory under DDP: restarting at micro-batch %d (not counted against "
                        "train.max_restarts)", micro_after)
            continue
        after = verdict.read(run_dir)
        # this launch's: new since the launch, and written by a trainer this task started (not a stranger's)
        if after is not None and after != before and after.launched_by == verdict.launcher(env):
            raise TrainError(f"{after.summary()}\n(the trainer's verdict in {run_dir / verdict.VERDICT_FILE}; "
                             "a restart cannot change it, so none was made. Fix the cause, then run the flow "
                             "again: the run continues from its newest checkpoint)")
        if any(SIGNALLED in line for line in tail[-3:]):  # someone stopped torchrun: a stop, not a crash
            log.warning("torchrun was stopped by a signal (its workers wrote a stop checkpoint): not restarted")
            return rc, tail
        if hung:
            log.warning("%s", hang_summary(run_dir, hung))
        if restarts == max_restarts:
            if hung:  # torchrun's own exit is 1: the hang's code and where its stacks are come from the folder
                raise TrainError(f"{hang_summary(run_dir, hung)}; train.max_restarts={max_restarts} restart(s) "
                                 "spent. Read the stacks to find what the rank waited for (a collective, the disk, "
                                 "a lock), then run the flow again: the run continues from its newest checkpoint")
            return rc, tail
        restarts += 1
        log.warning("torchrun exited %d (a hang or crash): restart %d of %d", rc, restarts, max_restarts)


def hang_folders(run_dir: Path) -> set[str]:
    """The watchdog's hang folders (<run_dir>/hangs/step<N>-attempt<k>, one per hang, every rank's stacks)."""
    return {p.name for p in (Path(run_dir) / "hangs").glob("step*")}


def hang_summary(run_dir: Path, folders: list[str]) -> str:
    """`hang (exit 5): <the first rank's report>; stacks in <folders>`: how the task names a hang."""
    first = ""
    for folder in folders:
        for path in sorted((Path(run_dir) / "hangs" / folder).glob("rank*.txt")):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                first = first or path.read_text().partition("\n")[0]
    where = ", ".join(str(Path(run_dir) / "hangs" / f) for f in folders)
    return f"hang (exit {HANG_EXIT}): {first or 'a rank made no progress'}; stacks in {where}"


def stored_run(cfg: RunConfig) -> dict | None:
    """The run's state (run_files.run_state) when it reached max_steps for this identity (DONE with a
    checkpoint), else None: what the train stage finds, and what train_task asks again after waiting for
    the run's concurrency slot (it may have finished meanwhile)."""
    state = run_state(run_dir_for(cfg), cfg.identity_hash())
    return state if state["done"] else None


@contextlib.contextmanager
def launch_config(cfg: RunConfig):
    """The resolved config as a JSON file the trainers load (`python -m gptcore.training.train <file>`):
    they run exactly what the flow decided, not a preset and overrides resolved once more. In a temporary
    folder of its own, removed after the launch (and its restarts)."""
    with tempfile.TemporaryDirectory(prefix="gptpipe-launch-") as folder:
        path = Path(folder) / f"{cfg.run_name}.json"
        write_json(path, cfg.to_dict())
        yield path


@task(name="train", cache_policy=NO_CACHE, task_run_name="train {run_name}")
def train_task(cfg: dict, run_name: str, nproc: int, wait_seconds: float = 600.0, tracking: bool = True) -> dict:
    """Train (or continue) run `run_name` of the flow's resolved config (`cfg.to_dict()`; `nproc` >= 1, as
    the flow resolved it) in gptcore.checkpoints.run_files.run_dir_for(cfg) to max_steps or its time budget;
    returns the run's state."""
    from prefect.runtime import flow_run

    from integrations.progress import TrainProgress

    log = get_run_logger()
    cfg = as_config(cfg, world_size=nproc)
    run_dir, identity_hash = run_dir_for(cfg), cfg.identity_hash()
    flow_run_id = flow_run.get_id()
    slot, guard = prefect_slot(run_name, wait_seconds)
    t0 = time.time()
    try:
        guard.__enter__()
    except TimeoutError:
        raise TrainError(f"another flow run is training run {run_name!r}: the concurrency limit {slot!r} "
                         f"stayed taken for {wait_seconds:.0f}s. Let it finish (or cancel it), then run "
                         f"again. A killed holder's slot is freed within ~{LEASE_SECONDS}s if the Prefect "
                         "server keeps its leases on disk (PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE, "
                         f"docs/prefect.md); else: prefect gcl update {slot} --active-slots 0") from None
    try:
        if time.time() - t0 > 1:
            log.info("waited %.0fs for concurrency slot %s", time.time() - t0, slot)
        state = run_state(run_dir, identity_hash)
        if state["done"]:  # e.g. finished while we waited for the slot
            log.info("run %s is already complete at step %s: %s is DONE", run_name, state["step"], run_dir)
            return {**state, "returncode": 0, "seconds": 0.0, "resumed_from": state["step"]}
        resumed_from = state["step"]
        log.info("run %s: %s on %d process(es)", run_name,
                 f"resuming from step {resumed_from}" if resumed_from is not None else "starting", nproc)
        shipper = None
        if tracking:
            from integrations.tracking import Shipper

            shipper = Shipper(run_dir, flow_run_id=flow_run_id,
                              system_metrics_interval=cfg.train.system_metrics_interval).start()
        start = time.time()
        # the trainer's lock record names this flow run, so a second trainer's error points at it
        env = dict(os.environ, GPTPIPE_LAUNCHED_BY=json.dumps({"flow_run_id": str(flow_run_id),
                                                                "pid": os.getpid()}))
        from gptcore.distributed import uses_cuda  # imports torch: only once there is training to do

        progress = TrainProgress(run_dir, run_name, cfg.train.max_steps, cfg.train.max_minutes * 60, shipper, log,
                                 world=nproc, cuda=uses_cuda(cfg.train))
        try:
            with launch_config(cfg) as path:
                rc, tail = run_trainer(str(path), None, nproc, cfg.train.max_restarts, run_dir, log, env,
                                       on_tick=progress.tick)
        finally:
            progress.tick(final=True)  # after a verdict too: the UI shows the step where it ended
            if shipper is not None and not shipper.stop():
                log.warning("MLflow shipping incomplete (%s); metrics stay in %s/metrics.jsonl and are "
                            "sent on the next run", shipper.last_error, run_dir)
    finally:
        guard.__exit__(None, None, None)
    last = "\n".join(tail)
    if rc != 0:
        raise TrainError(f"torchrun exited with code {rc} for run {run_name!r}; last lines:\n{last}")
    state = run_state(run_dir, identity_hash)
    if state["checkpoint"] is None:
        raise TrainError(f"the trainer exited 0 but {run_dir} has no checkpoint; last lines:\n{last}")
    return {**state, "returncode": rc, "seconds": round(time.time() - start, 1), "resumed_from": resumed_from}


class TrainStage(Stage):
    """The run trained to max_steps or its time budget (stored: DONE for this identity)."""
    name = "train"

    def stored(self, run: FlowRun) -> dict | None:
        return stored_run(run.cfg)

    def work(self, run: FlowRun) -> dict:
        # nproc=0 (one per GPU, else 1 on CPU) is resolved only here: counting GPUs imports torch, which a
        # re-run that skips everything should not pay for
        nproc = run.nproc
        if nproc == 0:
            import torch

            nproc = torch.cuda.device_count() if torch.cuda.is_available() else 1
        run.cfg.validate(nproc)  # the batch must split over the real number of processes (ConfigError if not)
        return train_task(run.cfg.to_dict(), run.cfg.run_name, nproc, wait_seconds=run.wait_seconds,
                          tracking=run.tracking)

    def reason(self, run: FlowRun, state: dict, ran: bool) -> str:
        if not ran:
            return f"{state['run_dir']} is DONE at step {state['step']}"
        return (f"steps {state.get('resumed_from') or 0} -> {state['step']}"
                f"{'' if state['done'] else ' (time budget reached; continues next run)'}")

    def keep(self, run: FlowRun, state: dict) -> None:
        run.state = state

    def task_run_name(self, run: FlowRun) -> str:
        return f"train {run.cfg.run_name}"


STAGE = TrainStage()
