"""gpu_check's sustained row (issue 68): gpt2-124m trained for minutes, not seconds, with the card's clocks,
power and temperature sampled, and the time outside steps measured in the run itself, not extrapolated.

    python -m benchmarks.gpu_check --rows sustained                  # on the GPU machine (a lease call)
    python -m benchmarks.gpu_check --rows sustained --device cpu     # the path, small (the CPU test)

The run is the preset's whole job through torchrun, as users launch it: its 524,288-token steps at
micro_batch=auto, compile, validation, HellaSwag, samples and checkpoints. Its evaluations come at the preset's
cadence *in wall time on its target of TARGET_GPUS GPUs*: one GPU takes TARGET_GPUS times as long per step,
and each of the target's ranks does 1/TARGET_GPUS of an evaluation's work, so every interval is divided by
TARGET_GPUS (validation and a sample every 250 / 8 = 31 steps, HellaSwag and a checkpoint every 125) and so is
each evaluation's work (10M / 8 validation tokens, 10,042 / 8 HellaSwag examples). HellaSwag reads the real
validation file when it is cached or carried (`$GPTPIPE_HOME/hellaswag/hellaswag_val.jsonl`), else a
synthetic set of its lengths, and the row says which. A checkpoint is whole-model on one rank either way.

It trains until SUSTAINED_SECONDS of step time after the warm-up and at least one of each evaluation and a
checkpoint, then stops the run. Reported: tokens/s over the first and the last minute of steps, the share of
wall time outside steps (checkpoint blocking and waits, validation + HellaSwag, samples; the gate leaves out the
first validation's excess over the later ones, a once-per-launch warm-up, reported beside it) and the wall time
unaccounted for by either, and NVML's samples (nvidia-smi, which the GPU image has) over the same span: SM
clock, power, temperature, first minute against last. PASS on CUDA when the outside share is within
gpu_check's OUTSIDE_TARGET and the last minute keeps >= 95% of the first's tokens/s.
"""

from __future__ import annotations

import csv
import math
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from benchmarks.gpu_check import (
    OUTSIDE_TARGET,
    ROOT,
    SYNTHETIC_FILE,
    WARM,
    hellaswag_settings,
    make_dataset,
    synthetic_hellaswag,
    wait_until,
    worker_env,
)

TARGET_GPUS = 8  # the preset's cadence is set for 8 x H100 (docs/training.md, the projection)
SUSTAINED_SECONDS = {"cuda": 180.0, "cpu": 6.0}
KEEP = 0.95  # the last minute's tokens/s over the first's
NVML_FIELDS = ("timestamp", "clocks.sm", "clocks.max.sm", "power.draw", "temperature.gpu", "utilization.gpu")


@dataclass
class Sample:
    t: float  # the machine's clock (seconds since the epoch), as metrics.jsonl's "time"
    sm_mhz: float
    sm_max_mhz: float
    watts: float
    celsius: float
    util: float


