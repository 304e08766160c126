"""The registered model's versions side by side, as a pandas DataFrame: the table users compare in.

    python -m tasks.leaderboard [tiny-cpu] [--csv board.csv] [--sort val_loss]
    leaderboard("tiny-cpu") -> DataFrame, one row per version:
        version, aliases, step, tokens_seen, val_loss, then each evaluation's headline metric (gptcore/evals)
        with its _stderr and _vs_best ("best", "within 2 SE": not told apart at this sample size, "better",
        "worse", "not measured": skipped or not run): hellaswag_acc_norm(_stderr, _vs_best); then every other
        metric the versions have, one column each (cost_usd, gpu_hours: what the run had cost at that step;
        hellaswag_acc, harness_<task>_<metric>, ...); optimizer, schedule, run_name, run_id, manifest_id,
        model_id, created

Measurements (val loss, every evaluation's numbers, step, tokens) are the metrics of each version's LoggedModel
(what the MLflow UI's Models tab sorts by); identity (recipe, manifest id, run) comes from the version's tags. Three
calls build it (the model's versions, its aliases, the logged models of that name), however many
versions there are. `best_version` reads the same table, so the alias and the board cannot disagree. The flow publishes
the board as a Prefect table artifact after it registers a checkpoint (`publish_leaderboard`).
"""

from __future__ import annotations

# lazy imports: mlflow and prefect's artifacts only when a leaderboard is read or published
import argparse
import math
import os
import re
import sys
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from gptcore.config import ConfigError
from gptcore.evals import EVALUATIONS
from integrations import mlflow_store as store
from integrations.progress import artifact_key

# metric of the logged model -> leaderboard column (every evaluation's metrics add columns of their own:
# hellaswag/acc_norm -> hellaswag_acc_norm, harness/arc_easy/acc -> harness_arc_easy_acc)
METRICS = {"val/loss": "val_loss", "train/step": "step", "train/tokens_seen": "tokens_seen",
           # what the run had cost at the version's step (gptcore/training/cost.py; cost only with a price)
           "train/gpu_hours": "gpu_hours", "train/cost_usd": "cost_usd"}
TAGS = ("optimizer", "schedule", "run_name", "manifest_id")
FIRST = ["version", "aliases", "step", "tokens_seen", "val_loss"]  # then each headline with its stderr and vs_best
LAST = ["optimizer", "schedule", "run_name", "run_id", "manifest_id", "model_id", "created"]


def headline_columns() -> list[str]:
    """Each registered evaluation's headline column, its stderr and its comparison with `best`."""
    out = []
    for ev in EVALUATIONS.values():
        if ev.headline:
            column = column_of(ev.headline_key)
            out += [column, f"{column}_stderr", f"{column}_vs_best"]
    return out


def _model_id(mv) -> str:
    return mv.model_id or (mv.source or "").removeprefix("models:/")


def _latest_values(metrics) -> dict[str, float]:
    """{key: value} at each key's last step (the checkpoint's own step: one value per key in practice)."""
    out: dict[str, tuple] = {}
    for m in metrics or []:
        if m.key not in out or (m.step, m.timestamp) >= out[m.key][0]:
            out[m.key] = ((m.step, m.timestamp), m.value)
    return {k: v for k, (_, v) in out.items()}


def _logged_model_metrics(mlc, name: str, model_ids: set[str]) -> dict[str, dict[str, float]]:
    """{model_id: {metric: value}} for the logged models named `name`, through search_logged_models."""
    exp_ids = [e.experiment_id for e in mlc.search_experiments()]
    found, token = {}, None
    while exp_ids:
        page = mlc.search_logged_models(exp_ids, filter_string=f"name = {store.quoted(name)}",
                                        max_results=100, page_token=token)
        found.update({lm.model_id: _latest_values(lm.metrics) for lm in page if lm.model_id in model_ids})
        token = page.token
        if not token:
            break
    for missing in model_ids - found.keys():  # e.g. a logged model in an experiment the search cannot see
        try:
            found[missing] = _latest_values(mlc.get_logged_model(missing).metrics)
        except Exception:  # noqa: BLE001 -- deleted or unreadable: its row has no measurements
            found[missing] = {}
    return found


