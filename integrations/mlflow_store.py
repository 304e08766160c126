"""Where MLflow lives, and the lookups every stage shares (register, evaluate, generate, the flow, the
metrics shipper in integrations/tracking.py).

    tracking_uri()            $MLFLOW_TRACKING_URI, else the `make demo` server of this pipeline home while it
                              runs, else the embedded SQLite store under the pipeline home
    client(uri)               an MlflowClient for tracking and registry
    rest_read(uri, endpoint)  a read through MLflow's REST API without importing mlflow (a second or more):
                              the flow's skip decisions use it against a tracking server
    ensure_user(uri, admin, ...)  the worker's user on a server with MLflow's basic-auth app, and its grants
    own_model(mlc, name)      the registered model `name` is the pipeline's (created and recorded), or refused

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

from gptcore.config import ConfigError
from gptcore.files import pipeline_home, read_json
from gptcore.overrides import flatten
from gptcore.security import check_name

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
    check_name("experiment", name)  # an MLflow name someone may pass on a command line: the one name rule
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
# logged models there, but not delete the experiment nor grant anyone access to it. MANAGE on the pipeline's
# registered models (the presets', which ensure_user has the admin create, and those it creates itself):
# register versions, move aliases, remove a duplicate version. Models of anyone else it refuses to use
# (own_model).
WORKER_EXPERIMENT_PERMISSION = "EDIT"
WORKER_MODEL_PERMISSION = "MANAGE"


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
                experiment: str = EXPERIMENT, models: list[str] | None = None) -> list[str]:
    """Create `username` on an MLflow server running the basic-auth app, or set its password if it exists,
    and give it what the pipeline's worker needs (WORKER_EXPERIMENT_PERMISSION on `experiment`, created
    here by the admin when missing; WORKER_MODEL_PERMISSION on the pipeline's registered models `models`,
    default every preset's, created here by the admin: ensure_models). Idempotent, for a stack's start-up
    (devstack, the compose stack's mlflow-users); every call goes through MLflow's own auth client as
    `admin` (name, password). Returns the problems found (squatted model names), each also logged."""
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
        _grant(auth, username, "experiment", experiment_id(client(uri), experiment), WORKER_EXPERIMENT_PERMISSION)
        return ensure_models(uri, auth, username, models, experiment)


# --- the pipeline's registered models: its own, never a name someone else took ----------------------
#
# Any signed-in user may create a registered model, and MLflow makes the creator its MANAGE holder, who
# may then grant the worker EDIT: a model's name, its tags and the worker's own permission on it prove
# nothing about who controls it. What a squatter cannot write is the pipeline's experiment (the admin
# creates it; only the admin and the worker may change it): the creator of each pipeline model (the admin
# at stack start, or the worker for a name of its own) records there, as the tag OWNERSHIP_TAG + name, the
# model's creation timestamp, which the server sets. A model is the pipeline's only when that record
# matches the model now holding the name: a model made under the name after the pipeline's was deleted
# carries another timestamp. Checked only for a signed-in client (a server with authentication): without
# it everyone may do everything, and there is no owner to protect.

OWNERSHIP_TAG = "gptpipe.registered_model."
MODEL_DESCRIPTION = "GPT-2 ({name}) checkpoints of the gptpipe pretraining pipeline; alias `best` = lowest val loss"


class ModelOwnershipError(RuntimeError):
    """A registered model name taken by a model the pipeline did not create; the message says what to do."""


def signed_in() -> bool:
    """Whether this process talks to MLflow as a user (a server with authentication)."""
    return bool(os.environ.get("MLFLOW_TRACKING_USERNAME") or os.environ.get("MLFLOW_TRACKING_TOKEN"))


def _not_ours(name: str, why: str) -> ModelOwnershipError:
    return ModelOwnershipError(
        f"registered model {name!r} is not the pipeline's: {why}. The pipeline never registers into a "
        f"model it did not create. Register under another name (the flow's model_name, or `tasks.register "
        f"--name`), or have the MLflow admin check that model's versions, delete it and restart the stack's "
        f"mlflow-users (or devstack), which creates {name!r} for the pipeline if it is a preset's name. A model "
        f"the pipeline made before it recorded its models: the admin checks it and runs adopt_model")


def own_model(mlc, name: str, experiment: str = EXPERIMENT) -> str:
    """Make sure registered model `name` is the pipeline's: create it and record it in `experiment` when
    missing; refuse (ModelOwnershipError) one that someone else created. Returns "created" or "owned"."""
    from mlflow.exceptions import MlflowException

    exp = mlc.get_experiment_by_name(experiment)
    if exp is None:
        raise _not_ours(name, f"the pipeline's experiment {experiment!r}, which records its models, does not "
                              "exist (or this user may not read it)")
    # Create first: to a non-admin, basic-auth answers a missing model and someone else's alike (403)
    try:
        model = mlc.create_registered_model(name, description=MODEL_DESCRIPTION.format(name=name))
    except MlflowException as e:
        if not _already_exists(e):
            raise
    else:  # ours: we created it. Recorded where only the admin and the worker may write.
        mlc.set_experiment_tag(exp.experiment_id, OWNERSHIP_TAG + name, str(model.creation_timestamp))
        return "created"
    try:
        model = mlc.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "PERMISSION_DENIED":
            raise _not_ours(name, "another user created it and this user may not even read it") from e
        raise
    if exp.tags.get(OWNERSHIP_TAG + name) != str(model.creation_timestamp):
        raise _not_ours(name, f"experiment {experiment!r} records no model of that name created by the "
                              "pipeline's admin or worker (someone else created it)")
    return "owned"


def model_owned_over_rest(uri: str, name: str, experiment: str = EXPERIMENT) -> bool | None:
    """own_model's check as two REST reads, for the flow's skip decision: True when `name` is the
    pipeline's, False when it is someone else's, None when it does not exist."""
    model = (rest_read(uri, "registered-models/get", {"name": name}) or {}).get("registered_model")
    if model is None:
        return None
    exp = (rest_read(uri, "experiments/get-by-name", {"experiment_name": experiment}) or {}).get("experiment")
    tags = {t["key"]: t["value"] for t in (exp or {}).get("tags", [])}
    return tags.get(OWNERSHIP_TAG + name) == str(model.get("creation_timestamp"))


def adopt_model(mlc, name: str, experiment: str = EXPERIMENT) -> None:
    """As the admin, after checking its versions: record existing model `name` as the pipeline's (a model
    the worker created before the pipeline recorded its models). Then run ensure_user again for the grant:

        MLFLOW_TRACKING_USERNAME=admin MLFLOW_TRACKING_PASSWORD=... python -c "from integrations import \
        mlflow_store as s; s.adopt_model(s.client(), 'gpt2-124m')"
    """
    model = mlc.get_registered_model(name)
    mlc.set_experiment_tag(experiment_id(mlc, experiment), OWNERSHIP_TAG + name, str(model.creation_timestamp))


def model_owners(auth, name: str, uri: str) -> str:
    """As the admin: the users holding MANAGE on registered model `name` (its creator and whoever it
    shared it with), for the message naming them; "" when they cannot be listed."""
    try:
        users = (rest_read(uri, "users/list") or {}).get("users", [])
        return ", ".join(sorted(
            u["username"] for u in users if not u.get("is_admin")
            and auth.get_user_permission(u["username"], "registered_model", name).permission == "MANAGE"))
    except Exception:  # only the message loses the names
        return ""


def ensure_models(uri: str, auth, worker: str, models: list[str] | None = None,
                  experiment: str = EXPERIMENT) -> list[str]:
    """As the admin (auth: its basic-auth client, signed in): create the pipeline's registered models
    `models` (default: every preset's name) and give `worker` WORKER_MODEL_PERMISSION on each. A name
    someone else took gets nothing: it is logged with its owners, and registration refuses it."""
    import logging

    from gptcore.presets import PRESETS

    problems = []
    mlc = client(uri)
    for name in models if models is not None else sorted(PRESETS):
        try:
            own_model(mlc, name, experiment)
        except ModelOwnershipError as e:
            owners = model_owners(auth, name, uri)
            problems.append(f"{e}" + (f" Its MANAGE holders: {owners}." if owners else ""))
            logging.getLogger("gptpipe.mlflow").warning("%s", problems[-1])
            continue
        _grant(auth, worker, "registered_model", name, WORKER_MODEL_PERMISSION)
    return problems


def _grant(auth, username: str, resource_type: str, resource_id: str, permission: str) -> None:
    """Exactly `permission` for `username` on the resource: granted, or reset if granted before (in case
    someone widened it since)."""
    from mlflow.exceptions import MlflowException

    try:
        auth.grant_user_permission(username, resource_type, resource_id, permission)
    except MlflowException as e:
        if not _already_exists(e):
            raise
        auth.revoke_user_permission(username, resource_type, resource_id)
        auth.grant_user_permission(username, resource_type, resource_id, permission)
