"""`make demo` as a new user meets it: `python -m devstack.demo` with the `tiny` deployment exactly as
shipped (no overrides), then `--status`, a second run that reuses the servers and redoes nothing, a bad
`--param`, and `--stop`. One pipeline home of its own; the commands are the README's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def demo(home: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPTPIPE_HOME": str(home), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):  # the demo finds its own servers
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "devstack.demo", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def field(out: str, name: str) -> str:
    m = re.search(rf"^{name} +(.*)$", out, re.M)
    assert m, f"no '{name}' line in the demo's report:\n{out[-3000:]}"
    return m.group(1).strip()


def status(home: Path) -> dict[str, str]:
    r = demo(home, "--status", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(line.split() for line in r.stdout.splitlines() if line.strip())


def test_make_demo_runs_the_shipped_deployment_then_reuses_and_stops(tmp_path):
    home = tmp_path / "var"
    try:
        assert set(status(home).values()) == {"stopped"}
        t0 = time.monotonic()
        first = demo(home)
        wall = time.monotonic() - t0
        assert first.returncode == 0, (first.stdout[-3000:], first.stderr[-3000:])
        out = first.stdout
        # the shipped recipe: tiny-cpu, 120 steps, evaluated, registered, sampled
        assert field(out, "run").startswith("tiny-cpu  (step 120, DONE)")
        # the trainer evaluated its last checkpoint (HellaSwag skipped offline counts as done): the stage finds it
        assert field(out, "stages") == "download ran, tokenize ran, train ran, evaluate skipped, register ran, " \
                                       "sample ran"
        assert field(out, "evaluations").startswith("hellaswag: ")  # each evaluation's own summary line
        val = float(field(out, "final val loss"))
        hours = field(out, "device-hours")  # the run's device-hours, its cost (no price set) and its ETA (done)
        assert re.fullmatch(r"\d+\.\d{4} \(no price set \(train.price_per_gpu_hour\); done\)", hours), hours
        assert float(hours.split()[0]) > 0
        assert val < 8.0, val  # an untrained model scores ~10.8; the tiny run ends near 6.3
        assert field(out, "MLflow model") == "models:/tiny-cpu/1"
        assert "Hello, I'm a language model," in out
        prefect_ui, mlflow_ui = field(out, "Prefect UI"), field(out, "MLflow UI")
        # the experiment's, the run's and the version's pages in model-training mode (MLflow's UI starts in
        # GenAI mode)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/#/experiments/\d+\?workflowType=machine_learning", mlflow_ui)
        assert re.fullmatch(re.escape(mlflow_ui.split("?")[0]) + r"/runs/\w+\?workflowType=machine_learning",
                            field(out, "MLflow run"))
        assert field(out, "MLflow version") == \
            mlflow_ui.split("/#/")[0] + "/#/models/tiny-cpu/versions/1?workflowType=machine_learning"
        # the flow run's artifacts, in Prefect's new UI (/v2), whose page keeps ?tab=Artifacts; the server
        # serves that UI there (a page of the old UI would not name /v2/ for its scripts)
        run_page = field(out, "Prefect run")
        assert re.fullmatch(re.escape(prefect_ui) + r"/v2/runs/flow-run/[0-9a-f-]{36}\?tab=Artifacts", run_page)
        with urlopen(Request(run_page, headers={"Accept": "text/html"}), timeout=30) as page:
            assert page.status == 200 and "/v2/assets/" in page.read().decode()
        # `took` is the flow run alone: the servers' start-up and the worker's pick-up are not in it
        took, startup = float(field(out, "took").split("s ")[0]), float(field(out, "start-up").split("s ")[0])
        assert 0 < took and 0 < startup and took + startup < wall, (took, startup, wall)
        assert set(status(home).values()) == {"running"}

        # again: the same servers (same addresses), every stage finds its artifacts, nothing changes
        run_dir = home / "runs" / "tiny-cpu"
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "train.lock"}
        second = demo(home)
        assert second.returncode == 0, (second.stdout[-3000:], second.stderr[-3000:])
        out2 = second.stdout
        assert "already deployed:" in out2
        assert (field(out2, "Prefect UI"), field(out2, "MLflow UI")) == (prefect_ui, mlflow_ui)
        assert field(out2, "stages") == "download skipped, tokenize skipped, train skipped, evaluate skipped, " \
                                        "register skipped, sample skipped"
        assert float(field(out2, "final val loss")) == val and field(out2, "MLflow model") == "models:/tiny-cpu/1"
        after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "train.lock"}
        assert after == before

        # --param reaches the flow: a bad one fails the flow run with the reason, exit 1
        bad = demo(home, "--param", "preset=nope", timeout=300)
        assert bad.returncode == 1 and "unknown preset 'nope'" in bad.stderr, (bad.stdout[-2000:], bad.stderr)
    finally:
        stop = demo(home, "--stop", timeout=120)
    assert stop.returncode == 0 and stop.stdout.startswith("stopped: "), stop
    assert "prefect-server" in stop.stdout and "mlflow-server" in stop.stdout
    assert set(status(home).values()) == {"stopped"}
