"""What every evaluation is: `Evaluation` (its name, its config section, settings, cadence, how it runs
across ranks, its documents, its one-line summary) and the `Context` it runs with; `score` runs one on every rank; the
registry (EVALUATIONS), which gptcore/evals/__init__.py fills. eval.json's bookkeeping is record.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gptcore.config import RunConfig, eval_section

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


@dataclass
class NoSettings:
    """An evaluation with no settings of its own."""


class Evaluation:
    name = ""
    # Its config section, eval.<name>.<field>: a dataclass of its own settings with their defaults (and an
    # optional validate() raising ConfigError). Fields named `enabled` and `interval` are its switch and its
    # cadence during training unless it says otherwise (below).
    Settings: type = NoSettings

    def options(self, cfg: RunConfig):
        """Its settings in this config (a Settings instance)."""
        return cfg.eval.options(self.name)

    def enabled(self, cfg: RunConfig) -> bool:
        return getattr(self.options(cfg), "enabled", True)

    def settings(self, cfg: RunConfig) -> dict:
        """What its numbers depend on besides the weights."""
        return {}

    def interval(self, cfg: RunConfig) -> int | None:
        """During training: every N steps (at an eval step) and at the end; 0 = only at the end; None =
        never (the flow's evaluate stage and `python -m gptcore.evals.evaluate` run it)."""
        return getattr(self.options(cfg), "interval", None)

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

    has_documents = False  # whether `documents` gives its examples (the contamination scan reads them)
    headline: str | None = None  # its metric that says most ("acc_norm"): the leaderboard compares versions on it

    @property
    def headline_key(self) -> str | None:
        """The headline's metric key, as eval.json's metrics and the registry name it ("hellaswag/acc_norm")."""
        return f"{self.name}/{self.headline}" if self.headline else None

    def documents(self, ctx: Context) -> dict[str, list[list[int]] | str]:
        """Its evaluation documents as token lists, by part ("<name>", or "<name>/<task>" for several),
        for the contamination scan; a str instead of a part's documents says why it has none. Set
        has_documents when it gives any."""
        return {}

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


# --- the registry: filled by gptcore/evals/__init__.py, one line per evaluation ---------------------

EVALUATIONS: dict[str, Evaluation] = {}


def register(evaluation: Evaluation) -> Evaluation:
    """Add an evaluation to the registry (its name must be new)."""
    if not evaluation.name or evaluation.name in EVALUATIONS or "/" in evaluation.name:
        raise ValueError(f"an evaluation needs a new name without '/', got {evaluation.name!r}")
    EVALUATIONS[evaluation.name] = evaluation
    eval_section(evaluation.name, evaluation.Settings)  # eval.<name>.* is now a known, typed section
    return evaluation


def unregister(name: str) -> None:
    EVALUATIONS.pop(name, None)
    eval_section(name, None)


def enabled(cfg: RunConfig) -> list[Evaluation]:
    return [ev for ev in EVALUATIONS.values() if ev.enabled(cfg)]


def due(cfg: RunConfig, step: int, last: bool) -> list[Evaluation]:
    """The evaluations the trainer runs at this eval step, by each one's interval."""
    out = []
    for ev in enabled(cfg):
        every = ev.interval(cfg)
        if every is not None and (last or (every and step % every == 0)):
            out.append(ev)
    return out
