"""The local services the demo and the tests run against: a Prefect server (SQLite), a process work
pool + worker, and an MLflow server, all on 127.0.0.1.

    stack = Stack(pipeline_home())
    stack.up()          # start what is not running (reuses healthy servers from an earlier call)
    stack.env()         # PREFECT_API_URL, MLFLOW_TRACKING_URI, ... for clients and CLI calls
    stack.down()        # stop everything this stack started

State lives under `<home>/services/`: one `<name>.json` per process (pid, process start time, port) and
one `<name>.log`. Each service runs in its own process group, so stopping it ends its children too; a pid
is only signalled when its recorded start time still matches (a recycled pid is never killed).
"""

from __future__ import annotations

# lazy imports: prefect and mlflow clients only where the stack is set up or checked
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from devstack.tls import Certificates, make_certificates
from gptcore.files import read_json, write_json
from integrations.mlflow_store import basic_auth
from integrations.processes import start_time, stop_tree, tree_of

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "docker"  # start-prefect-server.sh, start-mlflow.sh: the servers as compose starts them
CPU_POOL = "cpu-pool"
GPU_POOL = "gpu-pool"  # the nightly gpt2-124m deployment's pool; its worker runs on a GPU machine


LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"
# what docker/start-*.sh read (besides Prefect's own settings): only the Stack sets them for its servers
SCRIPT_SETTINGS = ("TLS_CERT_FILE", "TLS_KEY_FILE", "MLFLOW_ADMIN_PASSWORD", "MLFLOW_AUTH_DIR", "MLFLOW_AUTH_CONFIG",
                   "MLFLOW_ARTIFACTS_DIR", "MLFLOW_BACKEND_STORE_URI", "POSTGRES_USER", "POSTGRES_PASSWORD",
                   "POSTGRES_HOST", "POSTGRES_PORT", "PREFECT_AUTH_STRING", "MLFLOW_FLASK_SERVER_SECRET_KEY")


class ServiceError(RuntimeError):
    """A service did not start; the message ends with its log."""


def free_port(preferred: int = 0) -> int:
    """`preferred` if nothing listens there, else (or with 0) any free port."""
    with socket.socket() as s:
        # as the servers do: a port left in TIME_WAIT by a server we just stopped is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 2.0, auth: str | None = None, ca_file: Path | None = None) -> bool:
    """GET url answers 200 (`auth`: "user:password", sent as HTTP basic auth; https verified by `ca_file`,
    else by the system CAs)."""
    req = urllib.request.Request(url)
    if auth:  # never forwarded if the server redirects elsewhere
        req.add_unredirected_header("Authorization", basic_auth(auth))
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ssl.create_default_context(cafile=ca_file)) as r:
            return r.status == 200
    except OSError:
        return False


