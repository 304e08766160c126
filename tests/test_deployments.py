"""Deployments as a team runs them: recipes live in presets (a deployment carries only what varies per
deployment), so the documented CLI continues the demo's run; and the flow's code follows the deployment
(the pull step), so a worker whose working directory is elsewhere runs it from its own checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gptcore.config import load_config
from tests.prefect_stack import flow_logs, run_deployment_and_wait

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deployments"
PER_DEPLOYMENT = {"train.max_minutes"}  # the only overrides a deployment may carry: its time budget


@pytest.mark.parametrize("file", ["prefect.yaml", "prefect-docker.yaml", "prefect-k8s.yaml"])
def test_deployments_carry_only_what_varies(file):
    doc = yaml.safe_load((DEPLOY / file).read_text())
    for d in doc["deployments"]:
        p = d["parameters"]
        assert set(p.get("overrides") or {}) <= PER_DEPLOYMENT, (d["name"], p.get("overrides"))
        cfg = load_config(p["preset"], p.get("overrides"))
        preset = load_config(p["preset"])
        # the deployment trains the preset's run: `python -m gptcore.train <preset>` continues it
        assert (cfg.run_name, cfg.identity_hash()) == (preset.run_name, preset.identity_hash()), d["name"]


def test_the_demo_deployment_is_the_preset_as_is():
    """After `make demo`, docs/training.md's `python -m gptcore.train tiny-cpu` finds the demo's run (same
    name, same identity), instead of refusing it as another configuration."""
    tiny = next(d for d in yaml.safe_load((DEPLOY / "prefect.yaml").read_text())["deployments"]
                if d["name"] == "tiny")
    assert tiny["parameters"]["preset"] == "tiny-cpu" and not tiny["parameters"].get("overrides")
    assert "python -m gptcore.train tiny-cpu" in (ROOT / "docs" / "training.md").read_text()


def test_a_worker_elsewhere_runs_the_code_named_by_the_pull_step(prefect_stack, tmp_path):
    """`prefect deploy` from one checkout; a process worker started in an empty directory, with
    GPTPIPE_CODE_DIR naming another checkout: the flow run's pull step moves into that checkout and the
    flow completes. (Without the pull step the worker would look for flows/pretrain.py in its own cwd.)"""
    deployed_from, checkout, elsewhere = tmp_path / "deployed-from", tmp_path / "checkout", tmp_path / "worker-cwd"
    for dest in (deployed_from, checkout):
        for part in ("flows", "tasks", "integrations", "gptcore", "deployments"):
            shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere.mkdir()
    pool = "elsewhere-pool"
    prefect_stack.ensure_pool(pool)
    env = prefect_stack.env()
    # deployments/prefect.yaml as it is (its pull step included), its `tiny` deployment under its own name
    doc = yaml.safe_load((DEPLOY / "prefect.yaml").read_text())
    tiny = next(d for d in doc["deployments"] if d["name"] == "tiny")
    doc["deployments"] = [dict(tiny, name="tiny-elsewhere", work_pool=dict(tiny["work_pool"], name=pool))]
    doc.pop("definitions")
    (deployed_from / "deployments" / "elsewhere.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    assert doc["pull"] == [{"prefect.deployments.steps.set_working_directory":
                            {"directory": "{{ $GPTPIPE_CODE_DIR }}"}}]
    r = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file",
                        "deployments/elsewhere.yaml", "--all"],
                       cwd=deployed_from, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    shutil.rmtree(deployed_from)  # nothing may depend on the directory `prefect deploy` ran in
    worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type",
                               "process"], cwd=elsewhere, env=dict(env, GPTPIPE_CODE_DIR=str(checkout),
                                                                  PREFECT_WORKER_QUERY_SECONDS="2",
                                                                  OMP_NUM_THREADS="1"),
                              stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        params = {"preset": "micro", "register": False, "evaluate": False, "tracking": False,
                  "overrides": {"train.max_steps": 2, "train.run_name": "elsewhere",
                                "train.checkpoint_interval": 2, "eval.eval_interval": 0,
                                "eval.sample_interval": 0}}
        fr = run_deployment_and_wait(params, "pretrain/tiny-elsewhere", timeout=300)
        logs = "\n".join(flow_logs(fr.id))
        assert fr.state.is_completed(), (fr.state.message, logs[-3000:],
                                         (tmp_path / "worker.log").read_text()[-3000:])
        assert "set_working_directory" in logs or "set_working_directory" in (tmp_path / "worker.log").read_text()
    finally:
        os.killpg(worker.pid, 15)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, 9)
        time.sleep(0.5)


def test_the_nightly_schedules_as_the_server_holds_them(prefect_stack):
    """After `prefect deploy`, what the server will actually do at night: gpt2-124m has an active 22:00 UTC
    cron, the muon variant's is off (they share gpu-pool), and each runs one flow run at a time with late
    runs queued (ENQUEUE), not cancelled. The yaml's anchors can drift from this silently; the server cannot."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        deps = {name: c.read_deployment_by_name(f"pretrain/{name}") for name in ("gpt2-124m", "gpt2-124m-muon")}
    for name, active in (("gpt2-124m", True), ("gpt2-124m-muon", False)):
        d = deps[name]
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in d.schedules] == \
            [("0 22 * * *", "UTC", active)], (name, d.schedules)
        assert d.global_concurrency_limit is not None and d.global_concurrency_limit.limit == 1, name
        assert d.concurrency_options is not None and d.concurrency_options.collision_strategy == "ENQUEUE", name
        assert d.work_pool_name == "gpu-pool", name
