"""A real Prefect server (SQLite) + process work pool + worker + MLflow server on free 127.0.0.1 ports,
with the deployments of deployments/prefect.yaml, for tests (one per session; flows/services.py does
the work, as for the demo). The worker's flow runs reach the Hugging Face hub stand-in (tests/hub_standin.py)
through HF_ENDPOINT, which serves ARC-Easy for lm-evaluation-harness's own `arc_easy` task.

    def test_x(prefect_stack): ...   # the fixture comes through tests/conftest.py

Inside the fixture, this process's Prefect client talks to the stack's server.
"""

from __future__ import annotations

import re
import time

import pytest

from devstack.demo import deploy
from devstack.services import Stack
from tests.hub_standin import Hub, publish_arc_easy


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("gptpipe-home")
    hub = Hub(home / "hub")
    publish_arc_easy(hub)
    stack = Stack(home, prefect_port=0, mlflow_port=0, ui=False,
                  extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                             "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",  # Prefect's minimum
                             "HF_ENDPOINT": hub.url, "HF_HOME": str(home / "hf"), "HF_HUB_DISABLE_XET": "1"})
    try:
        stack.up()
        deploy(stack, force=True)
        with temporary_settings({PREFECT_API_URL: stack.prefect_api_url}):
            yield stack
        # after every test of the run: a server service that failed (the scheduler did, every minute, on
        # SQLAlchemy 2.1: #69) reaches no client and fails no request; only its log shows it
        errors = unexpected_server_errors(stack)
        assert not errors, f"the Prefect server logged {len(errors)} ERRORs during the suite:\n" + \
            "\n".join(e[-3000:] for e in errors[:5])
    finally:
        stack.down()
        hub.close()


def run_deployment_and_wait(parameters: dict, deployment: str = "pretrain/tiny", timeout: float = 300.0):
    """Create a flow run through the server and wait until it is final; returns the flow run."""
    from prefect.deployments import run_deployment

    fr = run_deployment(deployment, parameters=parameters, timeout=0)
    return wait_final(fr.id, timeout)


def wait_final(flow_run_id, timeout: float = 300.0):
    from prefect.client.orchestration import get_client

    end = time.monotonic() + timeout
    with get_client(sync_client=True) as c:
        while True:
            fr = c.read_flow_run(flow_run_id)
            if fr.state is not None and fr.state.is_final():
                return fr
            if time.monotonic() > end:
                raise TimeoutError(f"flow run {flow_run_id} still {fr.state.name if fr.state else None} "
                                   f"after {timeout}s")
            time.sleep(0.25)  # one small read: a test waits ~0.1 s past the end, not ~0.5 s


def flow_logs(flow_run_id, timeout: float = 60.0) -> list[str]:
    """The log messages of a final flow run, in order. Logs reach the server in batches, after the state
    can already be final: wait (up to `timeout`) for the engine's own last line, "Finished in state".
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    end = time.monotonic() + timeout
    with get_client(sync_client=True) as c:
        while True:
            out = []
            while True:
                logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                   offset=len(out), sort=LogSort.TIMESTAMP_ASC)
                if not logs:
                    break
                out += logs
            if any(lg.task_run_id is None and lg.message.startswith("Finished in state") for lg in out) \
                    or time.monotonic() > end:
                return [lg.message for lg in out]
            time.sleep(0.5)


def task_runs(flow_run_id) -> dict[str, str]:
    """task name -> final state name, for the flow run's own tasks (not its subflows')."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {tr.name: tr.state.name for tr in trs if tr.state is not None}


def task_run_states(flow_run_id) -> dict[str, tuple[str, str, str]]:
    """task run name -> (state type, state name, state message), for the flow run's own tasks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {tr.name: (tr.state.type.value, tr.state.name, tr.state.message or "") for tr in trs if tr.state}


def artifacts(flow_run_id, descriptions: dict | None = None) -> dict[str, object]:
    """artifact key -> data (tables decoded) for one flow run; each one's description into `descriptions`
    when given (what the UI shows beside a progress bar)."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))
    out = {}
    for a in arts:
        data = a.data
        if a.type == "table" and isinstance(data, str):
            data = json.loads(data)
        out[a.key] = data
        if descriptions is not None:
            descriptions[a.key] = a.description or ""
    return out


