"""The weights of a registered model version, fetched as data and verified before anything reads them.

A registered version is a pyfunc stored *as code* (integrations/mlflow_model.py); loading it with
`mlflow.pyfunc.load_model` would run whatever the model's artifacts hold. The pipeline's own readers (the
sample stage and `python -m tasks.generate`, `python -m tasks.evaluate models:/...`) never do: they take only
`artifacts/checkpoint/model.safetensors` + `meta.json` of the version (the layout tasks/register.py logs)
and check the weights' sha256 against the version's `checkpoint_sha256` tag first (fetch_verified).
"""

from __future__ import annotations

# lazy imports: mlflow only when weights are fetched (a cycle with mlflow_store otherwise)
from dataclasses import dataclass
from pathlib import Path

SHA_TAG = "checkpoint_sha256"  # tasks/register.py tags each version (and its logged model) with it
CHECKPOINT_ARTIFACT = "artifacts/checkpoint"  # the pyfunc's `checkpoint` artifact, inside the logged model
WEIGHTS, META = "model.safetensors", "meta.json"
URI_FORMS = ("models:/<name>@<alias>, models:/<name>/<version>, models:/<name>/latest, models:/<model_id> "
             "or a local checkpoint directory")


class UntrustedWeights(RuntimeError):
    """The weights a model URI points at cannot be shown to be the registered checkpoint's (sha256 mismatch,
    no checkpoint_sha256 tag, an unsupported URI); the message names the version, the hashes and the fix."""


@dataclass
class _Source:
    """Where a model URI's weights live and what they must hash to."""

    label: str  # "model 'x' version 3", for messages
    artifact_uri: str  # the logged model's artifact root
    expected: str | None  # the checkpoint_sha256 tag (None: missing)
    name: str | None = None
    version: str | None = None
    checkpoint: str | None = None  # the `checkpoint` tag: where the registered checkpoint was


def _parse_models_uri(model_uri: str) -> tuple[str, str | None, str | None]:
    """models:/name@alias -> (name, alias, None); models:/name/version -> (name, None, version);
    models:/<model_id> -> (model_id, None, None)."""
    rest = model_uri[len("models:/"):].strip("/")
    if "@" in rest:
        name, alias = rest.rsplit("@", 1)
        if name and alias and "/" not in alias:
            return name, alias, None
    elif "/" in rest:
        name, version = rest.rsplit("/", 1)
        if name and version:
            return name, None, version
    elif rest:
        return rest, None, None
    raise UntrustedWeights(f"{model_uri} is not a model URI this command reads; give {URI_FORMS}")


def _registry_source(mlc, model_uri: str) -> _Source:
    """Resolve a models:/ URI to one concrete model version (or logged model) and its expected sha256."""
    from integrations import mlflow_store as store

    name, alias, version = _parse_models_uri(model_uri)
    if alias is None and version is None:  # models:/<model_id>: a logged model, not a registry version
        lm = mlc.get_logged_model(name)
        return _Source(f"logged model {name}", lm.artifact_location, (lm.tags or {}).get(SHA_TAG))
    if (alias or version).lower() == "latest":  # MLflow reserves the alias name `latest`: the newest version
        versions = mlc.search_model_versions(f"name = {store.quoted(name)}")
        if not versions:
            raise UntrustedWeights(f"registered model {name!r} has no versions; register one with "
                                   "`python -m tasks.register <checkpoint>`")
        mv = max(versions, key=lambda v: int(v.version))
    elif alias is not None:
        mv = mlc.get_model_version_by_alias(name, alias)
    elif version.isdigit():
        mv = mlc.get_model_version(name, version)
    else:
        raise UntrustedWeights(f"{model_uri}: {version!r} is not a version number (model stages are not "
                               f"supported); give {URI_FORMS}")
    tags = dict(mv.tags or {})
    return _Source(f"model {name!r} version {mv.version}", mlc.get_model_version_download_uri(name, mv.version),
                   tags.get(SHA_TAG), name=name, version=str(mv.version), checkpoint=tags.get("checkpoint"))


def fix_for(src: _Source) -> str:
    ckpt = src.checkpoint or "<checkpoint>"
    if src.version is None:
        return f"register the checkpoint these weights came from with `python -m tasks.register {ckpt}`"
    return (f"delete this version (MLflow UI, or MlflowClient().delete_model_version({src.name!r}, "
            f"{src.version!r})), then re-register the checkpoint with `python -m tasks.register {ckpt}` "
            "(registration is idempotent per checkpoint, so the bad version must go first) and let its "
            "aliases move to the new version")


