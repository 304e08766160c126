"""Fixtures shared by test modules, and the markers that make the fast inner loop.

`prefect_stack` (a real Prefect server + worker + MLflow server, one per session) and `mlflow_server` (a
real MLflow server, one per session) are only started by the tests that ask for them; `standin` is the
Hugging Face hub stand-in.

A test is marked by what it starts, found from what it uses (nobody has to remember to mark it):
  server  -- a real Prefect or MLflow server: a fixture of MARKING_FIXTURES (directly or through another
             fixture: pytest's `item.fixturenames` is the closure)
  spawns  -- trainer, torchrun or CLI processes: such a fixture, or the test's code uses the subprocess module
             or a helper of tests/ that does (followed through the helpers it calls)
Whole modules that launch torchrun jobs, and long in-process computations, say `pytest.mark.slow`.
`make test-quick` runs what is left (-m "not slow and not server and not spawns"): the in-process tests.
`make test` (CI) runs everything.
"""

import inspect
import subprocess

import pytest

from tests.hub_standin import standin  # noqa: F401
from tests.mlflow_server import mlflow_server  # noqa: F401
from tests.prefect_stack import prefect_stack  # noqa: F401

# fixture name -> marker: a new fixture that starts a server or spawns processes is added here
# (tests/test_suite.py checks that each name is one fixture that exists).
MARKING_FIXTURES = {
    "prefect_stack": "server", "mlflow_server": "server", "secured": "server", "prefect_api": "server",
    "served": "server", "postgres": "server",
    "trained": "spawns", "from_step4": "spawns", "cli_reference": "spawns", "eager_job": "spawns",
}

# The skips expected on a CPU-only machine. `make test` (and so CI) passes --fail-on-unexpected-skips: any
# other skip (a linter missing, a hard-coded path that does not exist) fails the run instead of hiding.
EXPECTED_SKIPS = {
    "tests/test_gpu_check.py::test_gpu_acceptance_run": "needs CUDA",
}


def pytest_addoption(parser):
    parser.addoption("--fail-on-unexpected-skips", action="store_true",
                     help="exit non-zero if a test outside tests/conftest.py's EXPECTED_SKIPS is skipped")


_skipped: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--fail-on-unexpected-skips"):
        return
    unexpected = [(n, why) for n, why in _skipped if n not in EXPECTED_SKIPS]
    if unexpected:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        for nodeid, why in unexpected:
            tr.write_line(f"UNEXPECTED SKIP {nodeid}: {why}", red=True)
        tr.write_line("fix what the skip names, or add the test to EXPECTED_SKIPS in tests/conftest.py "
                      "with the reason it may skip on every CI machine", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def starts_processes(fn, seen: set | None = None) -> bool:
    """True if function `fn` uses the subprocess module, or calls a function of tests/ that does (its nested
    functions and lambdas included)."""
    seen = set() if seen is None else seen
    codes = [getattr(fn, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None or code in seen:
            continue
        seen.add(code)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        for name in code.co_names:
            obj = fn.__globals__.get(name)
            if obj is subprocess:
                return True
            if inspect.isfunction(obj) and obj.__module__.startswith("tests.") and starts_processes(obj, seen):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        markers = {MARKING_FIXTURES[n] for n in getattr(item, "fixturenames", ()) if n in MARKING_FIXTURES}
        if isinstance(item, pytest.Function) and starts_processes(item.function):
            markers.add("spawns")
        for marker in sorted(markers):
            item.add_marker(getattr(pytest.mark, marker))
