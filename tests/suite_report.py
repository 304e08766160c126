"""The suite's own time report, printed at the end of every run and kept in var/test-durations.json:
wall time, the share of it the machine's cores were busy (psutil's system-wide CPU times: measured alone,
that is the suite's own work), and the time per test file (setup + call + teardown of its tests, summed
over the workers), slowest first. With pytest-xdist the reports reach the controller, which prints them.

    make test                   # prints "suite time" and the per-file table last
    python -m json.tool var/test-durations.json

A file that grows past its share (docs/testing.md "The time budget") must share a fixture or join a
group before it lands.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

_start: dict = {}
_by_file: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")  # an xdist worker: the controller reports


def pytest_sessionstart(session):
    _start.update(wall=time.monotonic(), cpu=psutil.cpu_times())


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _by_file[path] += report.duration
    if report.when == "call":
        _tests[path] += 1


def busy_share(before, after, wall: float) -> float:
    """The share of `wall` x cores the machine spent running anything but idle or waiting for I/O."""
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0.0) - getattr(before, "iowait", 0.0))
    total = sum(after) - sum(before)
    return max(0.0, 1 - idle / total) if total > 0 else 0.0


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _is_worker(config) or "wall" not in _start:
        return
    wall = time.monotonic() - _start["wall"]
    busy = busy_share(_start["cpu"], psutil.cpu_times(), wall)
    workers = getattr(config.option, "numprocesses", None) or 0
    rows = sorted(_by_file.items(), key=lambda kv: -kv[1])
    tr = terminalreporter
    tr.write_sep("=", "suite time")
    tr.write_line(f"wall {wall / 60:.1f} min on {psutil.cpu_count()} cores, {workers or 'no'} xdist workers; "
                  f"cores busy {busy:.0%} of the wall time; test time summed over workers {sum(_by_file.values()) / 60:.1f} min")
    for path, seconds in rows[:25]:
        tr.write_line(f"  {seconds:7.1f} s  {_tests[path]:3d} tests  {path}")
    home = Path(os.environ.get("GPTPIPE_HOME", "var"))
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / "test-durations.json.tmp"
    tmp.write_text(json.dumps({"wall_s": round(wall, 1), "busy": round(busy, 3), "workers": workers,
                               "files": {p: {"seconds": round(s, 1), "tests": _tests[p]} for p, s in rows}},
                              indent=1))
    os.replace(tmp, home / "test-durations.json")
