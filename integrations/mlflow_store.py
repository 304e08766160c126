"""Where MLflow lives, and the lookups every stage shares (register, evaluate, generate, the flow, the
metrics shipper in integrations/tracking.py).

    tracking_uri()            $MLFLOW_TRACKING_URI, else the `make demo` server of this pipeline home while it
                              runs, else the embedded SQLite store under the pipeline home
    client(uri)               an MlflowClient for tracking and registry
    rest_read(uri, endpoint)  a read through MLflow's REST API without importing mlflow (a second or more):
                              the flow's skip decisions use it against a tracking server
    ensure_user(uri, admin, ...)  the worker's user on a server with MLflow's basic-auth app, and its grants

One MLflow experiment (`gpt2-pretrain`) holds one MLflow run per training run identity (tags below).
"""

from __future__ import annotations

# lazy imports: mlflow (~1.3 s) only where the client is needed; the flow's skip decisions read over REST
import base64
import contextlib
import json
import os
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from gptcore.config import ConfigError, check_name, flatten, pipeline_home
from gptcore.files import read_json

EXPERIMENT = "gpt2-pretrain"
TAG_RUN_NAME = "gptpipe.run_name"
TAG_IDENTITY = "gptpipe.identity_hash"
TAG_MANIFEST = "gptpipe.manifest_id"
TAG_CODE = "gptpipe.code_version"
TAG_FLOW_RUN = "gptpipe.prefect_flow_run_id"


# --- where MLflow lives --------------------------------------------------------------------------

def resolve_model_uri(uri: str) -> str:
    """`models:/name@latest` -> `models:/name/latest` (MLflow reserves the alias name `latest`)."""
    if uri.startswith("models:/") and uri.lower().endswith("@latest"):
        return uri[: -len("@latest")] + "/latest"
    return uri


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI if set (a local `mlflow server`, or a team server); else the MLflow server that
    `make demo` runs for this pipeline home, while it runs (the models it stored have `mlflow-artifacts:`
    locations only it can serve, so the documented commands must talk to it, not to its database); else
    the embedded SQLite store under the pipeline home."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if local := local_server(pipeline_home()):
        return local
    root = pipeline_home() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def local_server(home: Path) -> str | None:
    """The address of the MLflow server devstack runs for `home` (its state file
    <home>/services/mlflow-server.json: pid, start time, port), or None when it is not running."""
    from integrations.processes import start_time

    st = read_json(Path(home) / "services" / "mlflow-server.json", {})
    if not isinstance(st, dict) or not st.get("port") or not st.get("pid"):
        return None
    return f"http://127.0.0.1:{st['port']}" if start_time(st["pid"]) == st.get("start_time") else None


def use_store(uri: str | None = None) -> None:
    """Point MLflow's fluent API (tracking and model registry) at `uri`, default tracking_uri(). For the
    calls that take no client: log_model, pyfunc.load_model, artifacts.download_artifacts."""
    import mlflow

    uri = uri or tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)


def client(uri: str | None = None):
    from mlflow import MlflowClient

    uri = uri or tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# MLflow's UI picks its views by this experiment tag: model development opens on training runs, metrics and
# models (untagged, an empty experiment's UI is MLflow 3's GenAI views: "Agent versions", traces)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_id(mlc, name: str = EXPERIMENT) -> str:
    """The id of experiment `name` (created when missing), tagged as model development for MLflow's UI."""
    exp = mlc.get_experiment_by_name(name)
    if exp is None:
        exp_id = _create_experiment(mlc, name)
    else:
        exp_id = exp.experiment_id
        if exp.tags.get(EXPERIMENT_KIND[0]) == EXPERIMENT_KIND[1]:
            return exp_id
    from mlflow.exceptions import MlflowException

    try:
        mlc.set_experiment_tag(exp_id, *EXPERIMENT_KIND)
    except MlflowException:  # a user who may not tag it (READ): the UI's default views, nothing worse
        pass
    return exp_id


