"""The Kubernetes manifests users apply, checked against Kubernetes' own OpenAPI schemas (kubernetes-validate,
offline, strict: an unknown or misspelt field is an error) for the Kubernetes version docs/docker.md names:
deployments/k8s-multinode.yaml (its elastic variant too) and the Job every deployment of
deployments/prefect-k8s.yaml becomes once the Kubernetes worker renders the GPU pool's template with it.
No cluster is reachable here; against a live one: `kubectl apply --dry-run=server -f <file>`."""

from __future__ import annotations

import asyncio
import copy
import sys
import uuid
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deployments"
sys.path.insert(0, str(DEPLOY))
import job_templates  # noqa: E402  (deployments/job_templates.py: the pools' templates)

KUBERNETES = "1.33.0"  # the version docs/docker.md names ("Kubernetes")
PREFECT_REQUIRES_IN_POD = ("parallelism", "completions")


def check(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def multinode() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s-multinode.yaml").read_text()))


def rendered_jobs() -> dict[str, dict]:
    """deployment name -> the Job manifest the Kubernetes worker submits for a flow run of it: the GPU pool's
    template (deployments/k8s-gpu-overlay.json on the worker's default) with the deployment's job variables,
    turned into a job by prefect-kubernetes' own job configuration, as the worker does before it submits."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    t = job_templates.template("kubernetes")
    jobs = {}
    for d in yaml.safe_load((DEPLOY / "prefect-k8s.yaml").read_text())["deployments"]:
        jv = (d.get("work_pool") or {}).get("job_variables") or {}  # the template's defaults fill in the rest
        cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(t, jv))
        cfg.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name=f"{d['name']}-fr-1"))
        jobs[d["name"]] = cfg.job_manifest
    return jobs


def test_the_multinode_service_and_job_are_valid_kubernetes():
    docs = multinode()
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for doc in docs:
        check(doc)


def test_the_elastic_variant_the_multinode_comment_describes_is_valid_kubernetes():
    """The comment in k8s-multinode.yaml: NNODES "1:2", MAX_RESTARTS "3", a per-index backoff limit."""
    _, job = multinode()
    job = copy.deepcopy(job)
    del job["spec"]["backoffLimit"]
    job["spec"].update(backoffLimitPerIndex=3, maxFailedIndexes=1)
    [c] = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    env["NNODES"]["value"] = "1:2"
    env["MAX_RESTARTS"] = {"name": "MAX_RESTARTS", "value": "3"}
    c["env"] = list(env.values())
    check(job)
    assert "backoffLimitPerIndex: 3" in (DEPLOY / "k8s-multinode.yaml").read_text()


@pytest.mark.spawns  # importing prefect_kubernetes asks `file` about the interpreter (platform.architecture)
def test_every_prefect_k8s_deployment_renders_a_valid_job():
    jobs = rendered_jobs()
    assert "gpt2-124m" in jobs
    for name, job in jobs.items():
        assert job["kind"] == "Job", name
        pod = job["spec"]["template"]["spec"]
        # prefect-kubernetes requires a Job's parallelism/completions inside its pod template (its own check of
        # a pool's template refuses one without them), where Kubernetes has no such fields: the API server drops
        # them with a warning (the worker's client asks for no strict field validation). Everything else: strict
        assert {pod.pop(k) for k in PREFECT_REQUIRES_IN_POD} == {1}, name
        check(job)


@pytest.mark.parametrize("mistake", ["a misspelt field", "a wrong type"])
def test_the_check_refuses_what_a_cluster_would(mistake):
    """The check is not a formality: a field Kubernetes does not know, or a value of the wrong type, fails it."""
    _, job = multinode()
    job = copy.deepcopy(job)
    pod = job["spec"]["template"]["spec"]
    if mistake == "a misspelt field":
        pod["restartPolicyy"] = pod.pop("restartPolicy")
    else:
        job["spec"]["completions"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        check(job)
