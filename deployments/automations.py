"""The nightly run's automations, deployed from the repository:

1. failure notification: when a flow run of `pretrain/gpt2-124m` (or --deployment) ends Failed or
   Crashed, send a notification through --notify-block (create one first, e.g. a slack-webhook block in
   the UI); without a block it only records the trigger in the UI's automation log.
2. unresponsive run -> Crashed: a flow run whose machine died (power, preemption, OOM-killer on the
   worker) stops sending heartbeats but stays Running in the server for ever, so nobody is told.
   When a Running flow run of the deployment sends no heartbeat for --silence-seconds, the server marks
   it Crashed, which sends the notification above. (Heartbeats: every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
   seconds, 180 by default; keep the silence a few heartbeats long.) Prefect's "detect zombie flows".

    python deployments/automations.py                                  # create or update both
    python deployments/automations.py --notify-block slack-webhook/nightly-alerts   # send to this block

Idempotent: run it again after a change; each automation is matched by name.
"""

from __future__ import annotations

import argparse
import sys

NAME = "pretrain/{deployment}: failed or crashed"
UNRESPONSIVE = "pretrain/{deployment}: unresponsive run -> crashed"
FAILURE_EVENTS = {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}
FINAL_EVENTS = {"prefect.flow-run.Completed", "prefect.flow-run.Cancelled", *FAILURE_EVENTS}
SILENCE_SECONDS = 600  # a little over three of Prefect's default heartbeats (180 s)


def build(deployment_id: str, deployment: str, block_document_id: str | None):
    from prefect.automations import Automation
    from prefect.events.actions import DoNothing, SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    if block_document_id:
        action = SendNotification(
            block_document_id=block_document_id,
            subject="gpt2 nightly: flow run {{ flow_run.name }} {{ flow_run.state.name }}",
            body="Flow run {{ flow_run.name }} of pretrain/" + deployment + " ended {{ flow_run.state.name }}: "
                 "{{ flow_run.state.message }}\n{{ flow_run|ui_url }}")
    else:
        action = DoNothing()
    return Automation(
        name=NAME.format(deployment=deployment),
        description=f"Failure notification for the nightly pretrain/{deployment} run (deployments/automations.py)",
        trigger=EventTrigger(expect=FAILURE_EVENTS, posture=Posture.Reactive, threshold=1,
                             match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"}),
        actions=[action])


def build_unresponsive(deployment_id: str, deployment: str, silence_seconds: float):
    """Proactive: after a heartbeat of one of the deployment's flow runs, expect another heartbeat (or its
    end) within `silence_seconds`; if none comes, mark that flow run Crashed."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    return Automation(
        name=UNRESPONSIVE.format(deployment=deployment),
        description=f"Marks a flow run of pretrain/{deployment} Crashed when its heartbeats stop "
                    "(deployments/automations.py)",
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"},
                             expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
                             match={"prefect.resource.id": "prefect.flow-run.*"},
                             match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=silence_seconds)),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"no heartbeat for {silence_seconds:.0f}s: the flow run's process or machine died "
                    "(deployments/automations.py). Run the deployment again: it resumes from the newest "
                    "checkpoint.")])


def _upsert(wanted):
    from prefect.automations import Automation

    try:
        current = Automation.read(name=wanted.name)
    except ValueError:
        return wanted.create()
    for field in ("description", "trigger", "actions"):
        setattr(current, field, getattr(wanted, field))
    current.update()
    return Automation.read(name=wanted.name)


def deploy(deployment: str = "gpt2-124m", notify_block: str | None = None,
           silence_seconds: float = SILENCE_SECONDS):
    """Create or update both automations; returns (failure notification, unresponsive -> crashed).
    ValueError names what is missing or wrong (the silence first: before any call to the server)."""
    if not silence_seconds >= 60:
        raise ValueError(f"--silence-seconds {silence_seconds} is too short: heartbeats come at most every 30 s "
                         "(PREFECT_FLOWS_HEARTBEAT_FREQUENCY); use at least 60, a few heartbeats")
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            dep = c.read_deployment_by_name(f"pretrain/{deployment}")
        except Exception as e:  # noqa: BLE001 -- ObjectNotFound and friends: say what to do
            raise ValueError(f"deployment pretrain/{deployment} not found ({type(e).__name__}); deploy it first: "
                             "prefect deploy --prefect-file deployments/prefect.yaml --all") from None
        block_id = None
        if notify_block:
            block_type, _, block_name = notify_block.partition("/")
            try:
                block_id = str(c.read_block_document_by_name(block_name, block_type, include_secrets=False).id)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"notification block {notify_block!r} not found ({e}); create it first "
                                 "(e.g. a slack-webhook block) and pass its <type>/<name>") from None
    return (_upsert(build(str(dep.id), deployment, block_id)),
            _upsert(build_unresponsive(str(dep.id), deployment, silence_seconds)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployment", default="gpt2-124m", help="deployment name under the pretrain flow")
    p.add_argument("--notify-block", help="<block type>/<name> of a notification block, e.g. slack-webhook/alerts")
    p.add_argument("--silence-seconds", type=float, default=SILENCE_SECONDS,
                   help="a Running flow run without a heartbeat this long is marked Crashed")
    a = p.parse_args(argv)
    try:
        failure, unresponsive = deploy(a.deployment, a.notify_block, a.silence_seconds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = f"notifies {a.notify_block}" if a.notify_block else "no notifier yet"
    print(f"automation {failure.name!r} ({failure.id}): {how}")
    print(f"automation {unresponsive.name!r} ({unresponsive.id}): no heartbeat for {a.silence_seconds:.0f}s "
          "-> Crashed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
