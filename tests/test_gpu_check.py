"""The GPU acceptance run (benchmarks/gpu_check.py) runs end to end on CPU here, so only the CUDA kernels
go unexercised; on a CUDA machine the `gpu` tests run the real thing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


# what a bare CUDA PyTorch image lacks (it has torch, numpy, tiktoken, safetensors and pyarrow)
NOT_ON_A_BARE_IMAGE = ("prefect", "mlflow", "datasets", "pandas")


def gpu_check(*args, timeout=1800, env=None):
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def without_the_pipeline_packages(tmp_path: Path) -> dict:
    """An environment in which prefect, mlflow, datasets and pandas cannot be imported: a package of each
    name, first on PYTHONPATH, that raises ImportError (as a missing one would), for this process and the
    torchrun ranks it starts."""
    stubs = tmp_path / "stubs"
    for name in NOT_ON_A_BARE_IMAGE:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} is not on a bare CUDA image')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(ROOT)])}


def test_every_row_runs_on_cpu_without_prefect_or_mlflow_and_a_failing_row_leaves_the_table(tmp_path):
    """The whole default table on CPU, on a bare-image environment, with one row made to raise: that row is
    a FAIL naming the error, every other row still runs and passes (or informs), each is printed as it
    completes, and --out holds them all."""
    env = without_the_pipeline_packages(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import prefect"], env=env, capture_output=True, text=True)
    assert probe.returncode == 1 and "not on a bare CUDA image" in probe.stderr  # the stubs work
    (tmp_path / "work").mkdir()
    out = tmp_path / "rows.json"
    r = gpu_check("--device", "cpu", "--work", str(tmp_path / "work"), "--out", str(out),
                  "--fail-row", "harness parity", env=env)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout.split("gpu_check on", 1)[1]
    for row in ("info    micro-batch auto", "PASS    train gpt2-shaped", "info    outside steps gpt2-shaped",
                "PASS    train micro", "info    reference", "FAIL    harness parity", "info    guards gpt2-shaped",
                "PASS    resume after SIGKILL", "PASS    2 ranks == 1 rank"):
        assert row in table, table
    assert "RuntimeError: injected failure (--fail-row)" in table
    assert "killed mid-run: True" in table and "auto dtype float32)" in table
    assert "consistency check" in table and "micro: micro_batch 8 of at most 8" in table and "loss=plain" in table
    assert "over 2 alternated rounds" in table and "reference: our stand-in" in table
    rows = json.loads(out.read_text())
    assert [x["status"] for x in rows["rows"]].count("FAIL") == 1 and rows["passed"] is False
    assert len(rows["rows"]) == 9 and rows["device"] == "2 x CPU"
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"passed": False}


def test_rows_past_the_budget_are_reported_not_run(tmp_path):
    out = tmp_path / "rows.json"
    r = gpu_check("--device", "cpu", "--rows", "micro-batch,harness", "--budget-s", "0", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["name"], x["status"]) for x in rows] == [("micro-batch auto", "not run"), ("harness parity", "not run")]
    assert "budget of 0 s was spent" in rows[0]["detail"]
    bad = gpu_check("--device", "cpu", "--rows", "nope", timeout=120)
    assert bad.returncode == 2 and "--rows: unknown nope" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_checks_nothing():
    r = gpu_check(timeout=120)
    assert r.returncode == 0 and "no CUDA device is visible" in r.stdout and "PASS" not in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_acceptance_run():
    r = gpu_check(timeout=3600)
    assert r.returncode == 0, r.stdout[-5000:]
