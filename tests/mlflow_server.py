"""A real `mlflow server` (SQLite backend, proxied local artifacts) on a free 127.0.0.1 port, for tests.

    with MlflowServer(tmp_path) as srv:        # or the `mlflow_server` fixture (one per session)
        client = MlflowClient(srv.uri)
        srv.stop(); srv.start()               # same port, same database: a restart

The fixture comes through tests/conftest.py (do not import it into a test module: that would make a second
server for that module). Tests share it: they make their own experiments and model names.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`artifacts`: the folder it serves (default <root>/artifacts); `auth_config`: a basic-auth ini, which
    turns MLflow's basic-auth app on (tests/test_auth.py)."""

    def __init__(self, root: str | Path, port: int | None = None, artifacts: str | Path | None = None,
                 auth_config: str | Path | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.artifacts = Path(artifacts or self.root / "artifacts")
        self.auth_config = auth_config
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 90.0) -> MlflowServer:
        if self.healthy():
            raise RuntimeError(f"port {self.port} already serves something; not starting a second server")
        # No GenAI job runner (one process less); one thread per worker: the CPU is shared.
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        app = []
        if self.auth_config:
            env.update(MLFLOW_AUTH_CONFIG_PATH=str(self.auth_config), MLFLOW_FLASK_SERVER_SECRET_KEY="0" * 32)
            app = ["--app-name", "basic-auth"]
        cmd = [sys.executable, "-m", "mlflow", "server", *app,
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(self.artifacts),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        # Own process group: the server forks uvicorn and a job runner; stop() ends all of them.
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-3000:])
            if self.healthy():
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not become healthy in {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 3.0, kill: bool = False) -> None:
        """SIGTERM the server's process group (SIGKILL after `timeout`), or SIGKILL at once with kill=True
        (a crash). Only our own group: its id stays reserved while any member lives."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # == process group id (start_new_session)
        for sig in ((signal.SIGKILL,) if kill else (signal.SIGTERM, signal.SIGKILL)):
            try:
                os.killpg(pgid, sig)
                self.proc.wait(timeout)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        end = time.monotonic() + timeout
        while self.healthy():  # a worker outliving the leader is still in the group
            if time.monotonic() > end:
                os.killpg(pgid, signal.SIGKILL)
                end = time.monotonic() + timeout
            time.sleep(0.1)
        self.proc = None

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as srv:
        yield srv