class Service:
    """One background process with a state file and a log under `state_dir`."""

    def __init__(self, name: str, state_dir: Path):
        self.name = name
        self.state_dir = Path(state_dir)
        self.state_path = self.state_dir / f"{name}.json"
        self.log_path = self.state_dir / f"{name}.log"
        self.proc = None  # our child, polled so that it is reaped once it exits

    def state(self) -> dict | None:
        return read_json(self.state_path)

    def alive(self) -> bool:
        # an exited child is a zombie until reaped, and start_time() counts a zombie as gone
        self._reap()
        st = self.state()
        return bool(st) and start_time(st["pid"]) == st["start_time"]

    def spawn(self, cmd: list[str], env: dict, **extra) -> dict:
        """Start `cmd`; its state file records pid, start time, cmd and `extra`."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            # own session: stopping the service signals its whole group (uvicorn workers, flow runs)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=REPO, start_new_session=True)
        st = {"pid": self.proc.pid, "start_time": start_time(self.proc.pid), "cmd": cmd, **extra}
        write_json(self.state_path, st)
        return st

    def stop(self, grace: float = 15.0) -> bool:
        """SIGTERM the process group and the processes below the leader, SIGKILL after `grace` s. True
        if something was stopped."""
        stopped = self.alive()
        if stopped:
            pid = self.state()["pid"]
            stop_tree(pid, tree_of(pid), grace, poll=self._reap)
        self._reap()
        self.state_path.unlink(missing_ok=True)
        return stopped

    def error(self, what: str) -> ServiceError:
        try:
            tail = self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            tail = ""
        return ServiceError(f"{self.name} {what}; its log {self.log_path} ends with:\n{tail}")

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.poll()


@contextlib.contextmanager
def mlflow_trusting(certificates: Certificates | None):
    """MLflow's clients in this process verify the stack's servers by its CA, for the calls inside."""
    old = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    if certificates:
        os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"] = str(certificates.ca)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_SERVER_CERT_PATH", None)
        else:
            os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"] = old


@dataclass
class Auth:
    """Credentials for a stack other machines can reach: Prefect's basic auth ("user:password", the server's
    PREFECT_SERVER_API_AUTH_STRING and every client's PREFECT_API_AUTH_STRING) and MLflow's basic-auth app
    (an admin, and the user the worker and its flow runs log as)."""
    prefect: str
    mlflow_admin_password: str
    mlflow_worker_password: str
    mlflow_admin: str = "admin"
    mlflow_worker: str = "worker"

    def __post_init__(self):
        if ":" not in self.prefect.strip(":"):
            raise ValueError("the Prefect auth string must be user:password")
        if min(len(self.mlflow_admin_password), len(self.mlflow_worker_password)) < 12:
            raise ValueError("MLflow passwords must have at least 12 characters (its basic-auth app refuses "
                             "shorter ones); generate them with `openssl rand -hex 16`")


@dataclass
class Stack:
    """Prefect server + process pool worker + MLflow server for one pipeline home."""
    home: Path
    prefect_port: int = 4200
    mlflow_port: int = 5000
    pool: str = CPU_POOL
    ui: bool = True  # serve the Prefect UI (the tests turn it off)
    extra_env: dict = field(default_factory=dict)  # for the worker (e.g. OMP_NUM_THREADS in tests)
    auth: Auth | None = None  # None: no authentication (the demo, on loopback)
    # the servers' databases, through their environment (never argv: it holds the password). Empty: SQLite
    # under the home. prefect_db_env: PREFECT_SERVER_DATABASE_* settings, as docker-compose.yml gives them;
    # mlflow_db_env: start-mlflow.sh's POSTGRES_USER, _PASSWORD, _HOST, _PORT (compose's PostgreSQL), or
    # MLFLOW_BACKEND_STORE_URI
    prefect_db_env: dict = field(default_factory=dict)
    mlflow_db_env: dict = field(default_factory=dict)
    # https on both servers with a certificate for 127.0.0.1 signed by a CA made for this home
    # (<home>/services/tls, devstack.tls); every client of the stack verifies it by that CA (env())
    tls: bool = False

    def __post_init__(self):
        self.home = Path(self.home).resolve()
        self.state_dir = self.home / "services"
        self.certificates = (make_certificates(self.state_dir / "tls", ["127.0.0.1", "localhost"])
                             if self.tls else None)
        self.prefect = Service("prefect-server", self.state_dir)
        self.mlflow = Service("mlflow-server", self.state_dir)
        self.worker = Service(f"worker-{self.pool}", self.state_dir)
        # a running server of this home keeps its port
        for svc, attr in ((self.prefect, "prefect_port"), (self.mlflow, "mlflow_port")):
            if svc.alive():
                setattr(self, attr, svc.state()["port"])

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def prefect_ui_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.prefect_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect_ui_url}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.mlflow_port}"

    def env(self) -> dict[str, str]:
        """Environment for anything that talks to this stack (clients, CLI, the worker's flow runs)."""
        return {
            **os.environ,
            "GPTPIPE_HOME": str(self.home),
            "PREFECT_HOME": str(self.home / "prefect"),
            "PREFECT_API_URL": self.prefect_api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "MLFLOW_TRACKING_URI": self.mlflow_uri,
            "PYTHONUNBUFFERED": "1",
            **({"PREFECT_API_AUTH_STRING": self.auth.prefect, "MLFLOW_TRACKING_USERNAME": self.auth.mlflow_worker,
                "MLFLOW_TRACKING_PASSWORD": self.auth.mlflow_worker_password} if self.auth else {}),
            # the CA bundle each library's client verifies the servers by (docs/security.md)
            **({"PREFECT_API_SSL_CERT_FILE": str(self.certificates.ca),
                "MLFLOW_TRACKING_SERVER_CERT_PATH": str(self.certificates.ca)} if self.certificates else {}),
        }

    def prefect_settings(self) -> dict:
        """Prefect settings for a client of this stack in this process (temporary_settings)."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL

        return {PREFECT_API_URL: self.prefect_api_url,
                **({PREFECT_API_AUTH_STRING: self.auth.prefect} if self.auth else {}),
                **({PREFECT_API_SSL_CERT_FILE: str(self.certificates.ca)} if self.certificates else {})}

    def _health_url(self, server: Service) -> str:
        return f"{self.prefect_api_url if server is self.prefect else self.mlflow_uri}/health"

    def _health_auth(self, server: Service) -> str | None:
        return self.auth.prefect if self.auth and server is self.prefect else None

    @property
    def _ca_file(self) -> Path | None:
        return self.certificates.ca if self.certificates else None

    def _healthy(self, server: Service) -> bool:
        return server.alive() and http_ok(self._health_url(server), auth=self._health_auth(server),
                                          ca_file=self._ca_file)

    def _wait(self, server: Service, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not http_ok(self._health_url(server), auth=self._health_auth(server), ca_file=self._ca_file):
            if not server.alive():
                raise server.error("exited during start-up")
            if time.monotonic() > end:
                server.stop()
                raise server.error(f"was not healthy after {timeout:.0f}s")
            time.sleep(0.3)

    def up(self, timeout: float = 180.0) -> Stack:
        # Both servers start through docker/start-*.sh, the scripts compose's services run, with this
        # home's folders and ports in their environment. Start both before waiting for either: each spends
        # most of its start-up importing.
        if not self._healthy(self.mlflow):
            self.mlflow.stop()
            self.mlflow_port = free_port(self.mlflow_port)
            root = self.home / "mlflow"
            root.mkdir(parents=True, exist_ok=True)
            env = dict(self._server_env(), OMP_NUM_THREADS="1", MLFLOW_HOST="127.0.0.1",
                       MLFLOW_PORT=str(self.mlflow_port), MLFLOW_WORKERS="1",
                       MLFLOW_ARTIFACTS_DIR=str(root / "artifacts"),
                       **(self.mlflow_db_env or {"MLFLOW_BACKEND_STORE_URI": f"sqlite:///{root / 'mlflow.db'}"}))
            if self.auth:  # MLflow's basic-auth app: users in <home>/mlflow/auth/, never under the artifacts
                self._move_old_auth_db(root)
                env.update(MLFLOW_ADMIN_PASSWORD=self.auth.mlflow_admin_password, MLFLOW_AUTH_DIR=str(root / "auth"),
                           MLFLOW_AUTH_CONFIG=str(self.state_dir / "mlflow-auth.ini"))
            self.mlflow.spawn(["sh", str(SCRIPTS / "start-mlflow.sh")], env, port=self.mlflow_port)
        if not self._healthy(self.prefect):
            self.prefect.stop()
            self.prefect_port = free_port(self.prefect_port)
            (self.home / "prefect").mkdir(parents=True, exist_ok=True)
            env = dict(self._server_env(), PREFECT_UI_ENABLED=str(self.ui).lower(),
                       PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(self.prefect_port),
                       PREFECT_UI_API_URL=f"{self.scheme}://127.0.0.1:{self.prefect_port}/api",
                       # an expired concurrency lease (its holder was killed) is reclaimed within seconds
                       PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="5",
                       # leases on disk (<PREFECT_HOME>/concurrency_leases), not in the server's memory: a
                       # server restarted after a crash still knows them, so they expire and free their
                       # slots (in memory they are lost and the slots stay taken for ever)
                       PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=LEASE_STORAGE,
                       **self.prefect_db_env)
            if self.auth:
                env["PREFECT_AUTH_STRING"] = self.auth.prefect
            self.prefect.spawn(["sh", str(SCRIPTS / "start-prefect-server.sh")], env, port=self.prefect_port)
        self._wait(self.mlflow, timeout)
        self._wait(self.prefect, timeout)
        if self.auth:
            from integrations.mlflow_store import ensure_user

            a = self.auth
            with mlflow_trusting(self.certificates):
                ensure_user(self.mlflow_uri, (a.mlflow_admin, a.mlflow_admin_password), a.mlflow_worker,
                            a.mlflow_worker_password)
        self.start_worker()
        return self

    def _server_env(self) -> dict[str, str]:
        """What both start scripts get: this interpreter, the certificate when serving https, and neither the
        servers' client URLs (a server is not its own client) nor any start-script setting from the caller's
        environment (a TLS_CERT_FILE or MLFLOW_ADMIN_PASSWORD in your shell must not turn the demo's
        servers into something its clients do not expect): the Stack sets those itself."""
        env = {k: v for k, v in self.env().items()
               if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", *SCRIPT_SETTINGS)}
        env["PYTHON"] = sys.executable
        if self.certificates:
            env.update(TLS_CERT_FILE=str(self.certificates.cert), TLS_KEY_FILE=str(self.certificates.key))
        return env

    @staticmethod
    def _move_old_auth_db(root: Path) -> None:
        """A home from before kept the user database in <root> itself: it moves to <root>/auth (where
        start-mlflow.sh keeps it), so users, changed passwords and grants carry over."""
        auth_dir = root / "auth"
        auth_dir.mkdir(mode=0o700, exist_ok=True)
        db, old = auth_dir / "basic_auth.db", root / "basic_auth.db"
        if old.is_file() and not db.exists():
            old.rename(db)

    def ensure_pool(self, name: str | None = None) -> None:
        """Create the process work pool `name` (default: this stack's) unless it exists."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.exceptions import ObjectAlreadyExists
        from prefect.settings import temporary_settings

        with temporary_settings(self.prefect_settings()), get_client(sync_client=True) as c:
            try:
                c.create_work_pool(WorkPoolCreate(name=name or self.pool, type="process"))
            except ObjectAlreadyExists:
                pass

    def start_worker(self) -> None:
        """Start the pool's worker unless one already serves this stack's server."""
        if self.worker.alive() and (self.worker.state() or {}).get("api_url") == self.prefect_api_url:
            return
        self.worker.stop()
        self.ensure_pool()
        env = dict(self.env(), **self.extra_env,
                   GPTPIPE_CODE_DIR=self.extra_env.get("GPTPIPE_CODE_DIR", str(REPO)),  # the deployments' pull step
                   PREFECT_WORKER_QUERY_SECONDS="2",  # pick a scheduled run up within seconds
                   PREFECT_WORKER_HEARTBEAT_SECONDS="10")
        self.worker.spawn([sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool,
                           "--type", "process", "--name", f"{self.pool}-{socket.gethostname()}"],
                          env, api_url=self.prefect_api_url)
        time.sleep(1.0)
        if not self.worker.alive():
            raise self.worker.error("exited at start-up")

    def down(self) -> list[str]:
        """Stop everything; names of what was stopped. The worker goes first: it would otherwise
        crash-loop against a dead server."""
        return [s.name for s in (self.worker, self.prefect, self.mlflow) if s.stop()]

    def status(self) -> dict[str, bool]:
        return {self.prefect.name: self._healthy(self.prefect), self.worker.name: self.worker.alive(),
                self.mlflow.name: self._healthy(self.mlflow)}
