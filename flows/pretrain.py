"""The `pretrain` flow: download -> tokenize-and-shard -> train -> evaluate -> register -> sample.

    pretrain(preset="tiny-cpu", overrides={"train.max_steps": 100})
    prefect deployment run pretrain/tiny --param overrides='{"train.max_steps": 100}'

The config is validated before any work starts (unknown preset, bad override, missing local source: the
flow run fails at once with the reason). Each stage is skipped when its verified artifacts exist on disk
(or in the registry), so a re-run of a finished flow does nothing heavy, and a re-run of a killed one
continues where it stopped. One protocol for every stage: its task module's `done(...)` says why there
is nothing to do, or None (its task asks the same, so a task called alone is idempotent); the flow loops
over STAGES, showing a reason as a Skipped task run, and each stage leaves what it made on the FlowRun:

    download + tokenize   tasks.tokenize.done: the dataset's manifest is complete and its shards check out
    train                 tasks.train.done: DONE + a checkpoint for this run identity (else the trainer
                          resumes from its newest checkpoint)
    evaluate              tasks.evaluate.done / missing_parts: <checkpoint>/eval.json holds each part
                          (validation, each evaluation) with the same settings; the missing parts run
    register              tasks.register.done: a version of the pipeline's model carries the checkpoint's
                          sha256 and every measurement of eval.json (a re-run that added one registers it)
    sample                tasks.generate.done: <checkpoint>/sample.json holds text from that version

Tasks exchange paths and config dicts, never arrays. For the UI the flow publishes artifacts: the shard
table, the eval table, links to the MLflow run and model version, the sample text, and a summary table
(`pretrain-summary`, read back by `python -m devstack.demo`).
"""

from __future__ import annotations

# lazy imports: each stage's task module and torch load only when the stage has work; a no-op re-run
# of a finished flow imports neither torch nor mlflow (tests/test_flow.py checks it)
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from gptcore import evals
from gptcore.checkpoints.run_files import EVAL_FILE, RUN_FILE, read_meta, run_dir_for, run_state
from gptcore.config import ConfigError, RunConfig, check_name, load_config, pipeline_home
from gptcore.evals.record import result_metrics
from gptcore.files import read_json
from gptcore.metrics import METRICS_FILE, read_metrics
from integrations.progress import artifact_key, step_label
from integrations.secrets import mlflow_credentials_from_prefect
from tasks import generate

# pydantic notes that the parameter name `register` shadows a BaseModel method; harmless for validation
warnings.filterwarnings("ignore", message='Field name "register"')

SUMMARY_KEY = "pretrain-summary"
ALLOW_OUTSIDE_HOME = "GPTPIPE_ALLOW_OUTSIDE_HOME"  # =1 in the worker's environment: write dirs may be anywhere
WRITE_DIRS = ("train.run_dir", "data.dataset_dir")  # the overrides that name a directory the flow run writes


# --- config, checked before any work -------------------------------------------------------------------


