"""Links into the MLflow UI that open in its model-training mode.

MLflow 3's UI keeps one global workflow type and starts in GenAI mode: a plain experiment or run link
opens on a Traces / Latency / Token-usage dashboard and an "Agent versions" tab, and the experiment's
`mlflow.experimentKind` tag does not change that. The UI reads `workflowType` from the link's query (after
the hash route), so every link the project prints carries `?workflowType=machine_learning`, and opens on
Runs, Models and the registry.

    experiment_link(uri, "1")             http://host:5000/#/experiments/1?workflowType=machine_learning
    run_link(uri, "1", run_id)            .../#/experiments/1/runs/<run_id>?workflowType=machine_learning
    model_version_link(uri, "tiny-cpu", 3)  .../#/models/tiny-cpu/versions/3?workflowType=machine_learning
"""

from __future__ import annotations

from urllib.parse import quote

WORKFLOW = "workflowType=machine_learning"


def ui_link(uri: str, route: str) -> str:
    """The UI page at hash `route` of the server at `uri`, in model-training mode."""
    return f"{uri.rstrip('/')}/#/{route.lstrip('/')}?{WORKFLOW}"


def experiment_link(uri: str, experiment_id: str) -> str:
    return ui_link(uri, f"experiments/{quote(str(experiment_id), safe='')}")


def run_link(uri: str, experiment_id: str, run_id: str) -> str:
    return ui_link(uri, f"experiments/{quote(str(experiment_id), safe='')}/runs/{quote(str(run_id), safe='')}")


def model_link(uri: str, name: str) -> str:
    return ui_link(uri, f"models/{quote(name, safe='')}")


def model_version_link(uri: str, name: str, version) -> str:
    return ui_link(uri, f"models/{quote(name, safe='')}/versions/{quote(str(version), safe='')}")
