"""The GPU acceptance run (benchmarks/gpu_check.py) runs end to end on CPU here, so only the CUDA kernels
go unexercised; on a CUDA machine the `gpu` tests run the real thing."""

import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


# what a bare CUDA PyTorch image lacks (it has torch, numpy, tiktoken, safetensors, transformers and pyarrow)
NOT_ON_A_BARE_IMAGE = ("prefect", "mlflow", "datasets", "lm_eval", "dask", "pandas")
TORCHRUN_211 = ROOT / "tests" / "fixtures" / "torchrun-2.11.0.json"

# Loaded at every interpreter's start (sitecustomize, first on PYTHONPATH): torchrun answers with torch 2.11's
# argument list. `python -m torch.distributed.run ...` exits 2 on a flag 2.11 lacks, as 2.11 does, and in
# every process torchrun's get_args_parser is 2.11's, so `gptcore.launch.accepts` asks 2.11.
SITECUSTOMIZE = """
import importlib.abc, importlib.machinery, json, sys
sys.path.insert(0, {root!r})
from tests.torchrun_options import parser_from
OPTIONS = json.load(open({fixture!r}))["options"]
def parser():
    return parser_from(OPTIONS)
if sys.orig_argv[1:3] == ["-m", "torch.distributed.run"]:
    try:
        parser().parse_args(sys.orig_argv[3:])  # argparse prints its error and exits 2 on an unknown flag
    except BaseException as e:  # SystemExit would only be reported here: end the process as torchrun would
        import os
        print(f"torchrun (torch 2.11): {{e!r}}", file=sys.stderr, flush=True)
        os._exit(2)
class As211(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributed.run":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            module.get_args_parser = parser
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, As211())
"""


def gpu_check(*args, timeout=1800, env=None):
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def bare_image(tmp_path: Path) -> dict:
    """An environment like the GPU machine's bare CUDA image: prefect, mlflow, datasets, lm_eval, dask and
    pandas cannot be imported (a package of each name, first on PYTHONPATH, raises ImportError as a missing
    one would), and torchrun is torch 2.11's, in this process and every one it starts."""
    stubs = tmp_path / "stubs"
    for name in NOT_ON_A_BARE_IMAGE:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} is not on a bare CUDA image')\n")
    (stubs / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(ROOT), fixture=str(TORCHRUN_211)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(ROOT)])}


def test_the_bare_image_stand_in_blocks_the_packages_and_answers_as_torch_211(tmp_path):
    env = bare_image(tmp_path)
    for name in NOT_ON_A_BARE_IMAGE:
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert probe.returncode == 1 and "not on a bare CUDA image" in probe.stderr, name
    accepts = subprocess.run([sys.executable, "-m", "gptcore.launch", "accepts", "--shutdown-timeout"], env=env,
                             cwd=ROOT, capture_output=True, text=True)
    assert accepts.returncode == 3  # 2.11 has no --shutdown-timeout (the installed torch has it)
    old = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--shutdown-timeout=5", "--standalone",
                          "-m", "json.tool", "--help"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert old.returncode == 2 and "shutdown-timeout" in old.stderr