def _create_experiment(mlc, name: str) -> str:
    from mlflow.exceptions import MlflowException

    # The embedded SQLite store keeps artifacts beside the database (MLflow would otherwise use ./mlruns
    # relative to wherever the process happens to run); a server decides for itself.
    db = mlc.tracking_uri.removeprefix("sqlite:///")
    artifacts = (Path(db).parent / "artifacts").resolve().as_uri() if db != mlc.tracking_uri else None
    try:
        return mlc.create_experiment(name, artifact_location=artifacts)
    except MlflowException:  # created concurrently by another process
        exp = mlc.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def quoted(value: str) -> str:
    """`value` as a string literal of an MLflow search filter. MLflow's filter grammar has no escape (it
    strips the two quotes and keeps the rest), so a value that could end the literal early is refused."""
    if not isinstance(value, str) or any(c in value for c in "'\\\n\r"):
        raise ConfigError(f"{value!r} cannot be put in an MLflow search filter (it holds a quote, a backslash "
                          "or a line break); use a name of letters, digits, '.', '_' and '-'")
    return f"'{value}'"


def find_or_create_run(mlc, run_name: str, identity_hash: str, experiment: str = EXPERIMENT):
    """The MLflow run (an mlflow Run) of this training run identity, creating it the first time."""
    check_name("train.run_name", run_name)  # it was read back from run.json / meta.json: only a checked name
    exp_id = experiment_id(mlc, experiment)
    found = mlc.search_runs(
        [exp_id], filter_string=f"tags.`{TAG_RUN_NAME}` = {quoted(run_name)} and "
                                f"tags.`{TAG_IDENTITY}` = {quoted(identity_hash)}",
        order_by=["attributes.start_time ASC"], max_results=1)
    if found:
        return found[0]
    return mlc.create_run(exp_id, run_name=run_name, tags={TAG_RUN_NAME: run_name, TAG_IDENTITY: identity_hash})


def datasets_of(dataset_dir: str | Path) -> dict:
    """The MLflow datasets of a tokenized dataset directory: {"training": ..., "validation": ...} (empty when
    it holds no readable manifest). Both have the source of the manifest (the hub repo at the recorded
    commit, config and split, or the local path) and its id as digest, the id every shard, checkpoint and
    model version carries; the validation dataset is the held-out shard of that manifest, named
    `<dataset>/val`."""
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json  # mlflow: only when logging
    from mlflow.data.meta_dataset import MetaDataset

    from gptcore.data import sources
    from gptcore.data.shard_format import Manifest, ShardError

    try:
        m = Manifest.load(Path(dataset_dir))
    except ShardError:
        return {}
    # the source's kind describes it in MLflow's own dataset-source vocabulary (type + fields): the hub repo
    # at the recorded commit, config and split; a local path; a URL ...
    source_type, fields = sources.kind_for(str(m.source.get("source", ""))).lineage(m.source, Path(dataset_dir))
    source = get_dataset_source_from_json(json.dumps(fields), source_type)
    name = Path(dataset_dir).name
    return {"training": MetaDataset(source=source, name=name, digest=m.id),
            "validation": MetaDataset(source=source, name=f"{name}/val", digest=m.id)}


def log_datasets(mlc, run_id: str, dataset_dir: str | Path) -> dict:
    """Record the run's training and validation datasets as MLflow dataset inputs (the run page's "Datasets
    used", with their context); MLflow keeps one input per (run, dataset, context), so calling it on every
    invocation adds nothing. Returns datasets_of(dataset_dir)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    found = datasets_of(dataset_dir)
    if found:
        mlc.log_inputs(run_id, datasets=[DatasetInput(Dataset(**ds.to_dict()), [InputTag("mlflow.data.context", ctx)])
                                         for ctx, ds in found.items()])
    return found


def as_params(config: dict) -> dict[str, str]:
    """{"model": {"n_layer": 12}} -> {"model.n_layer": "12"}: MLflow params are flat strings."""
    return {k: str(v) for k, v in flatten(config).items()}


def code_version() -> str:
    """GPTPIPE_CODE_VERSION if set (e.g. by CI or a container build), else the git commit of this
    checkout (+"-dirty" with uncommitted changes to tracked files), else "unknown"."""
    if os.environ.get("GPTPIPE_CODE_VERSION"):
        return os.environ["GPTPIPE_CODE_VERSION"]
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- reads over REST, for decisions that should not pay for importing mlflow ------------------------

class RestUnavailable(RuntimeError):
    """The REST read did not work (not a server, unreachable, auth); callers fall back to the client."""


def basic_auth(user_password: str) -> str:
    """The Authorization header's value for HTTP basic auth as "user:password"."""
    return "Basic " + base64.b64encode(user_password.encode()).decode()


