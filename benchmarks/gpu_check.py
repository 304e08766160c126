"""The GPU acceptance run: one command on a fresh CUDA machine before a long run, sized for a 15-minute lease.

    python -m benchmarks.gpu_check --reference reference/build-nanogpt/train_gpt2.py --out gpu_check.json
    python -m benchmarks.gpu_check --device cpu    # the same rows on CPU, small (how the tests run it)
    python -m benchmarks.gpu_check --rows reference,guards    # some rows only (--rows all: every row)

Each row is isolated: an exception becomes that row's FAIL with its error, and the other rows still run.
Each row is printed as it completes, and every row so far is in the JSON of --out (rewritten after each
row, so a lease that ends mid-run keeps what passed), every run's logs in --logs (a .tar.gz, likewise). A
row whose start would come after --budget-s is reported as not started; a run still going at --deadline-s
is killed with its workers (its row FAILs, the table goes on). Exit 1 when any row failed.
`--markdown rows.json` prints a lease's rows as a table (docs/training.md).

Rows run by value, so that a lease's deadline cuts the least telling ones: reference, train <big> and
outside steps, harness parity, profile (on CUDA when the reference ratio misses its target, or asked for),
guards, micro-batch auto, train micro, resume, ranks, out of memory, family, fp8, sustained, speed. The default
set is everything but `speed`, `profile` and the rows a lease runs in calls of their own (`family`, `fp8`,
`sustained`: benchmarks/gpu_lease.sh's CALL):
  micro-batch auto   what train.micro_batch=auto chooses for gpt2-124m here, probed as the trainer probes it
          (the probe that killed the CUDA context on the first H200: it must finish)
  reference  the project's full trainer (torchrun, gpt2-124m, micro_batch=auto (64 x 1024 at most), 524,288-token
          steps, compile, bf16) against build-nanogpt's train_gpt2.py run from its own file
          (benchmarks/reference_run.py; --reference FILE, fetched by benchmarks/fetch_reference.sh), with
          the same shape and settings, alternated for --reference-rounds rounds (3: AB BA AB): tokens/s (each
          from its own step timer, after the warm-up steps), the ratio's median, min and max, MFU (llm.c's count
          over the card's datasheet peak; beside it the share of the matmul rate measured in this run), peak
          memory over the same measured steps on both sides.
          On CUDA with the real file it must reach 1.03x. Without --reference (and on CPU) it runs our
          stand-in of the same form (benchmarks/reference_standin.py), informational
  train   micro and a GPT-2-shaped model train under torchrun on every device (compile + bf16 on CUDA,
          fp16 + GradScaler on GPUs without native bf16, as `auto` selects), the whole job: validation,
          HellaSwag (the cached dataset, limited, or the bundled fixture), samples and checkpoints every 4
          steps: exit 0, finite losses, the loss falls, every evaluation and checkpoint done. On CUDA the
          GPT-2 shape runs at gpt2-124m's micro-batch (64 x 1024), so the evaluation costs below are
          measured at the preset's sizes
  outside the time spent outside training steps, measured in that run and projected to gpt2-124m's
          cadence (a checkpoint and HellaSwag every 1,000 steps, validation of 10M tokens and a sample
          every 250) from what each part cost per unit: a checkpoint's blocking copy per save, validation per
          token, HellaSwag per example, a sample per sample. The wait for the previous checkpoint write
          counts only where the write is slower than the preset's checkpoint interval. On CUDA the GPT-2
          shape must project <= 5% of wall time, and a checkpoint must block <= 150 ms
  harness parity  lm-eval adapter scores (eval.harness.dtype=float32) against a plain transformers
          forward of the HF export on this device: <= 1e-4 nats (benchmarks/harness_parity.py)
  guards  the replica consistency check (a bitwise checksum of the weights, gptcore/training/replicas.py) timed on
          gpt2-124m's model, projected to its cadence at the reference row's tokens/s (else the train row's):
          on CUDA it must cost <= 1% of wall time
  resume  a run SIGKILLed after its first checkpoint and started again ends with the losses of the
          uninterrupted run (bf16 tolerance on CUDA, fp32 rounding on CPU)
  ranks   2 ranks equal 1 rank with twice the accumulation (needs >= 2 devices: on one GPU the row says
          "not run" and why)
  profile one compiled micro-step of our model and of the plain build-nanogpt-style model under
          torch.profiler: the top kernels of each and their shares
  fp8     (--rows fp8: a lease call of its own) train.fp8=tensorwise against bf16 (off) on the same card, from the
          same initialisation and data, for each --fp8 size: FP8_STEPS steps of one micro-batch at the preset's
          cap, --fp8-rounds alternated (1: bf16 then fp8; 2: ABBA): tokens/s (median of the steps after
          the warm-up) and the mean loss of the last 50 steps. PASS when gpt2-1558m gains >= 10% with its
          loss within 0.5% of bf16 (issue 68); where float8 cannot run (a CPU, a card before 8.9, no
          torchao) the row says "not run" and why
  family  (--rows family: a lease call of its own) gpt2-350m, 774m and 1558m (--family) on one card at each
          preset's own steps (524,288 tokens; 1,048,576 at 1558m; micro_batch=auto up to its cap, so the
          accumulation a user's run has), under its activation checkpointing, over --family-seconds (60) of
          steps after the warm-up: tokens/s median with min-max, MFU (datasheet and measured matmul), peak
          memory over the same steps
  sustained (--rows sustained: a lease call of its own) gpt2-124m's whole job for 3 minutes of steps with
          NVML's clocks, power and temperature sampled: tokens/s of the first and last minute, the time outside
          steps measured in the run at the preset's cadence over 8 GPUs (benchmarks/gpu_sustained.py)
  speed   (--rows speed or all) the trainer's train_step against a plain build-nanogpt-style loop in this
          process, compile on, alternated over --speed-rounds rounds: informational since the reference
          row measures the same against the real file
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
EVERY = 4  # steps between checkpoints, evaluations, HellaSwag and samples in the train rows
FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_mini.jsonl"
STANDIN = ROOT / "benchmarks" / "reference_standin.py"
HELLASWAG_LIMIT = 200  # examples scored per HellaSwag evaluation when the real dataset is cached
# examples of the synthetic set when it is not (the device machine has no internet): enough full batches that
# the per-example time is a full batch's (the padded last batch of each length adds ~5% on CUDA)
SYNTHETIC_EXAMPLES = {"cuda": 1000, "cpu": 8}
SYNTHETIC_FILE = "hellaswag_synthetic.jsonl"
HELLASWAG_FULL = 10_042  # examples in HellaSwag's validation split: what gpt2-124m's evaluations score
BLOCKING_TARGET_S = 0.150  # a 124M checkpoint's copy off the device, per save (issue 43)
OUTSIDE_TARGET = 0.05
REFERENCE_TARGET = 1.03
REFERENCE_STEPS = 12  # per run; the first WARM steps (compile) and the last (the reference evaluates) left out
WARM = 3
REFERENCE_ROUNDS = 3  # a median with a spread (issue 68): AB, BA, AB


# --- the table -----------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    status: str  # PASS, FAIL, info or "not run"
    detail: str
    seconds: float


class Table:
    """Runs each row in isolation, prints it when it completes, keeps every row in --out."""

    def __init__(self, out: Path | None, header: dict, budget_s: float, fail_row: str | None):
        self.out, self.header, self.budget_s, self.fail_row = out, header, budget_s, fail_row
        self.rows: list[Row] = []
        self.t0 = time.monotonic()
        self.after_row = lambda: None  # main keeps the logs here (--logs)

    def run(self, name: str, check, *args, costs_device_time: bool = True) -> None:
        """`check(*args)` -> (True / False / None for informational, detail). A row that only reads what an
        earlier row measured (costs_device_time=False) runs past the budget: skipping it saves nothing and
        loses a figure already paid for (lease 6: the 0 s 'outside steps' row of a 127 s train run)."""
        elapsed = time.monotonic() - self.t0
        t0 = time.monotonic()
        if elapsed > self.budget_s and costs_device_time:
            row = Row(name, "not run", f"the run's budget of {self.budget_s:.0f} s was spent ({elapsed:.0f} s); "
                                       "raise --budget-s or pick rows with --rows", 0.0)
        else:
            try:
                if name == self.fail_row:
                    raise RuntimeError("injected failure (--fail-row)")
                ok, detail = check(*args)
                status = "PASS" if ok else "info" if ok is None else "FAIL"
            except Exception as e:  # noqa: BLE001 - one row's error is that row's FAIL, not the table's end
                where = traceback.extract_tb(e.__traceback__)[-1]
                ok, status = False, "FAIL"
                detail = f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})"
            row = Row(name, status, detail, time.monotonic() - t0)
            release_device_memory()
        self.rows.append(row)
        print(f"  {row.status:7s} {row.name:26s} {row.detail}  [{row.seconds:.0f} s]", flush=True)
        self.save()
        self.after_row()

    def skip(self, name: str, why: str) -> None:
        self.rows.append(Row(name, "not run", why, 0.0))
        print(f"  {'not run':7s} {name:26s} {why}", flush=True)
        self.save()

    @property
    def passed(self) -> bool:
        return not any(r.status == "FAIL" for r in self.rows)

    def save(self) -> None:
        if self.out is None:
            return
        from gptcore.files import write_json  # lazy imports: the table is usable before gptcore is on the path

        write_json(self.out, {**self.header, "seconds": round(time.monotonic() - self.t0, 1),
                              "passed": self.passed, "rows": [asdict(r) for r in self.rows]})


def release_device_memory() -> None:
    """After a row that ran on the GPU in this process (the probe alone caches tens of GB): hand the
    cached blocks back, so the trainers the next rows launch on the same GPU find the card free."""
    from gptcore.training.microbatch import free_memory

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free_memory(torch.device("cuda"))


# --- the data and the trainer --------------------------------------------------------------------------

def make_dataset(d: Path, val_tokens: int = 300_000) -> Path:
    """Learnable tokens (a repeating pattern with noise), a val shard and three train shards."""
    from gptcore.data.shard_format import Manifest, ShardInfo, write_shard

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    infos = []
    for i, n in enumerate((val_tokens, 200_000, 200_000, 200_000)):  # val 300K: a batch per rank on 8 GPUs
        base = np.repeat(rng.integers(0, 300, n // 4 + 1), 4)[:n]
        toks = np.where(rng.random(n) < 0.1, rng.integers(0, 50257, n), base).astype(np.uint16)
        split = "val" if i == 0 else "train"
        name = f"check_{split}_{i:06d}.bin"
        infos.append(ShardInfo(name, split, n, write_shard(d / name, toks)))
    Manifest(shard_tokens=200_000, source={"gpu_check": 0}, shards=infos).save(d)
    return d


def worker_env(extra: dict | None = None) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


def compile_cache(work: Path, side: str) -> dict:
    """The reference's own Inductor/Triton cache, shared by its rounds; ours use the one main sets for every
    run of the project's code (its train rows too). The second run of a side skips most of its compile: wall
    time only, since the measured steps come after the warm-up on both sides, so neither gains tokens/s."""
    return {} if side == "ours" else {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{side}")}


class Trainer:
    """Runs `torchrun -m gptcore.training.train` (the launcher's own command) on a shape, in its own session."""

    def __init__(self, work: Path, dataset: Path, device: str, shape: dict, ndev: int):
        self.work, self.dataset, self.device, self.shape, self.ndev = work, dataset, device, shape, ndev

    def overrides(self, run: Path, nproc: int, **extra) -> dict:
        B, T = self.shape["B"], self.shape["T"]  # the same step on any rank count: 2 micro-steps per device
        return {"data.dataset_dir": str(self.dataset), "train.run_dir": str(run), "train.device": self.device,
                "train.micro_batch": B, "train.seq_len": T, "train.total_batch_tokens": B * T * 2 * self.ndev,
                "train.max_steps": STEPS, "train.checkpoint_interval": EVERY, "train.keep_last": 10,
                "train.log_interval": 1, "optim.warmup_steps": 2, "eval.eval_interval": EVERY,
                "eval.hellaswag.interval": EVERY, "eval.sample_interval": EVERY, "eval.sample_tokens": 16,
                "eval.val_tokens": B * T * self.ndev, **hellaswag_settings(self.work, self.device),
                **{f"model.{k}": v for k, v in self.shape["model"].items()}, **extra}

    def start(self, run: Path, nproc: int, log: Path, env: dict | None = None, **extra) -> subprocess.Popen:
        from gptcore.launch import torchrun_cmd

        cmd = torchrun_cmd("micro", self.overrides(run, nproc, **extra), nproc)
        return subprocess.Popen(cmd, cwd=ROOT, env=worker_env(env), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def run(self, name: str, nproc: int) -> tuple[int, dict[int, float], str]:
        run, log = self.work / name, self.work / f"{name}.log"
        proc = self.start(run, nproc, log)
        rc = wait(proc, 3600)
        return rc, losses(run), log.read_text()[-2000:]


DEADLINE = [math.inf]  # time.monotonic() past which no subprocess may run (--deadline-s); main sets it


def time_left() -> float:
    return DEADLINE[0] - time.monotonic()


def wait(proc: subprocess.Popen, timeout: float) -> int:
    """The exit code; a run past `timeout` or past the call's deadline is killed (with its workers) and
    raises, so one hung run never spends the rest of a lease."""
    bound = min(timeout, max(time_left(), 0.0))
    try:
        return proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        why = "the call's --deadline-s" if bound < timeout else f"its {timeout:.0f} s limit"
        raise TimeoutError(f"killed after {bound:.0f} s: {why} (the log is kept in --logs)") from None


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout: float) -> int:
    """0 once the run has logged its train row of `step`, then the run is killed: the row measures steps,
    and the last step's validation and checkpoint (a minute each at 1.5B on the first H100 family call,
    which the deadline cut off with every step measured) are measured by the other rows. Else the exit
    code, as `wait`."""
    return wait_until(proc, run, lambda rows: any(r["step"] >= step for r in rows), timeout, f"step {step}")


def wait_until(proc: subprocess.Popen, run: Path, done, timeout: float, what: str) -> int:
    """0 once `done(the run's train rows so far)`, then the run is killed; else the exit code, as `wait`."""
    from gptcore.metrics import read_metrics

    bound = time.monotonic() + min(timeout, max(time_left(), 0.0))
    while proc.poll() is None and time.monotonic() < bound:
        if done(read_metrics(run / "metrics.jsonl", "train")):
            kill_session(proc)
            return 0
        time.sleep(1.0)
    if proc.poll() is None:
        kill_session(proc)
        raise TimeoutError(f"killed before {what}: its {timeout:.0f} s limit or the call's --deadline-s "
                           "(the log is kept in --logs)")
    return proc.returncode


def hellaswag_settings(work: Path, device: str) -> dict:
    """The real HellaSwag when it is cached (limited to HELLASWAG_LIMIT examples), else a synthetic set of
    its lengths (synthetic_hellaswag) in `work`."""
    from gptcore.files import pipeline_home

    cached = pipeline_home() / "hellaswag" / "hellaswag_val.jsonl"
    if cached.is_file():
        return {"eval.hellaswag.enabled": True, "eval.hellaswag.path": str(cached),
                "eval.hellaswag.limit": HELLASWAG_LIMIT}
    path = synthetic_hellaswag(work / SYNTHETIC_FILE, SYNTHETIC_EXAMPLES[device])
    return {"eval.hellaswag.enabled": True, "eval.hellaswag.path": str(path), "eval.hellaswag.limit": 0}


def synthetic_hellaswag(path: Path, n: int) -> Path:
    """`n` HellaSwag-format examples with the real set's spread of lengths, made of the fixture's words: what
    the outside-steps row times HellaSwag on when the real file is not cached. Its time per example must come
    from full batches: the 7-example fixture, which leases 1-3 scored, filled 7 of the 64 example slots of
    the one CUDA batch it made (8,192 tokens at length 32): 2.2x the padded tokens per example of a whole
    set's batches, and the projection to 10,042 examples was overstated with it. Contexts of 15-90 words and
    endings of 5-35 (rows of ~30-160 tokens, HellaSwag's range); the text is noise: the accuracy means nothing,
    the time does.
    Written once (to a temporary name, then renamed)."""
    import random

    from gptcore.evals.scorers.hellaswag import read_records
    from gptcore.files import temp_name

    if path.is_file():
        return path
    words = sorted({w for ctx, endings, _ in read_records(FIXTURE) for w in " ".join([ctx, *endings]).split()})
    rng = random.Random(0)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(lo, hi)))

    lines = [json.dumps({"ind": i, "ctx": text(15, 90), "endings": [text(5, 35) for _ in range(4)],
                         "label": rng.randrange(4), "source_id": f"synthetic~{i}"}) for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def losses(run: Path) -> dict[int, float]:
    from gptcore.metrics import read_metrics

    return {r["step"]: r["train/loss"] for r in read_metrics(run / "metrics.jsonl", "train")}


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (they run in their own sessions, so a process group would miss
    them), found with psutil (on the bare CUDA image too)."""
    from integrations.processes import tree_of

    for pid in tree_of(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def worst_gap(a: dict[int, float], b: dict[int, float]) -> float:
    if sorted(a) != sorted(b) or not a:
        return math.inf
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-9) for s in b)


def matmul_rate(device: torch.device) -> float:
    """Dense matmul FLOP/s measured now: bf16 8192^3 on CUDA (reported beside the datasheet MFU: what the card
    reaches today), fp32 512^3 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


# --- the checks ----------------------------------------------------------------------------------------

def check_train(t: Trainer, label: str, nproc: int, ctx: dict) -> tuple[bool, str]:
    from gptcore.checkpoints.run_files import list_checkpoints
    from gptcore.metrics import read_metrics

    rc, got, tail = t.run(f"train-{label}", nproc)
    run = t.work / f"train-{label}"
    evals = read_metrics(run / "metrics.jsonl", "eval") if rc == 0 else []
    due = list(range(EVERY, STEPS + 1, EVERY))
    whole_job = ([r["step"] for r in evals] == due and all("hellaswag/acc" in r for r in evals)
                 and [int(c.name[5:]) for c in list_checkpoints(run)] == due
                 and not read_metrics(run / "metrics.jsonl", "event"))
    ok = (rc == 0 and len(got) == STEPS and all(math.isfinite(v) for v in got.values()) and got[STEPS] < got[1]
          and whole_job)
    if ok:
        ctx[f"train {label}"] = (t, got)
        rows = [r for r in read_metrics(run / "metrics.jsonl", "train") if r["step"] > 2]  # after compiling
        ctx.setdefault("tokens_per_s", statistics.median(r["train/tokens_per_s"] for r in rows))
    detail = (f"{nproc} rank(s), B={t.shape['B']} x T={t.shape['T']}, loss {got.get(1, float('nan')):.3f} -> "
              f"{got.get(STEPS, float('nan')):.3f}, {len(evals)} evaluations with HellaSwag, checkpoints at "
              f"{due}: {'all done' if whole_job else 'MISSING'}")
    return ok, detail if rc == 0 else f"exit {rc}: {tail[-300:]}"


def check_outside_steps(t: Trainer, label: str, gate: bool) -> tuple[bool | None, str]:
    """Time outside training steps: its share in the train row's run, and projected to gpt2-124m's
    cadence from what each part cost per unit against the step time per token."""
    from gptcore.evals import HellaSwag  # and the registry: the evaluations' config sections (eval.hellaswag.*)
    from gptcore.metrics import read_metrics
    from gptcore.overrides import load_config

    rows = read_metrics(t.work / f"train-{label}" / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"][2:]  # after compile's warm-up steps
    evals = [r for r in rows if r["kind"] == "eval"]
    parts = ("checkpoint", "checkpoint_wait", "eval", "sample")
    spent = {k: [r[f"time/{k}_s"] for r in rows if r["kind"] == "overhead" and f"time/{k}_s" in r] for k in parts}
    writes = [r["time/checkpoint_write_s"] for r in rows if r["kind"] == "checkpoint"]
    if not (train and evals and writes and all(spent.values())):
        return False, "no timing rows in metrics.jsonl"
    steps_s = sum(r["train/step_time"] for r in train)
    outside = sum(sum(v) for v in spent.values())  # all of it falls after the warm-up steps
    settings = t.overrides(Path(), 1)
    batch = settings["train.total_batch_tokens"]
    which = "synthetic" if settings["eval.hellaswag.path"].endswith(SYNTHETIC_FILE) else "real"
    per_token_step = statistics.median(r["train/step_time"] for r in train) / batch
    # the first evaluation of a process warms up (its kernels, the first read of the shards): once per launch,
    # not once per interval, so the per-unit costs come from the later ones, as the steps' from the later steps
    warm = evals[1:] or evals
    val_s_per_token = sum(r["time/val_s"] for r in warm) / sum(r["val/tokens"] for r in warm)
    hs_s_per_example = sum(r["time/hellaswag_s"] for r in warm) / sum(r["hellaswag/n"] for r in warm)
    cfg = load_config("gpt2-124m")
    tc, ev = cfg.train, cfg.eval
    step = per_token_step * tc.total_batch_tokens
    med = {k: statistics.median(v) for k, v in spent.items()}
    write = statistics.median(writes)
    # the ranks wait for the previous write only when it outlasts the steps between two saves
    wait_at_cadence = max(0.0, write - tc.checkpoint_interval * step)
    per_step = ((med["checkpoint"] + wait_at_cadence) / tc.checkpoint_interval
                + val_s_per_token * ev.val_tokens / ev.eval_interval
                + hs_s_per_example * HELLASWAG_FULL / ev.options(HellaSwag.name).interval
                + med["sample"] / ev.sample_interval)
    projected = per_step / (per_step + step)
    detail = (f"{outside / (outside + steps_s):.1%} here (every {EVERY} steps: a checkpoint blocked "
              f"{med['checkpoint'] * 1000:.0f} ms (first save {spent['checkpoint'][0] * 1000:.0f} ms: it allocates "
              f"the pinned buffers) + waited {med['checkpoint_wait'] * 1000:.0f} ms for the previous write "
              f"({write:.2f} s each), eval {med['eval']:.2f} s, sample {med['sample']:.2f} s; steps "
              f"{per_token_step * 1e6:.2f} s/Mtok); projected at gpt2-124m's cadence ({step:.2f} s steps; val "
              f"{val_s_per_token * ev.val_tokens:.1f} s per {ev.val_tokens / 1e6:.0f}M tokens, HellaSwag "
              f"{hs_s_per_example * HELLASWAG_FULL:.1f} s per {HELLASWAG_FULL:,} examples, from the "
              f"{len(warm)} evaluations after the first, {warm[0]['hellaswag/n']} {which} examples each): "
              f"{projected:.1%} of wall time (pass <= {OUTSIDE_TARGET:.0%}, checkpoint blocking <= "
              f"{BLOCKING_TARGET_S * 1000:.0f} ms)")
    return (projected <= OUTSIDE_TARGET and med["checkpoint"] <= BLOCKING_TARGET_S) if gate else None, detail


def check_resume(t: Trainer, nproc: int, reference: dict[int, float], tol: float) -> tuple[bool, str]:
    run, log = t.work / "resume", t.work / "resume.log"
    proc = t.start(run, nproc, log)
    deadline = time.monotonic() + min(1800, max(time_left(), 0.0))
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "checkpoints" / "step_00000004").is_dir():
            break
        time.sleep(0.01)
    killed = proc.poll() is None
    kill_session(proc)
    proc = t.start(run, nproc, t.work / "resume2.log")
    rc = wait(proc, 3600)
    gap = worst_gap(losses(run), reference)
    ok = killed and rc == 0 and gap <= tol
    tail = "" if rc == 0 else f": {(t.work / 'resume2.log').read_text()[-400:]}"
    return ok, f"killed mid-run: {killed}, resumed exit {rc}, worst loss gap {gap:.2e} (tolerance {tol:.0e}){tail}"


OOM_STEP = 2  # inside the allocator's recorded history (gptcore/training/memory.py: HISTORY_STEPS)


def check_out_of_memory(t: Trainer) -> tuple[bool, str]:
    """The out-of-memory defence on the device (issue 54; no run of leases 1-6 ever ran out of memory):
    train.micro_batch=auto, and step 2's second forward pass raises torch.OutOfMemoryError
    (GPTPIPE_TEST_FAULT=oom@2, eager: the hook that raises it is Python). The run must write its memory
    record before the retry (on CUDA the allocator's counters and snapshot.pickle, what
    https://pytorch.org/memory_viz reads, from the history recorded since the probe), retry that step at half
    the micro-batch with the same data, and finish every step once."""
    import pickle

    from gptcore.metrics import read_metrics

    run, log, B = t.work / "oom", t.work / "oom.log", t.shape["B"]
    extra = {"train.micro_batch": "auto", "train.micro_batch_max": B, "train.compile": "false",
             "train.max_steps": EVERY}
    rc = wait(t.start(run, 1, log, {"GPTPIPE_TEST_FAULT": f"oom@{OOM_STEP}"}, **extra), 1800)
    if rc != 0:
        return False, f"exit {rc}: {log.read_text()[-600:]}"
    folder = run / "memory" / f"oom-step{OOM_STEP}-rank0"
    record = json.loads((folder / "record.json").read_text())
    steps = [(r["step"], r["train/micro_batch"]) for r in read_metrics(run / "metrics.jsonl", "train")]
    want = [(s, B if s < OOM_STEP else B // 2) for s in range(1, EVERY + 1)]
    ok = record["step"] == OOM_STEP and record["retry_at"] == B // 2 and steps == want
    detail = f"record.json at step {record['step']}, retried at {record['retry_at']}; steps (step, micro-batch) {steps}"
    if t.device == "cuda":  # the part only a GPU runs: the allocator's counters and its snapshot
        with open(folder / "snapshot.pickle", "rb") as f:
            snapshot = pickle.load(f)
        segments, cuda = snapshot.get("segments", []), record.get("cuda", {})
        ok = ok and bool(segments) and cuda.get("total_bytes", 0) > 0
        detail += (f"; allocator {cuda.get('allocated_bytes.all.current', 0) / 2**20:.0f} MiB allocated of "
                   f"{cuda.get('total_bytes', 0) / 2**30:.0f} GiB; snapshot.pickle {len(segments)} segments, "
                   f"{(folder / 'snapshot.pickle').stat().st_size / 2**20:.1f} MB")
    return ok, detail


def check_ranks(t: Trainer, two_ranks: dict[int, float], tol: float) -> tuple[bool, str]:
    rc, one, tail = t.run("one-rank", 1)
    gap = worst_gap(one, two_ranks)
    return rc == 0 and gap <= tol, f"{t.ndev} ranks vs 1 rank with {t.ndev}x the accumulation: worst loss gap {gap:.2e}"


def reference_shape(device: str) -> dict:
    """build-nanogpt's shape on CUDA; on CPU the same preset with a small model (the stand-in's own model
    knobs set to it), without compiling (minutes on 2 cores). `ours_micro`: the micro-batch our trainer is
    given: on CUDA the preset's own `auto`, so the probe picks it on this card as it would for a user (the
    reference runs its fixed B=64); the row says which size each side ran."""
    if device == "cuda":
        return {"preset": "gpt2-124m", "B": 64, "T": 1024, "total": 524_288, "compile": True, "model": {},
                "ours_micro": "auto"}
    return {"preset": "gpt2-124m", "B": 2, "T": 32, "total": 2 * 32 * 2, "compile": False,
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32}, "ours_micro": 2}


def reference_data(dataset: Path, folder: Path) -> Path:
    """The check's shards as build-nanogpt reads them: edu_fineweb10B/*_{train,val}_*.npy (uint16)."""
    from gptcore.data.shard_format import Manifest, read_shard

    data = folder / "edu_fineweb10B"
    data.mkdir(parents=True, exist_ok=True)
    for i, info in enumerate(Manifest.load(dataset).shards):
        np.save(data / f"check_{info.split}_{i:06d}.npy", np.asarray(read_shard(dataset / info.name)))
    return folder


def run_ours(work: Path, dataset: Path, device: str, shape: dict, name: str,
             extra_env: dict) -> tuple[float, float | None, int]:
    """The project's trainer through torchrun, as users launch it, with `extra_env` (--ours-env) in its
    environment: (tokens/s after the warm-up, peak GiB, the micro-batch it ran)."""
    from gptcore.files import read_json
    from gptcore.launch import torchrun_cmd
    from gptcore.metrics import read_metrics
    from gptcore.training.microbatch import CHOICE_FILE

    run, log = work / name, work / f"{name}.log"
    overrides = {"data.dataset_dir": str(dataset), "train.run_dir": str(run), "train.device": device,
                 "train.micro_batch": shape["ours_micro"], "train.micro_batch_max": shape["B"],
                 "train.seq_len": shape["T"],
                 "train.total_batch_tokens": shape["total"], "train.max_steps": REFERENCE_STEPS,
                 "optim.warmup_steps": 2,  # the preset's 715 exceed the run (the rate does not change the speed)
                 "train.log_interval": 1,  # a host read every step, as the reference's own print: no edge
                 "train.compile": str(shape["compile"]).lower(), "train.checkpoint_interval": REFERENCE_STEPS,
                 "eval.eval_interval": 0, "eval.val_tokens": shape["B"] * shape["T"], "eval.hellaswag.enabled": False,
                 "eval.sample_interval": 0, "eval.sample_tokens": 8,
                 **{f"model.{k}": v for k, v in shape["model"].items()}}
    proc = subprocess.Popen(torchrun_cmd(shape["preset"], overrides, 1), cwd=ROOT,
                            env=worker_env({**compile_cache(work, "ours"), **extra_env}), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    rc = wait(proc, 600)
    rows = [r for r in read_metrics(run / "metrics.jsonl", "train") if WARM < r["step"] < REFERENCE_STEPS]
    if rc != 0 or not rows:
        raise RuntimeError(f"the project's trainer exited {rc}: {log.read_text()[-600:]}")
    peak = [r["train/peak_memory_gib"] for r in rows if "train/peak_memory_gib" in r]  # each row: its own steps
    chosen = read_json(run / CHOICE_FILE) or {}
    micro = int(chosen.get("micro_batch", shape["ours_micro"] if shape["ours_micro"] != "auto" else 0))
    return statistics.median(r["train/tokens_per_s"] for r in rows), max(peak) if peak else None, micro


def run_reference(file: Path, folder: Path, shape: dict, name: str) -> tuple[float, float | None]:
    """The reference from its own file (benchmarks/reference_run.py): (tokens/s after the warm-up, peak GiB
    over the same steps, the harness's per-step count: its first and last steps' evaluations left out, as
    ours run none)."""
    from benchmarks.reference_run import parse_peak_memory, parse_steps

    settings = {"max_steps": REFERENCE_STEPS, "B": shape["B"], "T": shape["T"], "total_batch_size": shape["total"],
                "use_compile": shape["compile"]}
    if file.resolve() == STANDIN.resolve():
        settings.update({k: v for k, v in shape["model"].items() if k != "block_size"})
    cmd = [sys.executable, "-m", "benchmarks.reference_run", str(file), "--workdir", str(folder),
           *(f"--set={k}={v}" for k, v in settings.items())]
    log = folder.parent / f"{name}.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(compile_cache(folder.parent, "reference")),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    rc = wait(proc, 600)
    out = log.read_text()
    steps = parse_steps(out)
    span = range(WARM, REFERENCE_STEPS - 1)  # its steps count from 0: ours' WARM + 1 .. REFERENCE_STEPS - 1
    measured = [tps for s, (_, _, tps) in steps.items() if s in span]
    if rc != 0 or not measured:
        raise RuntimeError(f"the reference exited {rc}: {out[-600:]}")
    peaks = [gib for s, gib in parse_peak_memory(out).items() if s in span]
    return statistics.median(measured), max(peaks) if peaks else None


def check_reference(work: Path, dataset: Path, device: str, file: Path | None, rounds: int, ours_env: dict,
                    ctx: dict) -> tuple[bool | None, str]:
    """Ours against the reference in `rounds` alternated rounds in this run (AB, BA, AB, ...); the median of
    the per-round ratios counts (with two rounds, their mean: the row says which), reported with their min
    and max. Peak memory on both sides over the same measured steps."""
    from gptcore.config import ModelConfig
    from gptcore.model.gpt import GPT, mfu_text, peak_flops_guess
    from gptcore.overrides import load_config

    real = file is not None
    file = file or STANDIN
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: run benchmarks/fetch_reference.sh (and carry reference/)")
    shape = reference_shape(device)
    work.mkdir(parents=True, exist_ok=True)
    folder = reference_data(dataset, work / "reference-cwd")
    ours, theirs, ratios = [], [], []
    for r in range(rounds):  # ABBA: a linear drift in the machine's speed hits both sides alike
        pair = (("ours", "reference") if r % 2 == 0 else ("reference", "ours"))
        for side in pair:
            if side == "ours":
                ours.append(run_ours(work, dataset, device, shape, f"ours-{r}", ours_env))
            else:
                theirs.append(run_reference(file, folder, shape, f"reference-{r}"))
        ratios.append(ours[-1][0] / theirs[-1][0])
    ratio = statistics.median(ratios)
    ours_tps, ref_tps = statistics.median(o[0] for o in ours), statistics.median(t[0] for t in theirs)
    ctx["tokens_per_s"] = ours_tps
    ctx["reference_ratio"] = ratio
    model_cfg = load_config(shape["preset"]).model if not shape["model"] else ModelConfig(**shape["model"])
    fpt = GPT(model_cfg).flops_per_token(shape["T"])
    rate = matmul_rate(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    card = peak_flops_guess(torch.device(device, 0)) if device == "cuda" else None
    peaks = [o[1] for o in ours], [t[1] for t in theirs]
    memory = (f"; peak memory {max(peaks[0]):.1f} vs {max(peaks[1]):.1f} GiB over the measured steps"
              if all(p is not None for p in peaks[0] + peaks[1]) else "")
    commit = (file.parent / "COMMIT").read_text().strip()[:12] if (file.parent / "COMMIT").is_file() else "unpinned"
    which = f"{file.name} @ {commit}" if real else "our stand-in (pass --reference FILE for build-nanogpt's)"
    order = "".join("AB" if r % 2 == 0 else "BA" for r in range(rounds))
    sizes = sorted({o[2] for o in ours})
    middle = "median" if rounds > 2 else "mean" if rounds == 2 else "one"
    detail = (f"{ours_tps:,.0f} vs {ref_tps:,.0f} tok/s: {middle} {ratio:.3f}x over {rounds} alternated rounds "
              f"({order}; per round {', '.join(f'{x:.3f}' for x in ratios)}; min {min(ratios):.3f}, max "
              f"{max(ratios):.3f}; pass >= {REFERENCE_TARGET}); "
              f"{mfu_text(fpt, [ours_tps, ref_tps], card, rate)}{memory}; micro-batch ours {'/'.join(map(str, sizes))} "
              f"({shape['ours_micro']}) vs reference {shape['B']}, T={shape['T']}, {shape['total']:,}-token "
              f"steps, compile={shape['compile']}; reference: {which}"
              + (f"; ours with {' '.join(f'{k}={v}' for k, v in ours_env.items())}" if ours_env else ""))
    return (ratio >= REFERENCE_TARGET) if (real and device == "cuda") else None, detail


def check_speed(device: torch.device, shape: dict, dataset: Path, steps: int, rounds: int,
                ctx: dict) -> tuple[bool | None, str]:
    """train_step vs the plain loop, in this process, compile on, the precision `auto` picks; the two
    measured alternately, `rounds` times (informational: the reference row is the judge)."""
    from benchmarks.bench_train import BaseGPT
    from gptcore.config import ModelConfig, OptimConfig, TrainConfig
    from gptcore.data.loader import ShardLoader
    from gptcore.distributed import select
    from gptcore.model.gpt import GPT, mfu_text, peak_flops_guess
    from gptcore.model.loss import make_loss
    from gptcore.model.optim import adamw
    from gptcore.model.tokenizer import N_VOCAB
    from gptcore.training.trainer import train_step

    env = select(TrainConfig(device=device.type, compile="true"))
    c, B, T = ModelConfig(**shape["model"]), shape["B"], shape["T"]
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def measure(step) -> tuple[float, float]:
        for _ in range(3):  # compile and warm up
            step()
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return (time.perf_counter() - t0) / steps, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0

    torch.manual_seed(0)
    raw = GPT(c).to(device)
    raw.head_loss = make_loss(env.loss)
    model = torch.compile(raw)
    opt = adamw(raw.parameters(), OptimConfig(), device.type)
    loader = ShardLoader(dataset, B, T, B * T, seed=1, device=device)
    ours_s, ours_mem = measure(lambda: train_step(model, opt, loader, 1, env, None, 1.0))
    fpt = raw.flops_per_token(T)
    torch.manual_seed(0)
    base = BaseGPT(c).to(device)
    compiled_base = torch.compile(base)
    bopt = torch.optim.AdamW(base.parameters(), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    data = torch.randint(0, N_VOCAB, (B, T + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def base_step():
        with env.autocast():
            loss = compiled_base(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(base.parameters(), 1.0)
        bopt.step()
        bopt.zero_grad(set_to_none=True)

    base_s, base_mem = measure(base_step)
    ratios = [base_s / ours_s]
    for _ in range(rounds - 1):
        ours_s = measure(lambda: train_step(model, opt, loader, 1, env, None, 1.0))[0]
        base_s = measure(base_step)[0]
        ratios.append(base_s / ours_s)
    ratio = statistics.median(ratios)
    ctx.setdefault("tokens_per_s", B * T / ours_s)
    peak = peak_flops_guess(device)
    mfu = f", {mfu_text(fpt, [B * T / ours_s, B * T / base_s], peak)}" if peak and cuda else ""
    mem = f", peak memory {ours_mem:.1f} vs {base_mem:.1f} GiB" if cuda else ""
    return None, (f"{B * T / ours_s:,.0f} vs {B * T / base_s:,.0f} tok/s: median {ratio:.3f}x the plain loop over "
                  f"{len(ratios)} rounds ({min(ratios):.3f}..{max(ratios):.3f}) ({env.dtype}, B={B}, T={T}){mfu}{mem}")


def check_guards(device: torch.device, model_shape: dict, tokens_per_s: float) -> tuple[bool | None, str]:
    """The consistency check's cost per call on this model, and its share of wall time at gpt2-124m's
    cadence (the step time of a 524,288-token batch at the measured tokens/s)."""
    from gptcore.config import GuardConfig, ModelConfig
    from gptcore.model.gpt import GPT
    from gptcore.overrides import load_config
    from gptcore.training.replicas import weights_checksum

    raw = GPT(ModelConfig(**model_shape)).to(device)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        int(weights_checksum(raw).item())  # .item(): the host waits for the device, as the trainer's read does
        times.append(time.perf_counter() - t0)
    per_call = statistics.median(times[2:])
    every = GuardConfig().consistency_interval
    step_s = load_config("gpt2-124m").train.total_batch_tokens / tokens_per_s
    share = per_call / (every * step_s + per_call)
    detail = (f"consistency check {per_call * 1000:.2f} ms per call ({raw.num_params() / 1e6:.1f}M parameters; "
              f"spread {min(times[2:]) * 1000:.2f}..{max(times[2:]) * 1000:.2f} ms); every {every} steps of "
              f"{step_s:.2f} s: {share:.3%} of wall time (pass <= 1%)")
    return (share <= 0.01 if device.type == "cuda" else None), detail


# (preset, activation checkpointing) on one card; --family picks some (the CPU test runs two, to keep the suite short)
FAMILY = "gpt2-350m:none,gpt2-774m:none,gpt2-1558m:selective"
FAMILY_SECONDS = {"cuda": 60.0, "cpu": 2.0}  # of steps after WARM, per size (issue 68: a steady state, not 3.5 s)
FAMILY_MIN_STEPS = 3  # after WARM, however long the steps


def family_sizes(text: str, flag: str = "--family") -> list[tuple[str, str]]:
    """'preset:checkpointing,...' as (preset, mode) pairs, each checked by the config itself (its presets and
    train.activation_checkpointing's choices), refused with its reason otherwise."""
    from gptcore.config import ConfigError
    from gptcore.overrides import load_config

    pairs = [tuple(item.split(":", 1)) if ":" in item else (item, "none") for item in text.split(",") if item]
    for preset, mode in pairs:
        try:
            load_config(preset, {"train.activation_checkpointing": mode})
        except ConfigError as e:
            raise ConfigError(f"{flag}: {preset}:{mode} is not a preset:checkpointing pair ({e})") from None
    return pairs


def measured_span(seconds: float):
    """`done` for wait_until: the steps after WARM add up to `seconds` of step time, and FAMILY_MIN_STEPS."""
    def done(rows: list[dict]) -> bool:
        after = [r for r in rows if r["step"] > WARM]
        return len(after) >= FAMILY_MIN_STEPS and sum(r["train/step_time"] for r in after) >= seconds
    return done


def check_family(work: Path, dataset: Path, device: torch.device, sizes: list[tuple[str, str]], seconds: float
                 ) -> tuple[bool | None, str]:
    """The larger GPT-2 shapes on one device (issue 53), each through the trainer as users launch it, at its preset's
    own step (524,288 tokens, 1,048,576 at 1558m; micro_batch=auto up to the preset's cap, so the accumulation is
    what a user's run has), under its activation checkpointing, measured over `seconds` of steps after the WARM
    warm-up steps (issue 68: steady state): the size the probe chose, tokens/s (median of those steps, with their
    min and max), MFU (llm.c's count over the card's datasheet peak, and the share of the matmul rate measured in
    this call), peak memory over the same steps. On CPU the same depths at width 64 and small steps (a smoke test of
    the path, not a speed). PASS on CUDA when 1558m trains and the datasheet MFU targets hold (>= llm.c's ~44% at
    1558m, >= llm-foundry's 34.9% at 774m, at 350m and 774m)."""
    from gptcore.files import read_json
    from gptcore.launch import torchrun_cmd
    from gptcore.metrics import read_metrics
    from gptcore.model.gpt import flops_per_token, mfu_text, peak_flops_guess
    from gptcore.overrides import load_config
    from gptcore.training.microbatch import CHOICE_FILE

    work.mkdir(parents=True, exist_ok=True)
    rate = matmul_rate(device)
    cuda, parts, ok = device.type == "cuda", [], True
    for preset, recompute in sizes:
        width = {} if cuda else {"model.n_embd": 64, "model.n_head": 4}
        seq = 1024 if cuda else 64
        cfg = load_config(preset, width)
        run, log = work / f"family-{preset}", work / f"family-{preset}.log"
        cap = cfg.train.micro_batch_max if cuda else 4
        total = cfg.train.total_batch_tokens if cuda else cap * seq * 2
        overrides = {"data.dataset_dir": str(dataset), "train.run_dir": str(run), "train.device": device.type,
                     "train.micro_batch": "auto", "train.micro_batch_max": cap, "train.seq_len": seq,
                     "train.total_batch_tokens": total, "train.max_steps": 100_000,  # stopped by the span
                     "optim.warmup_steps": 2, "train.log_interval": 1, "train.checkpoint_interval": 100_000,
                     "train.activation_checkpointing": recompute, "eval.eval_interval": 0,
                     "eval.hellaswag.enabled": False, "eval.sample_interval": 0, "eval.val_tokens": cap * seq,
                     **width}
        proc = subprocess.Popen(torchrun_cmd(preset, overrides, 1), cwd=ROOT, env=worker_env(),
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = wait_until(proc, run, measured_span(seconds), 600, f"{seconds:.0f} s of steps")
        except TimeoutError as e:  # this size's text and a FAIL: the sizes before it keep their figures
            ok = False
            parts.append(f"{preset}: TimeoutError: {e}")
            continue
        rows = [r for r in read_metrics(run / "metrics.jsonl", "train") if r["step"] > WARM]
        if rc != 0 or not rows:
            ok = False
            parts.append(f"{preset}: exit {rc}: {log.read_text()[-300:]}")
            continue
        each = [r["train/tokens_per_s"] for r in rows]
        tok_s = statistics.median(each)
        fpt = flops_per_token(cfg.model, seq)
        peak = max((r.get("train/peak_memory_gib", 0.0) for r in rows), default=0.0)
        micro = (read_json(run / CHOICE_FILE) or {}).get("micro_batch")
        accumulation = total // (micro * seq) if micro else "?"
        # like with like: llm.c's and llm-foundry's figures are of the card's datasheet peak, so is the gate
        target = 0.44 if preset == "gpt2-1558m" else 0.349
        card = peak_flops_guess(device) if cuda else None  # None: a card the table does not know, no gate
        ok = ok and (fpt * tok_s / card >= target if card else True)
        measured = (f", {mfu_text(fpt, [tok_s], card, rate)} (target {target:.1%} of the card), peak {peak:.1f} GiB"
                    if cuda else "")
        parts.append(f"{preset} ({recompute}): micro_batch {micro} of {cap} x {accumulation} micro-steps "
                     f"({total:,}-token steps), {tok_s:,.0f} tok/s ({min(each):,.0f}-{max(each):,.0f}) over "
                     f"{len(rows)} steps, {sum(r['train/step_time'] for r in rows):.0f} s{measured}")
    head = (f"matmul {rate / 1e12:.1f} TFLOP/s" if cuda else "CPU, width 64: the path only, no speed or MFU")
    return (ok if cuda else None), f"{head}; steps after the first {WARM}; " + "; ".join(parts)


FP8_SIZES = "gpt2-1558m:selective,gpt2-774m:none,gpt2-124m:none"
FP8_STEPS = 100  # the loss curves compared over the last 50 of them
FP8_TARGET = (0.10, 0.005)  # gpt2-1558m: >= +10% tokens/s, mean loss of the last 50 steps within 0.5% of bf16


def fp8_unavailable(device: torch.device) -> str | None:
    """Why float8 training cannot run here (the trainer's own refusal: a CPU, a card before 8.9, no torchao;
    on a lease, carry torchao's wheel in wheels/), or None."""
    from gptcore.config import ConfigError
    from gptcore.model import fp8

    try:
        fp8.recipe_for("tensorwise", "gpt2-1558m", device, True)
    except ConfigError as e:
        return str(e)
    return None


def check_fp8(work: Path, dataset: Path, device: torch.device, sizes: list[tuple[str, str]], rounds: int
              ) -> tuple[bool | None, str]:
    """train.fp8=tensorwise against off, per size, through the trainer as users launch it (see the module's
    docstring, `fp8`). A size that fails or is cut by the deadline is that size's text and a FAIL, and the
    sizes measured before it keep their figures (the call orders them by what they tell: 1558m first)."""
    work.mkdir(parents=True, exist_ok=True)
    parts, ok = [], None
    for preset, recompute in sizes:
        try:
            text, gain, loss_gap = fp8_pair(work, dataset, preset, recompute, rounds)
        except (RuntimeError, TimeoutError) as e:
            parts.append(f"{preset}: {type(e).__name__}: {e}")
            ok = False
            continue
        parts.append(text)
        if preset == "gpt2-1558m":
            ok = (ok is not False) and gain >= FP8_TARGET[0] and abs(loss_gap) <= FP8_TARGET[1]
    order = "bf16 then fp8" if rounds == 1 else f"{rounds} alternated rounds"
    return ok, (f"fp8 (tensorwise) vs bf16, {FP8_STEPS} steps each, {order}, same initialisation and data; "
                + "; ".join(parts) + f"; pass at gpt2-1558m: >= +{FP8_TARGET[0]:.0%} tok/s, loss within "
                f"{FP8_TARGET[1]:.1%}")


def fp8_pair(work: Path, dataset: Path, preset: str, recompute: str, rounds: int) -> tuple[str, float, float]:
    """One size of the fp8 row: (its text, the tokens/s gain, the relative gap of the last 50 steps' loss)."""
    from gptcore.launch import torchrun_cmd
    from gptcore.metrics import read_metrics
    from gptcore.overrides import load_config

    cap = load_config(preset).train.micro_batch_max
    common = {"data.dataset_dir": str(dataset), "train.device": "cuda", "train.micro_batch": cap,
              "train.micro_batch_max": cap, "train.seq_len": 1024, "train.total_batch_tokens": cap * 1024,
              "train.max_steps": FP8_STEPS, "optim.warmup_steps": 10, "train.log_interval": 10,
              "train.checkpoint_interval": 100_000, "train.activation_checkpointing": recompute,
              "eval.eval_interval": 0, "eval.hellaswag.enabled": False, "eval.sample_interval": 0,
              "eval.val_tokens": cap * 1024}
    tok: dict[str, list[float]] = {"off": [], "tensorwise": []}
    last: dict[str, list[float]] = {"off": [], "tensorwise": []}
    for r in range(rounds):
        for side in (("off", "tensorwise") if r % 2 == 0 else ("tensorwise", "off")):
            run, log = work / f"fp8-{preset}-{side}-{r}", work / f"fp8-{preset}-{side}-{r}.log"
            proc = subprocess.Popen(torchrun_cmd(preset, {**common, "train.run_dir": str(run), "train.fp8": side}, 1),
                                    cwd=ROOT, env=worker_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
            rc = wait_for_step(proc, run, FP8_STEPS, 600)
            rows = read_metrics(run / "metrics.jsonl", "train")
            if rc != 0 or len(rows) < FP8_STEPS:
                raise RuntimeError(f"fp8={side}: exit {rc}, {len(rows)} steps: {log.read_text()[-300:]}")
            tok[side].append(statistics.median(x["train/tokens_per_s"] for x in rows if x["step"] > WARM))
            last[side].append(statistics.fmean(x["train/loss"] for x in rows[-50:]))
    gain = statistics.median(tok["tensorwise"]) / statistics.median(tok["off"]) - 1
    loss_gap = statistics.fmean(last["tensorwise"]) / statistics.fmean(last["off"]) - 1
    text = (f"{preset} ({recompute}, micro-batch {cap}): {statistics.median(tok['tensorwise']):,.0f} vs "
            f"{statistics.median(tok['off']):,.0f} tok/s ({gain:+.1%}), mean loss of the last 50 steps "
            f"{statistics.fmean(last['tensorwise']):.4f} vs {statistics.fmean(last['off']):.4f} ({loss_gap:+.2%})")
    return text, gain, loss_gap


def check_auto_micro_batch(device: torch.device) -> tuple[None, str]:
    """What train.micro_batch=auto picks for gpt2-124m on this device (on CPU: a small stand-in with the
    plain loss, the one `auto` picks on CUDA, since probing 64 x 1024 sequences there would only measure
    the host's swap)."""
    from gptcore.distributed import select
    from gptcore.model.gpt import GPT
    from gptcore.model.loss import make_loss
    from gptcore.model.optim import build_optimizer
    from gptcore.overrides import load_config
    from gptcore.training.microbatch import probe

    if device.type == "cuda":
        cfg = load_config("gpt2-124m", ["train.device=cuda"])
    else:
        cfg = load_config("micro", ["train.micro_batch=auto", "train.micro_batch_max=8", "train.seq_len=64",
                                    "train.total_batch_tokens=512", "train.loss=plain"])
    env = select(cfg.train)
    raw = GPT(cfg.model).to(env.device)
    raw.head_loss = make_loss(env.loss)
    t0 = time.perf_counter()
    # the real step: its optimizer's state held, as the trainer's probe has it (not DDP: one process here)
    chosen, failed = probe(raw, build_optimizer(raw, cfg.optim, env.device.type), cfg, env)
    tried = f"; out of memory at {', '.join(map(str, failed))}" if failed else ""
    return None, (f"{cfg.preset}: micro_batch {chosen} of at most {cfg.train.micro_batch_max} x seq_len "
                  f"{cfg.train.seq_len} ({env.dtype}, compile={env.compile}, loss={env.loss}){tried}; probed in "
                  f"{time.perf_counter() - t0:.1f} s")


def check_profile(device: torch.device, shape: dict, ratio: float | None) -> tuple[None, str]:
    """Where one micro-step's time goes on each side (issue 51: asked for when the reference ratio is below
    REFERENCE_TARGET): one compiled forward + backward of our model (the trainer's loss) and of the plain
    build-nanogpt-style model (benchmarks/bench_train.py's BaseGPT), each recorded with torch.profiler after
    three warm-up micro-steps; the top kernels (device time on CUDA, CPU time on CPU) and their shares."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.bench_train import BaseGPT
    from gptcore.config import ModelConfig, TrainConfig
    from gptcore.distributed import select
    from gptcore.model.gpt import GPT
    from gptcore.model.loss import make_loss
    from gptcore.model.tokenizer import N_VOCAB
    from gptcore.overrides import load_config

    cuda = device.type == "cuda"
    env = select(TrainConfig(device=device.type, compile="true"))
    c = ModelConfig(**shape["model"]) if shape["model"] else load_config(shape["preset"]).model
    B, T = shape["B"], shape["T"]
    data = torch.randint(0, N_VOCAB, (B, T + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    ours = GPT(c).to(device)
    ours.head_loss = make_loss(env.loss)
    theirs = BaseGPT(c).to(device)
    steps = {"ours": (torch.compile(ours), lambda m: m(x, y, return_logits=False)[1]),
             "plain": (torch.compile(theirs), lambda m: m(x, y))}
    lines = []
    for side, (model, loss_of) in steps.items():
        def micro_step(model=model, loss_of=loss_of):
            with env.autocast():
                loss = loss_of(model)
            loss.backward()
        for _ in range(3):
            micro_step()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            micro_step()
            if cuda:
                torch.cuda.synchronize()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        # on CUDA the kernels alone: an operator's own device time is its kernels' again
        kernels = [e for e in prof.key_averages() if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
        events = [e for e in kernels if getattr(e, key) > 0]
        total = sum(getattr(e, key) for e in events) or 1
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:6]
        lines.append(f"{side} {total / 1000:.1f} ms: " + "; ".join(
            f"{e.key[:48]} {getattr(e, key) / total:.0%}" for e in top))
        model.zero_grad(set_to_none=True)
    why = f"reference ratio {ratio:.3f}x" if ratio is not None else "no reference ratio"
    return None, f"one micro-step B={B} x T={T} ({why}); " + " | ".join(lines)


# --- the run ---------------------------------------------------------------------------------------

def train_row(table: Table, work: Path, dataset: Path, device: str, all_shapes: dict, label: str, ndev: int,
              ctx: dict) -> Trainer:
    t = Trainer(work / label, dataset, device, all_shapes[label], ndev)
    (work / label).mkdir()
    table.run(f"train {label}", check_train, t, label, ndev, ctx)
    return t


KEPT = (".log", ".jsonl", ".json", ".txt")  # a run's logs, metrics, events, configs; not checkpoints or data


def save_logs(work: Path, dest: Path) -> None:
    """Every run's logs and metrics under `work` into the .tar.gz `dest`, whole or not at all (written to a
    temporary name, then renamed): a call cut off mid-row still leaves the previous row's."""
    import tarfile

    from gptcore.files import temp_name

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(dest)
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            skip = {"checkpoints", "data", "edu_fineweb10B"} & set(f.relative_to(work).parts)
            if f.is_file() and f.suffix in KEPT and not skip and "inductor-" not in str(f):
                tar.add(f, arcname=str(f.relative_to(work)))
    os.replace(tmp, dest)


def shapes(device: str) -> dict[str, dict]:
    if device == "cuda":
        return {"micro": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64}, "B": 16, "T": 64},
                "gpt2-124m": {"model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
                              "B": 64, "T": 1024}}
    return {"micro": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64}, "B": 2, "T": 32},
            "gpt2-shaped": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 128, "block_size": 64}, "B": 2,
                            "T": 64}}


ROWS = ("micro-batch", "train", "reference", "harness", "guards", "resume", "ranks", "oom", "speed", "profile",
        "family", "fp8", "sustained")
OWN_CALLS = ("family", "fp8", "sustained")  # rows a lease runs in calls of their own: not in the default set


def markdown(table: dict) -> str:
    """A lease's rows.json as the table README and docs/training.md carry (the card and torch first)."""
    lines = [f"{table['device']}, torch {table['torch']}, {table['seconds']:.0f} s in all", "",
             "| row | status | seconds | measured |", "|---|---|---|---|"]
    for r in table["rows"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {r['detail'].replace('|', '/')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--work", help="keep the runs here (default: a temp dir)")
    ap.add_argument("--out", type=Path, help="write every row as JSON here (rewritten after each row)")
    ap.add_argument("--rows", default="default", help=f"comma-separated of {', '.join(ROWS)}; default: all but "
                                                      "speed; all: every row")
    ap.add_argument("--reference", type=Path, help="build-nanogpt's train_gpt2.py (benchmarks/fetch_reference.sh)")
    ap.add_argument("--reference-rounds", type=int, default=REFERENCE_ROUNDS,
                    help=f"alternated rounds of the reference row (default {REFERENCE_ROUNDS}: AB BA AB)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no row after this many seconds")
    ap.add_argument("--deadline-s", type=float, default=math.inf,
                    help="kill any run still going this many seconds after the start (its row FAILs, the table "
                         "goes on): a lease call must end inside its limit")
    ap.add_argument("--logs", type=Path, help="keep every run's logs and metrics here, as a .tar.gz rewritten "
                                              "after each row (checkpoints and data left out)")
    ap.add_argument("--family", default=FAMILY, help="the family row's preset:checkpointing pairs, comma-separated "
                                                     f"(default {FAMILY})")
    ap.add_argument("--family-seconds", type=float, help="the family row measures each size over this many "
                    f"seconds of steps after the warm-up (default {FAMILY_SECONDS['cuda']:.0f} on CUDA)")
    ap.add_argument("--sustained-seconds", type=float, help="the sustained row trains for this many seconds of "
                    "steps after the warm-up (default 180 on CUDA)")
    ap.add_argument("--fp8", default=FP8_SIZES, help="the fp8 row's preset:checkpointing pairs (default "
                                                     f"{FP8_SIZES})")
    ap.add_argument("--fp8-rounds", type=int, default=1, help="1: bf16 then fp8; 2: ABBA")
    ap.add_argument("--ours-env", action="append", default=[], metavar="KEY=VALUE",
                    help="set this in the environment of our side of the reference row only (repeatable): "
                         "to measure a knob, e.g. TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1, against the reference")
    ap.add_argument("--speed-steps", type=int, default=20)
    ap.add_argument("--speed-rounds", type=int, default=3)
    ap.add_argument("--fail-row", help="make the named row raise (to test that the table survives it)")
    ap.add_argument("--markdown", type=Path, metavar="ROWS_JSON", help="print a lease's rows.json as the "
                                                                       "README's table and exit")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible on this machine; nothing was checked (run it on the GPU "
              "machine, or --device cpu to try the checks on CPU)")
        return 0
    default = set(ROWS) - {"speed", "profile", *OWN_CALLS}
    chosen = default if a.rows == "default" else set(ROWS) if a.rows == "all" else set(a.rows.split(","))
    if chosen - set(ROWS):
        ap.error(f"--rows: unknown {', '.join(sorted(chosen - set(ROWS)))}; choose from {', '.join(ROWS)}")
    bad = [kv for kv in a.ours_env if "=" not in kv]
    if bad:
        ap.error(f"--ours-env {bad[0]!r}: write KEY=VALUE")
    ours_env = dict(kv.split("=", 1) for kv in a.ours_env)  # our side of the reference row only
    from gptcore.config import ConfigError

    try:
        sizes = family_sizes(a.family)  # at the edge: a typo fails now, not after the rows before it
        fp8_sizes = family_sizes(a.fp8, "--fp8")
    except ConfigError as e:
        ap.error(str(e))
    from gptcore.distributed import select_dtype

    ndev = torch.cuda.device_count() if a.device == "cuda" else 2
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    autocast = str(select_dtype("auto", device)).removeprefix("torch.")
    header = {"device": f"{ndev} x {name}", "torch": torch.__version__, "auto_dtype": autocast,
              **({"ours_env": ours_env} if ours_env else {})}
    print(f"gpu_check on {ndev} x {name} (torch {torch.__version__}, auto dtype {autocast})", flush=True)
    tol = 5e-2 if a.device == "cuda" else 1e-4  # bf16 + compiled kernels vs fp32 CPU
    table = Table(a.out, header, a.budget_s, a.fail_row)
    ctx: dict = {}
    all_shapes = shapes(a.device)
    big = list(all_shapes)[-1]
    if a.deadline_s < math.inf:
        DEADLINE[0] = table.t0 + a.deadline_s
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        work = Path(tmp)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-ours"))  # every run of ours
        if a.logs:
            table.after_row = lambda: save_logs(work, a.logs)
        dataset = make_dataset(work / "data")
        # by value, so that a lease's deadline cuts the least telling rows: the reference ratio, the preset's
        # own train run (outside steps, checkpoint blocking), harness parity, then the rest
        if "reference" in chosen:
            table.run("reference", check_reference, work / "reference", dataset, a.device, a.reference,
                      a.reference_rounds, ours_env, ctx)
        if "train" in chosen:
            t = train_row(table, work, dataset, a.device, all_shapes, big, ndev, ctx)
            if f"train {big}" in ctx:
                table.run(f"outside steps {big}", check_outside_steps, t, big, a.device == "cuda",
                          costs_device_time=False)
            else:
                table.skip(f"outside steps {big}", f"needs the train {big} row")
        if "harness" in chosen:
            from benchmarks.harness_parity import check_harness_parity

            table.run("harness parity", check_harness_parity, device)
        if "profile" in chosen:
            table.run("profile", check_profile, device, reference_shape(a.device), ctx.get("reference_ratio"))
        if "guards" in chosen:
            if ctx.get("tokens_per_s"):
                table.run(f"guards {big}", check_guards, device, all_shapes[big]["model"], ctx["tokens_per_s"])
            else:
                table.skip(f"guards {big}", f"needs tokens/s from the train {big}, reference or speed row")
        if "micro-batch" in chosen:
            table.run("micro-batch auto", check_auto_micro_batch, device)
        if chosen & {"train", "resume", "ranks", "oom"}:
            train_row(table, work, dataset, a.device, all_shapes, "micro", ndev, ctx)
        micro = ctx.get("train micro")
        if "resume" in chosen:
            if micro:
                table.run("resume after SIGKILL", check_resume, micro[0], ndev, micro[1], tol)
            else:
                table.skip("resume after SIGKILL", "needs the train micro row")
        if "ranks" in chosen and ndev < 2:  # asked for and not run says so (a one-GPU lease), never silence
            table.skip("ranks", f"needs >= 2 GPUs: this machine has {ndev}")
        elif "ranks" in chosen:
            if micro:
                table.run(f"{ndev} ranks == 1 rank", check_ranks, micro[0], micro[1], tol)
            else:
                table.skip(f"{ndev} ranks == 1 rank", "needs the train micro row")
        if "oom" in chosen:
            if micro:
                table.run("out of memory", check_out_of_memory, micro[0])
            else:
                table.skip("out of memory", "needs the train micro row")
        if "family" in chosen:
            table.run("family", check_family, work / "family", dataset, device, sizes,
                      a.family_seconds if a.family_seconds is not None else FAMILY_SECONDS[a.device])
        if "fp8" in chosen:
            if why := fp8_unavailable(device):
                table.skip("fp8", why)
            else:
                table.run("fp8", check_fp8, work / "fp8", dataset, device, fp8_sizes, a.fp8_rounds)
        if "sustained" in chosen:
            from benchmarks.gpu_sustained import SUSTAINED_SECONDS, check_sustained

            table.run("sustained", check_sustained, work / "sustained", device, all_shapes[big],
                      a.sustained_seconds if a.sustained_seconds is not None else SUSTAINED_SECONDS[a.device])
        if "speed" in chosen:
            table.run(f"speed {big}", check_speed, device, all_shapes[big], dataset, a.speed_steps, a.speed_rounds,
                      ctx)
        # unasked, the profile of a ratio below target comes last, on what is left of the budget: lease 6's
        # (69 s, where lease 1 had answered the question) pushed guards, the probe and resume past it
        ratio = ctx.get("reference_ratio")
        if a.device == "cuda" and a.rows == "default" and ratio is not None and ratio < REFERENCE_TARGET:
            table.run("profile", check_profile, device, reference_shape(a.device), ratio)
    print(f"gpu_check: {sum(r.status == 'PASS' for r in table.rows)} passed, "
          f"{sum(r.status == 'FAIL' for r in table.rows)} failed, {sum(r.status == 'info' for r in table.rows)} "
          f"informational, {sum(r.status == 'not run' for r in table.rows)} not run in "
          f"{time.monotonic() - table.t0:.0f} s" + (f"; rows in {a.out}" if a.out else ""))
    print(json.dumps({"passed": table.passed}))
    return 0 if table.passed else 1


if __name__ == "__main__":
    # one module whether run (python -m) or imported: gpu_sustained imports this one's helpers, and a second copy
    # would have its own DEADLINE, which main never sets
    sys.modules.setdefault("benchmarks.gpu_check", sys.modules[__name__])
    raise SystemExit(main())
