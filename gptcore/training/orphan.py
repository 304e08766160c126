"""No orphan ranks: a rank whose torchrun agent died stops within seconds.

torchrun starts each worker in a session of its own, so when the agent itself dies (the OOM killer, kill -9)
no signal reaches its workers: measured before this module, two orphaned ranks trained on from step 162 to
400 and wrote checkpoints that nobody launched or watched (#66). Each rank notes its parent (the agent) at
start, and a thread checks once a second that the agent is still its parent. When it is not, there is no
one to report to and nothing to restart: the rank prints one error line and exits AGENT_LOST_EXIT at once,
without a checkpoint (the newest one on disk stays the newest). The run lock is an flock, so it goes with
the process; the next launch resumes from the newest checkpoint. The rank's peers (on this host: orphans
too; on other hosts: their collective with it fails) end as for a lost host.
"""

from __future__ import annotations

import os
import sys
import threading
import time

AGENT_LOST_EXIT = 6  # beside 2 bad input, 3 diverged, 4 replicas disagree, 5 hang (gptcore/training/train.py)
POLL_S = 1.0


def under_torchrun() -> bool:
    """torchrun's agent names the run in every worker's environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_agent(poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch (a daemon thread) when this process is a torchrun worker; None otherwise."""
    if not under_torchrun():
        return None
    agent, rank = os.getppid(), os.environ.get("RANK", "?")

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(poll_s)
        print(f"error: rank {rank} lost its torchrun agent (pid {agent} is gone: killed, or out of memory): "
              "stopping now without a checkpoint, since no one would restart or collect it. Launch the run "
              "again: it continues from its newest checkpoint", file=sys.stderr, flush=True)
        os._exit(AGENT_LOST_EXIT)

    thread = threading.Thread(target=watch, name="torchrun-agent-watch", daemon=True)
    thread.start()
    return thread
