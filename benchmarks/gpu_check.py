"""The GPU acceptance run: one command on a fresh CUDA machine before a long run.

    python -m benchmarks.gpu_check                 # all visible GPUs; without CUDA it says so and exits 0
    python -m benchmarks.gpu_check --device cpu    # the same checks on CPU, small (how the tests run it)

Each check is a row of the table it prints, PASS or FAIL (exit 1 if any fails):
  train   micro and a GPT-2-shaped model train under torchrun on every device (compile + bf16 on CUDA,
          fp16 + GradScaler on GPUs without native bf16, as `auto` selects), the whole job: validation,
          HellaSwag (the cached dataset, limited, or the bundled fixture), samples and checkpoints every 4
          steps: exit 0, finite losses, the loss falls, every evaluation and checkpoint done
  outside the time spent outside training steps (checkpoint blocking, validation, HellaSwag, samples):
          measured here, and projected to gpt2-124m's cadence (a checkpoint and HellaSwag every 1,000
          steps, validation of 10M tokens and a sample every 250) from the per-token / per-example /
          per-save costs measured here; on CUDA the projection for the GPT-2 shape must be <= 5% of wall
          time
  resume  a run SIGKILLed after its first checkpoint and started again ends with the losses of the
          uninterrupted run (bf16 tolerance on CUDA, fp32 rounding on CPU)
  ranks   2 ranks equal 1 rank with twice the accumulation (when there are >= 2 devices)
  speed   the trainer's train_step against a plain single-file build-nanogpt-style loop (compile on,
          same shape, batch and precision), alternated over --speed-rounds rounds in this run: the median
          tokens/s ratio with its spread, MFU, peak memory. On CUDA the median must reach 0.97x: the two
          loops do the same work but for the trainer's stop vote, non-finite check and gradient norm
          (a few small kernels per step), so parity is the target and 3% is the noise allowance one
          ratio of two ~equal timings needs (on CPU the row is informational)
  guards  the replica consistency check (a bitwise checksum of the weights, gptcore/replicas.py) timed on
          the speed row's model, projected to gpt2-124m's cadence (every guard.consistency_interval steps of
          524,288 tokens at the speed row's tokens/s): on CUDA it must cost <= 1% of wall time
  micro-batch  what train.micro_batch=auto chooses for gpt2-124m here (seq_len 1024, at most 64), probed
          as the trainer probes it (informational: it depends on the card's memory)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
EVERY = 4  # steps between checkpoints, evaluations, HellaSwag and samples in the train rows
FIXTURE = ROOT / "tests" / "fixtures" / "hellaswag_mini.jsonl"
HELLASWAG_LIMIT = 200  # examples scored per HellaSwag evaluation when the real dataset is cached
HELLASWAG_FULL = 10_042  # examples in HellaSwag's validation split: what gpt2-124m's evaluations score


def make_dataset(d: Path) -> Path:
    """Learnable tokens (a repeating pattern with noise), a val shard and three train shards."""
    from gptcore.data.shard_format import Manifest, ShardInfo, write_shard

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    infos = []
    for i, n in enumerate((300_000, 200_000, 200_000, 200_000)):  # val: a batch per rank on 8 GPUs
        base = np.repeat(rng.integers(0, 300, n // 4 + 1), 4)[:n]
        toks = np.where(rng.random(n) < 0.1, rng.integers(0, 50257, n), base).astype(np.uint16)
        split = "val" if i == 0 else "train"
        name = f"check_{split}_{i:06d}.bin"
        infos.append(ShardInfo(name, split, n, write_shard(d / name, toks)))
    Manifest(shard_tokens=200_000, source={"gpu_check": 0}, shards=infos).save(d)
    return d


class Trainer:
    """Runs `torchrun -m gptcore.train` (the launcher's own command) on a shape, in its own session."""

    def __init__(self, work: Path, dataset: Path, device: str, shape: dict, ndev: int):
        self.work, self.dataset, self.device, self.shape, self.ndev = work, dataset, device, shape, ndev

    def overrides(self, run: Path, nproc: int, **extra) -> dict:
        B, T = self.shape["B"], self.shape["T"]  # the same step on any rank count: 2 micro-steps per device
        return {"data.dataset_dir": str(self.dataset), "train.run_dir": str(run), "train.device": self.device,
                "train.micro_batch": B, "train.seq_len": T, "train.total_batch_tokens": B * T * 2 * self.ndev,
                "train.max_steps": STEPS, "train.checkpoint_interval": EVERY, "train.keep_last": 10,
                "train.log_interval": 1, "optim.warmup_steps": 2, "eval.eval_interval": EVERY,
                "eval.hellaswag_interval": EVERY, "eval.sample_interval": EVERY, "eval.sample_tokens": 16,
                "eval.val_tokens": B * T * self.ndev, **hellaswag_settings(),
                **{f"model.{k}": v for k, v in self.shape["model"].items()}, **extra}

    def start(self, run: Path, nproc: int, log: Path) -> subprocess.Popen:
        from gptcore.launch import torchrun_cmd

        cmd = torchrun_cmd("micro", self.overrides(run, nproc), nproc)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def run(self, name: str, nproc: int) -> tuple[int, dict[int, float], str]:
        run, log = self.work / name, self.work / f"{name}.log"
        proc = self.start(run, nproc, log)
        rc = proc.wait(timeout=3600)
        return rc, losses(run), log.read_text()[-2000:]


def hellaswag_settings() -> dict:
    """The real HellaSwag when it is cached (limited to HELLASWAG_LIMIT examples), else the bundled fixture."""
    from gptcore.config import pipeline_home

    cached = pipeline_home() / "hellaswag" / "hellaswag_val.jsonl"
    path = cached if cached.is_file() else FIXTURE
    return {"eval.hellaswag": True, "eval.hellaswag_path": str(path), "eval.hellaswag_limit": HELLASWAG_LIMIT}


def losses(run: Path) -> dict[int, float]:
    from gptcore.metrics import read_metrics

    return {r["step"]: r["train/loss"] for r in read_metrics(run / "metrics.jsonl", "train")}


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (they run in their own sessions, so a process group would miss
    them). With psutil (integrations.processes); a bare CUDA image may lack it: then /proc, Linux's."""
    try:
        from integrations.processes import tree_of
    except ImportError:
        tree_of = _proc_descendants
    for pid in tree_of(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def _proc_descendants(pid: int) -> list[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [pid], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def worst_gap(a: dict[int, float], b: dict[int, float]) -> float:
    if sorted(a) != sorted(b) or not a:
        return math.inf
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-9) for s in b)


# --- the checks ----------------------------------------------------------------------------------------

def check_train(t: Trainer, label: str, nproc: int) -> tuple[bool, str, dict]:
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
    detail = (f"{nproc} rank(s), loss {got.get(1, float('nan')):.3f} -> {got.get(STEPS, float('nan')):.3f}, "
              f"{len(evals)} evaluations with HellaSwag, checkpoints at {due}: "
              f"{'all done' if whole_job else 'MISSING'}")
    return ok, detail if rc == 0 else f"exit {rc}: {tail[-300:]}", got


def check_outside_steps(t: Trainer, label: str, gate: bool) -> tuple[bool | None, str]:
    """Time outside training steps: its share in the train row's run, and projected to gpt2-124m's
    cadence from what each part cost per unit (checkpoint: per save; validation: per token; HellaSwag:
    per example; sample: per sample) against the step time per token."""
    import statistics

    from gptcore.config import load_config
    from gptcore.metrics import read_metrics

    rows = read_metrics(t.work / f"train-{label}" / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"][2:]  # after compile's warm-up steps
    evals = [r for r in rows if r["kind"] == "eval"]
    spent = {k: [r[f"time/{k}_s"] for r in rows if r["kind"] == "overhead" and f"time/{k}_s" in r]
             for k in ("checkpoint", "eval", "sample")}
    if not (train and evals and all(spent.values())):
        return False, "no timing rows in metrics.jsonl"
    steps_s = sum(r["train/step_time"] for r in train)
    outside = sum(sum(v) for v in spent.values())  # all of it falls after the warm-up steps
    batch = t.overrides(Path(), 1)["train.total_batch_tokens"]
    per_token_step = statistics.median(r["train/step_time"] for r in train) / batch
    val_s_per_token = sum(r["time/val_s"] for r in evals) / sum(r["val/tokens"] for r in evals)
    hs_s_per_example = sum(r["time/hellaswag_s"] for r in evals) / sum(r["hellaswag/n"] for r in evals)
    cfg = load_config("gpt2-124m")
    tc, ev = cfg.train, cfg.eval
    per_step = (statistics.median(spent["checkpoint"]) / tc.checkpoint_interval
                + val_s_per_token * ev.val_tokens / ev.eval_interval
                + hs_s_per_example * HELLASWAG_FULL / ev.hellaswag_interval
                + statistics.median(spent["sample"]) / ev.sample_interval)
    step = per_token_step * tc.total_batch_tokens
    projected = per_step / (per_step + step)
    med = {k: statistics.median(v) for k, v in spent.items()}
    detail = (f"{outside / (outside + steps_s):.1%} here (every {EVERY} steps: checkpoint blocked "
              f"{med['checkpoint'] * 1000:.0f} ms, eval {med['eval']:.2f} s, sample {med['sample']:.2f} s per "
              f"event; steps {per_token_step * 1e6:.2f} s/Mtok); projected at gpt2-124m's cadence: "
              f"{projected:.1%} of wall time")
    return (projected <= 0.05) if gate else None, detail


def check_resume(t: Trainer, nproc: int, reference: dict[int, float], tol: float) -> tuple[bool, str]:
    run, log = t.work / "resume", t.work / "resume.log"
    proc = t.start(run, nproc, log)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "checkpoints" / "step_00000004").is_dir():
            break
        time.sleep(0.01)
    killed = proc.poll() is None
    kill_session(proc)
    proc = t.start(run, nproc, t.work / "resume2.log")
    rc = proc.wait(timeout=3600)
    gap = worst_gap(losses(run), reference)
    ok = killed and rc == 0 and gap <= tol
    return ok, f"killed mid-run: {killed}, resumed exit {rc}, worst loss gap {gap:.2e} (tolerance {tol:.0e})"


def check_ranks(t: Trainer, two_ranks: dict[int, float], tol: float) -> tuple[bool, str]:
    rc, one, tail = t.run("one-rank", 1)
    gap = worst_gap(one, two_ranks)
    return rc == 0 and gap <= tol, f"{t.ndev} ranks vs 1 rank with {t.ndev}x the accumulation: worst loss gap {gap:.2e}"


def check_speed(device: torch.device, shape: dict, dataset: Path, steps: int, rounds: int) -> tuple[bool | None, str]:
    """train_step vs the plain loop, in this process, compile on, the precision `auto` picks; the two
    measured alternately, `rounds` times."""
    import statistics

    from benchmarks.bench_train import BaseGPT
    from gptcore.config import ModelConfig, OptimConfig, TrainConfig
    from gptcore.data.loader import ShardLoader
    from gptcore.distributed import select
    from gptcore.loss import make_loss
    from gptcore.model import GPT, peak_flops_guess
    from gptcore.optim import adamw
    from gptcore.trainer import train_step

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
    data = torch.randint(0, 50257, (B, T + 1), device=device)
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
    for _ in range(rounds - 1):  # alternated: drift in the machine's speed hits both loops alike
        ours_s = measure(lambda: train_step(model, opt, loader, 1, env, None, 1.0))[0]
        base_s = measure(base_step)[0]
        ratios.append(base_s / ours_s)
    ratio = statistics.median(ratios)
    peak = peak_flops_guess(device)
    mfu = f", MFU {fpt * B * T / ours_s / peak:.1%} vs {fpt * B * T / base_s / peak:.1%}" if peak and cuda else ""
    mem = f", peak memory {ours_mem:.1f} vs {base_mem:.1f} GiB" if cuda else ""
    detail = (f"{B * T / ours_s:,.0f} vs {B * T / base_s:,.0f} tok/s: median {ratio:.3f}x the plain loop over "
              f"{len(ratios)} rounds ({min(ratios):.3f}..{max(ratios):.3f}; pass >= 0.97) "
              f"({env.dtype}, B={B}, T={T}){mfu}{mem}")
    return (ratio >= 0.97 if cuda else None), detail, B * T / ours_s


def check_guards(device: torch.device, shape: dict, tokens_per_s: float) -> tuple[bool | None, str]:
    """The consistency check's cost per call on this model, and its share of wall time at gpt2-124m's
    cadence (the step time of a 524,288-token batch at the speed row's tokens/s)."""
    import statistics

    from gptcore.config import GuardConfig, ModelConfig, load_config
    from gptcore.model import GPT
    from gptcore.replicas import weights_checksum

    raw = GPT(ModelConfig(**shape["model"])).to(device)
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


def check_auto_micro_batch(device: torch.device) -> tuple[None, str]:
    """What train.micro_batch=auto picks for gpt2-124m on this device (on CPU: a small stand-in, since
    probing 64 x 1024 sequences there would only measure the host's swap)."""
    from gptcore.config import load_config
    from gptcore.distributed import select
    from gptcore.loss import make_loss
    from gptcore.microbatch import probe
    from gptcore.model import GPT

    if device.type == "cuda":
        cfg = load_config("gpt2-124m", ["train.device=cuda"])
    else:
        cfg = load_config("micro", ["train.micro_batch=auto", "train.micro_batch_max=8", "train.seq_len=32",
                                    "train.total_batch_tokens=512"])
    env = select(cfg.train)
    raw = GPT(cfg.model).to(env.device)
    raw.head_loss = make_loss(env.loss)
    t0 = time.perf_counter()
    chosen, failed = probe(raw, cfg, env)
    tried = f"; out of memory at {', '.join(map(str, failed))}" if failed else ""
    return None, (f"{cfg.preset}: micro_batch {chosen} of at most {cfg.train.micro_batch_max} x seq_len "
                  f"{cfg.train.seq_len} ({env.dtype}, compile={env.compile}){tried}; probed in "
                  f"{time.perf_counter() - t0:.1f} s")


# --- the run ---------------------------------------------------------------------------------------

def shapes(device: str) -> dict[str, dict]:
    if device == "cuda":
        return {"micro": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64}, "B": 16, "T": 64},
                "gpt2-124m": {"model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
                              "B": 16, "T": 1024}}
    return {"micro": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64}, "B": 2, "T": 32},
            "gpt2-shaped": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 128, "block_size": 64}, "B": 2,
                            "T": 64}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--work", help="keep the runs here (default: a temp dir)")
    ap.add_argument("--speed-steps", type=int, default=20)
    ap.add_argument("--speed-rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible on this machine; nothing was checked (run it on the GPU "
              "machine, or --device cpu to try the checks on CPU)")
        return 0
    ndev = torch.cuda.device_count() if a.device == "cuda" else 2
    tol = 5e-2 if a.device == "cuda" else 1e-4  # bf16 + compiled kernels vs fp32 CPU
    rows: list[tuple[str, bool | None, str]] = []
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        work = Path(tmp)
        dataset = make_dataset(work / "data")
        all_shapes = shapes(a.device)
        for label, shape in all_shapes.items():
            t = Trainer(work / label, dataset, a.device, shape, ndev)
            (work / label).mkdir()
            ok, detail, full = check_train(t, label, ndev)
            rows.append((f"train {label}", ok, detail))
            if ok:
                gate = a.device == "cuda" and label == list(all_shapes)[-1]
                rows.append((f"outside steps {label}", *check_outside_steps(t, label, gate)))
            if label == "micro" and ok:
                rows.append(("resume after SIGKILL", *check_resume(t, ndev, full, tol)))
                if ndev >= 2:
                    rows.append((f"{ndev} ranks == 1 rank", *check_ranks(t, full, tol)))
        big = list(all_shapes)[-1]
        device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
        ok, detail, tokens_per_s = check_speed(device, all_shapes[big], dataset, a.speed_steps, a.speed_rounds)
        rows.append((f"speed {big}", ok, detail))
        rows.append((f"guards {big}", *check_guards(device, all_shapes[big], tokens_per_s)))
        rows.append(("micro-batch auto", *check_auto_micro_batch(device)))
    from gptcore.distributed import select_dtype

    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    autocast = str(select_dtype("auto", device)).removeprefix("torch.")
    print(f"\ngpu_check on {ndev} x {name} (torch {torch.__version__}, auto dtype {autocast})")
    for check, ok, detail in rows:
        mark = "PASS" if ok else "info" if ok is None else "FAIL"
        print(f"  {mark:4s}  {check:26s} {detail}")
    print(json.dumps({"passed": all(ok is not False for _, ok, _ in rows)}))
    return 0 if all(ok is not False for _, ok, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
