"""The GPU pools' base job templates: Prefect's default template for the worker type plus only what this
project changes (`deployments/docker-gpu-overlay.json`, `deployments/k8s-gpu-overlay.json`).

    python deployments/job_templates.py docker > /tmp/gpu-docker.json
    prefect work-pool create gpu-docker --type docker --base-job-template /tmp/gpu-docker.json

The default is the one `prefect work-pool get-default-base-job-template --type <type>` prints (that command
starts a temporary server; this asks the same sources directly): the installed worker package's own
(prefect-docker 0.7.4 for docker, prefect-kubernetes 0.8.0 for kubernetes, pinned in constraints.txt,
`pip install -e ".[docker,kubernetes]"`), else the worker metadata Prefect bundles (kubernetes only). An
upgrade thus brings its new default fields along, and the overlays stay short enough to review.

Both overlays send flow runs to the servers over https and verify them by the stack's CA, mounted
read-only at /tls/ca.pem (docs/security.md#tls); Kubernetes pods mount it from the ConfigMap `gpt2-ca`.
The docker pool follows docker/.env as compose does (`set -a; . docker/.env; set +a` before rendering):
TLS_CA_FILE is the CA's path on the host (a private CA); TLS_CERT_FILE without TLS_CA_FILE means a public
CA (no CA mounted: the image's system CAs); STACK_PREFECT_API_URL / STACK_MLFLOW_TRACKING_URI replace the
servers' URLs (https only). None of them set: the overlay as it is (private CA at /etc/gpt2/tls/ca.pem).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERLAYS = {"docker": HERE / "docker-gpu-overlay.json", "kubernetes": HERE / "k8s-gpu-overlay.json"}
NEEDS = {"docker": "prefect-docker"}  # bundled metadata for these is older than the worker we target
CA_IN_CONTAINER = "/tls/ca.pem"  # where flow runs find the CA (PREFECT_API_SSL_CERT_FILE, ...)


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


CA_VARS = ("PREFECT_API_SSL_CERT_FILE", "MLFLOW_TRACKING_SERVER_CERT_PATH")
URL_VARS = {"STACK_PREFECT_API_URL": "PREFECT_API_URL", "STACK_MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"}


def bad_setting(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def as_stack_says(overlay: dict, settings: dict) -> dict:
    """The docker overlay with docker/.env's TLS settings (`settings`: TLS_CA_FILE, TLS_CERT_FILE,
    STACK_PREFECT_API_URL, STACK_MLFLOW_TRACKING_URI) applied, as compose applies them to its worker."""
    props = overlay["variables"]["properties"]
    env, volumes = props["env"]["default"], props["volumes"]["default"]
    for name, var in URL_VARS.items():
        if settings.get(name):
            if not settings[name].startswith("https://"):
                bad_setting(f"{name}={settings[name]} is not https: flow runs send credentials to it; give the "
                            "server's https URL, with a name its certificate holds (docs/security.md#tls)")
            env[var] = settings[name]
    ca_file = settings.get("TLS_CA_FILE")
    if ca_file:
        if not os.path.isabs(ca_file) or not os.path.isfile(ca_file):
            bad_setting(f"TLS_CA_FILE={ca_file} is not an existing file given by its absolute path: set it to the "
                        "CA certificate that signed the servers' certificate, as in docker/.env")
        volumes[:] = [f"{ca_file}:{CA_IN_CONTAINER}:ro" if v.split(":")[1] == CA_IN_CONTAINER else v
                      for v in volumes]
    elif settings.get("TLS_CERT_FILE"):  # a public CA: the system CAs verify it, nothing to mount
        volumes[:] = [v for v in volumes if v.split(":")[1] != CA_IN_CONTAINER]
        for var in CA_VARS:
            env.pop(var)
    return overlay


def template(worker_type: str) -> dict:
    """The GPU pool's base job template: Prefect's default + our overlay."""
    if worker_type not in OVERLAYS:
        raise SystemExit(f"error: no GPU overlay for worker type {worker_type!r}; choose {sorted(OVERLAYS)}")
    overlay = json.loads(OVERLAYS[worker_type].read_text())
    if worker_type == "docker":
        overlay = as_stack_says(overlay, os.environ)
    return merge(default_template(worker_type), overlay)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python deployments/job_templates.py {{{'|'.join(OVERLAYS)}}} > template.json")
    print(json.dumps(template(sys.argv[1]), indent=2))
