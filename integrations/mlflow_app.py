"""The MLflow server app of a stack with users: MLflow's basic-auth app, unchanged, plus one rule of its
own: only an admin chooses where an experiment keeps its artifacts.

    mlflow server --app-name gptpipe-auth ...     (docker/start-mlflow.sh, with MLFLOW_ADMIN_PASSWORD)

Registered as an `mlflow.app` entry point in pyproject.toml, the way MLflow takes server apps.

Why: an experiment's artifact_location is where the server itself writes that experiment's artifacts
(the UI's upload endpoint /ajax-api/2.0/mlflow/upload-artifact writes through the server's own file
system). A signed-in user who may create experiments could point one at `file:///mlflow-auth` (the user
database's volume: fill it and logins fail) or at the pipeline's tree (`file:///mlartifacts/1`, or
`mlflow-artifacts:/1`, the same folder through the store) and plant files there. Left unset, the server
puts the experiment under its own `mlflow-artifacts:` store in a folder of its new id, beside no one
else's: so a non-admin's request may not carry an artifact_location at all.
"""

from __future__ import annotations

import json

from flask import Flask, Response, request
from google.protobuf.json_format import ParseError
from mlflow.protos.service_pb2 import CreateExperiment
from mlflow.server import app as tracking_app
from mlflow.server import auth
from mlflow.utils.proto_json_utils import parse_dict

CREATE_EXPERIMENT = "/mlflow/experiments/create"  # under /api/2.0 and /ajax-api/2.0 (and a static prefix)


def create_app(app: Flask = tracking_app):
    """MLflow's basic-auth app with the check below. It runs after basic-auth's own check (Flask runs
    before-request functions in the order they were added): anonymous requests still get 401, and the
    users and permissions are basic-auth's."""
    served = auth.create_app(app)
    app.before_request(refuse_artifact_location)
    return served


def requested_location() -> str | None:
    """The artifact_location a create-experiment request asks for, read the way MLflow's handler reads it
    (JSON, possibly double-encoded by old clients, under either of its protobuf spellings); None when the
    body cannot be read as that request."""
    body = request.get_json(force=True, silent=True)
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    msg = CreateExperiment()
    try:
        parse_dict(body if body is not None else {}, msg)
    except (ParseError, TypeError, ValueError):
        return None
    return msg.artifact_location


def refuse_artifact_location() -> Response | None:
    if request.method != "POST" or not request.path.endswith(CREATE_EXPERIMENT) or auth.sender_is_admin():
        return None
    location = requested_location()
    if location == "":
        return None
    why = ("cannot read the request" if location is None
           else f"only an MLflow admin may choose an experiment's artifact_location (asked: {location!r})")
    return Response(json.dumps({
        "error_code": "PERMISSION_DENIED",
        "message": f"{why}; leave artifact_location unset: the server keeps the experiment's artifacts in its "
                   "own store (mlflow-artifacts:), in a folder of the experiment's own"}),
        status=403, mimetype="application/json")
