"""The production stack's servers as compose runs them: a real PostgreSQL cluster (tests/postgres.py, laid
out as docker/docker-compose.yml's `postgres` service), and `prefect server` and `mlflow server` started by
compose's own start scripts (docker/start-prefect-server.sh, start-mlflow.sh, through devstack's Stack) with
the prefect-server service's PREFECT_SERVER_DATABASE_* settings and the mlflow service's POSTGRES_* settings,
in the exposed configuration: Prefect basic auth, MLflow's basic-auth app with the worker account, and
https with a certificate signed by a CA made for the test. One flow run of pretrain/tiny end to end (train,
register, sample) through the servers; its records read back from PostgreSQL itself; a client without the
CA refused by both servers. Each server connects as its own role (docker/postgres-init.sql), which is no
superuser and cannot open the other's database; Prefect's Secret-block key is not in its database."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import psycopg2
import pytest
import yaml
from cryptography.fernet import Fernet

from devstack.demo import deploy
from devstack.services import Auth, Stack, mlflow_trusting
from integrations.artifact_tables import from_rows
from integrations.mlflow_store import signed_in_as
from integrations.secrets import PASSWORD_BLOCK, save_mlflow_credentials
from tests.postgres import postgres  # noqa: F401  (the fixture)
from tests.prefect_stack import (
    artifacts,
    pause_schedules,
    run_deployment_and_wait,
    schedule_copy,
    unexpected_server_errors,
    wait_final,
    wait_scheduled_run,
)

pytestmark = pytest.mark.slow
COMPOSE = Path(__file__).resolve().parent.parent / "docker" / "docker-compose.yml"
AUTH = Auth(prefect="admin:prefect-pg-password-1", mlflow_admin_password="admin-pg-password-2",
            mlflow_worker_password="worker-pg-password-3")
ENCRYPTION_KEY = Fernet.generate_key().decode()  # docker/.env's PREFECT_SERVER_ENCRYPTION_KEY


def compose_database_settings(pg) -> tuple[dict[str, str], dict[str, str]]:
    """The prefect-server service's PREFECT_SERVER_DATABASE_* (and its Secret-block key) and the mlflow
    service's POSTGRES_* settings, as compose gives them, pointed at this cluster (host, port, the
    password of the role compose names; driver, role and database names unchanged: start-mlflow.sh builds
    the URI from them as it does in the container)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env = {k: str(v) for k, v in services["prefect-server"]["environment"].items()
           if k.startswith("PREFECT_SERVER_DATABASE_")}
    assert env["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert env["PREFECT_SERVER_DATABASE_NAME"] == "prefect"
    assert env["PREFECT_SERVER_DATABASE_USER"] == "prefect"  # its own role, not the superuser
    env.update(PREFECT_SERVER_DATABASE_HOST=pg.host, PREFECT_SERVER_DATABASE_PORT=str(pg.port),
               PREFECT_SERVER_DATABASE_PASSWORD=pg.role_passwords["prefect"],
               PREFECT_SERVER_ENCRYPTION_KEY=ENCRYPTION_KEY)
    assert "PREFECT_SERVER_ENCRYPTION_KEY" in services["prefect-server"]["environment"]
    mlflow = services["mlflow"]
    assert mlflow["entrypoint"] == ["sh", "/start-mlflow.sh"]
    assert mlflow["environment"]["POSTGRES_USER"] == "mlflow" and "POSTGRES_PASSWORD" in mlflow["environment"]
    assert "MLFLOW_BACKEND_STORE_URI" not in mlflow["environment"]  # the script builds it
    return env, {"POSTGRES_USER": "mlflow", "POSTGRES_PASSWORD": pg.role_passwords["mlflow"],
                 "POSTGRES_HOST": pg.host, "POSTGRES_PORT": str(pg.port)}


def refused_without_the_ca(url: str) -> str:
    """The error a client that does not trust the stack's CA gets from `url` (the system CAs only)."""
    try:
        urllib.request.urlopen(url, timeout=10)
    except urllib.error.URLError as e:
        return str(e.reason)
    raise AssertionError(f"{url} answered a client without the CA")


def test_flow_run_end_to_end_on_postgres(postgres, tmp_path):  # noqa: F811
    from mlflow import MlflowClient
    from prefect.settings import temporary_settings

    pg = postgres
    prefect_db, mlflow_db = compose_database_settings(pg)
    stack = Stack(tmp_path / "home", prefect_port=0, mlflow_port=0, ui=False, auth=AUTH, tls=True,
                  extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                             "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"},
                  prefect_db_env=prefect_db, mlflow_db_env=mlflow_db)
    try:
        stack.up()
        assert stack.prefect_api_url.startswith("https://127.0.0.1:") and stack.mlflow_uri.startswith("https://")
        # the servers run compose's start scripts, and those serve https
        for svc, script in ((stack.prefect, "start-prefect-server.sh"), (stack.mlflow, "start-mlflow.sh")):
            assert svc.state()["cmd"] == ["sh", str(COMPOSE.parent / script)]
        # a client without the CA is refused by both; anonymous requests with it get 401
        for url in (f"{stack.prefect_api_url}/health", f"{stack.mlflow_uri}/health"):
            assert "CERTIFICATE_VERIFY_FAILED" in refused_without_the_ca(url), url
        tls = ssl.create_default_context(cafile=stack.certificates.ca)
        for url in (f"{stack.prefect_api_url}/flows/filter", f"{stack.mlflow_uri}/api/2.0/mlflow/experiments/search"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url, data=b"{}", headers={
                    "Content-Type": "application/json"}), timeout=10, context=tls)
            assert e.value.code == 401, url
        # the passwords reach the servers through their environment only
        for svc, role in ((stack.prefect, "prefect"), (stack.mlflow, "mlflow")):
            pid = svc.state()["pid"]
            assert pg.role_passwords[role] not in " ".join(psutil.Process(pid).cmdline()), svc.name
        deploy(stack, force=True)
        params = {"preset": "micro", "model_name": "micro-pg",
                  "overrides": {"train.max_steps": 4, "train.run_name": "pg", "train.checkpoint_interval": 4,
                                "eval.eval_interval": 4, "eval.sample_interval": 4},
                  "register": True}
        # Prefect's own client without the CA: refused
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_SSL_CERT_FILE

        with temporary_settings({**stack.prefect_settings(), PREFECT_API_SSL_CERT_FILE: None}):
            with get_client(sync_client=True) as c, pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
                c.read_work_pools()
        with temporary_settings(stack.prefect_settings()):
            save_mlflow_credentials(AUTH.mlflow_worker, AUTH.mlflow_worker_password)  # the docker pool's blocks
            # every table belongs to the server's own role (it ran its migrations as that role)
            for db in ("prefect", "mlflow"):
                assert pg.query(db, "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'") == [(db,)]
            # Prefect's Secret blocks: encrypted with docker/.env's key, which is nowhere in its database (without
            # the key, Prefect stores its own in the `configuration` table, beside the blocks)
            assert pg.query("prefect", "SELECT key FROM configuration WHERE key = 'ENCRYPTION_KEY'") == []
            [(stored,)] = pg.query("prefect", "SELECT data FROM block_document WHERE name = %s", (PASSWORD_BLOCK,))
            assert isinstance(stored, str) and AUTH.mlflow_worker_password not in stored  # a Fernet token (JSON string)
            assert AUTH.mlflow_worker_password in Fernet(ENCRYPTION_KEY.encode()).decrypt(stored.encode()).decode()
            fr = run_deployment_and_wait(params, timeout=240)
            assert fr.state.is_completed(), fr.state.message
            summary = from_rows(artifacts(fr.id)["pretrain-summary"])
            # the next night, on PostgreSQL: the server's scheduler creates the run (#69: on SQLAlchemy 2.1 it
            # failed every minute), the worker runs it, and it continues the same run: nothing left to do
            dep = schedule_copy("pretrain/tiny", "tiny-nightly-pg", params, due_in=8.0)
            try:
                nightly = wait_final(wait_scheduled_run(dep, timeout=90).id, timeout=240)
            finally:
                pause_schedules(dep)
            assert nightly.auto_scheduled and nightly.state.is_completed(), nightly.state.message
            assert pg.query("prefect", "SELECT auto_scheduled FROM flow_run WHERE id = %s", (str(nightly.id),)) \
                == [(True,)]
        assert summary["step"] == 4
        assert {s: summary["stages"][s] for s in ("train", "register", "sample")} == \
            {"train": "ran", "register": "ran", "sample": "ran"}, summary["stages"]
        assert summary["model_version"] == "models:/micro-pg/1"

        # MLflow through its server, as the worker (who registered it) and verified by the CA ...
        with mlflow_trusting(stack.certificates), signed_in_as(AUTH.mlflow_worker, AUTH.mlflow_worker_password):
            mlc = MlflowClient(stack.mlflow_uri, registry_uri=stack.mlflow_uri)
            mv = mlc.get_model_version("micro-pg", "1")
            assert mv.tags["flow_run_id"] == str(fr.id)
            # the flow's MLflow writes through basic auth: every step's metrics shipped while it trained, and
            # the worker moved an alias of the model it created (test_auth.py's SQLite stack asked the same of
            # a flow run of its own until 2026-11-27: this stack has the same auth, with TLS and PostgreSQL)
            assert sorted(m.step for m in mlc.get_metric_history(mv.run_id, "train/loss")) == [1, 2, 3, 4]
            assert "best" in mv.aliases
        # ... and in PostgreSQL itself: no SQLite file anywhere, the rows in the compose databases
        assert not (stack.home / "mlflow" / "mlflow.db").exists()
        assert not list((stack.home / "prefect").glob("*.db"))
        assert pg.query("mlflow", "SELECT name FROM registered_models WHERE name = %s", ("micro-pg",)) == \
            [("micro-pg",)]
        assert pg.query("mlflow", "SELECT version, run_id FROM model_versions WHERE name = %s",
                        ("micro-pg",)) == [(1, mv.run_id)]
        assert pg.query("mlflow", "SELECT status FROM runs WHERE run_uuid = %s", (mv.run_id,)) == [("FINISHED",)]
        assert pg.query("prefect", "SELECT state_type FROM flow_run WHERE id = %s", (str(fr.id),)) == \
            [("COMPLETED",)]
        assert unexpected_server_errors(stack) == []
    finally:
        stack.down()


