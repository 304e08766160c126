"""Every MLflow link the project prints opens in the UI's model-training mode (MLflow 3's UI starts in
GenAI mode: a plain experiment, run or model link opens on traces and "Agent versions"). The links are
built in one place, integrations/mlflow_links.py; nothing else writes a UI route by hand, docs included."""

from __future__ import annotations

import re
from pathlib import Path

from integrations import mlflow_links as links

REPO = Path(__file__).resolve().parent.parent
ROUTE = re.compile(r"/#/(experiments|models|runs|compare-runs)\b[^\s)`'\"]*")


def test_each_link_carries_the_model_training_mode():
    uri = "http://127.0.0.1:5000/"
    assert links.experiment_link(uri, "1") == "http://127.0.0.1:5000/#/experiments/1?workflowType=machine_learning"
    assert links.run_link(uri, "1", "ab12") == \
        "http://127.0.0.1:5000/#/experiments/1/runs/ab12?workflowType=machine_learning"
    assert links.model_version_link(uri, "tiny-cpu", 3) == \
        "http://127.0.0.1:5000/#/models/tiny-cpu/versions/3?workflowType=machine_learning"
    assert links.model_link(uri, "a b") == "http://127.0.0.1:5000/#/models/a%20b?workflowType=machine_learning"


def test_no_ui_route_is_written_by_hand():
    """A UI route in code or docs outside mlflow_links.py (a new link that forgot the mode) fails here;
    one in the docs must carry the mode itself."""
    found = []
    for path in [*REPO.glob("*.md"), *(REPO / "docs").glob("*.md"), *REPO.glob("[!.]*/**/*.py")]:
        if ".venv" in path.parts or "reference" in path.parts or path.name in ("mlflow_links.py", "test_links.py"):
            continue
        for m in ROUTE.finditer(path.read_text(errors="replace")):
            by_hand = path.suffix == ".py" and not path.name.startswith("test_")
            if by_hand or "workflowType=machine_learning" not in m.group(0):
                found.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not found, found
