"""The standalone evaluation command: `python -m gptcore.evals.evaluate <checkpoint | run dir | HF dir>`
(plain or under torchrun) runs the validation loss (gptcore/evals/validation.py) and the config's
evaluations on a model, with `--set eval.<name>.<option>=value` like the trainer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from gptcore import distributed, evals
from gptcore.checkpoints import checkpoint
from gptcore.checkpoints.run_files import META_FILE, CheckpointError, checkpoint_of
from gptcore.config import ConfigError, RunConfig, TrainConfig
from gptcore.data.location import dataset_dir
from gptcore.data.shard_format import Manifest, ShardError
from gptcore.evals.validation import validation_loss
from gptcore.model.gpt import evaluating
from gptcore.overrides import apply_overrides, from_dict, load_config

log = logging.getLogger(__name__)


# --- standalone evaluation ----------------------------------------------------------------------

def load_target(path: Path, device="cpu") -> tuple[torch.nn.Module, dict]:
    """Load the model behind `path`: a checkpoint dir, a run dir (its newest checkpoint) or a Hugging Face
    export dir. Returns (model in eval mode, info) where info names what was loaded."""
    path = checkpoint_of(Path(path))
    if (path / META_FILE).is_file():
        model, meta = checkpoint.load_model(path, device)
        return model, {"kind": "checkpoint", "path": str(path), "step": meta.get("step"), "meta": meta}
    if (path / "config.json").is_file():
        from gptcore.model.hf import load_hf_dir  # the Hugging Face export/import module

        return load_hf_dir(path).to(device).eval(), {"kind": "hf", "path": str(path)}
    raise FileNotFoundError(f"{path} is neither a checkpoint (no meta.json), a run directory (no "
                            "checkpoints/) nor a Hugging Face export (no config.json)")


def evaluate_model(model: torch.nn.Module, cfg: RunConfig, device, autocast_ctx=None, *, val: bool = False,
                   manifest_dir: Path | None = None, rank: int = 0, world: int = 1,
                   only: list[str] | None = None) -> dict:
    """Validation loss (with `val`) and every evaluation the config asks for (gptcore/evals: HellaSwag,
    lm-evaluation-harness tasks, contamination), each under its name, for an already-loaded model (a
    checkpoint, an HF export, or a registered MLflow model loaded by tasks/); `only`: just these parts
    ("val" and evaluation names). An evaluation whose data cannot be had is reported as skipped, not raised."""
    def wanted(part: str) -> bool:
        return only is None or part in only

    out: dict = {}
    if val and wanted("val"):
        if manifest_dir is None:
            manifest_dir = dataset_dir(cfg)
        out["val_loss"] = validation_loss(model, cfg, manifest_dir, device, autocast_ctx, rank, world)
        out["val_tokens"] = cfg.eval.val_tokens
        out["manifest_id"] = Manifest.load(manifest_dir).id
    ctx = evals.Context(model, cfg, device, autocast_ctx, rank, world, manifest_dir)
    for evaluation in evals.enabled(cfg):
        if wanted(evaluation.name):
            with evaluating(model) as plain:
                ctx.model = plain
                out[evaluation.name] = evals.score(evaluation, ctx)
    return out


def cli_overrides(args: argparse.Namespace) -> list[str]:
    """The command line's evaluation flags as config overrides: shorthands for eval.<name>.* settings, which
    win over the checkpoint's config; `--set eval.<name>.<key>=...` (any evaluation's settings) wins over them.
    Harness tasks and the contamination scan run when asked for here (they fetch datasets and scan shards:
    the flow's evaluate stage runs the config's), HellaSwag unless --no-hellaswag."""
    out = [f"eval.hellaswag.enabled={not args.no_hellaswag}", f"eval.hellaswag.limit={args.limit}",
           f"eval.harness.tasks={'' if args.tasks in (None, 'none') else args.tasks}",
           f"eval.contamination.ngram={args.contamination or 0}"]
    if args.hellaswag:
        out.append(f"eval.hellaswag.path={args.hellaswag}")
    if args.include_path:
        out.append(f"eval.harness.include_path={args.include_path}")
    if args.harness_limit is not None:
        out.append(f"eval.harness.limit={args.harness_limit}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gptcore.evals.evaluate",
        description="Evaluate a checkpoint, a run's newest checkpoint or a Hugging Face export dir: "
                    "HellaSwag (acc, acc_norm) and optionally validation loss. Prints JSON. "
                    "Runs under torchrun too (examples and val batches split across ranks).")
    p.add_argument("target", help="checkpoint dir, run dir, or Hugging Face export dir")
    p.add_argument("--hellaswag", metavar="PATH", help="local hellaswag_val.jsonl (default: download/cache)")
    p.add_argument("--no-hellaswag", action="store_true", help="skip HellaSwag")
    p.add_argument("--limit", type=int, default=0, help="score only the first N examples (0 = all)")
    p.add_argument("--val", action="store_true", help="also compute the validation loss")
    p.add_argument("--data", metavar="DIR", help="dataset dir (manifest.json) for --val; default: the "
                   "checkpoint config's dataset")
    p.add_argument("--config", help="preset or file for an HF export's --val batches (default gpt2-124m)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--label", help="name the target by this in the output (e.g. the model URI it came from)")
    p.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated, e.g. arc_easy,piqa (default: "
                   "none; the flow's evaluate stage runs the config's eval.harness.tasks)")
    p.add_argument("--include-path", metavar="DIR", help="a folder of your own harness task YAMLs")
    p.add_argument("--harness-limit", type=int, help="examples per harness task (default: eval.harness.limit)")
    p.add_argument("--contamination", type=int, metavar="N", help="report HellaSwag examples sharing an N-token "
                   "n-gram with the training shards, e.g. 13 (default: off)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    try:
        env = distributed.select(TrainConfig(device=args.device))
    except ConfigError as e:  # --device cuda on a machine without one
        print(f"error: {e}", file=sys.stderr)
        return 2
    distributed.init_process_group(env)  # only under torchrun with more than one rank
    rank, world, device, autocast_ctx = env.rank, env.world, env.device, env.autocast()
    try:
        model, info = load_target(Path(args.target), device)
        if info["kind"] == "checkpoint" and not args.config:
            if not isinstance(info["meta"].get("config"), dict):
                raise CheckpointError(f"{info['path']} records no training config in its meta.json; pass --config")
            # validated like any config: meta.json may come from a registered version someone else wrote
            cfg = apply_overrides(from_dict(info["meta"]["config"]), [*cli_overrides(args), *args.set]).validate()
        else:
            cfg = load_config(args.config or "gpt2-124m", [*cli_overrides(args), *args.set])
        result = evaluate_model(model, cfg, device, autocast_ctx, val=args.val,
                                manifest_dir=Path(args.data) if args.data else None, rank=rank, world=world)
        distributed.barrier()  # every rank is done with its collectives before any tears the group down
    except (OSError, ValueError, ShardError, CheckpointError, ConfigError, ImportError) as e:
        # bad input (HellaSwagError and ConfigError are ValueErrors); a RuntimeError such as CUDA out of
        # memory is not, and keeps its traceback and exit 1
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown()
    trained_on = info.get("meta", {}).get("manifest_id")
    if "manifest_id" in result and trained_on and result["manifest_id"] != trained_on:
        log.warning("val loss computed on dataset %s, but the model was trained on %s: not comparable "
                    "with the run's val/loss", result["manifest_id"], trained_on)
    result = {"target": args.label or info["path"], "kind": info["kind"], "step": info.get("step"), **result}
    if rank == 0:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
