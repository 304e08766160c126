"""What a checkpoint of an FSDP2 model costs the ranks, whole against sharded, measured in one run:

- whole (what FSDP2 runs wrote before sharded steps): every rank hands its shards to rank 0
  (`get_model_state_dict` / `get_optimizer_state_dict`, full and CPU-offloaded), which stages the whole
  state and writes one model.safetensors + trainer.pt in the background;
- sharded (today's, gptcore/checkpoints/sharded.py): every rank stages its own shard and DCP writes it in
  the background; rank 0 hashes the files and swaps the step in.

Both through the trainer's own Checkpointer, alternated round by round (ABBA), on 2 gloo ranks. Reported:
how long the ranks are blocked per save (the slowest rank), how long until the step is on disk, and the
bytes of state rank 0 stages (what bounds the model size a host can checkpoint). Target: sharded blocks
the ranks no longer than whole (<= 1.0x) and stages 1/world of the state on rank 0.

    python -m benchmarks.bench_sharded_checkpoint [--preset gpt2] [--rounds 4] [--dir /storage/to/measure]
    python -m benchmarks.bench_sharded_checkpoint --smoke   # tiny-cpu, 2 rounds; exits 0 whatever the ratio
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from benchmarks import parse_args
from gptcore import distributed
from gptcore.checkpoints import sharded
from gptcore.checkpoints.background import WRITTEN, Checkpointer
from gptcore.checkpoints.checkpoint import portable
from gptcore.config import OptimConfig, TrainConfig
from gptcore.model.gpt import GPT
from gptcore.model.optim import adamw
from gptcore.presets import model_preset
from gptcore.training import parallel

SMOKE = {"preset": "tiny-cpu", "rounds": 2}
RANKS = 2


def sharded_model(preset: str, env: distributed.Env):
    """An FSDP2 model of `preset` over the ranks, with AdamW state of its real size (one step of random
    gradients: no forward pass needed)."""
    torch.manual_seed(0)
    model = parallel.wrap(GPT(model_preset(preset)), "fsdp", env)
    opt = adamw(model.parameters(), OptimConfig(), "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def nbytes(state, seen: set | None = None) -> int:
    """Bytes of the tensors in `state` (this rank's pieces of DTensors), each storage once (the tied
    embedding and head are one tensor under two names)."""
    seen = set() if seen is None else seen
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        if t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.nbytes
    if isinstance(state, dict):
        return sum(nbytes(v, seen) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v, seen) for v in state)
    return 0


def save_whole(ck: Checkpointer, step: int, model, opt, master: bool) -> int:
    """The previous FSDP2 checkpoint: gather on rank 0, stage, write. Returns the bytes rank 0 staged."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, opt, options=options)
    if master:
        ck.save(step, weights, {"optimizer": optim, "step": step}, {"run_name": "bench"})
    seen: set = set()  # what the Checkpointer stages: the tied head's weight once (portable)
    return nbytes(portable(weights), seen) + nbytes(optim, seen)


def save_sharded(ck: Checkpointer, step: int, model, opt, group, master: bool) -> int:
    """Today's: every rank stages its own shard and writes it. Returns the bytes this rank staged."""
    staged = distributed.broadcast_object(ck.staging_dir(step) if master else None)
    saving = sharded.start_save(staged, model, opt, group)
    ck.save_sharded(step, saving, staged, {"step": step} if master else None,
                    {"run_name": "bench"} if master else None, master)
    seen: set = set()
    return nbytes(model.state_dict(), seen) + nbytes(opt.state_dict()["state"], seen)


def timed(save, ck: Checkpointer, master: bool) -> tuple[float, float, int]:
    """(seconds the slowest rank was blocked, seconds until the step was on disk, bytes rank 0 staged)."""
    dist.barrier()
    t = time.perf_counter()
    staged = save()
    blocked = max(distributed.all_gather_object(time.perf_counter() - t))
    out = ck.outcome(wait=True) if master else None
    ck.wait()
    assert not master or (out is not None and out.status == WRITTEN), out
    on_disk = distributed.broadcast_object(time.perf_counter() - t)
    return blocked, on_disk, distributed.broadcast_object(staged)


def worker(a: argparse.Namespace) -> int:
    env = distributed.select(TrainConfig(device="cpu", dtype="float32", compile="false"))
    distributed.init_process_group(env)
    master = env.rank == 0
    model, opt = sharded_model(a.preset, env)
    group = sharded.saving_group()
    rows: dict[str, list[tuple[float, float, int]]] = {"whole": [], "sharded": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        run = Path(distributed.broadcast_object(d))  # rank 0's directory: one run directory for both ranks
        ck = Checkpointer(run, keep_last=1)
        saves = {"whole": lambda s: save_whole(ck, s, model, opt, master),
                 "sharded": lambda s: save_sharded(ck, s, model, opt, group, master)}
        for kind in ("whole", "sharded"):  # the first save of each allocates its buffers: not counted
            timed(lambda k=kind: saves[k](1), ck, master)
        step = 2
        for r in range(a.rounds):  # ABBA: drift in the machine's speed hits both alike
            for kind in (("whole", "sharded") if r % 2 == 0 else ("sharded", "whole")):
                rows[kind].append(timed(lambda k=kind, s=step: saves[k](s), ck, master))
                step += 1
        dist.barrier()
    if master:
        report(a, model, rows)
    dist.destroy_process_group()
    return 0


def report(a: argparse.Namespace, model, rows) -> None:
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{a.preset} {params:.0f}M on {RANKS} ranks (gloo, CPU), {a.rounds} rounds each:")
    for kind, r in rows.items():
        blocked, on_disk = [x[0] for x in r], [x[1] for x in r]
        print(f"  {kind:8s} blocked {statistics.median(blocked):6.3f} s ({min(blocked):.3f}-{max(blocked):.3f}) | "
              f"on disk {statistics.median(on_disk):6.3f} s | rank 0 stages {r[0][2] / 1e6:.1f} MB")
    ratios = [s[0] / w[0] for s, w in zip(rows["sharded"], rows["whole"], strict=True)]
    ratio = statistics.median(ratios)
    share = rows["sharded"][0][2] / rows["whole"][0][2]
    print(f"  ranks blocked per save: sharded {ratio:.2f}x whole (median of {len(ratios)} paired rounds, "
          f"{min(ratios):.2f}-{max(ratios):.2f}); rank 0 stages {share:.2f}x the state "
          f"(target <= 1.0x blocked, <= {1 / RANKS + 0.05:.2f}x staged): "
          f"{'met' if ratio <= 1.0 and share <= 1 / RANKS + 0.05 else 'MISSED'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--preset", default="gpt2", help="model preset (gptcore.presets.MODEL_PRESETS)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on this disk)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launch below
    a = parse_args(ap, argv, SMOKE)
    if a.worker:
        return worker(a)
    # one gloo job of RANKS processes, as the trainer's; this process only launches it
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}", "--standalone",
           "-m", "benchmarks.bench_sharded_checkpoint", "--worker", "--preset", a.preset,
           "--rounds", str(a.rounds), *(["--dir", a.dir] if a.dir else [])]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


if __name__ == "__main__":
    raise SystemExit(main())
