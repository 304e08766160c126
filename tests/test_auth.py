"""A stack others can reach, with authentication on (devstack.services.Stack(auth=...), the same settings
the compose stack uses when exposed): a real Prefect server with basic auth and a real MLflow server with
its basic-auth app. Anonymous requests get 401 and the worker's credentials work. A flow run through such a
stack, its MLflow writes included (every step's metrics, a registered version, an alias), is
tests/test_postgres_stack.py's: the production stack, with the same authentication plus TLS and PostgreSQL
(until 2026-11-27 this file ran a second one on SQLite, 90 s of the suite for the same assertions).

What the worker account cannot do (issue #34): fetch or replace MLflow's user database through the
artifact proxy (measured on a real server laid out as docker-compose.yml lays it out, after reproducing the
attack on the layout compose had before), nor touch what it was not granted: the admin's experiments and
models, other users, permissions."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from devstack.services import Auth, Stack
from integrations.mlflow_store import basic_auth, ensure_user, signed_in_as
from tests.mlflow_server import MlflowServer
from tests.prefect_stack import unexpected_server_errors

pytestmark = pytest.mark.slow
AUTH = Auth(prefect="gpt:prefect-password-1", mlflow_admin_password="admin-password-2",
            mlflow_worker_password="worker-password-3")
ADMIN = f"{AUTH.mlflow_admin}:{AUTH.mlflow_admin_password}"
WORKER = f"{AUTH.mlflow_worker}:{AUTH.mlflow_worker_password}"
COMPOSE = Path(__file__).resolve().parent.parent / "docker" / "docker-compose.yml"
SQLITE_HEADER = b"SQLite format 3\x00"


def call(url: str, body: dict | bytes | None = None, user: str | None = None,
         method: str | None = None) -> tuple[int, bytes]:
    """(HTTP status, body) of a request; a dict body is sent as JSON, `user` ("name:password") as basic auth."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json", **({"Authorization": basic_auth(user)} if user else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def status(url: str, body: dict | bytes | None = None, user: str | None = None, method: str | None = None) -> int:
    return call(url, body, user, method)[0]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("secured-home"), prefect_port=0, mlflow_port=0, ui=False, auth=AUTH,
                  extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    stack.up()
    try:
        yield stack
        assert unexpected_server_errors(stack) == []  # 401s are answers, not server errors
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


# --- the user database out of reach (issue #34, item 1) ----------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def attack_user_database(uri: str, path: str = "basic_auth.db") -> tuple[int, bytes, int]:
    """As the worker: GET and PUT <uri>/api/2.0/mlflow-artifacts/artifacts/<path>, a path with no experiment
    id, which MLflow's basic-auth app judges by its default permission. (GET status, first 16 bytes, PUT
    status)."""
    url = f"{uri}/api/2.0/mlflow-artifacts/artifacts/{path}"
    got, body = call(url, user=WORKER)
    put, _ = call(url, b"not a user database", user=WORKER, method="PUT")
    return got, body[:16], put


def compose_mlflow_layout(tmp: Path) -> tuple[Path, Path]:
    """How docker-compose.yml lays out an authenticated MLflow server: the mlflow service's start script
    (docker/start-mlflow.sh, which compose mounts and runs) with the folders it defaults to (/mlartifacts,
    /mlflow-auth: the service's volumes; /tmp/basic_auth.ini) moved under `tmp` and PYTHON=echo, so it
    prints the `mlflow server` arguments instead of starting it. Returns the artifacts destination it
    passes and the basic-auth config it writes."""
    svc = yaml.safe_load(COMPOSE.read_text())["services"]["mlflow"]
    assert svc["entrypoint"] == ["sh", "/start-mlflow.sh"] and "./start-mlflow.sh:/start-mlflow.sh:ro" in svc["volumes"]
    assert {"artifacts:/mlartifacts", "mlflow-auth:/mlflow-auth"} <= set(svc["volumes"])
    for folder in ("mlartifacts", "mlflow-auth", "tmp"):  # the volumes exist when the container starts
        (tmp / folder).mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "PYTHON": "echo", "POSTGRES_USER": "gpt2",
           "POSTGRES_PASSWORD": "postgres-password-4", "MLFLOW_ADMIN_PASSWORD": AUTH.mlflow_admin_password,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "k", "MLFLOW_ARTIFACTS_DIR": str(tmp / "mlartifacts"),
           "MLFLOW_AUTH_DIR": str(tmp / "mlflow-auth"), "MLFLOW_AUTH_CONFIG": str(tmp / "tmp" / "basic_auth.ini")}
    r = subprocess.run(["sh", str(COMPOSE.parent / "start-mlflow.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    args = r.stdout.split()
    assert args[:3] == ["-m", "mlflow", "server"], args
    return Path(args[args.index("--artifacts-destination") + 1]), tmp / "tmp" / "basic_auth.ini"


def auth_database(ini: Path) -> Path:
    """The SQLite file of a basic-auth config's database_uri."""
    uri = re.search(r"^database_uri = (.+)$", ini.read_text(), flags=re.M).group(1)
    assert uri.startswith("sqlite:///"), uri
    return Path(uri.removeprefix("sqlite:///"))


def test_the_user_database_cannot_be_fetched_or_replaced_through_the_artifact_proxy(tmp_path):
    # Before: docker-compose.yml kept the user database in the folder the server serves, with EDIT for
    # every signed-in user. The worker downloads it (the admin's password hash) and replaces it.
    old = tmp_path / "before"
    (old / "mlartifacts").mkdir(parents=True)
    old_ini = old / "basic_auth.ini"
    old_ini.write_text(f"[mlflow]\ndefault_permission = EDIT\n"
                       f"database_uri = sqlite:///{old / 'mlartifacts' / 'basic_auth.db'}\n"
                       f"admin_username = admin\nadmin_password = {AUTH.mlflow_admin_password}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    with MlflowServer(old, artifacts=old / "mlartifacts", auth_config=old_ini) as srv:
        ensure_user(srv.uri, ("admin", AUTH.mlflow_admin_password), "worker", AUTH.mlflow_worker_password)
        assert attack_user_database(srv.uri) == (200, SQLITE_HEADER, 200)
        assert (old / "mlartifacts" / "basic_auth.db").read_bytes() == b"not a user database"

    # Now: the compose file's own layout. The database lives outside the served folder, and a signed-in
    # user holds nothing it was not granted; neither the plain path nor a climb out of the folder reaches it.
    artifacts, ini = compose_mlflow_layout(tmp_path / "compose")
    db = auth_database(ini)
    assert not db.resolve().is_relative_to(artifacts.resolve())
    with MlflowServer(tmp_path / "compose", artifacts=artifacts, auth_config=ini) as srv:
        ensure_user(srv.uri, ("admin", AUTH.mlflow_admin_password), "worker", AUTH.mlflow_worker_password)
        before = sha256(db)
        for path in ("basic_auth.db", "..%2Fmlflow-auth%2Fbasic_auth.db", "%2E%2E/mlflow-auth/basic_auth.db"):
            got, body, put = attack_user_database(srv.uri, path)
            assert got in (403, 404) and put in (403, 404) and body != SQLITE_HEADER, (path, got, put)
            # not even the admin, who may read every artifact, gets it: it is not in the served folder
            assert status(f"{srv.uri}/api/2.0/mlflow-artifacts/artifacts/{path}", user=ADMIN) in (400, 404)
        assert sha256(db) == before and not (artifacts / "basic_auth.db").exists()
        assert status(f"{srv.uri}/api/2.0/mlflow-artifacts/artifacts/basic_auth.db") == 401  # anonymous


def test_devstack_keeps_the_user_database_outside_the_artifacts(secured):
    db, artifacts = secured.home / "mlflow" / "auth" / "basic_auth.db", secured.home / "mlflow" / "artifacts"
    assert db.is_file() and not db.is_relative_to(artifacts)
    assert oct(db.parent.stat().st_mode & 0o777) == "0o700"
    before = sha256(db)
    got, body, put = attack_user_database(secured.mlflow_uri)
    assert got in (403, 404) and put in (403, 404) and body != SQLITE_HEADER
    assert sha256(db) == before


# --- least privilege (issue #34, item 2) ---------------------------------------------------------------

def test_the_worker_gets_only_what_the_pipeline_needs(secured):
    """The worker holds EDIT on the pipeline's experiment and MANAGE on the models it creates; everything
    else it reaches only through the server's default permission, NO_PERMISSIONS."""
    api, api3 = f"{secured.mlflow_uri}/api/2.0/mlflow", f"{secured.mlflow_uri}/api/3.0/mlflow"
    # the admin's own experiment and registered model
    code, body = call(f"{api}/experiments/create", {"name": "admin-only"}, ADMIN)
    assert code == 200, body
    admin_exp = json.loads(body)["experiment_id"]
    assert status(f"{api}/registered-models/create", {"name": "admin-model"}, ADMIN) == 200

    # the pipeline's experiment: the worker creates runs there, but cannot delete it or share it
    code, body = call(f"{api}/experiments/get-by-name?experiment_name=gpt2-pretrain", user=WORKER)
    assert code == 200, body
    exp = json.loads(body)["experiment"]["experiment_id"]
    assert status(f"{api}/runs/create", {"experiment_id": exp}, WORKER) == 200
    assert status(f"{api}/experiments/delete", {"experiment_id": exp}, WORKER) == 403
    grant = {"username": "worker", "resource_type": "experiment", "resource_id": exp, "permission": "MANAGE"}
    assert status(f"{api3}/users/permissions/grant", grant, WORKER) == 403

    # a model of its own: MLflow lets any signed-in user create one and makes the creator its MANAGE
    # holder (a flow run registers versions and moves aliases that way: tests/test_postgres_stack.py)
    assert status(f"{api}/registered-models/create", {"name": "worker-model"}, WORKER) == 200
    assert status(f"{api}/registered-models/get?name=worker-model", user=WORKER) == 200

    # the admin's resources: not readable, not writable, not deletable
    assert status(f"{api}/experiments/get?experiment_id={admin_exp}", user=WORKER) == 403
    assert status(f"{api}/runs/create", {"experiment_id": admin_exp}, WORKER) == 403
    assert status(f"{api}/experiments/delete", {"experiment_id": admin_exp}, WORKER) == 403
    assert status(f"{api}/registered-models/get?name=admin-model", user=WORKER) == 403
    assert status(f"{api}/registered-models/update", {"name": "admin-model", "description": "mine"}, WORKER,
                  "PATCH") == 403
    assert status(f"{api}/registered-models/delete", {"name": "admin-model"}, WORKER, "DELETE") == 403
    code, body = call(f"{api}/experiments/search", {"max_results": 100}, WORKER)
    assert code == 200 and "admin-only" not in body.decode()  # the search shows it nothing it may not read
    grant = {"username": "worker", "resource_type": "experiment", "resource_id": admin_exp, "permission": "READ"}
    assert status(f"{api3}/users/permissions/grant", grant, WORKER) == 403

    # users: it cannot change another user, make one or make itself admin
    assert status(f"{api}/users/update-password", {"username": "admin", "password": "x" * 16}, WORKER,
                  "PATCH") == 403
    assert status(f"{api}/users/create", {"username": "mallory", "password": "x" * 16}, WORKER) == 403
    assert status(f"{api}/users/update-admin", {"username": "worker", "is_admin": True}, WORKER, "PATCH") == 403
    # ... and the admin still can: the refusals above were permissions, not a broken server
    assert status(f"{api}/experiments/get?experiment_id={admin_exp}", user=ADMIN) == 200
    # anonymous: 401 everywhere
    assert status(f"{api}/experiments/get?experiment_id={exp}") == 401
    assert status(f"{api}/users/create", {"username": "mallory", "password": "x" * 16}) == 401


# --- the pipeline owns its registered models (issue #45, item 1) ----------------------------------------

EVE = "eve:eve-password-5678"  # a second signed-in user, as a new user of a shared server is: no grants


@pytest.fixture(scope="module")
def eve(secured):
    """Eve, made by the admin through MLflow's auth API and granted nothing."""
    from mlflow.server import get_app_client

    with signed_in_as(AUTH.mlflow_admin, AUTH.mlflow_admin_password):
        get_app_client("basic-auth", tracking_uri=secured.mlflow_uri).create_user(*EVE.split(":"))
    return EVE


@pytest.fixture
def as_worker(secured, monkeypatch):
    """This process talks to the stack's MLflow as its worker does (the credentials of Stack.env())."""
    for k, v in secured.env().items():
        if k.startswith("MLFLOW_TRACKING_"):
            monkeypatch.setenv(k, v)


def micro_checkpoint(run_dir: Path, seed: int) -> Path:
    import torch

    from gptcore.checkpoints import checkpoint
    from gptcore.model.gpt import GPT
    from gptcore.overrides import load_config

    cfg = load_config("micro", [f"train.run_name={run_dir.name}"])
    torch.manual_seed(seed)
    meta = {"tokens_seen": 0, "val_loss": 9.0, "config": cfg.to_dict(), "manifest_id": "m", "run_name": cfg.run_name,
            "identity_hash": cfg.identity_hash()}
    return checkpoint.save_checkpoint(run_dir, 1, GPT(cfg.model), {"optimizer": {}}, meta, keep_last=1)


def test_a_squatted_model_name_is_refused_and_the_pipeline_models_are_out_of_her_reach(
        secured, eve, as_worker, tmp_path, capsys):
    from tasks import register

    api, api3 = f"{secured.mlflow_uri}/api/2.0/mlflow", f"{secured.mlflow_uri}/api/3.0/mlflow"
    # Eve takes a name before the pipeline's first registration under it, and hands the worker MANAGE on it
    assert status(f"{api}/registered-models/create", {"name": "squatted"}, eve) == 200
    grant = {"username": "worker", "resource_type": "registered_model", "resource_id": "squatted",
             "permission": "MANAGE"}
    assert status(f"{api3}/users/permissions/grant", grant, eve) == 200
    # ... and fakes what she can: a tag on her model; the pipeline's record of its models she cannot write
    assert status(f"{api}/registered-models/set-tag", {"name": "squatted", "key": "owner", "value": "pipeline"},
                  eve) == 200
    code, body = call(f"{api}/experiments/get-by-name?experiment_name=gpt2-pretrain", user=WORKER)
    exp = json.loads(body)["experiment"]["experiment_id"]
    claim = {"experiment_id": exp, "key": "gptpipe.registered_model.squatted", "value": "0"}
    assert status(f"{api}/experiments/set-experiment-tag", claim, eve) == 403

    # the worker refuses her model: exit 2 and why, and nothing of the pipeline's lands in it
    ckpt = micro_checkpoint(tmp_path / "squat", seed=1)
    rc = register.main([str(ckpt), "--name", "squatted", "--tracking-uri", secured.mlflow_uri, "--no-hf"])
    err = capsys.readouterr().err
    assert rc == 2 and "'squatted' is not the pipeline's" in err and "another name" in err, err
    assert register.registered_version(ckpt, "squatted", secured.mlflow_uri) is None  # the flow does not skip
    code, body = call(f"{api}/model-versions/search?filter=name%3D%27squatted%27", user=ADMIN)
    assert code == 200 and json.loads(body).get("model_versions", []) == [], body
    # ... and reading her model by name is refused as writing into it is: generate, evaluate and the sample
    # stage load no weights from a name the pipeline does not own, before any version is resolved
    from integrations.registry_weights import UntrustedWeights
    from tasks import generate

    for uri in ("models:/squatted@best", "models:/squatted/1", "models:/squatted/latest"):
        with pytest.raises(UntrustedWeights, match="'squatted' is not the pipeline's"):
            generate.load(uri, secured.mlflow_uri)

    # A preset's model: the admin made it at the stack's start (ensure_user), so Eve cannot take the name,
    # and the worker registers into it (the admin granted it MANAGE)
    assert status(f"{api}/registered-models/create", {"name": "micro"}, eve) != 200
    out = register.register_checkpoint(micro_checkpoint(tmp_path / "owned", seed=2), tracking_uri=secured.mlflow_uri,
                                       hf=False)
    assert out["name"] == "micro" and "best" in out["aliases"], out
    assert generate.load("models:/micro@best", secured.mlflow_uri).version == str(out["version"])  # its own: read
    # Eve cannot move `best`, delete the version or write its tags
    alias = {"name": "micro", "alias": "best", "version": out["version"]}
    assert status(f"{api}/registered-models/alias", alias, eve) == 403
    assert status(f"{api}/registered-models/alias", alias, eve, "DELETE") == 403
    assert status(f"{api}/model-versions/delete", {"name": "micro", "version": out["version"]}, eve, "DELETE") == 403
    assert status(f"{api}/model-versions/set-tag", {"name": "micro", "version": out["version"],
                                                    "key": "checkpoint_sha256", "value": "x"}, eve) == 403
    assert status(f"{api3}/users/permissions/grant", dict(grant, resource_id="micro", username="eve"), eve) == 403


def test_the_admin_side_gives_the_worker_no_squatted_model_and_names_her(secured, eve):
    from mlflow.server import get_app_client

    api = f"{secured.mlflow_uri}/api/2.0/mlflow"
    assert status(f"{api}/registered-models/create", {"name": "squatted-preset"}, eve) == 200
    problems = ensure_user(secured.mlflow_uri, (AUTH.mlflow_admin, AUTH.mlflow_admin_password), "worker",
                           AUTH.mlflow_worker_password, models=["squatted-preset", "micro"])
    assert len(problems) == 1 and "'squatted-preset' is not the pipeline's" in problems[0], problems
    assert "eve" in problems[0]  # her name, for the admin
    with signed_in_as(AUTH.mlflow_admin, AUTH.mlflow_admin_password):
        auth = get_app_client("basic-auth", tracking_uri=secured.mlflow_uri)
        assert auth.get_user_permission("worker", "registered_model", "squatted-preset").permission != "MANAGE"
        assert auth.get_user_permission("worker", "registered_model", "micro").permission == "MANAGE"


# --- experiments only on the server's own artifact store (issue #45, item 2) --------------------------

def test_only_the_admin_chooses_where_an_experiment_keeps_its_artifacts(secured, eve, as_worker):
    from mlflow import MlflowClient

    from integrations.mlflow_store import experiment_id

    uri = secured.mlflow_uri
    auth_dir, artifacts = secured.home / "mlflow" / "auth", secured.home / "mlflow" / "artifacts"
    code, body = call(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=gpt2-pretrain", user=WORKER)
    pipeline_exp = json.loads(body)["experiment"]["experiment_id"]
    for i, (api, body) in enumerate([
            ("api", {"artifact_location": auth_dir.as_uri()}),  # the user database's folder
            ("api", {"artifact_location": (artifacts / pipeline_exp).as_uri()}),  # the pipeline's tree
            ("api", {"artifact_location": f"mlflow-artifacts:/{pipeline_exp}"}),  # the same, through the store
            ("api", {"artifactLocation": auth_dir.as_uri()}),  # protobuf's other spelling
            ("ajax-api", {"artifact_location": auth_dir.as_uri()})]):  # the UI's endpoint
        code, reply = call(f"{uri}/{api}/2.0/mlflow/experiments/create", {"name": f"evil-{i}", **body}, eve)
        assert code == 403 and b"only an MLflow admin may choose" in reply, (body, code, reply)
    # an old client's double-encoded JSON body is read the same way
    double = json.dumps(json.dumps({"name": "evil-9", "artifact_location": auth_dir.as_uri()})).encode()
    assert status(f"{uri}/api/2.0/mlflow/experiments/create", double, eve) == 403
    code, _ = call(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=evil-0", user=ADMIN)
    assert code == 404

    # left unset, the server puts it in its own store, and an upload lands there, in her experiment's folder
    code, body = call(f"{uri}/api/2.0/mlflow/experiments/create", {"name": "eve-exp"}, eve)
    assert code == 200, body
    eve_exp = json.loads(body)["experiment_id"]
    code, body = call(f"{uri}/api/2.0/mlflow/runs/create", {"experiment_id": eve_exp}, eve)
    run = json.loads(body)["run"]["info"]
    assert run["artifact_uri"].startswith(f"mlflow-artifacts:/{eve_exp}/"), run
    up = f"{uri}/ajax-api/2.0/mlflow/upload-artifact?run_uuid={run['run_id']}&path=evil.txt"
    assert status(up, b"planted", eve) == 200
    assert [p.relative_to(artifacts).parts[0] for p in artifacts.rglob("evil.txt")] == [eve_exp]
    assert not list(auth_dir.rglob("evil.txt"))
    # the pipeline's tree through the artifact proxy: hers to write only where she may
    put = f"{uri}/api/2.0/mlflow-artifacts/artifacts/{pipeline_exp}/evil.txt"
    assert status(put, b"planted", eve, "PUT") == 403

    # the admin still chooses locations; the worker's own experiments (no location) still work
    code, body = call(f"{uri}/api/2.0/mlflow/experiments/create",
                      {"name": "admin-placed", "artifact_location": "mlflow-artifacts:/admin-placed"}, ADMIN)
    assert code == 200, body
    mlc = MlflowClient(uri)
    assert mlc.get_experiment(experiment_id(mlc, "worker-made")).artifact_location.startswith("mlflow-artifacts:")
