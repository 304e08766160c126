"""The main command: train the tiny GPT through a real Prefect server and register it in MLflow.

    python -m devstack.demo            # (make demo)
    python -m devstack.demo --stop     # (make stop) stop the servers and the worker
    python -m devstack.demo --status

What it does, all on 127.0.0.1 with state under the pipeline home ($GPTPIPE_HOME, default ./var):
1. starts (or reuses, when healthy) an MLflow server, a Prefect server (SQLite), the process work pool
   `cpu-pool` and a worker for it (flows/services.py);
2. deploys deployments/prefect.yaml (`tiny` on cpu-pool, the nightly `gpt2-124m` on gpu-pool);
3. runs `pretrain/tiny` through the server and streams the flow run's logs while the worker runs it;
4. prints the tokens, final val loss, HellaSwag (or why it was skipped), the MLflow model version, a
   sample of generated text (read back from the flow run's summary artifact), the UI pages of the flow
   run's artifacts, the MLflow run and the model version, and how long the flow run took.

A second run reuses the servers and finds every stage's artifacts in place: it finishes in seconds and
changes nothing.
"""

from __future__ import annotations

# lazy imports: prefect (~2 s) only where a command talks to the Prefect server (--stop and --status do not)
import argparse
import hashlib
import json
import subprocess
import sys
import time

from devstack.services import GPU_POOL, REPO, Stack
from gptcore.files import read_json, write_json

DEPLOYMENT = "pretrain/tiny"
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"


def deploy(stack: Stack, force: bool = False) -> bool:
    """`prefect deploy` of deployments/prefect.yaml from the repository root (the flow code location).
    Skipped when the same yaml + flow source were already deployed to this server. True if deployed."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import temporary_settings

    # what the deployments were made from: the yaml, the flow's source, the server
    h = hashlib.sha256(PREFECT_FILE.read_bytes() + (REPO / "flows" / "pretrain.py").read_bytes()).hexdigest()
    stamp = {"sha256": h, "api_url": stack.prefect_api_url}
    stamp_file = stack.state_dir / "deployed.json"
    if not force and read_json(stamp_file) == stamp:
        with temporary_settings(stack.prefect_settings()), get_client(sync_client=True) as c:
            try:
                c.read_deployment_by_name(DEPLOYMENT)
                return False
            except ObjectNotFound:
                pass
    stack.ensure_pool(GPU_POOL)  # so the gpt2-124m deployment has its pool (its worker lives elsewhere)
    cmd = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(PREFECT_FILE), "--all"]
    r = subprocess.run(cmd, cwd=REPO, env=stack.env(), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"error: `{' '.join(cmd[2:])}` failed ({r.returncode}):\n"
                         f"{r.stdout[-3000:]}{r.stderr[-3000:]}")
    write_json(stamp_file, stamp)
    return True


def run_and_follow(deployment: str, parameters: dict, timeout: float):
    """Create a flow run of `deployment` on the server, print its logs until it is final; returns the final
    flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.deployments import run_deployment

    fr = run_deployment(deployment, parameters=parameters, timeout=0)
    print(f"flow run {fr.name} ({fr.id}) created; waiting for the worker to pick it up", flush=True)
    seen, end = 0, time.monotonic() + timeout
    with get_client(sync_client=True) as c:
        while True:
            logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])), limit=200, offset=seen,
                               sort=LogSort.TIMESTAMP_ASC)
            seen += len(logs)
            for lg in logs:
                print(f"  | {lg.message}", flush=True)
            fr = c.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))[0]
            if fr.state is not None and fr.state.is_final() and not logs:
                return fr
            if time.monotonic() > end:
                raise SystemExit(f"error: flow run {fr.id} not finished after {timeout:.0f}s (state "
                                 f"{fr.state.name if fr.state else None}); see the Prefect UI")
            if not logs:
                time.sleep(1.0)


