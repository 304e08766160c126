"""The evaluate stage: validation loss and each evaluation the config asks for (gptcore/evals) on a run's
newest checkpoint (or a given checkpoint / Hugging Face export dir), written to `<ckpt>/eval.json`; and the
command that evaluates a registered model:

    python -m tasks.evaluate models:/gpt2-124m@best --val --limit 1000
    python -m tasks.evaluate models:/gpt2-124m@best --tasks arc_easy,piqa
    python -m tasks.evaluate var/runs/tiny-cpu          # anything else: same as python -m gptcore.evals.evaluate

A model URI (`models:/<name>@<alias>`, `models:/<name>/<version>`, `@latest` = newest version) is resolved
against $MLFLOW_TRACKING_URI (or --tracking-uri); only the version's inference weights (its `checkpoint`
artifact: model.safetensors + meta.json) are downloaded, into a temporary directory, and evaluated like a
checkpoint with every option of `python -m gptcore.evals.evaluate`.

Idempotent, part by part: eval.json records each part's settings ("val" and each evaluation), so a re-run
flow (or a retry) computes only the parts it lacks: the trainer's own evaluation at the last step usually
holds validation loss and HellaSwag, and the flow adds the harness tasks. The flow runs each part as its own
Prefect task run (`evaluate_part`), so the UI shows them one by one.
"""

from __future__ import annotations

# lazy imports: torch and mlflow only where there is work; the flow imports this module to decide what to skip
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task

from gptcore.checkpoints.run_files import EVAL_FILE, META_FILE, checkpoint_of, read_meta
from gptcore.config import RunConfig, TrainConfig
from gptcore.evals.record import merge_evaluations, missing_evaluations, result_metrics
from gptcore.files import read_json, write_json
from gptcore.overrides import from_dict
from gptcore.runlock import RunLock
from integrations.progress import artifact_key, step_label
from tasks.stage import FlowRun, Stage

EVAL_LOCK = "eval.lock"  # held while a checkpoint is being evaluated
EVAL_WAIT_SECONDS = 3600.0  # a second evaluation of the same checkpoint waits this long for the first


def missing_parts(ckpt: str | Path, cfg: RunConfig, val: bool = True) -> list[str]:
    """The parts ("val", evaluation names) that <ckpt>/eval.json lacks for these settings: this stage's one
    decision, asked by the flow (each missing part becomes a task run) and by evaluate_dir alike."""
    done = read_json(Path(ckpt) / EVAL_FILE, {})  # {} when missing, unreadable or not an object
    return missing_evaluations(done, cfg, val)


def stored_evaluation(ckpt: str | Path, cfg: RunConfig, val: bool = True) -> dict | None:
    """The evaluation in <ckpt>/eval.json when it holds every part for these settings and nothing else,
    else None."""
    done = read_json(Path(ckpt) / EVAL_FILE, {})
    return done if complete(done, cfg, val) else None


def complete(done: dict, cfg: RunConfig, val: bool) -> bool:
    """Whether eval.json's `done` holds every part for these settings and no part the config no longer
    asks for (such a one makes it stale: evaluate_dir rewrites it without them)."""
    return not missing_evaluations(done, cfg, val) and \
        merge_evaluations(done, {}, cfg, val)["settings"] == done.get("settings")


def evaluate_dir(target: str | Path, cfg_dict: dict | None = None, val: bool = True,
                 device: str = "auto", log=None, only: list[str] | None = None, redo: list[str] = ()) -> dict:
    """Evaluate the parts that the checkpoint behind `target` lacks (`only`: of these parts; `redo`: these
    too, e.g. a part once skipped because its dataset was unreachable) and return its eval.json. Plain
    function: the Prefect task below wraps it, and tests / other tools call it directly."""
    ckpt = checkpoint_of(Path(target))
    if not cfg_dict and (ckpt / META_FILE).is_file():
        cfg_dict = read_meta(ckpt).get("config")  # the config the checkpoint was trained with
    cfg = from_dict(cfg_dict or {})
    # one evaluation per checkpoint at a time: a second caller (e.g. another flow run of the same training
    # run) waits here for the first, then finds its parts in eval.json
    with RunLock(ckpt, timeout=EVAL_WAIT_SECONDS, name=EVAL_LOCK):
        done = read_json(ckpt / EVAL_FILE, {})
        parts = [p for p in missing_evaluations(done, cfg, val) if only is None or p in only]
        parts += [p for p in redo if p not in parts]
        if not parts and complete(done, cfg, val):
            if log:
                log.info("%s already evaluated (%s); skipping", ckpt, ckpt / EVAL_FILE)
            return done
        new, t0 = {}, time.time()
        if parts:
            from gptcore import distributed  # torch: only when there is work to do
            from gptcore.evals.evaluate import evaluate_model, load_target

            env = distributed.select(TrainConfig(device=device))  # the trainer's hardware rules (dtype, TF32)
            model, info = load_target(ckpt, env.device)
            new = evaluate_model(model, cfg, env.device, env.autocast(), val=val, only=parts)
            new.update({"target": str(ckpt), "kind": info["kind"], "step": info.get("step")})
        result = merge_evaluations({**done, **{k: new[k] for k in ("target", "kind", "step") if k in new}},
                                   new, cfg, val)
        result["seconds"] = round(done.get("seconds", 0) + time.time() - t0, 2)
        write_json(ckpt / EVAL_FILE, result)
    if log:
        log.info("evaluated %s of %s: %s", ", ".join(parts) or "nothing", ckpt,
                 {k: result[k] for k in ("val_loss", *parts) if k in result})
    return result