def _legacy(tags: dict) -> dict[str, float]:
    """Versions registered before measurements were metrics carried them as tags of the column's name
    (val_loss, hellaswag_acc, ...): {column: value}."""
    out = {}
    for key, value in tags.items():
        if key == "val_loss" or key.split("_")[0] in EVALUATIONS:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def leaderboard(name: str, tracking_uri: str | None = None, mlc=None) -> pd.DataFrame:
    """One row per version of registered model `name` (empty, with the columns, when it has none)."""
    mlc = mlc or store.client(tracking_uri)
    versions = list(mlc.search_model_versions(f"name = {store.quoted(name)}"))
    measured = _logged_model_metrics(mlc, name, {_model_id(mv) for mv in versions}) if versions else {}
    newest = max((int(mv.version) for mv in versions), default=None)
    aliases: dict[int, list[str]] = {}  # searched versions do not carry their aliases; the model does
    for alias, version in (mlc.get_registered_model(name).aliases if versions else {}).items():
        aliases.setdefault(int(version), []).append(alias)
    rows = []
    for mv in versions:
        values = measured.get(_model_id(mv), {})
        row = {"version": int(mv.version),
               "aliases": ",".join(sorted(aliases.get(int(mv.version), []))
                                   + (["latest"] if int(mv.version) == newest else [])),
               "run_id": mv.run_id, "model_id": _model_id(mv),
               "created": pd.Timestamp(mv.creation_timestamp, unit="ms", tz="UTC")}
        legacy = _legacy(mv.tags)
        for key, column in METRICS.items():
            value = values.get(key, legacy.get(column))
            row[column] = value if value is not None and math.isfinite(value) else None
        row.update({t: mv.tags.get(t) for t in TAGS})
        # every evaluation's metrics (gptcore/evals), one column each: hellaswag_acc_norm, harness_arc_easy_acc
        evaluated = {column_of(k): v for k, v in values.items() if k.split("/")[0] in EVALUATIONS}
        row.update({**{k: v for k, v in legacy.items() if k not in row}, **evaluated})
        rows.append(row)
    firsts = FIRST + headline_columns()
    numbers = sorted({k for row in rows for k in row} - set(firsts) - set(LAST))
    df = pd.DataFrame(rows, columns=firsts + numbers + LAST)
    measured = ["val_loss", *numbers, *headline_columns()]
    df = df.astype({"step": "Int64", "tokens_seen": "Int64",
                    **{c: "Float64" for c in measured if not c.endswith("_vs_best")}})
    for ev in EVALUATIONS.values():  # each evaluation's headline metric, against the `best` version's
        column = column_of(ev.headline_key) if ev.headline_key else None
        if column:
            df[f"{column}_vs_best"] = compared_with_best(df, column)
    return df.sort_values("version", ignore_index=True)


def column_of(metric: str) -> str:
    """harness/arc_easy/acc -> harness_arc_easy_acc"""
    return re.sub(r"[^A-Za-z0-9_]", "_", metric)


