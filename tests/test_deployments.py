"""Deployments as a team runs them: recipes live in presets (a deployment carries only what varies per
deployment), so the documented CLI continues the demo's run; and the flow's code follows the deployment
(the pull step), so a worker whose working directory is elsewhere runs it from its own checkout."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from gptcore.overrides import load_config
from tests.prefect_stack import (
    flow_logs,
    pause_schedules,
    run_deployment_and_wait,
    schedule_copy,
    server_log_errors,
    wait_final,
    wait_scheduled_run,
)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deployments"
PER_DEPLOYMENT = {"train.max_minutes"}  # the only overrides a deployment may carry: its time budget
sys.path.insert(0, str(DEPLOY))
import job_templates  # noqa: E402  (deployments/job_templates.py: what `prefect work-pool create` is given)


@pytest.mark.parametrize("file", ["prefect.yaml", "prefect-docker.yaml", "prefect-k8s.yaml"])
def test_deployments_carry_only_what_varies(file):
    doc = yaml.safe_load((DEPLOY / file).read_text())
    for d in doc["deployments"]:
        p = d["parameters"]
        assert set(p.get("overrides") or {}) <= PER_DEPLOYMENT, (d["name"], p.get("overrides"))
        cfg = load_config(p["preset"], p.get("overrides"))
        preset = load_config(p["preset"])
        # the deployment trains the preset's run: `python -m gptcore.training.train <preset>` continues it
        assert (cfg.run_name, cfg.identity_hash()) == (preset.run_name, preset.identity_hash()), d["name"]


def test_the_demo_deployment_is_the_preset_as_is():
    """After `make demo`, docs/training.md's `python -m gptcore.training.train tiny-cpu` finds the demo's run (same
    name, same identity), instead of refusing it as another configuration."""
    tiny = next(d for d in yaml.safe_load((DEPLOY / "prefect.yaml").read_text())["deployments"]
                if d["name"] == "tiny")
    assert tiny["parameters"]["preset"] == "tiny-cpu" and not tiny["parameters"].get("overrides")
    assert "python -m gptcore.training.train tiny-cpu" in (ROOT / "docs" / "training.md").read_text()


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


def test_the_server_schedules_a_due_run_and_the_worker_runs_it(prefect_stack):
    """What a nightly schedule does, minus the wait for 22:00: a copy of pretrain/tiny whose schedule is due in
    seconds. The server's own scheduler service creates the flow run (auto-scheduled: no client asked for it)
    and the stack's worker runs it to completion. On SQLAlchemy 2.1 with prefect 3.8.8 the scheduler failed
    every minute and no run was ever created (#69)."""
    from prefect.client.orchestration import get_client

    params = {"preset": "micro", "register": False, "evaluate": False, "tracking": False,
              "overrides": {"train.max_steps": 2, "train.run_name": "scheduled", "train.checkpoint_interval": 2,
                            "eval.eval_interval": 0, "eval.sample_interval": 0}}
    dep = schedule_copy("pretrain/tiny", f"tiny-scheduled-{uuid.uuid4().hex[:6]}", params, due_in=8.0)
    try:
        scheduled = wait_scheduled_run(dep, timeout=90)
        fr = wait_final(scheduled.id, timeout=300)
    finally:
        pause_schedules(dep)
    assert fr.state.is_completed(), (fr.state.message, server_log_errors(prefect_stack)[:5])
    assert scheduled.auto_scheduled  # the scheduler service made it
    with get_client(sync_client=True) as c:
        assert [s.name for s in sorted(c.read_flow_run_states(fr.id), key=lambda s: s.timestamp)][0] == "Scheduled"
    assert fr.parameters["overrides"]["train.run_name"] == "scheduled"
    # created ahead of its time by the scheduler (the worker may start it a moment early: its prefetch)
    assert scheduled.created < scheduled.expected_start_time


def test_the_stacks_mlflow_server_starts_no_job_runner(prefect_stack):
    """docker/start-mlflow.sh turns MLflow's GenAI job runner off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false):
    with it on, every server start added 7 huey consumer processes (~24 s of CPU, ~1.4 GiB of memory) that
    this pipeline never gives a job. The stack's MLflow server is the CLI and its uvicorn, nothing else."""
    import psutil

    from integrations.processes import tree_of

    tree = [" ".join(psutil.Process(pid).cmdline()) for pid in tree_of(prefect_stack.mlflow.state()["pid"])]
    assert not [c for c in tree if "huey" in c], tree
    assert any("mlflow server" in c for c in tree) and any("uvicorn" in c for c in tree), tree


# --- TLS on every path a flow run takes --------------------------------------------------------------

CA_VARS = ("PREFECT_API_SSL_CERT_FILE", "MLFLOW_TRACKING_SERVER_CERT_PATH")  # what compose's worker trusts by


def urls(obj) -> list[str]:
    """Every string in `obj` (nested dicts and lists) that is a URL (not prose that mentions one)."""
    if isinstance(obj, dict):
        return [u for v in obj.values() for u in urls(v)]
    if isinstance(obj, list):
        return [u for v in obj for u in urls(v)]
    return [obj] if isinstance(obj, str) and re.match(r"[a-z][a-z0-9+.-]*://", obj) else []


def assert_https_and_trusted(env: dict, ca_in_container: set[str], where: str) -> None:
    """Both servers' URLs set and https, and each library's CA setting names the mounted CA."""
    assert env["PREFECT_API_URL"].startswith("https://") and env["MLFLOW_TRACKING_URI"].startswith("https://"), \
        (where, env)
    assert {env[v] for v in CA_VARS} <= ca_in_container and len({env[v] for v in CA_VARS}) == 1, (where, env)
    assert not {"PREFECT_API_TLS_INSECURE_SKIP_VERIFY", "MLFLOW_TRACKING_INSECURE_TLS"} & set(env), where


def test_every_path_a_flow_run_takes_is_https_verified_by_the_stacks_ca(tmp_path, monkeypatch):
    """The docker pool (its base job template as the docker worker turns it into a container:
    prefect-docker's own job configuration, prepared for a flow run by a worker whose own PREFECT_API_URL is
    plain http), the Kubernetes pool (its template rendered with prefect-k8s.yaml's job variables by
    Prefect's templating) and the multi-node Job: every Prefect and MLflow URL is https, the CA is mounted
    read-only where PREFECT_API_SSL_CERT_FILE and MLFLOW_TRACKING_SERVER_CERT_PATH point (the variables
    compose's worker gets from TLS_CA_FILE), and nothing turns verification off. The docker pool mounts the
    CA from docker/.env's TLS_CA_FILE; a relative or missing one is refused with exit 2."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.templating import apply_values
    from prefect_docker.worker import DockerWorkerJobConfiguration

    # docker: the CA from the host path docker/.env names
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("TLS_CA_FILE", str(ca))
    t = job_templates.template("docker")
    assert [u for u in urls(t["variables"]) if not u.startswith("https://")] == []
    values = {k: v["default"] for k, v in t["variables"]["properties"].items() if "default" in v}
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):  # the worker's own, on the host
        cfg = asyncio.run(DockerWorkerJobConfiguration.from_template_and_values(t, values))
        cfg.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="fr-1"))
    assert f"{ca}:{job_templates.CA_IN_CONTAINER}:ro" in cfg.volumes
    assert_https_and_trusted(cfg.env, {job_templates.CA_IN_CONTAINER}, "docker pool")
    # a public CA (docker/.env: a certificate, no TLS_CA_FILE): the names it signs, the system CAs
    monkeypatch.delenv("TLS_CA_FILE")
    public = {"TLS_CERT_FILE": "/etc/gpt2/tls/server.pem", "STACK_PREFECT_API_URL": "https://gpu1.example.org:4200/api",
              "STACK_MLFLOW_TRACKING_URI": "https://gpu1.example.org:5000"}
    for k, v in public.items():
        monkeypatch.setenv(k, v)
    props = job_templates.template("docker")["variables"]["properties"]
    env = props["env"]["default"]
    assert (env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"]) == (public["STACK_PREFECT_API_URL"],
                                                                    public["STACK_MLFLOW_TRACKING_URI"])
    assert not set(CA_VARS) & set(env) and not [v for v in props["volumes"]["default"] if "/tls/" in v]
    for bad, message in ((("TLS_CA_FILE", "docker/ca.pem"), "TLS_CA_FILE=docker/ca.pem is not an existing file"),
                         (("TLS_CA_FILE", str(tmp_path / "no.pem")), f"TLS_CA_FILE={tmp_path / 'no.pem'} is not an"),
                         (("STACK_MLFLOW_TRACKING_URI", "http://gpu1.example.org:5000"), "is not https")):
        r = subprocess.run([sys.executable, str(DEPLOY / "job_templates.py"), "docker"], capture_output=True,
                           text=True, env={**os.environ, bad[0]: bad[1]}, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stderr

    # kubernetes: the pool's template with the deployment's job variables
    t = job_templates.template("kubernetes")
    jv = next(d for d in yaml.safe_load((DEPLOY / "prefect-k8s.yaml").read_text())["deployments"]
              if d["name"] == "gpt2-124m")["work_pool"]["job_variables"]
    defaults = {k: v["default"] for k, v in t["variables"]["properties"].items() if "default" in v}
    for env in (defaults["env"], jv["env"]):  # a deployment without `env` gets the template's
        job = apply_values(t["job_configuration"], {**defaults, **jv, "env": env, "name": "fr-1", "command": "x"})
        pod = job["job_manifest"]["spec"]["template"]["spec"]
        [c] = pod["containers"]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volume = next(v for v in pod["volumes"] if v["name"] == "ca")
        assert mounts["ca"]["readOnly"] is True and volume["configMap"]["name"] == "gpt2-ca"
        in_container = {f"{mounts['ca']['mountPath']}/{item['path']}" for item in volume["configMap"]["items"]}
        assert_https_and_trusted(c["env"], in_container, "kubernetes pool")
        assert [u for u in urls(job) if not u.startswith("https://")] == []

    # the multi-node Job: talks to neither server, so it holds no URL and no credential
    docs = list(yaml.safe_load_all((DEPLOY / "k8s-multinode.yaml").read_text()))
    assert urls(docs) == []
    [c] = docs[1]["spec"]["template"]["spec"]["containers"]
    assert "envFrom" not in c and not {e["name"] for e in c["env"]} & {
        "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    assert "http://" not in json.dumps(docs)
