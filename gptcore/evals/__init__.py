"""The evaluations a checkpoint is judged by beside its validation loss: one module each, one registry.

Each is an `Evaluation`: its name (its key in eval.json and the prefix of its metrics), whether the config
asks for it, the settings its numbers depend on (a change means evaluate again), its cadence during
training, how it runs on the plain model across ranks, and a one-line summary. Its result is a dict of
numbers, each accuracy with its standard error beside it (`acc`, `acc_stderr`; nested dicts for several
tasks), or {"skipped": why}. Everything after it loops over EVALUATIONS and names none: the trainer's
periodic evaluation (gptcore/training/train_eval.py, each at its own interval), the standalone evaluate
(gptcore/evals/evaluate.py), eval.json's settings (gptcore/evals/record.py), the flow's
evaluate stage (one Prefect task run per evaluation) and its eval table, the logged model's metrics (tasks/register.py:
`<name>/<metric>`), the leaderboard (a column per metric) and the demo's summary.

Adding one: a module here with an Evaluation subclass, and one `register(...)` line at the bottom of this
file (tests/test_evaluations.py registers a toy one from inside the test). Validation loss stays the
trainer's own (it decides `best`).

How one runs under DDP (`score`): `prepare` on every rank (collectives allowed: rank 0 reads a dataset and
broadcasts it), then `share` on every rank with no collective (the trainer agrees on failures after it,
so a rank that raises cannot leave the others waiting), then `combine` of every rank's share. The simple
route is `run`: rank 0 computes the whole result alone, the others wait.

    hellaswag       gptcore/evals/scorers/hellaswag.py's 4-way completion scorer (examples split across ranks)
    harness         lm-evaluation-harness tasks on our GPT (gptcore/evals/scorers/harness.py; rank 0)
    contamination   HellaSwag examples sharing an n-gram with the training shards
                    (gptcore/evals/scorers/contamination.py)
    bpb             bits per byte of HellaSwag's correct endings and of a held-out text (one module)

May import: the base modules, model, data, checkpoints.
"""

from __future__ import annotations

from gptcore.evals.base import (  # noqa: F401 -- the evaluation API and its registry
    EVALUATIONS,
    Context,
    Evaluation,
    due,
    enabled,
    numbers,
    register,
    score,
    unregister,
)

# --- the registry -----------------------------------------------------------------------------------
from gptcore.evals.bpb import BitsPerByte  # noqa: E402
from gptcore.evals.contamination import Contamination  # noqa: E402
from gptcore.evals.harness import Harness  # noqa: E402
from gptcore.evals.hellaswag import HellaSwag  # noqa: E402

register(HellaSwag())
register(Harness())
register(Contamination())
register(BitsPerByte())