def _auth(req: urllib.request.Request) -> urllib.request.Request:
    """The credentials the MLflow client would send: MLFLOW_TRACKING_TOKEN, or USERNAME + PASSWORD. As an
    unredirected header: urllib copies add_header()'s headers onto the request a redirect makes, to
    whatever host the Location names; these go to the server asked, never further."""
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        req.add_unredirected_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
        pair = f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}"
        req.add_unredirected_header("Authorization", basic_auth(pair))
    return req


def trust_ca(ca_file: str | None) -> None:
    """Verify MLflow servers by the CA bundle `ca_file` in this process and its children, the way MLflow's
    own clients are told to (MLFLOW_TRACKING_SERVER_CERT_PATH). Empty or None: nothing changes (the system
    CAs). Never set that variable to "": MLflow passes it to requests as `verify`, where "" means no
    verification at all."""
    if ca_file:
        os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"] = str(ca_file)


def tls_context() -> ssl.SSLContext:
    """For urllib calls to the MLflow server: verified as MLflow's clients verify it, by
    MLFLOW_TRACKING_SERVER_CERT_PATH when set, else the system CAs."""
    return ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)


def rest_read(uri: str, endpoint: str, params: dict | None = None, body: dict | None = None,
              timeout: float = 10.0) -> dict | None:
    """A read from <uri>/api/2.0/mlflow/<endpoint>: GET with query `params`, or POST with a JSON `body` (the
    searches that take one, e.g. runs/search). The JSON reply, or None when the resource does not exist."""
    if not uri.startswith(("http://", "https://")):
        raise RestUnavailable(f"{uri} is not an MLflow server")
    url = f"{uri.rstrip('/')}/api/2.0/mlflow/{endpoint}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    data = json.dumps(body).encode() if body is not None else None
    req = _auth(urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}))
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=tls_context()) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404 or "RESOURCE_DOES_NOT_EXIST" in e.read().decode(errors="replace"):
            return None
        raise RestUnavailable(f"{url}: HTTP {e.code}") from e
    except (OSError, ValueError) as e:
        raise RestUnavailable(f"{url}: {e}") from e


# --- users of MLflow's basic-auth app (a stack others can reach) -----------------------------------

# What the worker account may do beyond the servers' default permission (NO_PERMISSIONS: nothing):
# EDIT on the pipeline's experiment lets it create runs and log metrics, params, datasets, artifacts and
# logged models there, but not delete the experiment nor grant anyone access to it. Registered models need
# no grant: MLflow lets any signed-in user create one and makes the creator its MANAGE holder, so the
# worker registers versions and moves aliases of the models it created, and of no one else's.
WORKER_EXPERIMENT_PERMISSION = "EDIT"


@contextlib.contextmanager
def signed_in_as(username: str, password: str):
    """MLflow's clients (MlflowClient, the basic-auth app's AuthServiceClient) read their credentials from
    MLFLOW_TRACKING_USERNAME / _PASSWORD on every request: these for the calls inside, then the old ones."""
    keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(MLFLOW_TRACKING_USERNAME=username, MLFLOW_TRACKING_PASSWORD=password)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _already_exists(e: Exception) -> bool:
    return getattr(e, "error_code", None) == "RESOURCE_ALREADY_EXISTS"


def ensure_user(uri: str, admin: tuple[str, str], username: str, password: str,
                experiment: str = EXPERIMENT) -> None:
    """Create `username` on an MLflow server running the basic-auth app, or set its password if it exists,
    and give it what the pipeline's worker needs (WORKER_EXPERIMENT_PERMISSION on `experiment`, created
    here by the admin when missing). Idempotent, for a stack's start-up (devstack, the compose stack's
    mlflow-users); every call goes through MLflow's own auth client as `admin` (name, password)."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    auth = get_app_client("basic-auth", tracking_uri=uri)
    with signed_in_as(*admin):
        try:
            auth.create_user(username, password)
        except MlflowException as e:
            if not _already_exists(e):
                raise RuntimeError(f"cannot create MLflow user {username!r} at {uri}: {e}; check the admin "
                                   "credentials (MLFLOW_ADMIN_PASSWORD)") from e
            auth.update_user_password(username, password)
        exp_id = experiment_id(client(uri), experiment)
        try:
            auth.grant_user_permission(username, "experiment", exp_id, WORKER_EXPERIMENT_PERMISSION)
        except MlflowException as e:
            if not _already_exists(e):
                raise
            # granted on an earlier start: reset it, in case someone widened it since
            auth.revoke_user_permission(username, "experiment", exp_id)
            auth.grant_user_permission(username, "experiment", exp_id, WORKER_EXPERIMENT_PERMISSION)
