"""The evaluations a checkpoint is judged by beside its validation loss: one module each, one registry.

Each is an `Evaluation`: its name (its key in eval.json and the prefix of its metrics), whether the config
asks for it, the settings its numbers depend on (a change means evaluate again), its cadence during
training, how it runs on the plain model across ranks, and a one-line summary. Its result is a dict of
numbers, each accuracy with its standard error beside it (`acc`, `acc_stderr`; nested dicts for several
tasks), or {"skipped": why}. Everything after it loops over EVALUATIONS and names none: the trainer's
periodic evaluation (gptcore/train_eval.py, each at its own interval), the standalone evaluate
(gptcore/evaluate.py), eval.json's settings (gptcore/checkpoints/run_files.eval_settings), the flow's evaluate stage
(one Prefect task run per evaluation) and its eval table, the logged model's metrics (tasks/register.py:
`<name>/<metric>`), the leaderboard (a column per metric) and the demo's summary.

Adding one: a module here with an Evaluation subclass, and one `register(...)` line at the bottom of this
file (tests/test_evaluations.py registers a toy one from inside the test). Validation loss stays the
trainer's own (it decides `best`).

How one runs under DDP (`score`): `prepare` on every rank (collectives allowed: rank 0 reads a dataset and
broadcasts it), then `share` on every rank with no collective (the trainer agrees on failures after it,
so a rank that raises cannot leave the others waiting), then `combine` of every rank's share. The simple
route is `run`: rank 0 computes the whole result alone, the others wait.

    hellaswag       gptcore/hellaswag.py's 4-way completion scorer (examples split across ranks)
    harness         lm-evaluation-harness tasks on our GPT (gptcore/harness.py; rank 0)
    contamination   HellaSwag examples sharing an n-gram with the training shards (gptcore/contamination.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gptcore.checkpoints.run_files import result_metrics  # noqa: F401 -- a result as flat metrics, `<name>/<metric>`
from gptcore.config import RunConfig

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
    cache: dict = field(default_factory=dict)  # what `prepare` loaded; the trainer keeps it across steps


class Evaluation:
    name = ""

    def enabled(self, cfg: RunConfig) -> bool:
        return True

    def settings(self, cfg: RunConfig) -> dict:
        """What its numbers depend on besides the weights."""
        return {}

    def interval(self, cfg: RunConfig) -> int | None:
        """During training: every N steps (at an eval step) and at the end; 0 = only at the end; None =
        never (the flow's evaluate stage and `python -m gptcore.evaluate` run it)."""
        return None

    def prepare(self, ctx: Context) -> None:
        """Every rank, before `share`: load what it needs into ctx.cache (collectives allowed)."""

    def share(self, ctx: Context) -> dict:
        """This rank's part of the result, with no collective. Default: rank 0 runs `run` alone."""
        return self.run(ctx) if ctx.rank == 0 else {}

    def combine(self, shares: list[dict]) -> dict:
        """The result from every rank's share (rank order). Default: rank 0's."""
        return shares[0]

    def run(self, ctx: Context) -> dict:
        """The whole result, computed by rank 0 alone; or {"skipped": why}."""
        raise NotImplementedError

    def summary(self, result: dict) -> str:
        """One line: each number with its standard error where it has one."""
        if "skipped" in result:
            return f"{self.name}: skipped: {result['skipped']}"
        return f"{self.name}: " + ", ".join(f"{k} {v}" for k, v in numbers(result).items())


def score(evaluation: Evaluation, ctx: Context) -> dict:
    """One evaluation's result on every rank (prepare, share, combine); the standalone route, where an
    exception is the evaluation's end (the trainer runs the same steps with its failure agreement)."""
    evaluation.prepare(ctx)
    share = evaluation.share(ctx)
    if ctx.world == 1:
        return evaluation.combine([share])
    from gptcore import distributed  # torch: only when an evaluation runs (a no-op re-run reads the registry)

    return evaluation.combine(distributed.all_gather_object(share))


def due(cfg: RunConfig, step: int, last: bool) -> list[Evaluation]:
    """The evaluations the trainer runs at this eval step, by each one's interval."""
    out = []
    for ev in enabled(cfg):
        every = ev.interval(cfg)
        if every is not None and (last or (every and step % every == 0)):
            out.append(ev)
    return out


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
