"""Validation loss over a fixed slice of the val split, and the standalone evaluation command.

validation_loss reads the first `cfg.eval.val_tokens` tokens of the val shards as (B, T) batches of
`train.micro_batch x train.seq_len` (gptcore.data.loader.val_batches): the same batches every time, so val/loss
is comparable across steps and runs. Batch i goes to rank i % world; the per-rank sums are all-reduced,
so the number does not depend on the world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from gptcore import distributed
from gptcore.config import ConfigError, RunConfig, TrainConfig, apply_overrides, from_dict, load_config
from gptcore.data.loader import val_batches
from gptcore.data.shard_format import Manifest, ShardError
from gptcore.model import evaluating
from gptcore.run_files import META_FILE, CheckpointError, checkpoint_of

log = logging.getLogger(__name__)


@torch.no_grad()
def validation_sums(model: torch.nn.Module, cfg: RunConfig, manifest_dir: Path, device,
                    autocast_ctx=None, rank: int = 0, world: int = 1) -> torch.Tensor:
    """This rank's [sum of batch mean losses, batch count] (float64, on `device`), on the plain model through
    the loss path (no logits kept); no collective, so a rank that fails here cannot leave others waiting."""
    B, T = cfg.train.resolved_micro_batch(), cfg.train.seq_len
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with evaluating(model) as plain:
        for x, y in val_batches(manifest_dir, B, T, cfg.eval.val_tokens, rank, world):
            x, y = x.to(device), y.to(device)
            with autocast_ctx or nullcontext():
                _, loss = plain(x, y, return_logits=False)
            total[0] += loss.double()
            total[1] += 1
    return total


def mean_loss(total: torch.Tensor, cfg: RunConfig) -> float:
    """The validation loss from the all-reduced [sum, count] of validation_sums."""
    B, T = cfg.train.resolved_micro_batch(), cfg.train.seq_len
    wanted = max(1, cfg.eval.val_tokens // (B * T))
    if total[1] < wanted:
        log.warning("eval.val_tokens=%d but the val split holds only %d full batches (%d tokens); "
                    "used those", cfg.eval.val_tokens, int(total[1]), int(total[1]) * B * T)
    # every batch has B*T tokens, so the mean of batch means is the mean over tokens
    return float(total[0] / total[1]) if total[1] else float("nan")  # nan: a rank alone with no batch


def validation_loss(model: torch.nn.Module, cfg: RunConfig, manifest_dir: Path, device,
                    autocast_ctx=None, rank: int = 0, world: int = 1) -> float:
    """Mean next-token loss over the first cfg.eval.val_tokens val tokens (same batches every call)."""
    total = validation_sums(model, cfg, manifest_dir, device, autocast_ctx, rank, world)
    if world > 1:  # world=1 inside a DDP job (rank 0 evaluating alone) must not wait for the others
        distributed.all_reduce_sum(total)
    return mean_loss(total, cfg)


# --- standalone evaluation ----------------------------------------------------------------------

def load_target(path: Path, device="cpu") -> tuple[torch.nn.Module, dict]:
    """Load the model behind `path`: a checkpoint dir, a run dir (its newest checkpoint) or a Hugging Face
    export dir. Returns (model in eval mode, info) where info names what was loaded."""
    from gptcore import checkpoint

    path = checkpoint_of(Path(path))
    if (path / META_FILE).is_file():
        model, meta = checkpoint.load_model(path, device)
        return model, {"kind": "checkpoint", "path": str(path), "step": meta.get("step"), "meta": meta}
    if (path / "config.json").is_file():
        from gptcore.hf import load_hf_dir  # the Hugging Face export/import module

        return load_hf_dir(path).to(device).eval(), {"kind": "hf", "path": str(path)}
    raise FileNotFoundError(f"{path} is neither a checkpoint (no meta.json), a run directory (no "
                            "checkpoints/) nor a Hugging Face export (no config.json)")


def evaluate_model(model: torch.nn.Module, cfg: RunConfig, device, autocast_ctx=None, *,
                   hellaswag: bool = True, hellaswag_path: Path | None = None, limit: int = 0,
                   val: bool = False, manifest_dir: Path | None = None, rank: int = 0,
                   world: int = 1, harness_tasks: list[str] | None = None, harness_include_path: str | None = None,
                   harness_limit: int = 0, contamination_ngram: int = 0) -> dict:
    """Validation loss, HellaSwag and lm-evaluation-harness tasks for an already-loaded model (a checkpoint,
    an HF export, or a registered MLflow model loaded by tasks/). HellaSwag or a task that cannot be fetched
    is reported, not raised. The harness runs on rank 0 (it has no notion of our ranks). With
    `contamination_ngram`, the share of HellaSwag examples found in the training shards (rank 0)."""
    from gptcore import hellaswag as hs

    out: dict = {}
    if val:
        if manifest_dir is None:
            from gptcore.data.build import dataset_dir
            manifest_dir = dataset_dir(cfg)
        out["val_loss"] = validation_loss(model, cfg, manifest_dir, device, autocast_ctx, rank, world)
        out["val_tokens"] = cfg.eval.val_tokens
        out["manifest_id"] = Manifest.load(manifest_dir).id
    if hellaswag:
        examples, reason = hs.shared_examples(cfg, hellaswag_path, limit, master=rank == 0)
        if examples is None:
            log.warning("HellaSwag evaluation skipped: %s", reason)
            out["hellaswag"] = {"skipped": reason}
        else:
            out["hellaswag"] = hs.evaluate(model, examples, device, autocast_ctx, rank, world)
            if contamination_ngram and rank == 0:
                from gptcore.contamination import contamination
                from gptcore.data.build import dataset_dir

                data = manifest_dir or dataset_dir(cfg)
                tokens = [ex.ctx_tokens + [t for e in ex.ending_tokens for t in e] for ex in examples]
                report = contamination(data, {"hellaswag": tokens}, contamination_ngram)
                out["contamination"] = {k: {f: v[f] for f in ("n", "examples", "contaminated", "share")}
                                        for k, v in report.items()}
    if harness_tasks and rank == 0:
        from gptcore.harness import run_tasks  # lm-eval: only when tasks are asked for

        out["harness"] = run_tasks(model, harness_tasks, device, autocast_ctx, harness_include_path or None,
                                   harness_limit or None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gptcore.evaluate",
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
    p.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (default: the config's "
                   "eval.harness_tasks; 'none' for none)")
    p.add_argument("--include-path", metavar="DIR", help="a folder of your own harness task YAMLs")
    p.add_argument("--harness-limit", type=int, help="examples per harness task (default: eval.harness_limit)")
    p.add_argument("--contamination", type=int, metavar="N", help="report HellaSwag examples sharing an N-token "
                   "n-gram with the training shards (default: eval.contamination_ngram; 0 = off)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    env = distributed.select(TrainConfig(device=args.device))
    distributed.init_process_group(env)  # only under torchrun with more than one rank
    rank, world, device, autocast_ctx = env.rank, env.world, env.device, env.autocast()
    try:
        model, info = load_target(Path(args.target), device)
        if info["kind"] == "checkpoint" and not args.config:
            if not isinstance(info["meta"].get("config"), dict):
                raise CheckpointError(f"{info['path']} records no training config in its meta.json; pass --config")
            cfg = apply_overrides(from_dict(info["meta"]["config"]), args.set)
        else:
            cfg = load_config(args.config or "gpt2-124m", args.set)
        tasks = cfg.eval.harness_task_list if args.tasks is None else \
            [t.strip() for t in args.tasks.split(",") if t.strip() and t.strip() != "none"]
        result = evaluate_model(model, cfg, device, autocast_ctx, hellaswag=not args.no_hellaswag,
                                hellaswag_path=args.hellaswag, limit=args.limit, val=args.val,
                                manifest_dir=Path(args.data) if args.data else None, rank=rank, world=world,
                                harness_tasks=tasks,
                                harness_include_path=args.include_path or cfg.eval.harness_include_path,
                                harness_limit=cfg.eval.harness_limit if args.harness_limit is None
                                else args.harness_limit,
                                contamination_ngram=cfg.eval.contamination_ngram if args.contamination is None
                                else args.contamination)
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
