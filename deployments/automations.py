"""The nightly run's failure notification, as a Prefect automation deployed from the repository.

    python deployments/automations.py                                  # create or update (no notifier yet)
    python deployments/automations.py --notify-block slack-webhook/nightly-alerts   # send to this block

It fires when a flow run of the `pretrain/gpt2-124m` deployment (or --deployment) ends Failed or Crashed.
With --notify-block it sends a notification through that block (create one first, e.g.
`prefect block create slack-webhook` in the UI, or any notification block); without, it records the
trigger in the UI's automation log (a placeholder action) until a block is named. Idempotent: run it
again after a change; the automation is matched by name.
"""

from __future__ import annotations

import argparse
import sys

NAME = "pretrain/{deployment}: failed or crashed"
FAILURE_EVENTS = {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}


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


def deploy(deployment: str = "gpt2-124m", notify_block: str | None = None):
    """Create or update the automation; returns it. ValueError names what is missing."""
    from prefect.automations import Automation
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        try:
            dep = c.read_deployment_by_name(f"pretrain/{deployment}")
        except Exception as e:  # noqa: BLE001 -- ObjectNotFound and friends: say what to do
            raise ValueError(f"deployment pretrain/{deployment} not found ({type(e).__name__}); deploy it first: "
                             "prefect deploy --prefect-file deployments/prefect.yaml --all") from None
    block_id = None
    if notify_block:
        try:
            block_id = str(Block.load(notify_block)._block_document_id)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"notification block {notify_block!r} not found ({e}); create it first "
                             "(e.g. a slack-webhook block) and pass its <type>/<name>") from None
    wanted = build(str(dep.id), deployment, block_id)
    try:
        current = Automation.read(name=wanted.name)
    except ValueError:
        return wanted.create()
    for field in ("description", "trigger", "actions"):
        setattr(current, field, getattr(wanted, field))
    current.update()
    return Automation.read(name=wanted.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployment", default="gpt2-124m", help="deployment name under the pretrain flow")
    p.add_argument("--notify-block", help="<block type>/<name> of a notification block, e.g. slack-webhook/alerts")
    a = p.parse_args(argv)
    try:
        auto = deploy(a.deployment, a.notify_block)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = f"notifies {a.notify_block}" if a.notify_block else "no notifier yet"
    print(f"automation {auto.name!r} ({auto.id}): {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
