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


def test_every_check_runs_and_passes_on_cpu_without_prefect_or_mlflow(tmp_path):
    env = without_the_pipeline_packages(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import prefect"], env=env, capture_output=True, text=True)
    assert probe.returncode == 1 and "not on a bare CUDA image" in probe.stderr  # the stubs work
    (tmp_path / "work").mkdir()
    r = gpu_check("--device", "cpu", "--speed-steps", "5", "--work", str(tmp_path / "work"), env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout.split("gpu_check on", 1)[1]
    for row in ("PASS  train micro", "PASS  resume after SIGKILL", "PASS  2 ranks == 1 rank",
                "PASS  train gpt2-shaped", "info  speed gpt2-shaped", "info  guards gpt2-shaped",
                "info  micro-batch auto"):
        assert row in table, table
    assert "killed mid-run: True" in table and "auto dtype float32)" in table
    assert "consistency check" in table and "micro: micro_batch 8 of at most 8" in table
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"passed": True}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_checks_nothing():
    r = gpu_check(timeout=120)
    assert r.returncode == 0 and "no CUDA device is visible" in r.stdout and "PASS" not in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_acceptance_run():
    r = gpu_check(timeout=3600)
    assert r.returncode == 0, r.stdout[-5000:]
