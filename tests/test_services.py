"""devstack.services.Service: the pid bookkeeping the demo and the tests rely on to start, reuse and stop
background servers and workers (no servers needed here: a `sleep` stands in)."""

from __future__ import annotations

import os
import signal
import sys
import time

from devstack.services import Service


def test_killed_service_is_not_alive_and_restarts(tmp_path):
    svc = Service("sleeper", tmp_path)
    st = svc.spawn([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    assert svc.alive()
    # a crash: SIGKILL its group. The child stays a zombie of this process until reaped; a zombie keeps
    # its /proc entry and start time, and must not count as a running service (it did, once: a worker
    # killed in a test was never restarted, and every later flow run stayed Late)
    os.killpg(st["pid"], signal.SIGKILL)
    end = time.monotonic() + 10
    while svc.alive():
        assert time.monotonic() < end, "a killed service still reported alive"
        time.sleep(0.05)
    st2 = svc.spawn([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    assert st2["pid"] != st["pid"] and svc.alive()
    assert svc.stop(grace=5) and not svc.alive() and svc.state() is None
    assert not svc.stop(), "stopping a stopped service is a no-op"


def test_recorded_pid_of_another_process_is_never_signalled(tmp_path):
    svc = Service("foreign", tmp_path)
    svc.state_dir.mkdir(parents=True, exist_ok=True)
    # this very process, but with a start time that does not match: a recycled pid
    svc.state_path.write_text(f'{{"pid": {os.getpid()}, "start_time": "1"}}')
    assert not svc.alive()
    assert not svc.stop()  # returns without signalling us (we are still here)
