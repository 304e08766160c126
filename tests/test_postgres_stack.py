"""The production stack's servers on the database compose deploys: a real PostgreSQL cluster
(tests/postgres.py, laid out as docker/docker-compose.yml's `postgres` service), `prefect server` with the
prefect-server service's PREFECT_SERVER_DATABASE_* settings, `mlflow server` with the mlflow service's
MLFLOW_BACKEND_STORE_URI (postgresql+psycopg2, in its environment, not its argv), started by devstack's
Stack; one flow run of pretrain/tiny end to end (train, register, sample) through the server, and its
records read back from PostgreSQL itself. Loopback, no auth, no TLS."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from devstack.demo import deploy
from devstack.services import Stack
from tests.postgres import postgres  # noqa: F401  (the fixture)
from tests.prefect_stack import artifacts, run_deployment_and_wait

pytestmark = pytest.mark.slow
COMPOSE = Path(__file__).resolve().parent.parent / "docker" / "docker-compose.yml"


def compose_database_settings(pg) -> tuple[dict[str, str], str]:
    """The prefect-server service's PREFECT_SERVER_DATABASE_* and the mlflow service's backend store URI, as
    compose gives them, pointed at this cluster (host, port, user, password; driver and names unchanged)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    env = {k: str(v) for k, v in services["prefect-server"]["environment"].items()
           if k.startswith("PREFECT_SERVER_DATABASE_")}
    assert env["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert env["PREFECT_SERVER_DATABASE_NAME"] == "prefect"
    env.update(PREFECT_SERVER_DATABASE_HOST=pg.host, PREFECT_SERVER_DATABASE_PORT=str(pg.port),
               PREFECT_SERVER_DATABASE_USER=pg.user, PREFECT_SERVER_DATABASE_PASSWORD=pg.password)
    cmd = " ".join(services["mlflow"]["command"])
    m = re.search(r'MLFLOW_BACKEND_STORE_URI="([^"]+)"', cmd)
    assert m, cmd
    uri = (m.group(1).replace("$${POSTGRES_USER}", pg.user).replace("$${POSTGRES_PASSWORD}", pg.password)
           .replace("@postgres:5432/", f"@{pg.host}:{pg.port}/"))
    assert uri == pg.url("postgresql+psycopg2", "mlflow"), "compose's MLflow URI changed shape"
    return env, uri


def test_flow_run_end_to_end_on_postgres(postgres, tmp_path):  # noqa: F811
    from mlflow import MlflowClient
    from prefect.settings import temporary_settings

    pg = postgres
    prefect_db, mlflow_uri = compose_database_settings(pg)
    stack = Stack(tmp_path / "home", prefect_port=0, mlflow_port=0, ui=False,
                  extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                             "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"},
                  prefect_db_env=prefect_db, mlflow_backend_uri=mlflow_uri)
    try:
        stack.up()
        # the password reaches the servers through their environment only
        for svc in (stack.prefect, stack.mlflow):
            pid = svc.state()["pid"]
            assert pg.password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), svc.name
        deploy(stack, force=True)
        params = {"preset": "micro", "model_name": "micro-pg",
                  "overrides": {"train.max_steps": 4, "train.run_name": "pg", "train.checkpoint_interval": 4,
                                "eval.eval_interval": 4, "eval.sample_interval": 4},
                  "register": True}
        with temporary_settings(stack.prefect_settings()):
            fr = run_deployment_and_wait(params, timeout=240)
            assert fr.state.is_completed(), fr.state.message
            summary = {r["key"]: json.loads(r["value"]) for r in artifacts(fr.id)["pretrain-summary"]}
        assert summary["step"] == 4
        assert {s: summary["stages"][s] for s in ("train", "register", "sample")} == \
            {"train": "ran", "register": "ran", "sample": "ran"}, summary["stages"]
        assert summary["model_version"] == "models:/micro-pg/1"

        # MLflow through its server ...
        mlc = MlflowClient(stack.mlflow_uri, registry_uri=stack.mlflow_uri)
        mv = mlc.get_model_version("micro-pg", "1")
        assert mv.tags["flow_run_id"] == str(fr.id)
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
    finally:
        stack.down()
