"""The evaluations a checkpoint is judged by beside its validation loss: one module each, one registry.

Each is an `Evaluation`: its name (its key in eval.json and the prefix of its metrics), whether the config
asks for it, the settings its numbers depend on (a change means evaluate again), how it runs on the plain
model, and a one-line summary. Its result is a dict of numbers, each accuracy with its standard error
beside it (`acc`, `acc_stderr`; nested dicts for several tasks), or {"skipped": why}. Everything after
it loops over EVALUATIONS and names none: the standalone evaluate and the flow's evaluate stage
(gptcore/evaluate.py), eval.json's settings (gptcore/run_files.eval_settings), the logged model's metrics
(tasks/register.py: `<name>/<metric>`), the flow's eval table and the leaderboard (a column per metric).

Adding one: a module here with an Evaluation subclass, and one `register(...)` line at the bottom of this
file (tests/test_evaluations.py registers a toy one from inside the test). Validation loss stays the
trainer's own (it decides `best`); during training the trainer also scores HellaSwag (gptcore/train_eval.py).

    hellaswag       gptcore/hellaswag.py's 4-way completion scorer (rank-parallel)
    harness         lm-evaluation-harness tasks on our GPT (gptcore/harness.py)
    contamination   HellaSwag examples sharing an n-gram with the training shards (gptcore/contamination.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gptcore.config import RunConfig
from gptcore.run_files import result_metrics  # noqa: F401 -- a result as flat metrics, `<name>/<metric>`

if TYPE_CHECKING:
    import torch


@dataclass
class Context:
    """What an evaluation runs with: the plain model and where it lives, the ranks, the run's dataset."""
    model: torch.nn.Module
    cfg: RunConfig
    device: torch.device | str
    autocast_ctx: object = None
    rank: int = 0
    world: int = 1
    data_dir: Path | None = None  # the training dataset (manifest.json), when known


class Evaluation:
    name = ""

    def enabled(self, cfg: RunConfig) -> bool:
        return True

    def settings(self, cfg: RunConfig) -> dict:
        """What its numbers depend on besides the weights."""
        return {}

    def run(self, ctx: Context) -> dict:
        """Its numbers, or {"skipped": why}. Under DDP every rank calls it (it may split the work)."""
        raise NotImplementedError

    def summary(self, result: dict) -> str:
        """One line: each number with its standard error where it has one."""
        if "skipped" in result:
            return f"{self.name}: skipped: {result['skipped']}"
        return f"{self.name}: " + ", ".join(f"{k} {v}" for k, v in numbers(result).items())


def numbers(result: dict, prefix: str = "") -> dict[str, str]:
    """{metric: "0.3100 ± 0.0150"} for a result's finite numbers (nested results flattened with "/")."""
    out: dict[str, str] = {}
    for k, v in result.items():
        if isinstance(v, dict):
            out.update(numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("_stderr") \
                and math.isfinite(v):
            se = result.get(f"{k}_stderr")
            out[f"{prefix}{k}"] = (f"{v:.4f} ± {se:.4f}" if isinstance(se, float) and math.isfinite(se)
                                   else f"{v:.4g}" if isinstance(v, float) else str(v))
    return out


EVALUATIONS: dict[str, Evaluation] = {}


def register(evaluation: Evaluation) -> Evaluation:
    """Add an evaluation to the registry (its name must be new)."""
    if not evaluation.name or evaluation.name in EVALUATIONS or "/" in evaluation.name:
        raise ValueError(f"an evaluation needs a new name without '/', got {evaluation.name!r}")
    EVALUATIONS[evaluation.name] = evaluation
    return evaluation


def unregister(name: str) -> None:
    EVALUATIONS.pop(name, None)


def enabled(cfg: RunConfig) -> list[Evaluation]:
    return [ev for ev in EVALUATIONS.values() if ev.enabled(cfg)]


# --- the registry -----------------------------------------------------------------------------------

from gptcore.evals.contamination import Contamination  # noqa: E402
from gptcore.evals.harness import Harness  # noqa: E402
from gptcore.evals.hellaswag import HellaSwag  # noqa: E402

register(HellaSwag())
register(Harness())
register(Contamination())