def test_the_lease_script_runs_every_row_on_cpu_on_a_bare_image_and_keeps_everything(tmp_path):
    """The lease's own command (benchmarks/gpu_lease.sh) on CPU, on the bare-image stand-in, with one row made
    to raise: that row is a FAIL naming the error, every other row still runs and passes (or informs), each is
    printed as it completes, and $OUT/gpu_check keeps rows.json, the log, env.txt and every run's logs."""
    env = {**bare_image(tmp_path), "OUT": str(tmp_path / "out"), "REFERENCE": str(tmp_path / "none.py"),
           "BUDGET_S": "1500", "DEADLINE_S": "1700", "PYTHON": sys.executable}
    (tmp_path / "work").mkdir()
    r = subprocess.run(["bash", "benchmarks/gpu_lease.sh", "--device", "cpu", "--work", str(tmp_path / "work"),
                        "--fail-row", "harness parity", "--ours-env", "TORCH_CPP_LOG_LEVEL=INFO"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout.split("gpu_check on", 1)[1]
    for row in ("info    micro-batch auto", "PASS    train gpt2-shaped", "info    outside steps gpt2-shaped",
                "PASS    train micro", "info    reference", "FAIL    harness parity", "info    guards gpt2-shaped",
                "PASS    resume after SIGKILL", "PASS    2 ranks == 1 rank", "PASS    out of memory"):
        assert row in table, table
    # by value: the reference first, then the preset's train run and its time outside steps, then parity
    order = [line[10:36].strip() for line in table.splitlines() if line.startswith("  ")]
    assert order[:4] == ["reference", "train gpt2-shaped", "outside steps gpt2-shaped", "harness parity"], order
    assert "RuntimeError: injected failure (--fail-row)" in table
    assert "killed mid-run: True" in table and "auto dtype float32)" in table
    assert "8 synthetic examples each" in table  # no real HellaSwag offline: the synthetic set, not the fixture
    assert "consistency check" in table and "micro: micro_batch 8 of at most 8" in table and "loss=plain" in table
    assert "over 3 alternated rounds (ABBAAB;" in table and "reference: our stand-in" in table
    assert "; min " in table.split("alternated rounds", 1)[1]  # the median with its spread (issue 68)
    assert "micro-batch ours 2 (2) vs reference 2" in table
    out = tmp_path / "out" / "gpu_check"
    rows = json.loads((out / "rows.json").read_text())
    assert [x["status"] for x in rows["rows"]].count("FAIL") == 1 and rows["passed"] is False
    assert len(rows["rows"]) == 10 and rows["device"] == "2 x CPU"
    oom = next(x for x in rows["rows"] if x["name"] == "out of memory")  # memory record, retry at half, every step
    assert "record.json at step 2, retried at 1; steps (step, micro-batch) [(1, 2), (2, 1), (3, 1), (4, 1)]" \
        in oom["detail"], oom
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"passed": False}
    assert (out / "gpu_check.log").read_text() == r.stdout
    env_txt = (out / "env.txt").read_text()
    assert "python 3." in env_txt and "torch 2." in env_txt and "torchrun's flags: " in env_txt
    assert "torchrun has no --shutdown-timeout" in env_txt and "the stand-in runs" in env_txt
    with tarfile.open(out / "logs.tar.gz") as tar:
        kept = tar.getnames()
    for name in ("reference/ours-0.log", "reference/ours-1.log", "reference/ours-2.log", "reference/reference-0.log",
                 "reference/reference-1.log", "reference/reference-2.log", "reference/reference-cwd/log/log.txt",
                 "gpt2-shaped/train-gpt2-shaped.log", "gpt2-shaped/train-gpt2-shaped/metrics.jsonl",
                 "micro/resume2.log", "micro/oom/memory/oom-step2-rank0/record.json"):
        assert name in kept, kept
    assert not any("checkpoints" in n or n.endswith((".pt", ".bin", ".npy")) for n in kept)
    # --ours-env (a knob tried against the reference, lease 4) reaches our side of the row and only ours
    assert rows["ours_env"] == {"TORCH_CPP_LOG_LEVEL": "INFO"} and "ours with TORCH_CPP_LOG_LEVEL=INFO" in table
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {n: tar.extractfile(n).read().decode() for n in ("reference/ours-0.log", "reference/reference-0.log")}
    assert "[c10d]" in logs["reference/ours-0.log"] and "[c10d]" not in logs["reference/reference-0.log"]


def test_the_family_row_trains_350m_and_1558m_depths_with_the_probe_and_checkpointing(tmp_path):
    """The lease's family call (--rows family): gpt2-350m and gpt2-1558m through the trainer with
    micro_batch=auto, 1558m with selective activation checkpointing, each run until its span of steps is
    measured; on CPU at width 64 and small steps (the path only)."""
    out = tmp_path / "rows.json"
    r = gpu_check("--device", "cpu", "--rows", "family", "--family", "gpt2-350m:none,gpt2-1558m:selective", "--out",
                  str(out), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "info", row
    # each measured over FAMILY_SECONDS["cpu"] (2 s) of steps after the warm-up, at least 3 steps (issue 68)
    for size in ("gpt2-350m \\(none\\)", "gpt2-1558m \\(selective\\)"):
        m = re.search(size + r": micro_batch 4 of 4 x 2 micro-steps \(512-token steps\), [\d,]+ tok/s "
                      r"\([\d,]+-[\d,]+\) over (\d+) steps, (\d+) s", row["detail"])
        assert m and int(m[1]) >= 3 and int(m[2]) >= 2, row["detail"]
    assert "steps after the first 3" in row["detail"]


# nvidia-smi as the sustained row runs it (--query-gpu ... --format=csv,noheader,nounits --loop-ms=N): one line of
# the asked fields every 0.2 s in its own format (local time), until it is stopped
NVIDIA_SMI = """#!/usr/bin/env bash
case "$*" in *"--query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu"*) ;;
    *) echo "unexpected arguments: $*"; exit 2 ;; esac
while true; do echo "$(date +'%Y/%m/%d %H:%M:%S.%3N'), 1980, 1980, 650.12, 61, 99"; sleep 0.2; done
"""


def test_the_sustained_call_trains_minutes_with_every_evaluation_and_reads_nvml(tmp_path):
    """The lease plan's sustained call on CPU (CALL=sustained, a few seconds of steps here): the whole job at
    the row's cadence, with the carried HellaSwag file installed where the pipeline caches it and scored, the
    first and last stretch of steps compared, the time outside steps measured in the run, NVML's samples read
    over the measured span (nvidia-smi stands in here, printing its own format)."""
    carried, bin_dir = tmp_path / "wheels", tmp_path / "bin"
    carried.mkdir()
    bin_dir.mkdir()
    (carried / "hellaswag_val.jsonl").write_text((ROOT / "tests" / "fixtures" / "hellaswag_mini.jsonl").read_text())
    (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**bare_image(tmp_path), "OUT": str(tmp_path / "out"), "WHEELS": str(carried), "CALL": "sustained",
           "GPTPIPE_HOME": str(tmp_path / "home"), "PYTHON": sys.executable,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    # --rows after the call's: the sustained row alone (the out-of-memory row runs in the default dry run above)
    r = subprocess.run(["bash", "benchmarks/gpu_lease.sh", "--device", "cpu", "--rows", "sustained"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "HellaSwag: " in r.stderr and "(7 examples) carried" in r.stderr
    rows = json.loads((tmp_path / "out" / "gpu_check" / "rows.json").read_text())["rows"]
    assert [(x["name"], x["status"]) for x in rows] == [("sustained", "info")], rows
    detail = rows[0]["detail"]
    assert "7 real examples each" in detail and int(re.search(r"over (\d+) saves", detail)[1]) >= 1, detail
    first, last = (float(x.replace(",", "")) for x in re.findall(r"(?:first|last) \d+ s ([\d,]+)", detail))
    assert first > 0 and last > 0
    steps = float(re.search(r"([\d.]+) s of steps", detail)[1])
    assert steps >= 6, detail  # SUSTAINED_SECONDS on CPU
    assert re.search(r"NVML \((\d+) samples\): first minute SM 1980 MHz, 650 W, 61 C max, util 99%", detail), detail
    assert "lowest SM clock 1980 of 1980 MHz" in detail
    assert "call sustained" in (tmp_path / "out" / "gpu_check" / "env.txt").read_text()
    bad = subprocess.run(["bash", "benchmarks/gpu_lease.sh"], cwd=ROOT, env={**env, "CALL": "nope"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "CALL=nope is not a call of the plan" in bad.stderr


def test_nvidia_smi_lines_it_cannot_read_are_nan_or_left_out():
    from benchmarks.gpu_sustained import nvml_text, parse_nvidia_smi

    text = ("2026/11/29 12:00:00.000, 1980, 1980, 690.5, 60, 100\n"
            "2026/11/29 12:00:01.000, 1755, 1980, [N/A], 71, 98\n"
            "2026/11/29 12:00:02.0")  # torn: the sampler was stopped mid-line
    samples = parse_nvidia_smi(text)
    assert [(s.sm_mhz, s.celsius) for s in samples] == [(1980.0, 60.0), (1755.0, 71.0)]
    assert samples[1].t - samples[0].t == 1.0 and math.isnan(samples[1].watts)
    text = nvml_text(samples, (samples[0].t, samples[1].t), 0.5, None)
    assert "first minute SM 1980 MHz, 690 W, 60 C max" in text and "last minute SM 1755 MHz, nan W, 71 C max" in text
    assert "lowest SM clock 1755 of 1980 MHz" in text
    assert nvml_text(samples, (0.0, 1.0), 0.5, None) == "no NVML samples inside the measured span"


def test_the_reference_peak_memory_is_read_per_step():
    from benchmarks.reference_run import parse_peak_memory

    out = "step    3 | loss: 1.0 | ...\nreference peak memory per step: 0:20.500,3:18.250,11:21.000\n"
    assert parse_peak_memory(out) == {0: 20.5, 3: 18.25, 11: 21.0}
    assert parse_peak_memory("step    3 | loss: 1.0 |") == {}  # off CUDA: no line


def test_rows_that_cannot_run_here_say_why_instead_of_vanishing(tmp_path):
    """Every row asked for appears: fp8 on a machine without float8 (the trainer's own refusal) and ranks
    on fewer than 2 GPUs are "not run" with their reason (a one-GPU lease dropped `--rows ranks` silently);
    a typo in --fp8 is refused at the edge."""
    out = tmp_path / "rows.json"
    r = gpu_check("--device", "cpu", "--rows", "fp8", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    [row] = json.loads(out.read_text())["rows"]
    assert (row["name"], row["status"]) == ("fp8", "not run")
    assert "train.fp8=tensorwise needs a CUDA GPU with float8 tensor cores" in row["detail"]
    typo = gpu_check("--device", "cpu", "--rows", "fp8", "--fp8", "gpt2-155m:none", timeout=120)
    assert typo.returncode == 2 and "--fp8: gpt2-155m:none is not a preset:checkpointing pair" in typo.stderr


def test_rows_past_the_budget_are_reported_not_run(tmp_path):
    """Past the budget a row that would use the device is not run, but one that reads what an earlier row
    paid for still is (lease 6 lost its 0 s 'outside steps' row to the budget); a row missing what it
    needs says so instead of failing (lease 6's guards alone: a RuntimeError and a FAIL)."""
    out = tmp_path / "rows.json"
    r = gpu_check("--device", "cpu", "--rows", "micro-batch,harness,guards", "--budget-s", "0", "--out", str(out),
                  timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["name"], x["status"]) for x in rows] == [
        ("harness parity", "not run"), ("guards gpt2-shaped", "not run"), ("micro-batch auto", "not run")]
    assert "budget of 0 s was spent" in rows[0]["detail"]
    assert rows[1]["detail"] == "needs tokens/s from the train gpt2-shaped, reference or speed row"
    from benchmarks.gpu_check import Table

    table = Table(None, {}, budget_s=0, fail_row=None)
    table.t0 -= 1  # the budget is spent
    table.run("launches a trainer", lambda: (True, "ran"))
    table.run("outside steps", lambda: (True, "read"), costs_device_time=False)
    assert [(x.name, x.status) for x in table.rows] == [("launches a trainer", "not run"), ("outside steps", "PASS")]
    bad = gpu_check("--device", "cpu", "--rows", "nope", timeout=120)
    assert bad.returncode == 2 and "--rows: unknown nope" in bad.stderr
    typo = gpu_check("--device", "cpu", "--rows", "family", "--family", "gpt2-774:none", timeout=120)
    assert typo.returncode == 2 and "--family: gpt2-774:none is not a preset:checkpointing pair" in typo.stderr


def test_a_run_past_the_deadline_is_killed_and_its_row_fails_without_ending_the_table(tmp_path):
    """A lease call must end inside its limit: a trainer still running at --deadline-s is killed with its
    workers (no process of it left), its row FAILs naming the deadline, the rows that need it are reported,
    and the table and its logs are still written."""
    import psutil

    out, logs = tmp_path / "rows.json", tmp_path / "logs.tar.gz"
    before = {p.pid for p in psutil.process_iter()}
    work = tmp_path / "work"  # in every trainer's command line (its run_dir): this call's, not the other worker's
    work.mkdir()
    r = gpu_check("--device", "cpu", "--rows", "resume", "--deadline-s", "4", "--out", str(out), "--logs", str(logs),
                  "--work", str(work), timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {x["name"]: x for x in json.loads(out.read_text())["rows"]}
    assert rows["train micro"]["status"] == "FAIL" and rows["train micro"]["seconds"] < 30
    assert "TimeoutError: killed after" in rows["train micro"]["detail"]
    assert "--deadline-s" in rows["train micro"]["detail"]
    assert rows["resume after SIGKILL"]["status"] == "not run"
    with tarfile.open(logs) as tar:
        assert "micro/train-micro.log" in tar.getnames()
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
            and str(work) in " ".join(p.info["cmdline"] or [])]
    assert not left, left


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_checks_nothing():
    r = gpu_check(timeout=120)
    assert r.returncode == 0 and "no CUDA device is visible" in r.stdout and "PASS" not in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_acceptance_run():
    r = gpu_check(timeout=3600)
    assert r.returncode == 0, r.stdout[-5000:]


def test_the_reference_runs_to_its_last_step_and_saves_its_checkpoint(tmp_path):
    """build-nanogpt saves a checkpoint holding a dataclass defined in its own file on its last step; run
    from a plain dict its pickling failed (`attribute lookup GPTConfig on __main__ failed`, exit 1, issue 51).
    The stand-in does the same, so the harness runs it to its end: exit 0, every step parsed, validation on
    the first and last step, log/log.txt, and a checkpoint whose config loads back as the file's class."""
    from benchmarks.gpu_check import make_dataset, reference_data
    from benchmarks.reference_run import parse_steps

    cwd = reference_data(make_dataset(tmp_path / "data"), tmp_path / "cwd")
    r = subprocess.run([sys.executable, "-m", "benchmarks.reference_run", "benchmarks/reference_standin.py",
                        "--workdir", str(cwd), "--set", "max_steps=4", "--set", "B=2", "--set", "T=32",
                        "--set", "total_batch_size=128", "--set", "n_embd=32"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(parse_steps(r.stdout)) == [0, 1, 2, 3] and r.stdout.count("validation loss:") == 2
    assert (cwd / "log" / "log.txt").read_text().splitlines()[-1].startswith("3 train ")
    loaded = subprocess.run([sys.executable, "-c", "import torch, sys; from dataclasses import dataclass\n"
                             "@dataclass\nclass RunConfig:\n n_layer: int\n n_head: int\n n_embd: int\n"
                             "c = torch.load(sys.argv[1], weights_only=False)['config']; print(c.n_embd)",
                             str(cwd / "log" / "model_00003.pt")], capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "32", loaded.stderr[-2000:]


def test_the_synthetic_hellaswag_costs_per_example_what_the_whole_set_does(tmp_path):
    """The outside-steps row times HellaSwag per example and projects it to 10,042 examples; on a device
    without the real file it scores the synthetic set. Counted in padded tokens through the scorer's own
    bucketing at CUDA's batch (the forwards a GPU runs), 1,000 synthetic examples cost within 10% of
    10,042 per example, while the 7-example fixture that leases 1-3 timed cost over twice as much (one
    8,192-token forward for 7 examples): its projection overstated HellaSwag's share."""
    import math

    from benchmarks.gpu_check import FIXTURE, SYNTHETIC_EXAMPLES, synthetic_hellaswag
    from gptcore.evals.scorers.hellaswag import bucket_lengths, example_rows, make_example, read_records

    def padded_per_example(path: Path) -> float:
        records, buckets, per_bucket = read_records(path), bucket_lengths(1024), {}
        for r in records:
            longest = max(len(t) for t, _ in example_rows(make_example(*r), 1024))
            b = next(x for x in buckets if x >= longest)
            per_bucket[b] = per_bucket.get(b, 0) + 1
        tokens = 0
        for length, n in per_bucket.items():
            per_batch = max(1, 8192 // (4 * length))  # the scorer's examples per forward on CUDA
            tokens += math.ceil(n / per_batch) * 4 * per_batch * length
        return tokens / len(records)

    lease = synthetic_hellaswag(tmp_path / "lease.jsonl", SYNTHETIC_EXAMPLES["cuda"])
    whole = synthetic_hellaswag(tmp_path / "whole.jsonl", 10_042)
    assert len(read_records(lease)) == 1000 and len(read_records(whole)) == 10_042
    lengths = [len(t) for r in read_records(lease) for t, _ in example_rows(make_example(*r), 1024)]
    assert min(lengths) < 40 and max(lengths) > 150  # HellaSwag's range of row lengths, ~30-160 tokens
    assert padded_per_example(lease) <= 1.10 * padded_per_example(whole)
    assert padded_per_example(FIXTURE) > 2 * padded_per_example(whole)
    before = lease.read_bytes()
    assert synthetic_hellaswag(lease, 5) == lease and lease.read_bytes() == before  # written once


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine would train the sizes for real")
def test_a_size_of_the_fp8_row_that_fails_keeps_the_other_sizes_and_fails_the_row(tmp_path):
    """A size that cannot train (here: this machine has no CUDA, so each run exits 2 at start-up, as a size cut
    by the deadline raises) is that size's text and a FAIL; the row does not raise, so the sizes measured before
    it (on a lease: 1558m, then 774m) keep their figures in the table."""
    from benchmarks.gpu_check import check_fp8, make_dataset

    ok, detail = check_fp8(tmp_path / "fp8", make_dataset(tmp_path / "data"), torch.device("cpu"),
                           [("gpt2-1558m", "selective"), ("gpt2-124m", "none")], 1)
    assert ok is False, detail
    # torchrun exits 1 when a worker fails; the worker refused the device with exit 2, in each size's log
    assert "gpt2-1558m: RuntimeError: fp8=off: exit 1" in detail and "gpt2-124m: RuntimeError: fp8=off: exit 1" \
        in detail, detail
    log = (tmp_path / "fp8" / "fp8-gpt2-124m-off-0.log").read_text()
    assert "train.device=cuda but no CUDA device is visible" in log and "exitcode  : 2" in log, log[-2000:]


def test_the_sustained_cadence_is_the_presets_over_8_gpus_and_the_trainer_accepts_it():
    """On CUDA the row's evaluations come at gpt2-124m's cadence in wall time on 8 GPUs: every interval and each
    evaluation's work divided by 8 (module docstring of benchmarks/gpu_sustained.py); the keys are the trainer's."""
    from benchmarks.gpu_sustained import sustained_settings
    from gptcore.overrides import load_config

    every = sustained_settings("cuda", 0)
    assert every == {"eval.eval_interval": 31, "eval.sample_interval": 31, "eval.hellaswag.interval": 125,
                     "train.checkpoint_interval": 125, "eval.val_tokens": 1_310_720}
    cfg = load_config("gpt2-124m", every)
    assert cfg.eval.val_tokens % (64 * 1024) == 0  # whole 64 x 1024 batches: 20 of them


def test_a_family_size_cut_by_the_deadline_is_its_own_text_and_the_row_goes_on(tmp_path, monkeypatch):
    """A size the call's deadline cuts (here the deadline has passed before the first) is that size's text;
    the row does not raise, so on a lease the sizes measured before it keep their figures."""
    import benchmarks.gpu_check as gc

    monkeypatch.setattr(gc, "DEADLINE", [time.monotonic()])
    ok, detail = gc.check_family(tmp_path / "family", gc.make_dataset(tmp_path / "data"), torch.device("cpu"),
                                 [("gpt2-350m", "none"), ("gpt2-1558m", "selective")], 2.0)
    assert "gpt2-350m: TimeoutError: killed before 2 s of steps" in detail, detail
    assert "gpt2-1558m: TimeoutError: killed before 2 s of steps" in detail, detail
