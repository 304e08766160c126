"""A real PostgreSQL cluster in a temporary directory, laid out as docker/docker-compose.yml's `postgres`
service lays it out: the superuser POSTGRES_USER (gpt2) with a password, the database `prefect`
(POSTGRES_DB), then docker/postgres-init.sql run as the image runs it (`psql -v ON_ERROR_STOP=1 -f`, with
PREFECT_DB_PASSWORD and MLFLOW_DB_PASSWORD in its environment): the non-superuser roles `prefect` and
`mlflow`, each owning its database; password authentication on TCP. It listens on 127.0.0.1 only, on a
free port; its unix socket sits inside the temporary directory. One cluster per test module.

    def test_x(postgres): postgres.url("postgresql+asyncpg", "prefect", role="prefect") ...

Needs Debian's `postgresql` package (initdb, pg_ctl, psql under /usr/lib/postgresql/<v>/bin); without it
the test fails, naming the package. initdb refuses to run as root: as root, the cluster runs as the
`postgres` OS user (runuser).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INIT_SQL = REPO / "docker" / "postgres-init.sql"
USER = "gpt2"  # compose: POSTGRES_USER's default
DATABASES = ("prefect", "mlflow")  # compose: POSTGRES_DB, then postgres-init.sql's
ROLES = {"prefect": "PREFECT_DB_PASSWORD", "mlflow": "MLFLOW_DB_PASSWORD"}  # role -> its password's variable


def pg_bin() -> Path:
    """The newest /usr/lib/postgresql/<v>/bin with initdb, pg_ctl and psql (or $PG_BIN)."""
    found = [Path(os.environ["PG_BIN"])] if os.environ.get("PG_BIN") else sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    for d in reversed(found):
        if all((d / tool).is_file() for tool in ("initdb", "pg_ctl", "psql")):
            return d
    pytest.fail("PostgreSQL server binaries (initdb, pg_ctl, psql) not found under /usr/lib/postgresql/*/bin: "
                "install the Debian package `postgresql` (apt-get install postgresql), or set PG_BIN",
                pytrace=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Postgres:
    host: str
    port: int
    user: str
    password: str
    databases: tuple[str, ...]
    socket_dir: Path
    role_passwords: dict[str, str]  # the servers' roles (postgres-init.sql) -> password

    def credentials(self, role: str | None) -> tuple[str, str]:
        """(user, password) of `role`, or of the superuser for None."""
        return (role, self.role_passwords[role]) if role else (self.user, self.password)

    def url(self, driver: str, database: str, role: str | None = None) -> str:
        """e.g. url("postgresql+psycopg2", "mlflow", role="mlflow")"""
        user, password = self.credentials(role)
        return f"{driver}://{user}:{password}@{self.host}:{self.port}/{database}"

    def connect(self, database: str, role: str | None = None):
        """A psycopg2 connection over TCP with the password (as the servers connect), as `role` (default:
        the superuser)."""
        import psycopg2

        user, password = self.credentials(role)
        return psycopg2.connect(host=self.host, port=self.port, user=user, password=password, dbname=database)

    def query(self, database: str, sql: str, args: tuple = (), role: str | None = None) -> list[tuple]:
        conn = self.connect(database, role)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                rows = cur.fetchall()
            conn.commit()
            return rows
        finally:
            conn.close()


@pytest.fixture(scope="module")
def postgres():
    bindir = pg_bin()
    as_root = os.geteuid() == 0
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    # not under pytest's tmp_path: its parent is private to this user, and the cluster runs as `postgres`
    root = Path(tempfile.mkdtemp(prefix="gptpipe-pg-"))
    data, sock, pwfile, log = root / "data", root / "sock", root / "pwfile", root / "postgres.log"
    password = secrets.token_hex(16)
    sock.mkdir()
    pwfile.write_text(password + "\n")
    if as_root:
        shutil.chown(root, "postgres", "postgres")
        for p in (sock, pwfile):
            shutil.chown(p, "postgres", "postgres")
    os.chmod(pwfile, 0o600)

    def run(*cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120, cwd=root,
                           env={**os.environ, **(env or {})})
        if r.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            pytest.fail(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{r.stdout}{r.stderr}\n{tail}", pytrace=False)
        return r

    port = free_port()
    started = False
    try:
        # as the postgres image initialises its volume: POSTGRES_USER is the superuser, with a password;
        # connections over TCP must give it (scram-sha-256), the local socket trusts (the init scripts use it)
        run(str(bindir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth-local=trust",
            "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o",
            f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={sock}", "start")
        started = True
        psql = [str(bindir / "psql"), "-h", str(sock), "-p", str(port), "-U", USER, "-v", "ON_ERROR_STOP=1", "-q"]
        run(*psql, "-d", "postgres", "-c", "CREATE DATABASE prefect")  # POSTGRES_DB
        # docker-entrypoint-initdb.d: the file itself (`psql -f`), connected to POSTGRES_DB as POSTGRES_USER,
        # the roles' passwords in its environment as compose gives them to the postgres container
        role_passwords = {role: secrets.token_hex(16) for role in ROLES}
        run(*psql, "-d", "prefect", "-f", str(INIT_SQL),
            env={var: role_passwords[role] for role, var in ROLES.items()})
        yield Postgres("127.0.0.1", port, USER, password, DATABASES, sock, role_passwords)
    finally:
        if started:
            subprocess.run([*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                           capture_output=True, timeout=120, cwd=root)
        shutil.rmtree(root, ignore_errors=True)