def parse_nvidia_smi(text: str) -> list[Sample]:
    """nvidia-smi's `--format=csv,noheader,nounits` lines of NVML_FIELDS; a field it cannot read ("[N/A]",
    "[Not Supported]") is NaN, a torn last line (the sampler was stopped mid-write) is left out. nvidia-smi
    writes local time, as datetime reads it."""
    def number(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            return math.nan

    samples = []
    for fields in csv.reader(line for line in text.splitlines() if line.strip()):
        if len(fields) != len(NVML_FIELDS):
            continue
        try:
            when = datetime.strptime(fields[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        samples.append(Sample(when, *(number(f.strip()) for f in fields[1:])))
    return samples


class NvmlSampler:
    """nvidia-smi sampling NVML_FIELDS of GPU 0 every `every_ms` into a file while the run trains (a process
    of its own: nothing in the trainer's or this process's way). `why` says why there are no samples."""

    def __init__(self, path: Path, every_ms: int = 1000):
        self.path, self.every_ms, self.proc, self.why = path, every_ms, None, None

    def __enter__(self) -> NvmlSampler:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.why = "no NVML samples: nvidia-smi is not on this machine"
            return self
        self.proc = subprocess.Popen([smi, "--id=0", f"--query-gpu={','.join(NVML_FIELDS)}",
                                      "--format=csv,noheader,nounits", f"--loop-ms={self.every_ms}"],
                                     stdout=open(self.path, "w"), stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def samples(self) -> list[Sample]:
        found = parse_nvidia_smi(self.path.read_text()) if self.path.is_file() else []
        if self.proc is not None and not found:
            self.why = f"no NVML samples: nvidia-smi printed {self.path.read_text()[-200:]!r}"
        return found


def sustained_settings(device: str, val_tokens: int) -> dict:
    """The trainer's overrides for the row: the preset's cadence over TARGET_GPUS on CUDA (module docstring);
    on CPU every 4 steps, as gpu_check's train rows."""
    from gptcore.evals import HellaSwag  # and the registry: eval.hellaswag's section
    from gptcore.overrides import load_config

    if device != "cuda":
        return {"eval.eval_interval": 4, "eval.sample_interval": 4, "eval.hellaswag.interval": 4,
                "train.checkpoint_interval": 4, "eval.val_tokens": val_tokens}
    cfg = load_config("gpt2-124m")
    every = {"eval.eval_interval": cfg.eval.eval_interval, "eval.sample_interval": cfg.eval.sample_interval,
             "eval.hellaswag.interval": cfg.eval.options(HellaSwag.name).interval,
             "train.checkpoint_interval": cfg.train.checkpoint_interval}
    return {**{k: max(1, v // TARGET_GPUS) for k, v in every.items()},
            "eval.val_tokens": cfg.eval.val_tokens // TARGET_GPUS}


def window(rows: list[dict], seconds: float, last: bool) -> float:
    """Tokens/s over the first (or last) `seconds` of step time of `rows`: their tokens over their time."""
    picked, spent = [], 0.0
    for r in (reversed(rows) if last else rows):
        if spent >= seconds:
            break
        picked.append(r)
        spent += r["train/step_time"]
    return sum(r["train/tokens_per_s"] * r["train/step_time"] for r in picked) / spent


def nvml_text(samples: list[Sample], span: tuple[float, float], minute: float, why: str | None) -> str:
    """The samples inside the measured span (the machine's clock), first minute vs last."""
    inside = [s for s in samples if span[0] <= s.t <= span[1]]
    if not inside:
        return why or "no NVML samples inside the measured span"

    def stats(part: list[Sample]) -> str:
        def med(xs):
            xs = [x for x in xs if math.isfinite(x)]
            return statistics.median(xs) if xs else math.nan
        return (f"SM {med(s.sm_mhz for s in part):.0f} MHz, {med(s.watts for s in part):.0f} W, "
                f"{max((s.celsius for s in part), default=math.nan):.0f} C max, util "
                f"{med(s.util for s in part):.0f}%")

    first = [s for s in inside if s.t <= span[0] + minute]
    last = [s for s in inside if s.t >= span[1] - minute]
    lowest = min((s.sm_mhz for s in inside if math.isfinite(s.sm_mhz)), default=math.nan)
    return (f"NVML ({len(inside)} samples): first minute {stats(first)}; last minute {stats(last)}; lowest SM "
            f"clock {lowest:.0f} of {inside[0].sm_max_mhz:.0f} MHz")


def check_sustained(work: Path, device: torch.device, shape: dict, seconds: float) -> tuple[bool | None, str]:
    """The row (module docstring). `shape`: gpu_check's gpt2-124m shape on CUDA, its small one on CPU. Its
    own data: a val split as long as one evaluation reads."""
    from gptcore.launch import torchrun_cmd
    from gptcore.metrics import read_metrics

    cuda = device.type == "cuda"
    work.mkdir(parents=True, exist_ok=True)
    run, log = work / "sustained", work / "sustained.log"
    B, T = shape["B"], shape["T"]
    every = sustained_settings(device.type, B * T)
    dataset = make_dataset(work / "data", val_tokens=max(300_000, every["eval.val_tokens"] + 1))
    hellaswag = hellaswag_settings(work, device.type)
    real = not hellaswag["eval.hellaswag.path"].endswith(SYNTHETIC_FILE)
    if cuda:  # 1/TARGET_GPUS of the whole validation split per evaluation, as one of the target's ranks scores
        share = math.ceil(10_042 / TARGET_GPUS)
        hellaswag = ({**hellaswag, "eval.hellaswag.limit": share} if real else
                     {**hellaswag, "eval.hellaswag.path": str(synthetic_hellaswag(work / "hs.jsonl", share))})
    cpu_model = {} if cuda else {f"model.{k}": v for k, v in shape["model"].items()}
    overrides = {"data.dataset_dir": str(dataset), "train.run_dir": str(run), "train.device": device.type,
                 "train.micro_batch": "auto" if cuda else B, "train.micro_batch_max": B, "train.seq_len": T,
                 "train.total_batch_tokens": 524_288 if cuda else B * T * 2, "train.max_steps": 100_000,
                 "train.log_interval": 1, "optim.warmup_steps": 2, "eval.sample_tokens": 32 if cuda else 8,
                 **every, **hellaswag, **cpu_model}

    def done(rows: list[dict]) -> bool:
        after = [r for r in rows if r["step"] > WARM]
        if sum(r["train/step_time"] for r in after) < seconds:
            return False
        later = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > WARM]  # one read per poll
        return (any(r["kind"] == "checkpoint" for r in later)
                and any(r["kind"] == "eval" and "hellaswag/acc" in r for r in later))

    with NvmlSampler(work / "nvml.csv") as nvml:
        proc = subprocess.Popen(torchrun_cmd("gpt2-124m", overrides, 1), cwd=ROOT, env=worker_env(),
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        rc = wait_until(proc, run, done, 600, f"{seconds:.0f} s of steps with every evaluation")
    rows = read_metrics(run / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train" and r["step"] > WARM]
    if rc != 0 or not train:
        return False, f"exit {rc}: {log.read_text()[-600:]}"
    start = next(r["time"] - r["train/step_time"] for r in train)  # the first measured step's start
    inside = [r for r in rows if r["time"] >= start and r["time"] <= train[-1]["time"]]
    spent = {k: sum(r.get(f"time/{k}_s", 0.0) for r in inside if r["kind"] == "overhead")
             for k in ("checkpoint", "checkpoint_wait", "eval", "sample")}
    steps_s, outside = sum(r["train/step_time"] for r in train), sum(spent.values())
    wall = train[-1]["time"] - start
    minute = min(60.0, steps_s / 3)
    first, last = window(train, minute, last=False), window(train, minute, last=True)
    evals = [r for r in inside if r["kind"] == "eval"]
    saves = [r for r in inside if r["kind"] == "checkpoint"]
    hs = [r for r in evals if "hellaswag/acc" in r]
    samples = nvml.samples()
    nvml_part = nvml_text(samples, (start, train[-1]["time"]), minute, nvml.why)
    # the first validation of a process warms up (its kernels, the first read of the shards): once per launch,
    # not once per interval, so the gate leaves out its excess over the later ones (as gpu_check's outside row)
    val_times = [r["time/val_s"] for r in evals if "time/val_s" in r]
    once = max(0.0, val_times[0] - statistics.median(val_times[1:])) if len(val_times) > 1 else 0.0
    share_out, with_once = (outside - once) / (outside - once + steps_s), outside / (outside + steps_s)
    ok = share_out <= OUTSIDE_TARGET and last >= KEEP * first
    which = "real" if real else "synthetic (carry the real file: docs/training.md, the GPU lease)"
    detail = (f"{len(train)} steps after the first {WARM}, {steps_s:.0f} s of steps in {wall:.0f} s of wall time; "
              f"tokens/s first {minute:.0f} s {first:,.0f}, last {minute:.0f} s {last:,.0f} "
              f"({last / first:.1%}; pass >= {KEEP:.0%}); outside steps {share_out:.1%} of steps + outside "
              f"(pass <= {OUTSIDE_TARGET:.0%}; {with_once:.1%} with the first validation's one-time {once:.1f} s "
              f"warm-up): checkpoint blocked {spent['checkpoint']:.2f} s + waited "
              f"{spent['checkpoint_wait']:.2f} s over {len(saves)} saves, {len(evals)} evaluations "
              f"{spent['eval']:.1f} s ({len(hs)} with HellaSwag, {hs[0]['hellaswag/n'] if hs else 0} {which} "
              f"examples each), samples {spent['sample']:.1f} s; unaccounted "
              f"{max(0.0, wall - steps_s - outside):.1f} s; cadence {', '.join(f'{k}={v}' for k, v in every.items())}"
              f"{f' (the preset over {TARGET_GPUS} GPUs)' if cuda else ''}; {nvml_part}")
    return (ok if cuda else None), detail
