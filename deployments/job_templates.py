"""The Kubernetes GPU pool's base job template: Prefect's default template for the worker type plus only
what this project changes (`deployments/k8s-gpu-overlay.json`).

    python deployments/job_templates.py kubernetes > /tmp/gpu-k8s.json
    prefect work-pool create gpu-k8s --type kubernetes --base-job-template /tmp/gpu-k8s.json

The default comes from the installed Prefect: the worker metadata it bundles, the same JSON that
`prefect work-pool get-default-base-job-template --type <type>` prints (that command starts a temporary
server; this reads the file). A Prefect upgrade thus brings its new default fields along, and the overlay
stays short enough to review. (The docker pool's template stays whole in docker-gpu-job-template.json:
Prefect 3.8.8 bundles an older docker default than the prefect-docker it targets, so default + overlay
would change it.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERLAYS = {"kubernetes": HERE / "k8s-gpu-overlay.json"}


def default_template(worker_type: str) -> dict:
    """Prefect's default base job template for `worker_type` (docker, kubernetes, process, ...)."""
    import prefect

    path = Path(prefect.__file__).parent / "server/api/collections_data/views/aggregate-worker-metadata.json"
    for collection in json.loads(path.read_text()).values():
        for worker in collection.values():
            if worker.get("type") == worker_type:
                return worker["default_base_job_configuration"]
    raise SystemExit(f"error: Prefect {prefect.__version__} has no default template for worker type "
                     f"{worker_type!r}")


def merge(base, overlay):
    """`overlay` on top of `base`: mappings merge key by key, anything else (lists too) is replaced."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in overlay.items()}}
    return overlay


def template(worker_type: str) -> dict:
    """The GPU pool's base job template: Prefect's default + our overlay."""
    if worker_type not in OVERLAYS:
        raise SystemExit(f"error: no GPU overlay for worker type {worker_type!r}; choose {sorted(OVERLAYS)}")
    return merge(default_template(worker_type), json.loads(OVERLAYS[worker_type].read_text()))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python deployments/job_templates.py {{{'|'.join(OVERLAYS)}}} > template.json")
    print(json.dumps(template(sys.argv[1]), indent=2))
