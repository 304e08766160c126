"""A stack others can reach, with authentication on (devstack.services.Stack(auth=...), the same settings
the compose stack uses when exposed): a real Prefect server with basic auth and a real MLflow server with
its basic-auth app. Anonymous requests get 401; the worker, a flow run through it and the flow's MLflow
writes (metrics, a registered model version) work with the credentials."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from devstack.services import Auth, Stack
from integrations.mlflow_store import basic_auth

pytestmark = pytest.mark.slow
AUTH = Auth(prefect="gpt:prefect-password-1", mlflow_admin_password="admin-password-2",
            mlflow_worker_password="worker-password-3")


def status(url: str, body: dict | None = None, user: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": basic_auth(user)} if user else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("secured-home"), prefect_port=0, mlflow_port=0, ui=False, auth=AUTH,
                  extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


def test_anonymous_requests_get_401(secured):
    flows = f"{secured.prefect_api_url}/flows/filter"
    assert status(flows, {}) == 401
    assert status(flows, {}, user="gpt:wrong") == 401
    assert status(flows, {}, user=AUTH.prefect) == 200
    search = f"{secured.mlflow_uri}/api/2.0/mlflow/experiments/search?max_results=1"
    assert status(search) == 401
    assert status(search, user="worker:wrong") == 401
    assert status(search, user=f"worker:{AUTH.mlflow_worker_password}") == 200


def test_a_flow_run_with_credentials_trains_tracks_and_registers(secured, monkeypatch):
    from mlflow import MlflowClient
    from prefect.settings import temporary_settings

    from devstack.demo import deploy
    from tests.prefect_stack import run_deployment_and_wait

    assert deploy(secured, force=True)
    params = {"preset": "micro", "model_name": "micro-auth", "evaluate": False,
              "overrides": {"train.max_steps": 4, "train.run_name": "auth", "train.checkpoint_interval": 4,
                            "eval.eval_interval": 4, "eval.sample_interval": 0}}
    with temporary_settings(secured.prefect_settings()):
        fr = run_deployment_and_wait(params, timeout=300)
    assert fr.state.is_completed(), fr.state.message
    for k, v in secured.env().items():
        if k.startswith("MLFLOW_TRACKING_"):
            monkeypatch.setenv(k, v)
    mlc = MlflowClient(secured.mlflow_uri, registry_uri=secured.mlflow_uri)
    mv = mlc.get_model_version("micro-auth", "1")  # the register stage wrote through basic auth
    assert sorted(m.step for m in mlc.get_metric_history(mv.run_id, "train/loss")) == [1, 2, 3, 4]
