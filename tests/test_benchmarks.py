"""Every benchmark runs: `python -m benchmarks.<name> --smoke` (its smallest setting, same code, same result
lines) exits 0 and prints its result lines with numbers in them. Not a timing: the numbers must be there
and sane (finite, > 0), whatever their size. ~2-5 minutes for all on a 2-core CPU. bench_rerun runs on the
session's shared stack (`prefect_stack`, through its --api-url): its own stack's start-up was ~50 of its
115-130 s here. `make bench-smoke` runs this file; `make bench` runs the benchmarks at full size.
benchmarks/gpu_check.py has its own test (test_gpu_check.py).
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

N = r"(\d[\d,]*(?:\.\d+)?)"  # a number as the benchmarks print them: 0.86, 1,332, 2.1 (of "2.1%"); not nan/inf

# module -> the lines it must print, one regex each (re.MULTILINE); its groups are the N numbers, each > 0
LINES = {
    "bench_tokenize": [
        *(rf"^{m} +{N}M +{N}x \({N}-{N}\) +{N}M +{N} MB$" for m in ("ideal", "batch", "naive", "stage")),
        rf"^stage vs naive \(wall\): {N}x \({N}-{N}\)$",
        r"^targets \(stage >= 0\.85x ideal, >= 1\.0x naive, wall time\): (?:met|MISSED)",
    ],
    "bench_train": [
        rf"^tiny-cpu +fp32 compile=False ours +{N} tok/s \(MFU {N}%\) \| eager baseline +{N} tok/s "
        rf"\(MFU {N}%\) \| ratio {N}x \(wall {N}x\) \| data [\d.]+% of step \| peak {N} GFLOP/s$",
        rf"^gpt2-124m on 8xH100: .*hours_at_40pct_mfu_8xH100={N}",
        r"^targets (?:met|NOT met)",
    ],
    "bench_hellaswag": [
        rf'^ "batched_examples_per_s": {N},$', rf'^ "reference_examples_per_s": {N},$', rf'^ "speedup": {N},$',
    ],
    "bench_rerun": [
        # pickup/start are left out: one of them can round to 0.00 s
        rf"^  flow +{N} s  \({N}-{N}\)   target <= 5 s: (?:met|MISSED)$",
        rf"^  e2e +{N} s  \({N}-{N}\)   target <= 10 s: (?:met|MISSED)$",
        rf"^  for scale: cold `import flows.pretrain` +{N} s .* torch +{N} s .* mlflow +{N} s",
    ],
    "bench_recipe": [
        rf"^  muon \+ wsd, 0\.5N=4 +{N} \({N}-{N}\) +{N} ms/step$",
        rf"^best default: adamw lr [\d.]+, cosine, N=8 -> {N}; new recipe at 0\.5x the tokens -> {N} ",
        rf"^time per step, Muon\+AdamW / AdamW: {N}x \(target <= 1\.1x: (?:met|MISSED)\)$",
    ],
    "bench_checkpoint": [
        rf"^tiny-cpu {N}M checkpoint: .*model\.safetensors {N} MB",
        rf"^  ranks blocked per save: async {N}% of sync .*target <= 15%: (?:PASS|FAIL)$",
        rf"^  verification adds {N}x the plain load at resume",
    ],
    "bench_sharded_checkpoint": [
        *(rf"^  {kind} +blocked +{N} s \({N}-{N}\) \| on disk +{N} s \| rank 0 stages {N} MB$"
          for kind in ("whole", "sharded")),
        rf"^  ranks blocked per save: sharded {N}x whole \(median of {N} paired rounds, {N}-{N}\); rank 0 "
        rf"stages {N}x the state .*: (?:met|MISSED)$",
    ],
    "bench_harness": [
        rf"^micro: ours {N} req/s \| lm-eval HFLM {N} req/s \| ratio {N}x \({N}-{N}, 1 rounds\) \| largest "
        r"log-likelihood difference",
        r"^target \(ours >= 1\.0x HFLM\): (?:met|MISSED)$",
    ],
    "bench_contamination": [
        rf"^scan 200,000 tokens against 100 examples \(n=13, {N} found, same as the baseline\): ours {N}M tok/s "
        rf"\| numpy baseline {N}M tok/s \| ratio {N}x \({N}-{N}\)$",
        rf"^projected for 10B tokens on one core: {N} min",
    ],
    "bench_bitrot": [
        rf"^{N} ranks, {N} shards of {N} tokens, one epoch: sha256 {N} MB/s$",
        rf"^  every rank hashes: {N} shard checks, [\d.]+ s of hashing$",
        rf"^  one per node: +{N} shard checks, [\d.]+ s of hashing \([\d.]+x less\)$",
        rf"^  at gpt2-124m on one 8-GPU node \([\d.]+ s steps\): {N}% of step time with {N} hashing ranks, {N}% "
        r"with one",
    ],
    "bench_memory": [
        *(rf"^  {mode} +activations {N} MiB \({N}x\) \| step {N} s \({N}x\) \| loss the same \| spread "
          for mode in ("none", "selective", "full")),
    ],
    "bench_eval": [
        rf"^  eager \(trainer\) +first +{N} s, later median {N} s",
        rf"^  compiled +first +{N} s, later median {N} s",
        r"^  compiled (?:saves|is not faster)",
    ],
}


def test_every_benchmark_has_a_smoke_run():
    """A new benchmarks/bench_*.py gets a --smoke setting and its lines in LINES."""
    assert sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")) == sorted(LINES)


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(LINES))
def test_benchmark_smoke_run(module, tmp_path, request):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(OMP_NUM_THREADS="1", GPTPIPE_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"))
    shared = ["--api-url", request.getfixturevalue("prefect_stack").prefect_api_url] if module == "bench_rerun" else []
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", *shared], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    out = f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    assert r.returncode == 0, out
    for pattern in LINES[module]:
        m = re.search(pattern, r.stdout, re.MULTILINE)
        assert m, f"no line matches {pattern!r}\n{out}"
        for x in (float(g.replace(",", "")) for g in m.groups()):  # the only groups are the N numbers
            assert math.isfinite(x) and x > 0, f"{x} in {m.group(0)!r}"
