"""Links into the MLflow UI that open in its model-training mode.

MLflow 3's UI keeps one global workflow type and starts in GenAI mode: a plain experiment or run link
opens on a Traces / Latency / Token-usage dashboard and an "Agent versions" tab, and the experiment's
`mlflow.experimentKind` tag does not change that. The UI reads `workflowType` from the link's query (after
the hash route), so every link the project prints carries `?workflowType=machine_learning`, and opens on
Runs, Models and the registry.

    experiment_link(uri, "1")             http://host:5000/#/experiments/1?workflowType=machine_learning
    run_link(uri, "1", run_id)            .../#/experiments/1/runs/<run_id>?workflowType=machine_learning
    model_version_link(uri, "tiny-cpu", 3)  .../#/models/tiny-cpu/versions/3?workflowType=machine_learning
    pipeline_links(uri, run_id, name, version)  the pipeline experiment's page (read over REST), the
                                          run's and the model version's (what the demo prints)
    flow_links(reg, run_name)             a flow run's MLflow run and model version, as markdown
"""

from __future__ import annotations

from urllib.parse import quote

from integrations import mlflow_store as store  # its REST helpers only: importing it does not import mlflow

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


def pipeline_experiment_id(uri: str) -> str | None:
    """The pipeline experiment's id on the server at `uri`, read over REST (no mlflow import); None while
    it does not exist. store.RestUnavailable when the server cannot be read."""
    exp = (store.rest_read(uri, "experiments/get-by-name", {"experiment_name": store.EXPERIMENT}) or {})
    return (exp.get("experiment") or {}).get("experiment_id")


def pipeline_links(uri: str, run_id: str | None = None, name: str | None = None, version=None) -> dict[str, str]:
    """{"experiment": the pipeline experiment's page, or the server's experiments page while it cannot be
    read; "run": run `run_id`'s page (a run's page needs its experiment's id); "model version": version
    `version` of registered model `name`}; a link only where its parts are known."""
    try:
        exp_id = pipeline_experiment_id(uri)
    except store.RestUnavailable:
        exp_id = None
    links = {"experiment": experiment_link(uri, exp_id) if exp_id else ui_link(uri, "experiments")}
    if exp_id and run_id:
        links["run"] = run_link(uri, exp_id, run_id)
    if name and version is not None:
        links["model version"] = model_version_link(uri, name, version)
    return links


def flow_links(reg: dict | None, run_name: str) -> str:
    """Markdown links to the MLflow run and model version of a flow run (when MLflow is a server with a
    UI), for its artifact; read over REST, so a re-run that changes nothing does not import mlflow."""
    uri = store.tracking_uri()
    if not uri.startswith("http"):
        return f"MLflow store: `{uri}` (no UI server); run `mlflow ui --backend-store-uri {uri}` to browse."
    lines = []
    try:
        exp_id = pipeline_experiment_id(uri)
        run_id = reg["run_id"] if reg else None
        if exp_id is not None and run_id is None:
            runs = (store.rest_read(uri, "runs/search", body={
                "experiment_ids": [exp_id], "max_results": 1,
                "filter": f"tags.`{store.TAG_RUN_NAME}` = {store.quoted(run_name)}"}) or {}).get("runs") or []
            run_id = runs[0]["info"]["run_id"] if runs else None
        if exp_id is not None and run_id:
            lines.append(f"- MLflow run: [{run_name}]({run_link(uri, exp_id, run_id)})")
    except store.RestUnavailable as e:  # links are a convenience; never fail the flow for them
        lines.append(f"- MLflow run: unavailable ({e})")
    if reg:
        lines.append(f"- Model version: [{reg['name']} v{reg['version']}]"
                     f"({model_version_link(uri, reg['name'], reg['version'])}) (`{reg['model_uri']}`)")
    return "\n".join(lines) or "no MLflow run yet"