def check_config(preset: str, overrides: dict | None, nproc: int) -> RunConfig:
    """The validated config, or ConfigError naming the problem (the flow run fails right away)."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"overrides must be a mapping like {{\"train.max_steps\": 100}}, got {overrides!r}")
    cfg = load_config(preset, overrides, world_size=nproc)
    check_write_dirs(cfg)
    from gptcore.data import sources

    try:  # the source's kind knows what a usable source is (a local one: only lists its files)
        sources.source_kind(cfg).validate(cfg)
    except sources.SourceError as e:
        raise ConfigError(str(e)) from None
    return cfg


def check_write_dirs(cfg: RunConfig) -> None:
    """Anyone who can start a flow run chooses its overrides, so the directories it writes must resolve
    (symlinks followed) inside GPTPIPE_HOME, unless the worker is set up with GPTPIPE_ALLOW_OUTSIDE_HOME=1
    (e.g. run dirs on a shared filesystem elsewhere); and never, whatever the worker allows, onto the
    servers' own state or another run's directory (check_not_protected). Not checked on the CLI: a shell
    user owns the disk."""
    home = pipeline_home()
    for key in WRITE_DIRS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if not value:
            continue
        where = Path(value).expanduser().resolve()
        if os.environ.get(ALLOW_OUTSIDE_HOME) != "1" and (where == home or not where.is_relative_to(home)):
            raise ConfigError(f"{key}={value!r} is not a directory inside GPTPIPE_HOME ({home}): a flow run writes "
                              f"only under it; leave {key} unset for the default there, or set "
                              f"{ALLOW_OUTSIDE_HOME}=1 in the worker's environment to allow other directories")
        check_not_protected(key, value, where, cfg, home)


def server_dirs(home: Path) -> list[Path]:
    """The servers' own state, never a flow run's to write: devstack's services/ (the TLS key, the MLflow
    auth config), the embedded MLflow store with its user database (mlflow/auth/), Prefect's home, and the
    MLflow auth folder wherever MLFLOW_AUTH_DIR puts it."""
    dirs = [home / "services", home / "mlflow", home / "prefect"]
    if os.environ.get("MLFLOW_AUTH_DIR"):
        dirs.append(Path(os.environ["MLFLOW_AUTH_DIR"]).expanduser().resolve())
    return dirs


def owning_run(where: Path) -> tuple[Path, str] | None:
    """The run directory `where` is or lies in (the nearest one holding run.json), with its run name."""
    for d in (where, *where.parents):
        if (d / RUN_FILE).is_file():
            return d, str(read_json(d / RUN_FILE, {}).get("run_name"))
    return None


def check_not_protected(key: str, value: str, where: Path, cfg: RunConfig, home: Path) -> None:
    """ConfigError when a write directory is, holds or lies in a server's state folder, holds the runs'
    folder, or is (or lies in) a run directory that is not this run's own: run.json names its run."""
    def refuse(what: str):
        raise ConfigError(f"{key}={value!r} resolves to {where}, {what}: a flow run must not write there; "
                          f"leave {key} unset for the default, or name a directory of its own")

    for d in server_dirs(home):
        if where == d or where.is_relative_to(d) or d.is_relative_to(where):
            refuse(f"which is or holds the servers' own state ({d})")
    if (home / "runs").is_relative_to(where):
        refuse(f"which holds every run's directory ({home / 'runs'})")
    owner = owning_run(where)
    if owner and not (key == "train.run_dir" and owner == (where, cfg.run_name)):
        refuse(f"which is or lies in the directory of run {owner[1]!r} ({owner[0]})")


def check_params(nproc: int, wait_seconds: float, model_name: str, dask_address: str = "") -> None:
    """The ranges Prefect's type checks do not cover; ConfigError fails the flow run at once."""
    if dask_address and not re.fullmatch(r"(tcp|tls|inproc|ucx)://\S+", dask_address):
        raise ConfigError(f"dask_address {dask_address!r} is not a Dask scheduler address; use e.g. "
                          "tcp://scheduler-host:8786, or '' for the local process pool")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 0:
        raise ConfigError(f"nproc must be an integer >= 0 (0 = one per GPU, or 1 on CPU), got {nproc!r}")
    if not wait_seconds >= 0:
        raise ConfigError(f"wait_seconds must be >= 0, got {wait_seconds!r}")
    if model_name:  # a registered-model name: an MLflow name, a filter value and part of task-run names
        check_name("model_name", model_name)


def dask_runner(address: str):
    """prefect-dask's runner for an existing Dask cluster; None (the local process pool) for ""."""
    if not address:
        return None
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as e:
        raise ConfigError(f"dask_address={address!r} needs prefect-dask on the worker: pip install -e '.[dask]'") from e
    return DaskTaskRunner(address=address)


# --- stages ----------------------------------------------------------------------------------------

def mlflow_links(reg: dict | None, run_name: str) -> str:
    """Markdown links to the MLflow run and model version (when MLflow is a server with a UI); read over
    REST, so a re-run that changes nothing does not import mlflow. They open in MLflow's model-training mode."""
    from integrations import mlflow_links as links
    from integrations import mlflow_store as store

    uri = store.tracking_uri()
    if not uri.startswith("http"):
        return f"MLflow store: `{uri}` (no UI server); run `mlflow ui --backend-store-uri {uri}` to browse."
    lines = []
    try:
        exp = (store.rest_read(uri, "experiments/get-by-name", {"experiment_name": store.EXPERIMENT})
               or {}).get("experiment")
        run_id = reg["run_id"] if reg else None
        if exp is not None and run_id is None:
            runs = (store.rest_read(uri, "runs/search", body={
                "experiment_ids": [exp["experiment_id"]], "max_results": 1,
                "filter": f"tags.`{store.TAG_RUN_NAME}` = {store.quoted(run_name)}"}) or {}).get("runs") or []
            run_id = runs[0]["info"]["run_id"] if runs else None
        if exp is not None and run_id:
            lines.append(f"- MLflow run: [{run_name}]({links.run_link(uri, exp['experiment_id'], run_id)})")
    except store.RestUnavailable as e:  # links are a convenience; never fail the flow for them
        lines.append(f"- MLflow run: unavailable ({e})")
    if reg:
        lines.append(f"- Model version: [{reg['name']} v{reg['version']}]"
                     f"({links.model_version_link(uri, reg['name'], reg['version'])}) (`{reg['model_uri']}`)")
    return "\n".join(lines) or "no MLflow run yet"


