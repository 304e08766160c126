"""The faster recipe against the default one, side by side on the same small GPT-2-shaped model and shards.

    python -m benchmarks.bench_recipe [--steps 240] [--seeds 1337 42] [--preset tiny-cpu] [--set KEY=VALUE ...]
    python -m benchmarks.bench_recipe --smoke    # the micro model, 8 steps, small batches: runs, not results

In one run, on the built-in corpus's shards, real trainer processes (`python -m gptcore.training.train`):
- the default recipe (AdamW, cosine) for N = --steps steps at three peak learning rates, one above 3e-3;
  its best is the baseline;
- the new recipe (optim.name=muon, optim.schedule=wsd) as a separate run whose whole schedule is
  compressed to 0.5 x N steps (not a crossing point read off a longer curve);
- every configuration with each seed (model init and data order). Reported: the final val loss of every
  run (mean and spread over seeds), the token ratio, and the median time per step of each optimizer.
Targets (issue 17): the new recipe at 0.5 x N reaches a val loss at or below the best default's at N, and
its time per step is <= 1.1x AdamW's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import parse_args
from gptcore.metrics import read_metrics

ADAMW_LRS = (1e-3, 3e-3, 6e-3)
# the new recipe at this scale: the gpt2-124m-muon preset's Muon settings; its AdamW part keeps the
# preset's own peak lr (tiny-cpu: 3e-3), no weight decay (as the preset), WSD with a 30% decay to 0
MUON = ["optim.name=muon", "optim.schedule=wsd", "optim.decay_frac=0.3", "optim.min_lr=0",
        "optim.weight_decay=0", "optim.muon_lr=0.02", "optim.muon_momentum=0.95", "optim.muon_weight_decay=0"]
COMMON = ["train.total_batch_tokens=2048", "eval.eval_interval=0", "eval.sample_interval=0",
          "eval.hellaswag.enabled=false", "eval.val_tokens=32768", "train.checkpoint_interval=100000",
          "train.log_interval=1"]
# --smoke: 8 steps, so that the 0.5N run still has steps after the two its step time leaves out
SMOKE = {"preset": "micro", "steps": 8, "seeds": [1337],
         "set": ["train.total_batch_tokens=256", "eval.val_tokens=1024"]}


def run(preset: str, name: str, steps: int, seed: int, extra: list[str], home: Path) -> dict:
    """Train one run to the end; its final val loss and median step time."""
    warmup = max(1, steps // 12)
    cmd = [sys.executable, "-m", "gptcore.training.train", preset, f"train.run_name={name}", f"train.max_steps={steps}",
           f"train.seed={seed}", f"optim.warmup_steps={warmup}", *COMMON, *extra]
    r = subprocess.run(cmd, env={**os.environ, "GPTPIPE_HOME": str(home)}, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: {name} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    rows = read_metrics(home / "runs" / name / "metrics.jsonl")
    val = [x["val/loss"] for x in rows if "val/loss" in x][-1]
    times = [x["train/step_time"] for x in rows if x.get("kind") == "train" and x["step"] > 2]
    return {"val": val, "step_time": statistics.median(times)}


def summary(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4f} ({min(xs):.4f}-{max(xs):.4f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny-cpu")
    p.add_argument("--steps", type=int, default=240, help="N, the default recipe's steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 42])
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for every run, after the common ones (e.g. train.total_batch_tokens=4096)")
    args = parse_args(p, argv, SMOKE)
    n, half = args.steps, args.steps // 2
    with tempfile.TemporaryDirectory(prefix="gptpipe-bench-recipe-") as tmp:
        home = Path(tmp)
        env = {**os.environ, "GPTPIPE_HOME": str(home)}
        subprocess.run([sys.executable, "-m", "gptcore.data.build", args.preset], env=env, check=True,
                       capture_output=True)
        results: dict[str, list[dict]] = {}
        configs = [(f"adamw lr {lr:g}, cosine, N={n}", n, [f"optim.max_lr={lr}", f"optim.min_lr={lr / 10}"])
                   for lr in ADAMW_LRS]
        configs.append((f"muon + wsd, 0.5N={half}", half, MUON))
        for seed in args.seeds:  # seeds outermost: a drifting machine hits every configuration alike
            for i, (label, steps, extra) in enumerate(configs):
                r = run(args.preset, f"c{i}-s{seed}", steps, seed, [*args.set, *extra], home)
                results.setdefault(label, []).append(r)
                print(f"  {label:32s} seed {seed}: val {r['val']:.4f}, {r['step_time'] * 1000:.1f} ms/step",
                      flush=True)
    print(f"\nfinal val loss ({args.preset}, {len(args.seeds)} seeds; mean (min-max)) and median step time")
    for label, rs in results.items():
        print(f"  {label:32s} {summary([r['val'] for r in rs])}   "
              f"{statistics.median(r['step_time'] for r in rs) * 1000:.1f} ms/step")
    adamw = {k: v for k, v in results.items() if k.startswith("adamw")}
    best = min(adamw, key=lambda k: statistics.mean(r["val"] for r in adamw[k]))
    best_val = statistics.mean(r["val"] for r in adamw[best])
    new = results[configs[-1][0]]
    new_val = statistics.mean(r["val"] for r in new)
    ratio = statistics.median(r["step_time"] for r in new) / statistics.median(
        r["step_time"] for k in adamw for r in adamw[k])
    print(f"\nbest default: {best} -> {best_val:.4f}; new recipe at 0.5x the tokens -> {new_val:.4f} "
          f"({'at or below' if new_val <= best_val else 'ABOVE'} the best default: target "
          f"{'met' if new_val <= best_val else 'MISSED'})")
    print(f"time per step, Muon+AdamW / AdamW: {ratio:.2f}x (target <= 1.1x: {'met' if ratio <= 1.1 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
