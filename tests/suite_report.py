"""The suite's own time report, printed at the end of every run and kept in var/test-durations.json:
wall time, the share of it the machine's cores were busy (psutil's system-wide CPU times: measured alone,
that is the suite's own work), and the time per test file (setup + call + teardown of its tests, summed
over the workers), slowest first. With pytest-xdist the reports reach the controller, which prints them.

    make test                   # prints "suite time" and the per-file table last
    python -m json.tool var/test-durations.json

The files run longest first (tests/file_durations.json, the per-file seconds of a measured run: `make
test-durations` rewrites it), so that with two workers the long files overlap instead of the last one
running alone. A file that grows past its share (docs/testing.md "The time budget") must share a fixture
or be split before it lands.

With `--dist loadfile` a work unit is a file, except the files that use the session's `prefect_stack`:
they are one unit (STACK_FILES), so one worker runs them all and the suite starts one stack, not one per
worker (xdist's own `pytest_xdist_make_scheduler` hook, below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from gptcore.files import write_json

_start: dict = {}
_by_file: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)


FILE_DURATIONS = Path(__file__).with_name("file_durations.json")
UNMEASURED_S = 60.0  # a file not measured yet: in the middle
# The files whose tests use `prefect_stack` (a Prefect server, worker and MLflow server: ~25 s of CPU to
# start, then ~5% of a core while it idles for the rest of the run): one work unit, one worker, one stack.
# tests/test_suite.py checks this list against the fixture's users.
STACK_FILES = ("tests/test_flow.py", "tests/test_benchmarks.py", "tests/test_deployments.py")


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: the test's file, or "prefect_stack" for STACK_FILES."""
    path = nodeid.split("::", 1)[0]
    return "prefect_stack" if path in STACK_FILES else path


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with work_unit() as the unit (a file, or the stack's files together); any other
    --dist is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling  # xdist is only imported where it runs the suite

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileScheduling(config, log)


def pytest_configure(config):
    """xdist's loadfile hands out files by their number of tests unless told not to (its
    --loadscope-reorder, on by default), which put the one-test demo (5 minutes) last, running alone while
    the other worker idled: the order below is the schedule only with the reordering off."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Longest work units first (a file not measured yet in the middle; the stack's files by their sum),
    in a unit its files longest first, each file's tests in their own order. Every xdist worker collects
    the same order, as xdist requires."""
    try:
        seconds = json.loads(FILE_DURATIONS.read_text())
    except (OSError, ValueError):
        return
    position = {id(item): i for i, item in enumerate(items)}
    files = {it.nodeid.split("::", 1)[0] for it in items}
    unit_s: dict[str, float] = defaultdict(float)
    for path in files:
        unit_s[work_unit(path)] += seconds.get(path, UNMEASURED_S)

    def key(it):
        path = it.nodeid.split("::", 1)[0]
        return -unit_s[work_unit(path)], work_unit(path), -seconds.get(path, UNMEASURED_S), position[id(it)]

    items.sort(key=key)


def is_xdist_worker(config) -> bool:
    """An xdist worker (not a nested pytest that inherited a worker's environment): the controller
    reports, and checks once for all."""
    return hasattr(config, "workerinput")


def machine_probe() -> float:
    """Seconds for a cold `import torch` in a new process: what every trainer, torchrun and server the
    suite starts pays first, so the suite's wall time moves with it. The same code ran 28.5-29.6 min on
    days when the machine was fast and 38.8 min on one when it was ~1/3 slower (docs/testing.md): this
    line in the report tells the two causes, a slower machine and a heavier suite, apart."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
    return time.perf_counter() - t


def pytest_sessionstart(session):
    # the probe on the xdist controller only, not in nested runs; xdist's own sessionstart, which starts the
    # workers, is trylast, so the machine is still idle here
    if getattr(session.config.option, "numprocesses", None) and not is_xdist_worker(session.config):
        _start["probe"] = machine_probe()
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
    if is_xdist_worker(config) or "wall" not in _start or not _tests:
        return  # a worker, or nothing ran (--collect-only): no report
    wall = time.monotonic() - _start["wall"]
    busy = busy_share(_start["cpu"], psutil.cpu_times(), wall)
    workers = getattr(config.option, "numprocesses", None) or 0
    rows = sorted(_by_file.items(), key=lambda kv: -kv[1])
    tr = terminalreporter
    tr.write_sep("=", "suite time")
    summed = sum(_by_file.values()) / 60
    tr.write_line(f"wall {wall / 60:.1f} min on {psutil.cpu_count()} cores, {workers or 'no'} xdist workers; "
                  f"cores busy {busy:.0%} of the wall time; test time summed over workers {summed:.1f} min")
    if "probe" in _start:
        tr.write_line(f"machine: a cold `import torch` took {_start['probe']:.2f} s at the start (2.2 s on "
                      f"2026-11-27's slow day; compare before blaming the tests)")
    for path, seconds in rows[:25]:
        tr.write_line(f"  {seconds:7.1f} s  {_tests[path]:3d} tests  {path}")
    home = Path(os.environ.get("GPTPIPE_HOME", "var"))
    write_json(home / "test-durations.json", {"wall_s": round(wall, 1), "busy": round(busy, 3), "workers": workers,
               "import_torch_s": round(_start["probe"], 2) if "probe" in _start else None,
               "files": {p: {"seconds": round(s, 1), "tests": _tests[p]} for p, s in rows}})
    if config.getoption("--write-file-durations"):  # make test-durations: the order of the next runs
        write_json(FILE_DURATIONS, {p: round(s, 1) for p, s in sorted(rows)})


def pytest_addoption(parser):
    parser.addoption("--write-file-durations", action="store_true",
                     help="after the run, write each file's seconds to tests/file_durations.json (the order "
                          "in which later runs start the files)")