@task(name="skipped", cache_policy=NO_CACHE)
def skipped_task(reason: str) -> None:
    """A stage with nothing to do: a task run that completes at once, its reason in the state message."""
    return Completed(name="Skipped", message=f"skipped: {reason}")


class Stages:
    """What each stage did ("ran" / "skipped" and why): logged as it happens, and an artifact at the end.
    A skipped stage still appears in the flow run's graph as a task run (state "Skipped", message = why),
    so every flow run of a deployment shows the same stages in the UI."""

    def __init__(self, log):
        self.log, self.rows = log, []

    def __call__(self, name: str, status: str, detail: str = "", task_run_name: str = "") -> None:
        self.rows.append({"stage": name, "status": status, "detail": detail})
        self.log.info("stage %s: %s %s", name, status, detail)
        if status == "skipped":
            skipped_task.with_options(name=name, task_run_name=task_run_name or name)(detail)


@dataclass
class FlowRun:
    """What the stages share: the flow's resolved config and parameters, and what each stage made."""
    cfg: RunConfig
    stage: Stages
    nproc: int = 0
    wait_seconds: float = 600.0
    tracking: bool = True
    dask_address: str = ""
    model_name: str = ""
    dataset_dir: str = ""
    tokens: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # the training run's (run_files.run_state)
    result: dict | None = None  # eval.json of the newest checkpoint
    reg: dict | None = None  # the registered version
    sample: dict = field(default_factory=dict)

    @property
    def ckpt(self) -> str:
        return self.state["checkpoint"]


def data_stage(run: FlowRun) -> None:
    """The dataset (made, or found complete), tokenized on the Dask cluster at `dask_address` when one is
    given; the shard table artifact."""
    from gptcore.data import location
    from gptcore.data.shard_format import Manifest
    from tasks import tokenize

    cfg = run.cfg
    dataset_dir, why_done = str(location.dataset_dir(cfg)), tokenize.done(cfg)
    if why_done is None:
        from tasks.download import download_task

        download_task(cfg.to_dict())
        from flows.dataset import tokenize_dataset

        dataset_dir = tokenize_dataset(cfg.to_dict(), task_runner=dask_runner(run.dask_address))
    rows = [{"shard": s.name, "split": s.split, "tokens": s.tokens, "sha256": s.sha256[:12]}
            for s in Manifest.load(Path(dataset_dir)).shards]
    tokens = {split: sum(r["tokens"] for r in rows if r["split"] == split) for split in ("train", "val")}
    run.stage("data", "skipped" if why_done else "ran", f"{len(rows)} shards, {tokens['train']:,} train tokens"
              f"{f'; {why_done}' if why_done else f' in {dataset_dir}'}")
    create_table_artifact(rows, key=artifact_key(cfg.run_name, "shards"),
                          description=f"Shards of {dataset_dir} ({tokens['train']:,} train / {tokens['val']:,} "
                                      "val tokens)")
    run.dataset_dir, run.tokens = dataset_dir, tokens


def train_stage(run: FlowRun) -> None:
    """The run trained to max_steps or its time budget (or found DONE)."""
    from tasks import train

    cfg = run.cfg
    run.state = run_state(run_dir_for(cfg), cfg.identity_hash())
    if (why := train.done(cfg)) is not None:
        run.stage("train", "skipped", why, f"train {cfg.run_name}")
        return
    # nproc=0 (one per GPU, else 1 on CPU) is resolved only here: counting GPUs imports torch, which a re-run
    # that skips everything should not pay for
    nproc = run.nproc
    if nproc == 0:
        import torch

        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 1
    cfg.validate(nproc)  # the batch must split over the real number of processes (ConfigError if not)
    run.state = train.train_task(cfg.to_dict(), cfg.run_name, nproc, wait_seconds=run.wait_seconds,
                                 tracking=run.tracking)
    run.stage("train", "ran", f"steps {run.state.get('resumed_from') or 0} -> {run.state['step']}"
                              f"{'' if run.state['done'] else ' (time budget reached; continues next run)'}")


