"""Register a checkpoint as a version of the preset's one registered model (MLflow 3 style).

    register_checkpoint("var/runs/tiny-cpu/checkpoints/step_00000120")
    -> {"name": "tiny-cpu", "version": "3", "aliases": ["best", "latest"], "created": True, ...}

What a registration does:
- logs a LoggedModel (MLflow 3: models live outside run artifacts, `models:/<model_id>`) linked to the
  training run's MLflow run (the one integrations.tracking ships metrics into): the pyfunc text generator
  of integrations/mlflow_model.py with the checkpoint's weights, plus the Hugging Face export under `hf/`;
- records the checkpoint's measurements as **metrics of the logged model** (MLflow 3's model metrics, what
  the UI's Models tab sorts and charts by): `val/loss` (tied to the validation dataset), every
  evaluation's `<name>/<metric>` with its `_stderr` (gptcore/evals), `train/step` and `train/tokens_seen`
  (tied to the training dataset); the result names each evaluation's headline metric (`headline`);
- creates a version of the registered model `<preset>` (e.g. `gpt2-124m`: one stable model, never one
  per run) from it, tagged with what identifies it: step, manifest id, config hash, run name, code
  version, flow run id, the weights' sha256 and the recipe (optimizer, schedule), all set in the creating
  call;
- moves the aliases: `best` to the version with the lowest `val/loss` metric (tasks.leaderboard.best_version:
  ties go to the older version, no finite val loss is never best). "latest" is MLflow's own
  `models:/<name>/latest` (newest version; MLflow reserves `latest` as an alias name, so
  `resolve_model_uri` maps `@latest` to it).

Idempotent: a checkpoint already registered (same `checkpoint_sha256` tag) returns the existing
version, logs the measurements it lacks (e.g. HellaSwag from a later evaluation), and the alias step runs
again, so a retry after a partial failure converges.
"""

from __future__ import annotations

# lazy imports: mlflow and torch only where there is work; the flow decides to skip over REST without them
import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.checkpoints.run_files import (
    CONSOLIDATED_DIR,
    META_FILE,
    RUN_FILE,
    CheckpointError,
    consolidation_source,
    is_sharded,
    read_meta,
)
from gptcore.config import ConfigError
from gptcore.evals.record import checkpoint_metrics, headlines
from gptcore.files import file_sha256, read_json
from gptcore.security import check_name
from integrations import mlflow_store as store
from integrations.progress import step_label
from tasks.leaderboard import best_version, leaderboard
from tasks.stage import FlowRun, Stage

log = logging.getLogger("gptpipe.register")

BEST = "best"
MODEL_FILE = Path(__file__).resolve().parent.parent / "integrations" / "mlflow_model.py"
GPTCORE_DIR = Path(__file__).resolve().parent.parent / "gptcore"


class RegistryError(RuntimeError):
    """A checkpoint that cannot be registered; the message names the problem and the fix."""


def _requirements() -> list[str]:
    # Pinned to what produced the model; local version labels (+cpu, +cu124) are not on PyPI.
    out = []
    for pkg in ("torch", "tiktoken", "safetensors", "numpy"):
        try:
            out.append(f"{pkg}=={metadata.version(pkg).split('+')[0]}")
        except metadata.PackageNotFoundError:
            out.append(pkg)
    return out