def schedule_copy(deployment: str, name: str, parameters: dict, due_in: float = 8.0):
    """A copy of `deployment` (same flow, code location and pool) named `name`, with one active interval
    schedule whose first run is due `due_in` seconds from now and the next a day later: the server's own
    scheduler must create the flow run (nobody calls run_deployment). Returns the new deployment's id."""
    import datetime as dt

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    first = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=due_in)
    with get_client(sync_client=True) as c:
        d = c.read_deployment_by_name(deployment)
        return c.create_deployment(
            flow_id=d.flow_id, name=name, parameters=parameters, work_pool_name=d.work_pool_name,
            work_queue_name=d.work_queue_name, entrypoint=d.entrypoint, path=d.path, pull_steps=d.pull_steps,
            parameter_openapi_schema=d.parameter_openapi_schema, job_variables=d.job_variables,
            schedules=[DeploymentScheduleCreate(
                schedule=IntervalSchedule(interval=dt.timedelta(days=1), anchor_date=first), active=True)])


def wait_scheduled_run(deployment_id, timeout: float = 60.0):
    """The first flow run the server's scheduler created for the deployment (auto_scheduled), once it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    end = time.monotonic() + timeout
    with get_client(sync_client=True) as c:
        while True:
            runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                    sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=5)
            if runs:
                return runs[0]
            if time.monotonic() > end:
                raise TimeoutError(f"the server's scheduler created no flow run of deployment {deployment_id} "
                                   f"in {timeout:.0f}s (its errors are in the server log: server_log_errors)")
            time.sleep(1.0)


def pause_schedules(deployment_id) -> None:
    """Stop the copy from scheduling more runs (its next one is a day later; a long suite must not meet it)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        c.pause_deployment(deployment_id)


# Errors the Prefect server logs that are understood and harmless, each with why; anything else fails the run.
KNOWN_SERVER_ERRORS = {
    # test_concurrency_slot_set_up_by_many_flow_runs_at_once races 8 first uses of one limit: Prefect's upsert
    # is read-then-create, the losers' inserts hit the unique name and are answered 409 (tasks/train.py
    # prefect_slot takes that as "exists"); the server logs each as an exception in the request
    r"UNIQUE constraint failed: concurrency_limit_v2\.name|UniqueViolationError.*concurrency_limit_v2":
        "racing first uses of one concurrency limit (answered 409, handled by the client)",
    # SQLite only (the demo's server; compose runs PostgreSQL): the worker-heartbeat write upgrades a read
    # transaction, which WAL refuses at once when another write committed meanwhile (busy_timeout cannot
    # help); the worker's next heartbeat, seconds later, lands
    r"heartbeat persistence failed[\s\S]*database is locked":
        "a worker heartbeat lost to SQLite write contention (the next one lands)",
    # SQLite only, the same read-then-write upgrade in one of the server's perpetual services (docket runs them
    # on a fixed cadence: the foreman's monitor_worker_health marking an idle pool NOT_READY, seen in CI); the
    # next run of the service, seconds later, redoes the whole pass. An API request refused the same way is
    # not covered: a client would see it
    r"^\S+ \| ERROR +\| docket\.dependencies - [^\n]*\n[\s\S]*sqlite3\.OperationalError\) database is locked":
        "a perpetual service's pass lost to SQLite write contention (its next pass redoes it)",
    # SQLite only, the same contention at a worker's channel set-up (Prefect 3.8's worker websocket; seen once in
    # CI, 2026-11-29: the set-up's UPDATE of the pool's base job template): the server closes the channel with
    # TRANSIENT_SERVER_ERROR, which Prefect's close policy marks retryable and not terminal, and the worker
    # connects again (every flow run of that suite then ran on it)
    r"Worker channel setup failed due to a transient server error[^\n]*\n[\s\S]*sqlite3\.OperationalError\) "
    r"database is locked":
        "a worker channel's set-up lost to SQLite write contention (retryable: the worker connects again)",
}


def unexpected_server_errors(stack) -> list[str]:
    """server_log_errors less the KNOWN_SERVER_ERRORS."""
    return [e for e in server_log_errors(stack) if not any(re.search(p, e) for p in KNOWN_SERVER_ERRORS)]


def server_log_errors(stack) -> list[str]:
    """ERROR records of the stack's Prefect server log, each with the traceback lines under it (the scheduler
    and every other server service log there; a failing service never reaches a client, so only its log
    shows it)."""
    log = stack.state_dir / "prefect-server.log"
    if not log.exists():
        return []
    errors, current = [], None
    for ln in log.read_text(errors="replace").splitlines():
        if re.match(r"^\d\d:\d\d:\d\d\.\d+ \| ", ln):  # a new record ends the one before
            current = None
            if "| ERROR" in ln:
                errors.append(ln)
                current = len(errors) - 1
        elif current is not None:
            errors[current] += "\n" + ln
    return errors
