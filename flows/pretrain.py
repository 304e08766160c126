"""The `pretrain` flow: download -> tokenize-and-shard -> train -> evaluate -> register -> sample.

    pretrain(preset="tiny-cpu", overrides={"train.max_steps": 100})
    prefect deployment run pretrain/tiny --param overrides='{"train.max_steps": 100}'

The config is validated before any work starts (unknown preset, bad override, missing local source: the
flow run fails at once with the reason). Each stage is skipped when its verified artifacts exist on disk
(or in the registry), so a re-run of a finished flow does nothing heavy, and a re-run of a killed one
continues where it stopped. Every stage is a `Stage` (tasks/stage.py) in its own module, and this flow
only composes them (STAGES): each first looks for its verified result (`stored`) and is skipped with the
reason when it finds it, else does its work; either way it leaves one result on the FlowRun for the next:

    download   tasks/download.py: not needed once the dataset is complete (else fetch and verify the source)
    tokenize   flows/dataset.py: the dataset's manifest is complete and its shards check out (else
               tokenize-and-shard the source, pieces mapped over a process pool or a Dask cluster)
    train      tasks/train.py: DONE + a checkpoint for this run identity (else the trainer resumes from its
               newest checkpoint)
    evaluate   tasks/evaluate.py: <checkpoint>/eval.json holds each part (validation, each evaluation) with
               the same settings; the missing parts run, one task run each
    register   tasks/register.py: a version of the pipeline's model carries the checkpoint's sha256 and every
               measurement of eval.json (a re-run that added one registers it)
    sample     tasks/generate.py: <checkpoint>/sample.json holds text from that version

Tasks exchange paths and config dicts, never arrays. For the UI the flow publishes artifacts: the shard
table, the eval table, links to the MLflow run and model version, the sample text, and a summary table
(`pretrain-summary`: one row per value, plain, as integrations/artifact_tables.py writes it; read back by
`python -m devstack.demo` with artifact_tables.from_rows).
"""

from __future__ import annotations

# lazy imports: torch and mlflow load only where a stage has work; a no-op re-run of a finished flow
# imports neither (tests/test_flow.py checks it)
import json
import re
import warnings
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

import tasks.download
import tasks.evaluate
import tasks.generate
import tasks.register
import tasks.train
from flows import dataset
from gptcore import evals
from gptcore.checkpoints.run_files import read_meta
from gptcore.config import ConfigError, RunConfig
from gptcore.metrics import METRICS_FILE, read_metrics
from gptcore.overrides import load_config
from gptcore.security import check_name
from integrations.artifact_tables import to_rows
from integrations.mlflow_links import flow_links
from integrations.progress import artifact_key
from integrations.secrets import mlflow_credentials_from_prefect
from integrations.write_dirs import check_write_dirs
from tasks.stage import FlowRun, Stage, run_stages

# pydantic notes that the parameter name `register` shadows a BaseModel method; harmless for validation
warnings.filterwarnings("ignore", message='Field name "register"')

SUMMARY_KEY = "pretrain-summary"


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


# the stages in order (each says which flow parameter, if any, turns it off)
STAGES: list[Stage] = [tasks.download.STAGE, dataset.STAGE, tasks.train.STAGE, tasks.evaluate.STAGE,
                       tasks.register.STAGE, tasks.generate.STAGE]


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
    run = FlowRun(cfg, log, nproc, wait_seconds, tracking, dask_address, model_name)
    run_stages(run, STAGES, {"evaluate": evaluate, "register": register})
    create_markdown_artifact("\n".join([f"### MLflow ({cfg.run_name})", flow_links(run.reg, cfg.run_name)]),
                             key=artifact_key(cfg.run_name, "mlflow"), description="MLflow run and model version")
    create_table_artifact(run.rows, key=artifact_key(cfg.run_name, "stages"),
                          description="What this flow run did or skipped")
    summary = summarize(run)
    # one row per value, shown plainly in the UI (stages.train | ran); read back with artifact_tables.from_rows
    create_table_artifact(to_rows(summary), key=SUMMARY_KEY, description=f"Summary of run {cfg.run_name}")
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
        # what the demo's MLflow run and model version links are made of (integrations/mlflow_links.py)
        "mlflow_run_id": run.reg["run_id"] if run.reg else None,
        "registered_name": run.reg["name"] if run.reg else None,
        "registered_version": run.reg["version"] if run.reg else None,
        "sample": run.sample["text"],
        "stages": {s["stage"]: s["status"] for s in run.rows},
    }


if __name__ == "__main__":  # python -m flows.pretrain tiny-cpu '{"train.max_steps": 50}'
    import sys

    print(json.dumps(pretrain(sys.argv[1] if len(sys.argv) > 1 else "tiny-cpu",
                              json.loads(sys.argv[2]) if len(sys.argv) > 2 else None), indent=1))
