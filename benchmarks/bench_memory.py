"""What activation checkpointing saves and costs, measured in one run against `none`:

for each train.activation_checkpointing mode, a fresh process takes one training step (forward + backward)
of the same model on the same batch; its peak resident memory above the model's own (weights and
gradients, measured in the same process before the step) is the step's activation memory, and its wall
time the step's cost. Targets: selective <= 0.85x none's activation memory at <= 1.1x its step time, full
<= 0.4x at <= 1.35x (docs/training.md "DDP or FSDP2" has the measured numbers).

    python -m benchmarks.bench_memory [--layers 24 --width 512 --batch 2 --seq 512]   # gpt2-350m's depth
    python -m benchmarks.bench_memory --smoke   # a tiny model; exits 0 whatever the ratios

glibc's malloc is pinned to give large blocks back to the system (MALLOC_MMAP_THRESHOLD_), so resident
memory follows what is live; a CUDA card's allocator peak is the GPU lease's measure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from benchmarks import parse_args

MODES = ("none", "selective", "full")
SMOKE = {"layers": 2, "width": 64, "batch": 2, "seq": 64, "rounds": 1}


def one_step(layers: int, width: int, batch: int, seq: int) -> dict:
    """Inside the child: peak RSS growth of one forward + backward, past the model and its gradients."""
    import torch  # in the child only: the parent process must stay small

    from gptcore.config import ModelConfig
    from gptcore.model.gpt import GPT
    from gptcore.model.loss import make_loss

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=layers, n_embd=width, n_head=max(1, width // 64), block_size=seq))
    model.recompute = os.environ["BENCH_MODE"]
    model.head_loss = make_loss("fused")  # the trainer's loss on CPU: no logits-sized tensors to blur the blocks'
    for p in model.parameters():  # the gradients' memory exists before the measured step
        p.grad = torch.zeros_like(p)
    x = torch.randint(0, 50257, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    _, loss = model(x[:, :-1], x[:, 1:], return_logits=False)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"activation_bytes": peak - before, "seconds": seconds, "loss": loss.item()}


def measure(mode: str, args) -> dict:
    env = {**os.environ, "BENCH_MODE": mode, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    code = (f"import json; from benchmarks.bench_memory import one_step; "
            f"print(json.dumps(one_step({args.layers}, {args.width}, {args.batch}, {args.seq})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2, help="each mode this many times, interleaved; medians")
    args = parse_args(parser, argv, SMOKE)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(measure(mode, args))
    print(f"{args.layers} layers x {args.width} wide, batch {args.batch} x {args.seq} tokens, "
          f"{args.rounds} round(s), one forward + backward per process:")
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    base_mem = median([r["activation_bytes"] for r in runs["none"]])
    base_s = median([r["seconds"] for r in runs["none"]])
    for mode in MODES:
        mem, s = median([r["activation_bytes"] for r in runs[mode]]), median([r["seconds"] for r in runs[mode]])
        same = all(r["loss"] == runs["none"][0]["loss"] for r in runs[mode])
        spread_s = [r["seconds"] for r in runs[mode]]
        spread_mem = [r["activation_bytes"] / 2**20 for r in runs[mode]]
        print(f"  {mode:9s} activations {mem / 2**20:,.1f} MiB ({mem / max(base_mem, 1):.2f}x) | step "
              f"{s:.2f} s ({s / base_s:.2f}x) | loss {'the same' if same else 'DIFFERS'} | spread "
              f"{min(spread_mem):,.1f}-{max(spread_mem):,.1f} MiB, {min(spread_s):.2f}-{max(spread_s):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