def evaluate_stage(run: FlowRun) -> None:
    """Validation loss and each evaluation of the config (gptcore/evals) that <ckpt>/eval.json lacks, each
    as its own task run; a part skipped for lack of its dataset counts as done (a re-run of a finished
    flow does nothing)."""
    from tasks import evaluate

    ckpt, cfg = run.ckpt, run.cfg
    why = evaluate.done(ckpt, cfg)
    if why is not None:  # the trainer's own evaluation at the last step usually is this one
        run.stage("evaluate", "skipped", why, f"evaluate {step_label(ckpt)}")
        result = read_json(Path(ckpt) / EVAL_FILE, {})
    else:
        parts = evaluate.missing_parts(ckpt, cfg)
        for part in parts:
            result = evaluate.evaluate_part(ckpt, part, cfg.to_dict())
        if not parts:  # only parts the config no longer asks for to drop: no task run needed
            result = evaluate.evaluate_dir(ckpt, cfg.to_dict(), only=[])
        run.stage("evaluate", "ran", f"{', '.join(parts) or 'rewrote eval.json'}; val loss {result.get('val_loss')}")
    rows = [{"metric": "val_loss", "value": result.get("val_loss")},
            {"metric": "val_tokens", "value": result.get("val_tokens")}]
    # every evaluation the config asked for (gptcore/evals), each number with its standard error beside it
    for name in (result.get("settings") or {}).get("evaluations", {}):
        scores = result.get(name) or {}
        if "skipped" in scores:
            rows.append({"metric": name, "value": f"skipped: {scores['skipped']}"})
        rows += [{"metric": k.replace("/", "_"), "value": v} for k, v in result_metrics(name, scores).items()]
        rows += [{"metric": f"{name}_n", "value": scores["n"]}] if "n" in scores else []
    create_table_artifact(rows, key=artifact_key(cfg.run_name, "eval"),
                          description=f"Evaluation of {ckpt} (step {result.get('step')})")
    run.result = result


def register_stage(run: FlowRun) -> None:
    """The checkpoint as a version of the pipeline's registered model, with its measurements; the
    leaderboard artifact when it ran."""
    from tasks import register

    ckpt, name = run.ckpt, run.model_name or run.cfg.preset
    why = register.done(ckpt, name)
    if why is not None:
        run.stage("register", "skipped", why, f"register {name} {step_label(ckpt)}")
        run.reg = register.registered_version(ckpt, name)
    else:
        from prefect.runtime import flow_run

        from tasks.leaderboard import publish_leaderboard

        run.reg = register.register_task(ckpt, name, flow_run_id=flow_run.get_id())
        scores = ", ".join(f"{k} {v}" for k, v in run.reg.get("headline", {}).items())
        run.stage("register", "ran", f"{run.reg['model_uri']}" + (f" ({scores})" if scores else ""))
        publish_leaderboard(name)  # the model's versions side by side, as a table artifact


def sample_stage(run: FlowRun) -> None:
    """A text sample from what was registered (or from the checkpoint)."""
    ckpt, cfg = run.ckpt, run.cfg
    model_uri = run.reg["model_uri"] if run.reg else None
    prompt, n_new = cfg.eval.sample_prompt, cfg.eval.sample_tokens
    why = generate.done(ckpt, model_uri, prompt, n_new)
    if why is not None:
        run.stage("sample", "skipped", why)
        sample = generate.stored_sample(ckpt, model_uri, prompt, n_new)
    else:
        sample = generate.sample_task(ckpt, model_uri, prompt, n_new)
        run.stage("sample", "ran", "")
    create_markdown_artifact(f"### Sample from {model_uri or ckpt}\n\n```\n{sample['text']}\n```",
                             key=artifact_key(cfg.run_name, "sample"), description="Generated text")
    run.sample = sample


# the stages in order, and the flow parameter that turns one off (None: always runs)
STAGES = [(data_stage, None), (train_stage, None), (evaluate_stage, "evaluate"), (register_stage, "register"),
          (sample_stage, None)]


