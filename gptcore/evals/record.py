"""A checkpoint's eval.json, the record of what was evaluated: each part's result and the settings it was
computed with. A part whose settings changed is evaluated again; one that still holds is kept. Torch-free:
the flow's no-op re-run compares these settings.

    eval_settings(cfg, val)          what each part's numbers depend on besides the weights
    missing_evaluations(done, ...)   the parts eval.json lacks for these settings
    merge_evaluations(done, new, ...) eval.json after computing `new`
    result_metrics(name, result)     a part's result as flat metrics (the logged model's, the eval table's)
    checkpoint_metrics(ckpt, meta)   a checkpoint's measurements: what its registered version records
    headlines(metrics)               each evaluation's headline number with its standard error
"""

from __future__ import annotations

from pathlib import Path

from gptcore import evals
from gptcore.checkpoints.run_files import EVAL_FILE, finite, val_loss_of
from gptcore.config import RunConfig
from gptcore.files import read_json


def result_metrics(name: str, result) -> dict[str, float]:
    """An evaluation's result in eval.json as flat metrics, `<name>/<metric>` (nested: `<name>/<task>/
    <metric>`), each standard error beside its number; counts (`n`, `examples`) and skips left out. What
    the logged model in MLflow and the flow's eval table show (torch-free: a no-op re-run imports this)."""
    out: dict[str, float] = {}
    if not isinstance(result, dict) or "skipped" in result:
        return out
    for k, v in result.items():
        if isinstance(v, dict):
            out.update(result_metrics(f"{name}/{k}", v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("n", "examples"):
            out[f"{name}/{k}"] = float(v)
    return out


def eval_settings(cfg: RunConfig, val: bool, only: tuple[str, ...] | None = None) -> dict:
    """What an evaluation's numbers depend on besides the weights, recorded in eval.json, part by part: a
    change means evaluate that part again. "val": the validation batches (None without validation);
    "evaluations": every evaluation the config asks for (gptcore/evals) with its own settings; `only`:
    those that were part of it (the trainer scores each at its own interval)."""
    # the validation loss is the mean over the first whole (micro_batch x seq_len) batches of val_tokens:
    # the tokens it covers are what it depends on, so a trainer that chose micro_batch=auto's 16 and an
    # evaluation at micro_batch_max's 64 agree whenever they cover the same tokens
    B, T = cfg.train.resolved_micro_batch(), cfg.train.seq_len
    return {"val": {"tokens": max(1, cfg.eval.val_tokens // (B * T)) * B * T, "seq_len": T} if val else None,
            "evaluations": {ev.name: ev.settings(cfg) for ev in evals.enabled(cfg)
                            if only is None or ev.name in only}}


def missing_evaluations(done: dict, cfg: RunConfig, val: bool) -> list[str]:
    """The parts of an evaluation ("val" and evaluation names) that eval.json's `done` lacks for these
    settings. A part skipped for lack of its dataset counts as done, for every caller alike (a re-run of a
    finished flow stays a no-op); tasks.evaluate.evaluate_dir(..., redo=[part]) scores it again on request."""
    want, have = eval_settings(cfg, val), done.get("settings") or {}
    missing = []
    if val and (have.get("val") != want["val"] or not finite(done.get("val_loss"))):
        missing.append("val")
    for name, settings in want["evaluations"].items():
        if (have.get("evaluations") or {}).get(name) != settings or not isinstance(done.get(name), dict):
            missing.append(name)
    return missing


def merge_evaluations(done: dict, new: dict, cfg: RunConfig, val: bool) -> dict:
    """eval.json after computing `new` (parts named as in missing_evaluations) over `done`: the parts of
    `done` that still hold for these settings are kept, evaluations the config no longer asks for dropped."""
    want, have = eval_settings(cfg, val), done.get("settings") or {}
    out = {k: v for k, v in done.items() if k in ("target", "kind", "step", "by")}
    val_keys = ("val_loss", "val_tokens", "manifest_id")
    if "val_loss" in new:
        out.update({k: new[k] for k in val_keys if k in new})
        val_settings = want["val"]
    elif finite(done.get("val_loss")) and have.get("val") is not None and (not val or have["val"] == want["val"]):
        out.update({k: done[k] for k in val_keys if k in done})
        val_settings = have["val"]
    else:
        val_settings = None
    settings = {}
    for name, wanted in want["evaluations"].items():
        if name in new:
            out[name] = new[name]
        elif (have.get("evaluations") or {}).get(name) == wanted and isinstance(done.get(name), dict):
            out[name] = done[name]
        else:
            continue
        settings[name] = wanted
    return {**out, "settings": {"val": val_settings, "evaluations": settings}}


def checkpoint_metrics(ckpt_dir: Path, meta: dict) -> dict[str, float]:
    """The checkpoint's measurements, as metrics of its logged model: the val loss, and every evaluation's
    numbers (each accuracy with its standard error, `<name>/<metric>_stderr`) from <ckpt>/eval.json (the
    trainer's evaluation after the checkpoint, or the evaluate stage's), else from what meta.json recorded
    under the evaluation's name (checkpoints written before eval.json existed). A non-finite val loss (a
    diverged run) is left out, so such a version is never `best`."""
    ev = read_json(ckpt_dir / EVAL_FILE, {})
    values = {"val/loss": val_loss_of(ckpt_dir, meta), "train/step": meta["step"],
              "train/tokens_seen": meta.get("tokens_seen"),
              # what the run had cost at this step (gptcore/training/cost.py); absent in older checkpoints
              "train/gpu_hours": meta.get("gpu_hours"), "train/cost_usd": meta.get("cost_usd")}
    for name in evals.EVALUATIONS:
        result = ev.get(name)
        if not isinstance(result, dict) or "skipped" in result:  # none here: what an older meta.json recorded
            result = meta.get(name) or result
        values.update(result_metrics(name, result))
    return {k: float(v) for k, v in values.items() if v is not None and not isinstance(v, bool)}


def headlines(metrics: dict[str, float]) -> dict[str, str]:
    """Each evaluation's headline metric among a version's metrics, with its standard error
    ("hellaswag/acc_norm": "0.2950 ± 0.0046"): the numbers a registration reports."""
    out = {}
    for ev in evals.EVALUATIONS.values():
        key = ev.headline_key
        if key and key in metrics:
            se = metrics.get(f"{key}_stderr")
            out[key] = f"{metrics[key]:.4f}" + (f" ± {se:.4f}" if se is not None else "")
    return out
