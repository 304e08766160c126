"""What the Prefect UI and the demo show, in-process: the summary table's plain cells and their way back, the
training progress line's device-hours, and the demo's report (its links and times)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from integrations.artifact_tables import from_rows, to_rows
from integrations.progress import TrainProgress

SUMMARY = {  # the shape of flows/pretrain.py's summary, with what makes a table hard
    "run_name": "tiny-cpu", "step": 120, "done": True, "val_loss": 6.343, "cost_usd": None,
    "stages": {"download": "ran", "sample": "skipped"},
    "evaluations": {"hellaswag": {"skipped": "cannot download"},
                    "harness": {"arc_easy": {"acc": 0.5, "acc,none": [1, 2]}}},
    "evaluation_summary": ["hellaswag: skipped: cannot download", "harness: arc_easy/acc 0.5"],
    "empty": {}, "none_yet": [], "odd": {"a.b": 1, "c[0]": 2}, "digits": {"1": "one"},
    "sample": "Hello, I'm a language model,\n\nWith your is",
}


def test_the_summary_table_shows_plain_values_and_reads_back_exactly():
    rows = to_rows(SUMMARY)
    cells = {r["key"]: r["value"] for r in rows}
    # what the UI shows: a string as itself (not JSON text with its quotes), numbers as numbers, a dict's
    # leaves on rows of their own
    assert cells["run_name"] == "tiny-cpu" and cells["step"] == 120 and cells["done"] is True
    assert cells["stages.download"] == "ran" and cells["stages.sample"] == "skipped"
    assert cells["evaluations.hellaswag.skipped"] == "cannot download"
    assert cells["evaluation_summary[1]"] == "harness: arc_easy/acc 0.5"
    assert not any(isinstance(v, str) and v.startswith('"') for v in cells.values())
    # what cannot be a path, and empty containers, stay whole in their cell
    assert cells["odd"] == {"a.b": 1, "c[0]": 2} and cells["empty"] == {} and cells["none_yet"] == []
    # through Prefect (the table is stored as JSON) and back: the same dict
    assert from_rows(json.loads(json.dumps(rows))) == SUMMARY
    with pytest.raises(ValueError, match="cannot be written as a path"):
        to_rows({"a.b": 1})


def progress_line(tmp_path, rows: list[dict], **where) -> str:
    """TrainProgress's description after the trainer wrote `rows` to a new run's metrics.jsonl."""
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    run_dir.mkdir()
    p = TrainProgress(run_dir, "tiny-cpu", 120, 0, None, None, **where)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", **r}) + "\n" for r in rows))
    p._read()
    return p.describe()


def test_the_progress_line_counts_device_hours_named_for_the_device(tmp_path):
    rows = [{"step": 10, "train/loss": 9.0, "train/gpu_hours": 0.0123}]
    assert "0.0123 CPU-process-hours so far (1 process)" in progress_line(tmp_path, rows)
    eight = [{"step": 10, "train/loss": 3.4, "train/gpu_hours": 24.48, "train/mfu": 0.41}]
    line = progress_line(tmp_path, eight, world=8, cuda=True)
    assert "24.48 GPU-hours so far (8 GPUs)" in line and "MFU 41%" in line
    assert "hours" not in progress_line(tmp_path, [{"step": 1, "train/loss": 9.0}])  # none recorded yet
    assert "MFU" not in progress_line(tmp_path, rows)  # a CPU has no known peak (gptcore/model/gpt.py)


def test_the_demo_reports_the_flow_runs_time_and_links_to_its_pages(monkeypatch):
    from devstack import demo
    from integrations import mlflow_links

    monkeypatch.setattr(mlflow_links, "pipeline_experiment_id", lambda uri: "7")
    stack = SimpleNamespace(prefect_ui_url="http://127.0.0.1:4200", mlflow_uri="http://127.0.0.1:5000")
    s = {"run_name": "tiny-cpu", "step": 120, "done": True, "gpu_hours": 0.034, "model_version": "models:/tiny-cpu/1",
         "mlflow_run_id": "ab12", "registered_name": "tiny-cpu", "registered_version": "1"}
    out = demo.report(s, stack, "f-1", startup_s=31.4, took_s=140.2)
    lines = {line[:19].strip(): line[19:] for line in out.splitlines() if line.strip() and line[0] != "="}
    # the flow run's artifacts, in the UI that keeps ?tab=Artifacts (the next test)
    assert lines["Prefect run"] == "http://127.0.0.1:4200/v2/runs/flow-run/f-1?tab=Artifacts"
    # MLflow: the experiment, the run and the model version, each in model-training mode
    assert lines["MLflow UI"] == "http://127.0.0.1:5000/#/experiments/7?workflowType=machine_learning"
    assert lines["MLflow run"] == "http://127.0.0.1:5000/#/experiments/7/runs/ab12?workflowType=machine_learning"
    assert lines["MLflow version"] == "http://127.0.0.1:5000/#/models/tiny-cpu/versions/1?workflowType=machine_learning"
    # `took` is the flow run; the servers' start-up is its own line
    assert lines["took"] == "140s (the flow run)" and lines["start-up"].startswith("31s ")
    assert lines["device-hours"].startswith("0.0340 ")


def test_the_installed_prefect_ui_opens_a_flow_run_on_the_tab_the_demo_links():
    """The new UI's flow-run route (/runs/flow-run/$id under /v2) validates ?tab= against its own tab names;
    a name it does not know falls back to Logs. Read from the UI bundle Prefect ships, so an upgrade that
    renames the tab fails here rather than in a user's browser. (The old UI at the root paths drops
    ?tab=Artifacts on a fresh load: that tab is hidden until the run is read, then reset to Logs.)"""
    import re
    from pathlib import Path
    from urllib.parse import parse_qs, urlsplit

    import prefect

    from devstack.demo import flow_run_link

    link = urlsplit(flow_run_link("http://127.0.0.1:4200/", "f-1"))
    assert link.path == "/v2/runs/flow-run/f-1"
    bundle = "\n".join(p.read_text(errors="replace")
                       for p in (Path(prefect.__ui_v2_static_path__) / "assets").glob("*.js"))
    route = re.search(r"`/runs/flow-run/\$id`\)\(\{validateSearch:([\w$]+)", bundle)
    assert route, "the UI bundle's flow-run route was not found: check flow_run_link against this Prefect"
    tabs = re.search(re.escape(route.group(1)) + r"=\w+\(\{tab:\w+\(\[([^\]]*)\]\)", bundle)
    assert tabs, "the flow-run route's tab names were not found: check flow_run_link against this Prefect"
    assert parse_qs(link.query)["tab"][0] in re.findall(r"`(\w+)`", tabs.group(1)), tabs.group(1)