@flow(name="pretrain", log_prints=True)
def pretrain(preset: str = "tiny-cpu", overrides: dict | None = None, nproc: int = 0, register: bool = True,
             model_name: str = "", evaluate: bool = True, tracking: bool = True,
             wait_seconds: float = 600.0, dask_address: str = "") -> dict:
    """Prepare data, train (or continue) the run, evaluate its newest checkpoint and register it.

    preset: gpt2-124m | gpt2-124m-muon | tiny-cpu | micro | a .toml/.json config file on the worker
    overrides: {"section.key": value}, e.g. {"train.max_minutes": 60} for a time-boxed nightly run
    nproc: trainer processes (0 = one per GPU, 1 on CPU)
    register / model_name: register the checkpoint in MLflow (name default: the preset)
    evaluate: validation loss + the config's evaluations (gptcore/evals) on the newest checkpoint
    tracking: ship training metrics to MLflow while training
    wait_seconds: how long to wait for another flow run training the same run before failing
    dask_address: a Dask scheduler (tcp://host:8786) whose workers tokenize the dataset's pieces (they must
        share GPTPIPE_HOME with this flow run); "" = a process pool on the flow run's machine
    """
    log = get_run_logger()
    check_params(nproc, wait_seconds, model_name, dask_address)
    cfg = check_config(preset, overrides, nproc or 1)  # resolved once: every stage gets this config
    mlflow_credentials_from_prefect(log)  # a docker/k8s flow run's MLflow login, from Prefect Secret blocks
    log.info("run %s (identity %s), preset %s, %s process(es)", cfg.run_name, cfg.identity_hash(), preset,
             nproc or "auto")
    run = FlowRun(cfg, Stages(log), nproc, wait_seconds, tracking, dask_address, model_name)
    switches = {"evaluate": evaluate, "register": register}
    for stage, switch in STAGES:
        if switch is None or switches[switch]:
            stage(run)
    create_markdown_artifact("\n".join([f"### MLflow ({cfg.run_name})", mlflow_links(run.reg, cfg.run_name)]),
                             key=artifact_key(cfg.run_name, "mlflow"), description="MLflow run and model version")
    create_table_artifact(run.stage.rows, key=artifact_key(cfg.run_name, "stages"),
                          description="What this flow run did or skipped")
    summary = summarize(run)
    create_table_artifact([{"key": k, "value": json.dumps(v)} for k, v in summary.items()], key=SUMMARY_KEY,
                          description=f"Summary of run {cfg.run_name}")
    return summary


def summarize(run: FlowRun) -> dict:
    """The flow run's result: what the demo prints and the `pretrain-summary` artifact holds."""
    # every evaluation the config asked for, as its one-line summary (the demo prints these)
    result = run.result or {}
    evaluated = {ev.name: ev.summary(result.get(ev.name) or {"skipped": "evaluation disabled"})
                 for ev in evals.enabled(run.cfg)}
    meta = read_meta(Path(run.ckpt))
    rows = read_metrics(Path(run.state["run_dir"]) / METRICS_FILE, "train")
    last_train = rows[-1] if rows else {}
    return {
        "run_name": run.cfg.run_name, "run_dir": run.state["run_dir"], "dataset_dir": run.dataset_dir,
        "train_tokens": run.tokens["train"], "val_tokens_in_dataset": run.tokens["val"],
        "step": run.state["step"], "done": run.state["done"], "checkpoint": run.ckpt,
        "tokens_seen": meta.get("tokens_seen"),
        # what the run has cost (gptcore/training/cost.py): at its newest checkpoint, and when it will finish
        "gpu_hours": meta.get("gpu_hours"), "cost_usd": meta.get("cost_usd"),
        "eta_s": 0.0 if run.state["done"] else last_train.get("train/eta_s"),
        "cost_projected_usd": meta.get("cost_usd") if run.state["done"] else last_train.get("train/cost_projected_usd"),
        "val_loss": result.get("val_loss"),
        "evaluations": {name: result.get(name) for name in evaluated},
        "evaluation_summary": list(evaluated.values()),
        "model_version": run.reg["model_uri"] if run.reg else None,
        "mlflow_uri": run.reg["tracking_uri"] if run.reg else None,
        "sample": run.sample["text"],
        "stages": {s["stage"]: s["status"] for s in run.stage.rows},
    }


if __name__ == "__main__":  # python -m flows.pretrain tiny-cpu '{"train.max_steps": 50}'
    import sys

    print(json.dumps(pretrain(sys.argv[1] if len(sys.argv) > 1 else "tiny-cpu",
                              json.loads(sys.argv[2]) if len(sys.argv) > 2 else None), indent=1))
