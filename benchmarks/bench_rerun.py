"""How long a re-run of a finished `pretrain` flow takes: the nightly deployment's no-op case.

    python -m benchmarks.bench_rerun [--rounds 5] [--imports 3] [--smoke] [--api-url URL]

Starts its own Prefect server, worker and MLflow server in a temporary home (free ports), deploys,
runs a `micro` training run to completion once, then times `--rounds` re-runs of the same parameters
through the server (each must skip every stage). With --api-url it times them on a stack that is already
running instead (its deployments made and its worker polling: after `make demo`, or the test suite's
shared stack, which then pays no second start-up). For each re-run, from the server's state history:

    pickup    Scheduled -> Pending      the worker polls every 2 s (flows/services.py)
    start     Pending -> Running        the worker starts a process that imports Prefect and the flow
    flow      Running -> Completed      the flow body: every skip decision and the UI artifacts
    e2e       `run_deployment` called -> Completed seen by this client (polling every 0.1 s)

Measured in the same run, for scale: a cold `python -c "import flows.pretrain"` (the floor any flow run
pays to start), and the imports the skip path avoids (torch, mlflow).
Targets (issue 15): flow <= 5 s and e2e <= 10 s, medians.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import parse_args
from devstack.demo import deploy
from devstack.services import Stack

PARAMS = {"preset": "micro", "model_name": "micro-bench",
          "overrides": {"train.max_steps": 4, "train.run_name": "bench-rerun", "train.checkpoint_interval": 4,
                        "eval.eval_interval": 4, "eval.sample_interval": 4}}
TARGETS = {"flow": 5.0, "e2e": 10.0}
SMOKE = {"rounds": 1, "imports": 1}  # the stack's start and the first (training) run are most of its time


def cold_import(module: str, env: dict) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(r.stdout.strip())


def timed_run(client, params: dict) -> dict:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    t0 = time.monotonic()
    fr = run_deployment("pretrain/tiny", parameters=params, timeout=0)
    while True:
        fr = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))[0]
        if fr.state is not None and fr.state.is_final():
            e2e = time.monotonic() - t0
            break
        time.sleep(0.1)
    if not fr.state.is_completed():
        raise SystemExit(f"error: flow run {fr.name} ended {fr.state.name}: {fr.state.message}")
    at = {s.name: s.timestamp for s in client.read_flow_run_states(fr.id)}
    return {"pickup": (at["Pending"] - at["Scheduled"]).total_seconds(),
            "start": (at["Running"] - at["Pending"]).total_seconds(),
            "flow": (at["Completed"] - at["Running"]).total_seconds(), "e2e": e2e}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s  ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--imports", type=int, default=3, help="cold imports timed of each module, for scale")
    p.add_argument("--api-url", help="a running stack's Prefect API (e.g. http://127.0.0.1:4200/api), with "
                                     "deployments/prefect.yaml deployed and a worker on its pool: no stack of its own")
    args = parse_args(p, argv, SMOKE)
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with contextlib.ExitStack() as cleanup:
        if args.api_url:
            api_url, env = args.api_url, dict(os.environ)
        else:
            home = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="gptpipe-bench-rerun-"))
            stack = Stack(Path(home), prefect_port=0, mlflow_port=0, ui=False)
            cleanup.callback(stack.down)
            print("starting Prefect server, worker and MLflow server ...", flush=True)
            stack.up()
            deploy(stack, force=True)
            api_url, env = stack.prefect_api_url, stack.env()
        with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as c:
            print("first run (trains the micro run to completion, or finds it trained) ...", flush=True)
            timed_run(c, PARAMS)
            rows = []
            for i in range(args.rounds):
                rows.append(timed_run(c, PARAMS))
                print(f"re-run {i + 1}: " + "  ".join(f"{k} {v:.2f}s" for k, v in rows[-1].items()), flush=True)
        floor = [cold_import("flows.pretrain", env) for _ in range(args.imports)]
        avoided = {m: [cold_import(m, env) for _ in range(args.imports)] for m in ("torch", "mlflow")}
    print(f"\nno-op re-run of a finished flow, {args.rounds} rounds (median, min-max)")
    for key in ("pickup", "start", "flow", "e2e"):
        xs = [r[key] for r in rows]
        target = f"   target <= {TARGETS[key]:.0f} s: {'met' if statistics.median(xs) <= TARGETS[key] else 'MISSED'}" \
            if key in TARGETS else ""
        print(f"  {key:8s} {spread(xs)}{target}")
    print(f"  for scale: cold `import flows.pretrain` {spread(floor)}; imports the skip path avoids: "
          + ", ".join(f"{m} {spread(v)}" for m, v in avoided.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
