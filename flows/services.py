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

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tasks import processes
from tasks.processes import start_time

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PREFECT_PORT = 4200
DEFAULT_MLFLOW_PORT = 5000
CPU_POOL = "cpu-pool"
GPU_POOL = "gpu-pool"  # the nightly gpt2-124m deployment's pool; its worker runs on a GPU machine


class ServiceError(RuntimeError):
    """A service did not start; the message points at its log."""


def free_port(preferred: int | None = None) -> int:
    """`preferred` if nothing listens there, else any free port."""
    if preferred:
        with socket.socket() as s:
            # as the servers do: a port left in TIME_WAIT by a server we just stopped is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Service:
    """One background process with a pid file and a log under <home>/services/."""
    name: str
    state_dir: Path

    @property
    def state_path(self) -> Path:
        return self.state_dir / f"{self.name}.json"

    @property
    def log_path(self) -> Path:
        return self.state_dir / f"{self.name}.log"

    def state(self) -> dict | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None

    def alive(self) -> bool:
        self._reap()
        st = self.state()
        return bool(st) and start_time(st["pid"]) == st["start_time"]

    def spawn(self, cmd: list[str], env: dict, **extra) -> dict:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            logf.flush()
            # Own session: stopping the service signals its whole group (uvicorn workers, flow runs).
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=REPO, start_new_session=True)
        st = {"pid": proc.pid, "start_time": start_time(proc.pid), "cmd": cmd, **extra}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        tmp.replace(self.state_path)
        self._proc = proc  # keeps the Popen alive so it can be reaped
        return st

    def exited(self) -> int | None:
        proc = getattr(self, "_proc", None)
        return proc.poll() if proc is not None else None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> bool:
        """SIGTERM the process group and the processes below the leader, SIGKILL after `grace` s. True
        if something was stopped."""
        st = self.state()
        if not st:
            return False
        stopped = start_time(st["pid"]) == st["start_time"]
        if stopped:
            processes.stop_tree(st["pid"], processes.tree_of(st["pid"]), grace, poll=self._reap)
        self._reap()
        self.state_path.unlink(missing_ok=True)
        return stopped

    def _reap(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None:
            proc.poll()


@dataclass
class Stack:
    """Prefect server + process pool worker + MLflow server for one pipeline home."""
    home: Path
    prefect_port: int = DEFAULT_PREFECT_PORT
    mlflow_port: int = DEFAULT_MLFLOW_PORT
    pool: str = CPU_POOL
    ui: bool = True  # serve the Prefect UI (the tests turn it off)
    extra_env: dict = field(default_factory=dict)  # for the worker (e.g. OMP_NUM_THREADS in tests)

    def __post_init__(self):
        self.home = Path(self.home).resolve()
        self.state_dir = self.home / "services"
        self.prefect = Service("prefect-server", self.state_dir)
        self.mlflow = Service("mlflow-server", self.state_dir)
        self.worker = Service(f"worker-{self.pool}", self.state_dir)
        # a running server of this home keeps its port
        for svc, attr in ((self.prefect, "prefect_port"), (self.mlflow, "mlflow_port")):
            st = svc.state()
            if st and svc.alive():
                setattr(self, attr, st["port"])

    # --- addresses -------------------------------------------------------------------------------
    @property
    def prefect_api_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def prefect_ui_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

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
        }

    def prefect_healthy(self) -> bool:
        return http_ok(f"{self.prefect_api_url}/health")

    def mlflow_healthy(self) -> bool:
        return http_ok(f"{self.mlflow_uri}/health")

    # --- start -----------------------------------------------------------------------------------
    def _wait(self, svc: Service, healthy, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if healthy():
                return
            if svc.exited() is not None or not svc.alive():
                raise ServiceError(f"{svc.name} exited during start-up; its log {svc.log_path} ends with:\n"
                                   + svc.log_tail())
            time.sleep(0.3)
        svc.stop()
        raise ServiceError(f"{svc.name} was not healthy after {timeout:.0f}s; see {svc.log_path}:\n"
                           + svc.log_tail())

    def start_mlflow(self, timeout: float = 120.0, wait: bool = True) -> None:
        if self.mlflow.alive() and self.mlflow_healthy():
            return
        self.mlflow.stop()
        self.mlflow_port = free_port(self.mlflow_port)
        root = self.home / "mlflow"
        root.mkdir(parents=True, exist_ok=True)
        env = dict(self.env(), OMP_NUM_THREADS="1")
        env.pop("MLFLOW_TRACKING_URI")
        self.mlflow.spawn([sys.executable, "-m", "mlflow", "server",
                           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                           "--artifacts-destination", str(root / "artifacts"),
                           "--host", "127.0.0.1", "--port", str(self.mlflow_port), "--workers", "1"],
                          env, port=self.mlflow_port)
        if wait:
            self._wait(self.mlflow, self.mlflow_healthy, timeout)

    def start_prefect(self, timeout: float = 120.0, wait: bool = True) -> None:
        if self.prefect.alive() and self.prefect_healthy():
            return
        self.prefect.stop()
        self.prefect_port = free_port(self.prefect_port)
        (self.home / "prefect").mkdir(parents=True, exist_ok=True)
        env = dict(self.env(), PREFECT_UI_ENABLED=str(self.ui).lower(),
                   PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(self.prefect_port),
                   # an expired concurrency lease (its holder was killed) is reclaimed within seconds
                   PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="5")
        env.pop("PREFECT_API_URL")
        self.prefect.spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                            "--port", str(self.prefect_port)], env, port=self.prefect_port)
        if wait:
            self._wait(self.prefect, self.prefect_healthy, timeout)

    def ensure_pool(self, name: str | None = None) -> None:
        """Create a process work pool if it does not exist (idempotent)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.prefect_api_url}), get_client(sync_client=True) as c:
            try:
                c.read_work_pool(name or self.pool)
            except ObjectNotFound:
                try:
                    c.create_work_pool(WorkPoolCreate(name=name or self.pool, type="process"))
                except ObjectAlreadyExists:
                    pass

    def start_worker(self) -> None:
        if self.worker.alive():
            st = self.worker.state() or {}
            if st.get("api_url") == self.prefect_api_url:
                return
            self.worker.stop()
        self.ensure_pool()
        env = dict(self.env(), **self.extra_env,
                   PREFECT_WORKER_QUERY_SECONDS="2",  # pick a scheduled run up within seconds
                   PREFECT_WORKER_HEARTBEAT_SECONDS="10")
        self.worker.spawn([sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool,
                           "--type", "process", "--name", f"{self.pool}-{socket.gethostname()}"],
                          env, api_url=self.prefect_api_url)
        time.sleep(1.0)
        if not self.worker.alive():
            raise ServiceError(f"the worker exited at start-up; see {self.worker.log_path}:\n"
                               + self.worker.log_tail())

    def up(self, timeout: float = 180.0) -> Stack:
        # both servers boot at once (each spends most of its start-up importing)
        self.start_mlflow(wait=False)
        self.start_prefect(wait=False)
        self._wait(self.mlflow, self.mlflow_healthy, timeout)
        self._wait(self.prefect, self.prefect_healthy, timeout)
        self.start_worker()
        return self

    def down(self) -> list[str]:
        """Stop the worker first (it would otherwise crash-loop against a dead server). Names of what
        was stopped."""
        return [s.name for s in (self.worker, self.prefect, self.mlflow) if s.stop()]

    def status(self) -> dict[str, bool]:
        return {"prefect-server": self.prefect.alive() and self.prefect_healthy(),
                f"worker-{self.pool}": self.worker.alive(),
                "mlflow-server": self.mlflow.alive() and self.mlflow_healthy()}
