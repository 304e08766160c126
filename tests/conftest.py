"""Fixtures shared by test modules, and the markers that make the fast inner loop.

`prefect_stack` (a real Prefect server + worker + MLflow server, one per session) and `mlflow_server` (a
real MLflow server, one per session) are only started by the tests that ask for them; `standin` is the
Hugging Face hub stand-in.

A test is marked by what it starts, through the fixtures it uses (directly or through another fixture:
pytest's `item.fixturenames` is the closure):
  server  -- a real Prefect or MLflow server
  spawns  -- trainer, torchrun or CLI processes started by a module-scoped fixture
Whole modules that launch torchrun jobs say `pytestmark = pytest.mark.slow`.
`make test-quick` runs what is left (-m "not slow and not server and not spawns"): the in-process tests.
`make test` (CI) runs everything.
"""

import pytest

from tests.hub_standin import standin  # noqa: F401
from tests.mlflow_server import mlflow_server  # noqa: F401
from tests.prefect_stack import prefect_stack  # noqa: F401

# fixture name -> marker. Names are unique across the tests (a new fixture that starts a server or
# spawns processes is added here; test_layout-style drift is caught by test_markers_name_real_fixtures).
MARKING_FIXTURES = {
    "prefect_stack": "server", "mlflow_server": "server", "secured": "server", "prefect_api": "server",
    "served": "server",
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            marker = MARKING_FIXTURES.get(name)
            if marker is not None:
                item.add_marker(getattr(pytest.mark, marker))