def compared_with_best(board: pd.DataFrame, column: str) -> pd.Series:
    """Per version, how its `column` compares with the `best` version's: "best", "within 2 SE" (the
    difference is within two standard errors of the difference, sqrt(se_a^2 + se_b^2): noise at this
    sample size), "better" or "worse"; "not measured" for a version without the number (its evaluation
    was skipped, e.g. offline, or not run); None when the numbers to compare are missing (e.g. no
    standard error recorded, or `best` itself was not measured)."""
    out = pd.Series([None] * len(board), index=board.index, dtype=object)
    best = best_version(board) if len(board) else None
    if best is None:
        return out
    b = board[board["version"] == int(best)].iloc[0]
    for i, row in board.iterrows():
        a, se_a, vb, se_b = row[column], row[f"{column}_stderr"], b[column], b[f"{column}_stderr"]
        if pd.isna(a):  # `best` is by val loss: a version that skipped this evaluation is not ranked on it
            out[i] = "not measured"
        elif row["version"] == int(best):
            out[i] = "best"
        elif not any(pd.isna(v) for v in (a, se_a, vb, se_b)):
            out[i] = ("within 2 SE" if abs(a - vb) <= 2 * math.sqrt(se_a ** 2 + se_b ** 2)
                      else "better" if a > vb else "worse")
    return out


def best_version(board: pd.DataFrame) -> str | None:
    """The version `best` belongs on: the lowest val loss; a tie goes to the older version (so
    re-registering never moves the alias); versions without a finite val loss are never best."""
    scored = board[board["val_loss"].notna()]
    if scored.empty:
        return None
    return str(scored.sort_values(["val_loss", "version"]).iloc[0]["version"])


def records(board: pd.DataFrame) -> list[dict]:
    """JSON-safe rows (missing values as None, times as ISO strings): a Prefect table, a REST reply."""
    out = board.assign(created=board["created"].map(lambda t: t.isoformat(timespec="seconds")))
    return [{k: (None if pd.isna(v) else v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in out.astype(object).to_dict("records")]


@task(name="leaderboard", cache_policy=NO_CACHE)
def publish_leaderboard(name: str, tracking_uri: str | None = None) -> list[dict]:
    """The leaderboard of `name` as a Prefect table artifact (key leaderboard-<name>); returns its rows."""
    from prefect.artifacts import create_table_artifact

    from integrations.mlflow_links import model_link

    rows = records(leaderboard(name, tracking_uri))
    uri = tracking_uri or store.tracking_uri()
    where = f" [{name} in MLflow]({model_link(uri, name)})" if uri.startswith("http") else ""
    create_table_artifact(rows, key=artifact_key("leaderboard", name),
                          description=f"Registered versions of {name}: val loss, HellaSwag, step, tokens, recipe "
                                      f"(`python -m tasks.leaderboard {name}`).{where}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print a registered model's versions as a table.")
    p.add_argument("model", nargs="?", default="tiny-cpu", help="registered model name (default tiny-cpu)")
    p.add_argument("--csv", default=None, help="also write the table to this CSV file")
    p.add_argument("--sort", default="version", help="sort by this column (default version; e.g. val_loss, "
                   "hellaswag_acc_norm)")
    p.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or the embedded store")
    args = p.parse_args(argv)
    from mlflow.exceptions import MlflowException

    try:
        board = leaderboard(args.model, args.tracking_uri)
    except ConfigError as e:  # a name that cannot go into a search filter
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MlflowException as e:
        print(f"error: the MLflow tracking server {args.tracking_uri or store.tracking_uri()} failed: {e}. Check "
              "that it is running (MLFLOW_TRACKING_URI or --tracking-uri)", file=sys.stderr)
        return 2
    if board.empty:
        print(f"error: registered model {args.model!r} has no versions at {args.tracking_uri or store.tracking_uri()};"
              " name one that exists (python -m tasks.leaderboard <model>) or register a checkpoint first",
              file=sys.stderr)
        return 2
    if args.sort not in board:
        print(f"error: --sort {args.sort!r} is not a column of this board; use one of {list(board.columns)}",
              file=sys.stderr)
        return 2
    board = board.sort_values(args.sort, ignore_index=True, na_position="last")
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(board.drop(columns=["run_id", "model_id"]).to_string(index=False))
    if args.csv:
        tmp = Path(f"{args.csv}.tmp{os.getpid()}")
        board.to_csv(tmp, index=False)
        os.replace(tmp, args.csv)  # never a half-written CSV
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