def read_summary(flow_run_id) -> dict:
    """The flow's summary table artifact (key pretrain-summary) of one flow run, as a dict."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from flows.pretrain import SUMMARY_KEY
    from integrations.artifact_tables import from_rows

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[SUMMARY_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    if not arts:
        return {}
    rows = json.loads(arts[0].data) if isinstance(arts[0].data, str) else arts[0].data
    return from_rows(rows)


def flow_run_link(ui_url: str, flow_run_id, tab: str = "Artifacts") -> str:
    """A flow run's page in the Prefect UI, open on `tab` (Logs, TaskRuns, Artifacts, Details, ...).

    Prefect 3.8 serves two UIs: the new one under /v2 (where the server's root sends a browser) and the old
    one at the root paths. The old one's flow-run page drops ?tab=Artifacts on a fresh load: that tab is
    hidden until the page has read the run's state, and a tab it does not show is reset to Logs. The new
    one's route validates ?tab= against its tab names (Artifacts among them) and keeps it."""
    return f"{ui_url.rstrip('/')}/v2/runs/flow-run/{flow_run_id}?tab={tab}"


def mlflow_lines(uri: str, s: dict) -> list[str]:
    """The MLflow experiment, the run and the registered version, each page in model-training mode
    (MLflow's UI starts in GenAI mode); the run's and the version's when the summary names them."""
    from integrations.mlflow_links import pipeline_links

    links = pipeline_links(uri, s.get("mlflow_run_id"), s.get("registered_name"), s.get("registered_version"))
    labels = {"experiment": "MLflow UI", "run": "MLflow run", "model version": "MLflow version"}
    return [f"{labels[k]:19}{link}" for k, link in links.items()]


def cost_line(s: dict) -> str:
    """The run's device-hours so far, its cost and the ETA (gptcore/training/cost.py): what a long run's
    operator asks first. Device-hours: GPU-hours on GPUs, training processes' hours on a CPU (the demo's)."""
    from gptcore.training.cost import duration

    hours = s.get("gpu_hours")
    if hours is None:
        return "not recorded (a checkpoint written before cost tracking)"
    cost = (f"${s['cost_usd']:,.2f} so far, ${s['cost_projected_usd']:,.2f} projected"
            if s.get("cost_usd") is not None and s.get("cost_projected_usd") is not None
            else "no price set (train.price_per_gpu_hour)")
    eta = "done" if s.get("done") else f"ETA {duration(s['eta_s'])}" if s.get("eta_s") is not None else "ETA unknown"
    return f"{hours:.4f} ({cost}; {eta})"


def report(s: dict, stack: Stack, flow_run_id, startup_s: float, took_s: float) -> str:
    """What the demo prints at the end; `took_s` is the flow run's own time (Running), `startup_s` what came
    before it: the servers, the worker and the deployments."""
    val = s.get("val_loss")
    stages = ", ".join(f"{k} {v}" for k, v in (s.get("stages") or {}).items())
    return "\n".join([
        "",
        "=" * 78,
        f"run                {s.get('run_name')}  (step {s.get('step')}, {'DONE' if s.get('done') else 'not done'})",
        f"dataset            {s.get('train_tokens', 0):,} train tokens, "
        f"{s.get('val_tokens_in_dataset', 0):,} val tokens",
        f"tokens trained     {s.get('tokens_seen') or 0:,}",
        f"final val loss     {val:.4f}" if isinstance(val, float) else f"final val loss     {val}",
        f"device-hours       {cost_line(s)}",
        *[f"{'evaluations' if i == 0 else '':19}{line}" for i, line in enumerate(s.get("evaluation_summary") or [])],
        f"MLflow model       {s.get('model_version')}",
        f"stages             {stages}",
        "sample:",
        "  " + str(s.get("sample", "")).replace("\n", "\n  "),
        "",
        f"Prefect UI         {stack.prefect_ui_url}",
        f"Prefect run        {flow_run_link(stack.prefect_ui_url, flow_run_id)}",
        *mlflow_lines(stack.mlflow_uri, s),
        f"checkpoint         {s.get('checkpoint')}",
        f"start-up           {startup_s:.0f}s (servers, worker, deployments; before the flow run)",
        f"took               {took_s:.0f}s (the flow run)",
        "stop the servers:  python -m devstack.demo --stop   (make stop)",
        "=" * 78,
    ])


def main(argv: list[str] | None = None) -> int:
    from gptcore.files import pipeline_home

    p = argparse.ArgumentParser(description="Run the tiny GPT-2 pretraining demo through Prefect + MLflow.")
    p.add_argument("--stop", action="store_true", help="stop the Prefect server, worker and MLflow server")
    p.add_argument("--status", action="store_true", help="show which services are running")
    p.add_argument("--deployment", default=DEPLOYMENT)
    p.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                   help="flow parameter, e.g. --param overrides='{\"train.max_steps\": 50}'")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    stack = Stack(pipeline_home())
    if args.stop:
        stopped = stack.down()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return 0
    if args.status:
        for name, ok in stack.status().items():
            print(f"{name:20s} {'running' if ok else 'stopped'}")
        return 0
    params = {}
    for kv in args.param:
        k, _, v = kv.partition("=")
        try:
            params[k] = json.loads(v)
        except ValueError:
            params[k] = v
    t0 = time.monotonic()
    print(f"pipeline home {stack.home}; starting services (reused when already running) ...", flush=True)
    stack.up()
    print(f"Prefect {stack.prefect_ui_url}  MLflow {stack.mlflow_uri}  worker on pool {stack.pool}", flush=True)
    done = deploy(stack)
    startup_s = time.monotonic() - t0
    print(f"{'deployed' if done else 'already deployed:'} {PREFECT_FILE.relative_to(REPO)}; running "
          f"{args.deployment} through the server", flush=True)
    from prefect.settings import temporary_settings

    with temporary_settings(stack.prefect_settings()):  # prefect read its env at import
        fr = run_and_follow(args.deployment, params, args.timeout)
        if not fr.state.is_completed():
            print(f"\nerror: flow run {fr.name} ended {fr.state.name}: {fr.state.message}\n"
                  f"logs: Prefect UI {flow_run_link(stack.prefect_ui_url, fr.id, 'Logs')}; worker log "
                  f"{stack.worker.log_path}", file=sys.stderr)
            return 1
        summary = read_summary(fr.id)
    # the flow run's own time in Running (the server's count): not the start-up, not the wait for the worker
    print(report(summary, stack, fr.id, startup_s, fr.total_run_time.total_seconds()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