def fetch_verified(model_uri: str, dst: Path, tracking_uri: str | None = None) -> tuple[Path, _Source]:
    """Download the weights (model.safetensors) and their config (meta.json) of `model_uri` into `dst`
    with MLflow's artifact API, and check the weights' sha256 against the version's checkpoint_sha256 tag
    before anything reads them. Returns the directory holding both files (a checkpoint, weights only).
    UntrustedWeights on a mismatch or a missing tag; MlflowException / OSError when MLflow cannot answer."""
    import mlflow.artifacts

    from gptcore.checkpoints.run_files import read_meta
    from gptcore.files import file_sha256
    from integrations import mlflow_store as store

    uri = tracking_uri or store.tracking_uri()
    store.use_store(uri)  # mlflow-artifacts: locations resolve through this server
    name, alias, version = _parse_models_uri(model_uri)
    # on a shared server any user may create a name a person might type: the pipeline reads only its own
    # models, as it registers only into them (mlflow_store.own_model); a model id names one logged model
    if (alias or version) and store.signed_in() and store.model_owned_over_rest(uri, name) is False:
        raise UntrustedWeights(
            f"registered model {name!r} is not the pipeline's: experiment {store.EXPERIMENT!r} records no model "
            "of that name created by the pipeline's admin or worker (another user created it); refusing to load "
            "its weights. Give one of the pipeline's models, or a checkpoint directory you trust; if it is a "
            "model the pipeline made before it recorded its models, the MLflow admin checks it and runs "
            "mlflow_store.adopt_model")
    src = _registry_source(store.client(uri), model_uri)
    if not src.expected:
        raise UntrustedWeights(f"{src.label} ({model_uri}) has no {SHA_TAG} tag, so its weights cannot be "
                               f"verified; refusing to load them. Fix: {fix_for(src)}")
    dst.mkdir(parents=True, exist_ok=True)

    def download(name: str) -> None:  # only meta.json and the weights: nothing of the stored code is fetched
        mlflow.artifacts.download_artifacts(artifact_uri=f"{src.artifact_uri.rstrip('/')}/{CHECKPOINT_ARTIFACT}/"
                                            f"{name}", dst_path=str(dst), tracking_uri=uri)

    download(META)  # checked first: the weights are fetched, and the model built, only for a sound meta.json
    check_meta(read_meta(dst), src, model_uri)
    download(WEIGHTS)
    actual = file_sha256(dst / WEIGHTS)
    if actual != src.expected:
        raise UntrustedWeights(
            f"{src.label} ({model_uri}): its weights ({CHECKPOINT_ARTIFACT}/{WEIGHTS}) have sha256 {actual}, but "
            f"the version's {SHA_TAG} tag records {src.expected}: the registered weights were changed after "
            f"registration; refusing to load them. Fix: {fix_for(src)}")
    return dst, src


def check_meta(meta: dict, src: _Source, model_uri: str) -> None:
    """A version's meta.json is someone's data until shown otherwise: it must record the weights the tag
    names (so its config belongs to them) and a model shape within gptcore.config's bounds (so building
    the model cannot exhaust the worker's memory). UntrustedWeights naming the fix otherwise."""
    from gptcore.config import ConfigError, model_config_from

    where = f"{src.label} ({model_uri}): {CHECKPOINT_ARTIFACT}/{META}"
    recorded = meta.get("model_sha256")
    if not recorded:
        raise UntrustedWeights(f"{where} records no model_sha256, so it cannot be shown to describe the "
                               f"registered weights; refusing to load them. Fix: {fix_for(src)}")
    if recorded != src.expected:  # meta.json belongs to other weights: do not trust its config
        raise UntrustedWeights(f"{where} records weights with sha256 {recorded}, but the version's {SHA_TAG} "
                               f"tag records {src.expected}: the registered files were changed after "
                               f"registration; refusing to load them. Fix: {fix_for(src)}")
    try:
        model_config_from(meta.get("model_config"))
    except (ConfigError, TypeError) as e:
        raise UntrustedWeights(f"{where} has no usable model_config ({e}); refusing to build the model. "
                               f"Fix: {fix_for(src)}") from None