ROLES = {"prefect": "mlflow", "mlflow": "prefect"}  # each server's role -> the other server's database


@pytest.mark.parametrize("role, other", ROLES.items())
def test_each_server_role_is_confined_to_its_own_database(postgres, role, other):  # noqa: F811
    """The roles docker/postgres-init.sql makes (run by tests/postgres.py as the postgres image runs it):
    each works in its own database, cannot even connect to the other's (Prefect's holds the Secret blocks,
    MLflow's the registry), and is no superuser, so a leaked server password cannot run commands on the
    database host (`COPY ... TO PROGRAM`), read its files or make roles."""
    pg = postgres
    assert pg.query("postgres", "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls "
                    "FROM pg_roles WHERE rolname = %s", (role,)) == [(False, False, False, False, False)]
    table = f"probe_{role}"
    pg.query(role, f"CREATE TABLE {table} (v text); INSERT INTO {table} VALUES ('mine'); "
                   f"SELECT v FROM {table}", role=role)  # its own database: owner, reads and writes
    try:
        with pytest.raises(psycopg2.OperationalError, match=f'permission denied for database "{other}"'):
            pg.connect(other, role=role)
        conn = pg.connect(role, role=role)
        try:
            for sql, why in ((f"COPY (SELECT 1) TO PROGRAM 'id > /tmp/{role}-was-here'", "pg_execute_server_program"),
                             ("SELECT pg_read_file('/etc/passwd')", "permission denied for function pg_read_file"),
                             ("CREATE ROLE intruder", "permission denied to create role"),
                             (f"SET ROLE {other}", f'permission denied to set role "{other}"')):
                with conn.cursor() as cur, pytest.raises(psycopg2.errors.InsufficientPrivilege, match=why):
                    cur.execute(sql)
                conn.rollback()
        finally:
            conn.close()
    finally:
        pg.query(role, f"DROP TABLE {table}; SELECT 1", role=role)
