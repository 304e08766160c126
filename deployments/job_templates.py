"""The GPU pools' base job templates: Prefect's default template for the worker type plus only what this
project changes (`deployments/docker-gpu-overlay.json`, `deployments/k8s-gpu-overlay.json`).

    python deployments/job_templates.py docker > /tmp/gpu-docker.json
    prefect work-pool create gpu-docker --type docker --base-job-template /tmp/gpu-docker.json

The default is the one `prefect work-pool get-default-base-job-template --type <type>` prints (that command
starts a temporary server; this asks the same sources directly): the installed worker package's own
(prefect-docker 0.7.4 for docker, pinned in constraints.txt, `pip install -e ".[docker]"`), else the
worker metadata Prefect bundles (kubernetes). An upgrade thus brings its new default fields along, and
the overlays stay short enough to review.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERLAYS = {"docker": HERE / "docker-gpu-overlay.json", "kubernetes": HERE / "k8s-gpu-overlay.json"}
NEEDS = {"docker": "prefect-docker"}  # bundled metadata for these is older than the worker we target


def default_template(worker_type: str) -> dict:
    """Prefect's default base job template for `worker_type` (docker, kubernetes, process, ...)."""
    import prefect
    from prefect.plugins import load_prefect_collections
    from prefect.workers.base import BaseWorker

    load_prefect_collections()  # registers installed worker packages (prefect-docker, ...)
    worker = BaseWorker.get_worker_class_from_type(worker_type)
    if worker is not None:
        return worker.get_default_base_job_template()
    if worker_type in NEEDS:
        raise SystemExit(f"error: the {worker_type} template needs {NEEDS[worker_type]}: pip install -c "
                         f"constraints.txt -e \".[{worker_type}]\"")
    path = Path(prefect.__file__).parent / "server/api/collections_data/views/aggregate-worker-metadata.json"
    for collection in json.loads(path.read_text()).values():
        for w in collection.values():
            if w.get("type") == worker_type:
                return w["default_base_job_configuration"]
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
