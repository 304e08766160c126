"""Two training runs side by side, step by step: did my change alter the training?

    python -m benchmarks.loss_compare RUN_A RUN_B                  # the table, exit 0
    python -m benchmarks.loss_compare RUN_A RUN_B --assert-equal   # exit 1 at the first step they part
    python -m benchmarks.loss_compare RUN_A RUN_B --tolerance 1e-4 # ... by more than 1e-4 (x max(1, |B|))

    python -m benchmarks.loss_compare runs:/<mlflow run id> RUN_B --tracking-uri http://127.0.0.1:5000

RUN_A and RUN_B are run directories (their metrics.jsonl) or MLflow runs (`runs:/<run id>`: the metric
histories the shipper logged, from --tracking-uri or MLFLOW_TRACKING_URI). Each step's loss, gradient norm
and tokens/s are printed for both, with the loss and norm differences. A step run twice (a resume from an earlier
checkpoint re-runs the steps after it) counts as its last run, the one the weights continued from. With
--assert-equal or --tolerance, the losses and gradient norms must agree on every step both runs have, and
both must have the same steps; the first disagreement is named and the exit code is 1. Tokens/s are never
compared (they measure the machine, not the training).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from gptcore.metrics import read_metrics

COMPARED = ("train/loss", "train/grad_norm")


MLFLOW_RUN = "runs:/"


def steps_of(run: str, tracking_uri: str | None = None) -> dict[int, dict]:
    """{step: its last train row} of a run directory, or of an MLflow run (`runs:/<id>`)."""
    if run.startswith(MLFLOW_RUN):
        return mlflow_steps(run.removeprefix(MLFLOW_RUN).strip("/"), tracking_uri)
    metrics = Path(run) / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"loss_compare: {run} has no metrics.jsonl: pass a run directory (train.run_dir)")
    return {r["step"]: r for r in read_metrics(metrics, "train")}


def mlflow_steps(run_id: str, tracking_uri: str | None) -> dict[int, dict]:
    """The same rows from an MLflow run's metric histories (the latest value logged at each step wins, as a
    resumed run's last row does in its metrics.jsonl)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)
    steps: dict[int, dict] = {}
    try:
        for key in (*COMPARED, "train/tokens_per_s"):
            for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
                steps.setdefault(m.step, {"step": m.step})[key] = m.value
    except MlflowException as e:
        raise SystemExit(f"loss_compare: MLflow run {run_id!r} could not be read ({e.message}); check the run id "
                         "and --tracking-uri") from None
    if not steps:
        raise SystemExit(f"loss_compare: MLflow run {run_id!r} has no train/loss metrics on this server; check "
                         "the run id and --tracking-uri")
    return steps


def first_parting(a: dict[int, dict], b: dict[int, dict], tolerance: float) -> str | None:
    """Where the runs part (a step only one has, or a loss/norm further apart than `tolerance`), else None."""
    only = sorted(set(a) ^ set(b))
    if only:
        which = "A" if only[0] in a else "B"
        return f"step {only[0]} is only in run {which} ({len(a)} vs {len(b)} steps)"
    for step in sorted(a):
        for key in COMPARED:
            x, y = a[step].get(key), b[step].get(key)
            if x is None and y is None:
                continue
            if x is None or y is None or not (abs(x - y) <= tolerance * max(1.0, abs(y))
                                              or (math.isnan(x) and math.isnan(y))):
                return f"step {step}: {key} {x!r} vs {y!r} (difference {abs((x or 0) - (y or 0)):.3g}, " \
                       f"tolerance {tolerance:g})"
    return None


def table(a: dict[int, dict], b: dict[int, dict]) -> list[str]:
    def cell(row: dict | None, key: str, fmt: str) -> str:
        return format(row[key], fmt) if row and key in row else "-"

    lines = [f"{'step':>6} {'loss A':>10} {'loss B':>10} {'diff':>9} {'norm A':>9} {'norm B':>9} {'diff':>9} "
             f"{'tok/s A':>10} {'tok/s B':>10}"]
    for s in sorted(set(a) | set(b)):
        x, y = a.get(s), b.get(s)
        diffs = [format(abs(x[k] - y[k]), ".2e") if x and y and k in x and k in y else "-" for k in COMPARED]
        lines.append(f"{s:>6} {cell(x, 'train/loss', '.6f'):>10} {cell(y, 'train/loss', '.6f'):>10} "
                     f"{diffs[0]:>9} {cell(x, 'train/grad_norm', '.4f'):>9} {cell(y, 'train/grad_norm', '.4f'):>9} "
                     f"{diffs[1]:>9} {cell(x, 'train/tokens_per_s', ',.0f'):>10} "
                     f"{cell(y, 'train/tokens_per_s', ',.0f'):>10}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", help="a run directory, or runs:/<mlflow run id>")
    ap.add_argument("run_b", help="a run directory, or runs:/<mlflow run id>")
    ap.add_argument("--tracking-uri", help="the MLflow server of runs:/ arguments (default: MLFLOW_TRACKING_URI)")
    check = ap.add_mutually_exclusive_group()
    check.add_argument("--assert-equal", action="store_true", help="losses and norms bit-identical")
    check.add_argument("--tolerance", type=float, help="losses and norms within this difference (absolute below "
                                                       "1, relative above)")
    a = ap.parse_args(argv)
    if a.tolerance is not None and not a.tolerance >= 0:
        ap.error(f"--tolerance must be a number >= 0, got {a.tolerance}")
    runs = steps_of(a.run_a, a.tracking_uri), steps_of(a.run_b, a.tracking_uri)
    print(f"A: {a.run_a}\nB: {a.run_b}")
    print("\n".join(table(*runs)))
    if not a.assert_equal and a.tolerance is None:
        return 0
    parting = first_parting(*runs, 0.0 if a.assert_equal else a.tolerance)
    if parting:
        print(f"loss_compare: the runs part at {parting}", file=sys.stderr)
        return 1
    how = "bit-identical" if a.assert_equal else f"within {a.tolerance:g}"
    print(f"loss_compare: {len(runs[0])} steps agree ({how})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