def _version_tags(ckpt_dir: Path, meta: dict, sha: str, flow_run_id: str | None) -> dict[str, str]:
    """What identifies the version (measurements are metrics: checkpoint_metrics)."""
    optim = (meta.get("config") or {}).get("optim") or {}
    tags = {
        "step": meta["step"], "manifest_id": meta.get("manifest_id"), "config_hash": meta.get("identity_hash"),
        "run_name": meta.get("run_name"), "code_version": store.code_version(),
        "flow_run_id": flow_run_id, "checkpoint_sha256": sha, "checkpoint": str(ckpt_dir.resolve()),
        # the recipe, so versions trained either way stay comparable in the registry
        "optimizer": optim.get("name", "adamw"), "schedule": optim.get("schedule", "cosine"),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


def _read_checkpoint(ckpt_dir: Path) -> tuple[dict, str, Path]:
    """The step's meta, the sha256 of its whole model, and the directory holding that model as
    model.safetensors + meta.json (what a version logs): the step itself, or for a sharded step (FSDP2)
    its consolidation, written once on the CPU from the verified shards (checkpoint.consolidate). Why here
    and not in the trainer: only registered steps need one file, and the trainer never gathers the model."""
    meta = read_meta(ckpt_dir) if (ckpt_dir / META_FILE).is_file() else {}
    if is_sharded(meta):
        from gptcore.checkpoints.checkpoint import consolidate  # torch: only for a sharded step's first registration

        try:
            whole = consolidate(ckpt_dir)
        except CheckpointError as e:
            raise RegistryError(f"{ckpt_dir} cannot be consolidated into one model ({e}); register another "
                                "checkpoint") from e
    else:
        whole = ckpt_dir
    if not (whole / META_FILE).is_file() or not (whole / "model.safetensors").is_file():
        raise RegistryError(f"{ckpt_dir} is not a checkpoint (needs meta.json and model.safetensors, or a "
                            "sharded step's shards/); pass a directory like "
                            "<home>/runs/<run>/checkpoints/step_00001000")
    sha = file_sha256(whole / "model.safetensors")
    recorded = (meta if whole == ckpt_dir else read_meta(whole)).get("model_sha256")
    if recorded and recorded != sha:
        raise RegistryError(f"{whole}/model.safetensors has sha256 {sha} but its meta.json records "
                            f"{recorded}: the checkpoint is corrupt; register another one")
    return meta, sha, whole


def _known_sha(ckpt_dir: Path, meta: dict) -> str | None:
    """The whole model's sha256 as recorded (no hashing, no torch): meta.json's, or a sharded step's
    consolidation's. None for a sharded step not consolidated yet, which no registration has seen."""
    if not is_sharded(meta):
        return meta.get("model_sha256")
    done = read_json(ckpt_dir / CONSOLIDATED_DIR / META_FILE, {})
    same = done.get("consolidated_from") == consolidation_source(meta)
    return done.get("model_sha256") if same else None


def _same_checkpoint_filter(name: str, sha: str, ident: str | None) -> str:
    """Versions of `name` registered from this checkpoint: the same weights (sha256) of the same run
    identity (config_hash). Equal weights from another run are another registration."""
    query = f"name = {store.quoted(name)} and tags.checkpoint_sha256 = {store.quoted(sha)}"
    return query + (f" and tags.config_hash = {store.quoted(ident)}" if ident else "")


def _existing_version(mlc, name: str, sha: str, ident: str | None):
    """The oldest version of _same_checkpoint_filter, or None."""
    found = mlc.search_model_versions(_same_checkpoint_filter(name, sha, ident))
    return min(found, key=lambda mv: int(mv.version)) if found else None


def _delete_logged_model(mlc, model_id: str) -> None:
    """Remove a duplicate version's logged model. On a server with MLflow's basic-auth app the worker holds
    EDIT on the experiment, which cannot delete (see mlflow_store.WORKER_EXPERIMENT_PERMISSION): the
    logged model then stays, with no version pointing at it, rather than failing the registration."""
    from mlflow.exceptions import MlflowException

    try:
        mlc.delete_logged_model(model_id)
    except MlflowException as e:
        if e.error_code != "PERMISSION_DENIED":
            raise
        log.warning("could not delete the duplicate's logged model %s (%s); it is left unused", model_id, e)


def _keep_oldest(mlc, name: str, sha: str, ident: str | None, mine):
    """After creating `mine`: if a concurrent registration of the same checkpoint created one too, the
    oldest stays and the others are removed by their creators (each sees every older version, so exactly
    one survives, whatever the interleaving). Returns the survivor."""
    oldest = _existing_version(mlc, name, sha, ident)
    if oldest is None or oldest.version == mine.version:
        return mine
    mlc.delete_model_version(name, mine.version)
    if mine.model_id:
        _delete_logged_model(mlc, mine.model_id)
    log.info("%s version %s duplicated version %s (a concurrent registration); removed it", name,
             mine.version, oldest.version)
    return oldest


def _log_model(mlc, uri: str, ckpt_dir: Path, whole: Path, meta: dict, name: str, tags: dict, hf: bool,
               experiment: str) -> tuple[str, str]:
    """Log the LoggedModel (pyfunc + HF export of the whole model in `whole`) under the training run;
    returns its model_id and that run's id."""
    import mlflow
    from mlflow.entities import LoggedModelOutput

    from gptcore.checkpoints.checkpoint import load_model
    from integrations.mlflow_model import INPUT_EXAMPLE, SIGNATURE

    run = store.find_or_create_run(mlc, meta["run_name"], meta["identity_hash"], experiment).info
    store.use_store(uri)  # the fluent log_model below resolves the store from it
    params = store.as_params({"model": meta.get("model_config") or meta["config"]["model"]})
    lm = mlflow.initialize_logged_model(name=name, source_run_id=run.run_id, experiment_id=run.experiment_id,
                                        tags=tags, params=params, model_type="gpt2-text-generation")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # the inference weights: the checkpoint without its trainer state
            ck = Path(tmp) / "checkpoint"
            ck.mkdir()
            for f in ("model.safetensors", META_FILE):
                shutil.copy2(whole / f, ck / f)
            mlflow.pyfunc.log_model(
                name=name, python_model=str(MODEL_FILE), artifacts={"checkpoint": str(ck)},
                code_paths=[str(GPTCORE_DIR)], signature=SIGNATURE, input_example=INPUT_EXAMPLE,
                pip_requirements=_requirements(),
                model_id=lm.model_id, step=int(meta["step"]))
            # the run lists the model among its outputs, at the checkpoint's step
            mlc.log_outputs(run.run_id, [LoggedModelOutput(lm.model_id, step=int(meta["step"]))])
            _log_metrics(mlc, run.run_id, lm.model_id, ckpt_dir, meta)
            if hf:
                from gptcore.model.hf import export_hf

                model, _ = load_model(whole, device="cpu", verify=False)  # sha256 checked above
                export_hf(model, Path(tmp) / "hf")
                mlc.log_model_artifacts(lm.model_id, str(Path(tmp) / "hf"), artifact_path="hf")
        mlc.finalize_logged_model(lm.model_id, "READY")
    except BaseException:
        mlc.finalize_logged_model(lm.model_id, "FAILED")
        raise
    return lm.model_id, run.run_id


def _log_metrics(mlc, run_id: str, model_id: str, ckpt_dir: Path, meta: dict, have: set[str] = frozenset()):
    """The checkpoint's measurements as metrics of its logged model (those not in `have`), in one batch,
    at the checkpoint's step. Lineage rides along: `val/loss` is tied to the validation dataset and
    `train/tokens_seen` to the training dataset (name + manifest digest), and the run lists both as its
    inputs, so models:/<name>/<version> -> dataset -> source (hub repo@commit or local path) is traceable
    in the UI."""
    from mlflow.entities import Metric

    dataset_dir = read_json(ckpt_dir.parent.parent / RUN_FILE, {}).get("dataset_dir")  # the trainer's record
    datasets = store.log_datasets(mlc, run_id, dataset_dir) if dataset_dir else {}
    if not datasets:
        log.warning("no manifest in %s: the model version carries no dataset lineage", dataset_dir)
    tied = {"val/loss": datasets.get("validation"), "train/tokens_seen": datasets.get("training")}
    step, now = int(meta["step"]), int(time.time() * 1000)
    batch = [Metric(key, value, now, step, model_id=model_id,
                    dataset_name=tied[key].name if tied.get(key) else None,
                    dataset_digest=tied[key].digest if tied.get(key) else None)
             for key, value in checkpoint_metrics(ckpt_dir, meta).items() if key not in have]
    if batch:
        mlc.log_batch(run_id, metrics=batch, synchronous=True)


def _move_best(mlc, name: str) -> None:
    """Point `best` at the version with the lowest val loss (tasks.leaderboard.best_version)."""
    board = leaderboard(name, mlc=mlc)
    best = best_version(board)
    holder = next((str(v) for v, a in zip(board["version"], board["aliases"], strict=True) if BEST in a.split(",")),
                  None)
    if best is not None and holder != best:
        mlc.set_registered_model_alias(name, BEST, best)


def register_checkpoint(ckpt_dir: str | Path, model_name: str | None = None, tracking_uri: str | None = None,
                        flow_run_id: str | None = None, hf: bool = True,
                        experiment: str = store.EXPERIMENT) -> dict:
    """Register one checkpoint (idempotent); returns the version's name, number, aliases and tags."""
    from mlflow.exceptions import MlflowException

    ckpt_dir = Path(ckpt_dir)
    meta, sha, whole = _read_checkpoint(ckpt_dir)
    name = model_name or meta["config"]["preset"]
    uri = tracking_uri or store.tracking_uri()
    mlc = store.client(uri)
    if store.signed_in():  # a server with users: the model must be the pipeline's, not a squatter's
        try:
            store.own_model(mlc, name, experiment)
        except store.ModelOwnershipError as e:
            raise RegistryError(str(e)) from e
    else:  # everyone may do everything: there is no owner to check
        try:
            mlc.get_registered_model(name)
        except MlflowException:
            try:
                mlc.create_registered_model(name, description=store.MODEL_DESCRIPTION.format(name=name))
            except MlflowException:  # created concurrently
                mlc.get_registered_model(name)
    tags = _version_tags(ckpt_dir, meta, sha, flow_run_id)
    ident = meta.get("identity_hash")
    mv, created = _existing_version(mlc, name, sha, ident), False
    if mv is not None:
        # already registered: only fill in what was not known then (e.g. HellaSwag from a later eval)
        for k, v in tags.items():
            if k not in mv.tags:
                mlc.set_model_version_tag(name, mv.version, k, v)
        mv = mlc.get_model_version(name, mv.version)
        model_id = mv.model_id or mv.source.removeprefix("models:/")  # the server may leave model_id unset
        if model_id and mv.run_id:
            have = {m.key for m in mlc.get_logged_model(model_id).metrics or []}
            _log_metrics(mlc, mv.run_id, model_id, ckpt_dir, meta, have)
    else:
        model_id, run_id = _log_model(mlc, uri, ckpt_dir, whole, meta, name, tags, hf, experiment)
        # the sha256 tag (the idempotency key) arrives with the version in one call
        mine = mlc.create_model_version(name, source=f"models:/{model_id}", run_id=run_id, tags=tags,
                                        model_id=model_id)
        mv = _keep_oldest(mlc, name, sha, ident, mine)
        created = mv.version == mine.version
        if created:
            log.info("registered %s as %s version %s", ckpt_dir, name, mv.version)
    _move_best(mlc, name)
    return {**_describe(mlc, name, mv.version, created, uri), "headline": headlines(checkpoint_metrics(ckpt_dir, meta))}


def _describe(mlc, name: str, version, created: bool, uri: str) -> dict:
    mv = mlc.get_model_version(name, str(version))
    newest = max(int(v.version) for v in mlc.search_model_versions(f"name = {store.quoted(name)}"))
    aliases = sorted(mv.aliases) + (["latest"] if int(mv.version) == newest else [])
    return {"name": name, "version": str(mv.version), "aliases": aliases, "created": created,
            "model_uri": f"models:/{name}/{mv.version}", "run_id": mv.run_id,
            "model_id": mv.model_id or mv.source.removeprefix("models:/"),  # the LoggedModel
            "tags": dict(mv.tags), "tracking_uri": uri}


def registered_version(ckpt_dir: str | Path, model_name: str | None = None,
                       tracking_uri: str | None = None) -> dict | None:
    """The version already holding this checkpoint with every measurement the checkpoint has (as
    register_checkpoint describes it, with created=False), or None: not registered, or its logged model
    lacks a metric of eval.json, which the register task then logs (the register stage is not done while
    one is missing: a re-run that added an evaluation must bring its scores to the model). Read-only, for
    a flow deciding whether to register: against a tracking server it reads over REST without importing
    mlflow, and it trusts the sha256 that meta.json records (the register task itself hashes the file)."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    sha = _known_sha(ckpt_dir, meta)
    if sha is None and not is_sharded(meta):  # a whole checkpoint that records none: hash the file
        sha = _read_checkpoint(ckpt_dir)[1]
    if sha is None:
        return None  # a sharded step not consolidated yet: never registered
    name = model_name or meta["config"]["preset"]
    uri = tracking_uri or store.tracking_uri()
    try:
        if store.signed_in() and store.model_owned_over_rest(uri, name) is False:
            return None  # someone else's model: the register task refuses it, with the reason
        found = _registered_over_rest(uri, name, sha, meta.get("identity_hash"))
        if found is not None and found["model_id"]:
            reply = store.rest_read(uri, f"logged-models/{found['model_id']}") or {}
            have = {m["key"] for m in (((reply.get("model") or {}).get("data") or {}).get("metrics") or [])}
            if lacks_metrics(ckpt_dir, meta, have):
                return None  # the register task logs what is missing
        return found
    except store.RestUnavailable:
        if store.signed_in():  # whose model it is went unchecked: the register task checks, and is idempotent
            return None
        # the embedded store, or a server the plain REST read cannot use: ask the client
    from mlflow.exceptions import MlflowException

    mlc = store.client(uri)
    try:
        mv = _existing_version(mlc, name, sha, meta.get("identity_hash"))
        model_id = mv and (mv.model_id or mv.source.removeprefix("models:/"))
        if model_id and lacks_metrics(ckpt_dir, meta, {m.key for m in mlc.get_logged_model(model_id).metrics or []}):
            return None  # the register task logs what is missing
    except MlflowException:
        return None
    return None if mv is None else _describe(mlc, name, mv.version, False, uri)


def lacks_metrics(ckpt_dir: Path, meta: dict, have: set[str]) -> bool:
    """Whether the checkpoint has measurements (eval.json: e.g. a harness task added on a re-run) that its
    logged model does not: then the version holds the checkpoint but the register stage is not done."""
    return not set(checkpoint_metrics(Path(ckpt_dir), meta)) <= have


def _registered_over_rest(uri: str, name: str, sha: str, ident: str | None) -> dict | None:
    def first(filter_string: str, order_by: str) -> dict | None:  # the first matching version, in that order
        reply = store.rest_read(uri, "model-versions/search", {"filter": filter_string, "order_by": order_by,
                                                               "max_results": 1})
        return ((reply or {}).get("model_versions") or [None])[0]

    mv = first(_same_checkpoint_filter(name, sha, ident), "version_number ASC")  # the oldest, as _existing_version
    if mv is None:
        return None
    full = (store.rest_read(uri, "model-versions/get", {"name": name, "version": mv["version"]}) or {})
    full = full.get("model_version") or mv
    newest = first(f"name = {store.quoted(name)}", "version_number DESC")
    aliases = sorted(full.get("aliases", [])) + (["latest"] if newest and newest["version"] == mv["version"] else [])
    return {"name": name, "version": str(mv["version"]), "aliases": aliases, "created": False,
            "model_uri": f"models:/{name}/{mv['version']}", "run_id": full.get("run_id"),
            "model_id": full.get("model_id") or full.get("source", "").removeprefix("models:/"),
            "tags": {t["key"]: t["value"] for t in mv.get("tags", [])}, "tracking_uri": uri}


# no Prefect caching: the registry itself is the idempotency record (checkpoint_sha256 + config_hash tags)
def _run_name() -> str:
    """"register tiny-cpu step 120": short, for the flow-run graph."""
    from prefect.runtime import task_run

    p = task_run.parameters
    return f"register {p.get('model_name') or ''} {step_label(p['ckpt_dir'])}".replace("  ", " ")


register_task = task(name="register", task_run_name=_run_name, retries=3, retry_delay_seconds=[10, 30, 60],
                     cache_policy=NO_CACHE)(register_checkpoint)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Register a checkpoint in the MLflow model registry.")
    p.add_argument("checkpoint", help="a checkpoint dir, e.g. var/runs/tiny-cpu/checkpoints/step_00000120")
    p.add_argument("--name", default=None, help="registered model name (default: the config preset)")
    p.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or the embedded store")
    p.add_argument("--flow-run-id", default=os.environ.get("PREFECT__FLOW_RUN_ID"))
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face export artifact")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # an MLflow name and a filter value: the one name rule (gptcore.config), checked before anything
        if args.name is not None:
            check_name("--name", args.name)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mlflow.exceptions import MlflowException

    try:
        out = register_checkpoint(args.checkpoint, args.name, args.tracking_uri, args.flow_run_id,
                                  hf=not args.no_hf)
    except (RegistryError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MlflowException as e:
        print(f"error: the MLflow tracking server {args.tracking_uri or store.tracking_uri()} failed: {e}. Check "
              "that it is running (MLFLOW_TRACKING_URI or --tracking-uri), then run again: registration is "
              "idempotent", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in out.items() if k != "tags"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())


class RegisterStage(Stage):
    """The checkpoint as a version of the pipeline's registered model with its measurements; stored when a
    version holds this checkpoint and every measurement of it (registered_version: read-only, over REST);
    the leaderboard artifact when it ran."""
    name = "register"
    switch = "register"

    def stored(self, run: FlowRun) -> dict | None:
        return registered_version(run.ckpt, run.registered_name)

    def work(self, run: FlowRun) -> dict:
        from prefect.runtime import flow_run

        from tasks.leaderboard import publish_leaderboard

        reg = register_task(run.ckpt, run.registered_name, flow_run_id=flow_run.get_id())
        publish_leaderboard(run.registered_name)  # the model's versions side by side, as a table artifact
        return reg

    def reason(self, run: FlowRun, reg: dict, ran: bool) -> str:
        if not ran:
            return f"{reg['model_uri']} holds this checkpoint and every measurement of it"
        scores = ", ".join(f"{k} {v}" for k, v in reg.get("headline", {}).items())
        return reg["model_uri"] + (f" ({scores})" if scores else "")

    def keep(self, run: FlowRun, reg: dict) -> None:
        run.reg = reg

    def task_run_name(self, run: FlowRun) -> str:
        return f"register {run.registered_name} {step_label(run.ckpt)}"


STAGE = RegisterStage()