def _run_name() -> str:
    """"<part> step 120" (a checkpoint) or "<part> <dir name>": short, for the flow-run graph."""
    from prefect.runtime import task_run

    params = task_run.parameters
    return f"{params.get('part', 'evaluate')} {step_label(params['target'])}"


@task(name="evaluate", task_run_name=_run_name)
def evaluate_part(target: str, part: str, cfg_dict: dict | None = None, device: str = "auto") -> dict:
    """One part of a checkpoint's evaluation ("val" or an evaluation's name, gptcore/evals), added to
    <ckpt>/eval.json; returns that file. Skipped work when eval.json already holds the part."""
    return evaluate_dir(target, cfg_dict, True, device, log=get_run_logger(), only=[part])


# --- the pretrain flow's evaluate stage (tasks/stage.py) ------------------------------------------------

@dataclass
class Evaluated:
    result: dict  # <ckpt>/eval.json
    parts: list[str]  # the parts this flow run evaluated (none when it was stored)


class EvaluateStage(Stage):
    """Validation loss and each evaluation of the config (gptcore/evals) that <ckpt>/eval.json lacks, each
    as its own task run; stored when eval.json holds every part with the same settings (a part skipped for
    lack of its dataset counts as done: a re-run of a finished flow does nothing); the eval table artifact."""
    name = "evaluate"
    switch = "evaluate"

    def stored(self, run: FlowRun) -> Evaluated | None:
        found = stored_evaluation(run.ckpt, run.cfg)  # the trainer's own evaluation at the last step, usually
        return None if found is None else Evaluated(found, [])

    def work(self, run: FlowRun) -> Evaluated:
        parts = missing_parts(run.ckpt, run.cfg)
        for part in parts:
            result = evaluate_part(run.ckpt, part, run.cfg.to_dict())
        if not parts:  # only parts the config no longer asks for to drop: no task run needed
            result = evaluate_dir(run.ckpt, run.cfg.to_dict(), only=[])
        return Evaluated(result, parts)

    def reason(self, run: FlowRun, e: Evaluated, ran: bool) -> str:
        if ran:
            return f"{', '.join(e.parts) or 'rewrote eval.json'}; val loss {e.result.get('val_loss')}"
        by = "the trainer, after the checkpoint" if e.result.get("by") == "trainer" else "an earlier run"
        return f"{run.ckpt}/{EVAL_FILE} holds every part (evaluated by {by})"

    def keep(self, run: FlowRun, e: Evaluated) -> None:
        from prefect.artifacts import create_table_artifact

        result = e.result
        rows = [{"metric": "val_loss", "value": result.get("val_loss")},
                {"metric": "val_tokens", "value": result.get("val_tokens")}]
        # every evaluation the config asked for (gptcore/evals), each number with its standard error beside it
        for name in (result.get("settings") or {}).get("evaluations", {}):
            scores = result.get(name) or {}
            if "skipped" in scores:
                rows.append({"metric": name, "value": f"skipped: {scores['skipped']}"})
            rows += [{"metric": k.replace("/", "_"), "value": v} for k, v in result_metrics(name, scores).items()]
            rows += [{"metric": f"{name}_n", "value": scores["n"]}] if "n" in scores else []
        create_table_artifact(rows, key=artifact_key(run.cfg.run_name, "eval"),
                              description=f"Evaluation of {run.ckpt} (step {result.get('step')})")
        run.result = result

    def task_run_name(self, run: FlowRun) -> str:
        return f"evaluate {step_label(run.ckpt)}"


STAGE = EvaluateStage()


# --- a registered model -------------------------------------------------------------------------------

def fetch_registered(model_uri: str, dst: Path, tracking_uri: str | None = None) -> Path:
    """Download the inference weights of a registered model version into `dst`, checked against the
    version's checkpoint_sha256 tag (integrations/registry_weights.py); returns the checkpoint dir
    (model.safetensors + meta.json, the layout tasks/register.py logs). UntrustedWeights if they differ."""
    from integrations.mlflow_store import resolve_model_uri
    from integrations.registry_weights import fetch_verified

    return fetch_verified(resolve_model_uri(model_uri), dst, tracking_uri)[0]


def main(argv: list[str] | None = None) -> int:
    from gptcore.evals import evaluate as ev

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].startswith("models:/"):
        return ev.main(argv)
    model_uri, rest = argv[0], argv[1:]
    tracking_uri = None
    if "--tracking-uri" in rest:
        i = rest.index("--tracking-uri")
        if i + 1 == len(rest):
            print("error: --tracking-uri needs a value, e.g. --tracking-uri http://127.0.0.1:5000", file=sys.stderr)
            return 2
        tracking_uri, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="gptpipe-eval-") as tmp:
        from integrations.registry_weights import UntrustedWeights

        try:
            ckpt = fetch_registered(model_uri, Path(tmp), tracking_uri)
        except UntrustedWeights as e:  # names the version, both hashes and the fix
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (MlflowException, OSError) as e:
            print(f"error: cannot fetch {model_uri}: {e}\nSee the registered models and aliases in the MLflow "
                  "UI (MLFLOW_TRACKING_URI or --tracking-uri names the server).", file=sys.stderr)
            return 2
        return ev.main([str(ckpt), *rest, "--label", model_uri])


if __name__ == "__main__":
    raise SystemExit(main())
