"""Fixtures shared by test modules, and the markers that make the fast inner loop.

`prefect_stack` (a real Prefect server + worker + MLflow server, one per session) and `mlflow_server` (a
real MLflow server, one per session) are only started by the tests that ask for them; `standin` is the
Hugging Face hub stand-in.

A test is marked by what it starts, found from what it uses (nobody has to remember to mark it):
  server  -- a real Prefect or MLflow server: a fixture of MARKING_FIXTURES (directly or through another
             fixture: pytest's `item.fixturenames` is the closure)
  spawns  -- trainer, torchrun or CLI processes (another program): such a fixture, or code that uses the
             subprocess module (a module-level import, one inside the function, or its functions imported
             by name) in the test, its fixtures, or what they call: functions and classes of tests/, and the
             methods they call of the project's classes (devstack.services.Service.spawn, say). A pool of
             forked workers (the tokenizer's) is in-process work in parallel, not a spawn
Whole modules that launch torchrun jobs, and long in-process computations, say `pytest.mark.slow`.
`make test-quick` runs what is left (-m "not slow and not server and not spawns"): the in-process tests.
`make test` (CI) runs everything, and checks the marks as it goes: a test left unmarked that starts a
process anyway (Python's audit events: subprocess.Popen, os.posix_spawn, os.spawn, os.system, os.exec)
fails, naming the event, so a leak into the quick loop cannot pass CI. Skips at collection time (a
module-level `pytest.importorskip`) and xfail/xpass outcomes count as skips for --fail-on-unexpected-skips.
"""

import os

# One OpenMP thread per process: two xdist workers share two cores with the processes their tests start, and
# torch's default of a thread per core oversubscribes them (the in-process tests took 104-105 s with it and
# 84-95 s without, docs/testing.md). Set before anything imports torch (libgomp reads it when it is loaded);
# the xdist workers and every process a test starts inherit it; an OMP_NUM_THREADS already set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib
import inspect
import subprocess
import sys
import tempfile
import threading

import pytest

from tests.hub_standin import standin  # noqa: F401
from tests.mlflow_server import mlflow_server  # noqa: F401
from tests.prefect_stack import prefect_stack  # noqa: F401
from tests.suite_report import is_xdist_worker

pytest_plugins = ["tests.suite_report"]  # the time report at the end of every run

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


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """A small tokenized dataset on disk (tests/test_train_utils.make_dataset), one per test module."""
    from tests.test_train_utils import make_dataset  # the helpers import torch: only for modules that train

    return make_dataset(tmp_path_factory.mktemp("ds"))


# A whole run peaks at 1.3 GB under the temporary directory (checkpoints, datasets, server homes; ci17 in
# docs/testing.md), on top of the 2.4 GB venv. Below this, tests fail one by one with ENOSPC in whatever
# they write, hundreds of errors that hide the cause: refuse at the start instead, with the cause named.
DEFAULT_MIN_FREE_GB = "3"


def pytest_sessionstart(session):
    if is_xdist_worker(session.config):  # the controller checked once for all
        return
    setting = os.environ.get("GPTPIPE_TEST_MIN_FREE_GB", DEFAULT_MIN_FREE_GB)
    try:
        need_gb = float(setting)
    except ValueError:
        pytest.exit(f"GPTPIPE_TEST_MIN_FREE_GB={setting!r} is not a number of GB; set it to one (e.g. 3) or unset "
                    "it", returncode=pytest.ExitCode.USAGE_ERROR)
    from gptcore.files import free_disk  # the project's free-space reader (download and tokenize planning)

    where = tempfile.gettempdir()
    free_gb = free_disk(where) / 2**30
    if free_gb < need_gb:
        pytest.exit(f"only {free_gb:.1f} GB free in {where}; the suite needs {need_gb:g} GB there. Free "
                    "space (old pytest-of-* directories, clones, torchinductor caches), point TMPDIR elsewhere, "
                    "or set GPTPIPE_TEST_MIN_FREE_GB", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_addoption(parser):
    parser.addoption("--fail-on-unexpected-skips", action="store_true",
                     help="exit non-zero if a test outside tests/conftest.py's EXPECTED_SKIPS is skipped")


_skipped: list[tuple[str, str]] = []
QUICK_EXCLUDED = ("slow", "server", "spawns")  # the markers `make test-quick` deselects
SPAWN_EVENTS = {"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system", "os.exec"}
# what libraries start for their own metadata, in milliseconds: MLflow tags a run with the git commit
# (`git rev-parse HEAD`), platform.processor() runs `uname -p`. Not the test starting the product.
INCIDENTAL = {"git", "uname"}
PROJECT = ("tests.", "devstack.", "integrations.", "tasks.", "flows.", "gptcore.", "benchmarks.")


def _reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_collectreport(report):
    if report.skipped:  # a module-level importorskip: every test in it vanishes without a test report
        _skipped.append((report.nodeid, _reason(report)))


def pytest_runtest_logreport(report):
    if hasattr(report, "wasxfail"):  # xfail and xpass: a test that may fail is a skip by another name
        if report.when == "call" or report.skipped:
            _skipped.append((report.nodeid, f"xfail: {report.wasxfail}"))
    elif report.skipped:
        _skipped.append((report.nodeid, _reason(report)))


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


def _spawns(obj) -> bool:
    return obj is subprocess or getattr(obj, "__module__", None) == "subprocess"


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:  # an attribute that only looks like a module path
        return None


def starts_processes(fn, seen: set | None = None, attrs: frozenset = frozenset()) -> bool:
    """True if function `fn` uses the subprocess module (imported at module level or
    inside it, or one of their functions imported by name), or calls a function or class of tests/ that
    does, or a method of a project class that does (among the attribute names `fn` uses): nested functions
    and lambdas included."""
    seen = set() if seen is None else seen
    codes = [getattr(fn, "__code__", None)]
    names: set[str] = set()
    while codes:
        code = codes.pop()
        if code is None or code in seen:
            continue
        seen.add(code)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        names |= set(code.co_names)
    if "subprocess" in names:  # `import subprocess` inside the function
        return True
    # modules of the project imported inside the function (`from devstack.services import Service`): their
    # names are locals, looked up in those modules
    local_modules = [m for n in names if n.startswith(PROJECT) or f"{n}." in PROJECT if (m := _module(n))]
    for name in names:
        obj = getattr(fn, "__globals__", {}).get(name)
        for mod in local_modules:
            obj = obj if obj is not None else getattr(mod, name, None)
        if obj is None:
            continue
        if _spawns(obj):
            return True
        mod = getattr(obj, "__module__", "") or ""
        if inspect.isfunction(obj) and mod.startswith("tests.") and starts_processes(obj, seen):
            return True
        if inspect.isclass(obj) and mod.startswith(PROJECT):
            # its methods that this code names (svc.spawn(...)), and everything of a helper class of tests/
            wanted = names if not mod.startswith("tests.") else set(vars(obj))
            for attr in wanted & set(vars(obj)):
                member = inspect.unwrap(getattr(obj, attr, None)) if callable(getattr(obj, attr, None)) else None
                if inspect.isfunction(member) and starts_processes(member, seen):
                    return True
    return False


def _fixture_functions(item) -> list:
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) or {}
    return [d.func for ds in defs.values() for d in ds if getattr(d, "func", None) is not None]


def pytest_collection_modifyitems(config, items):
    for item in items:
        markers = {MARKING_FIXTURES[n] for n in getattr(item, "fixturenames", ()) if n in MARKING_FIXTURES}
        if isinstance(item, pytest.Function):
            fixtures = [f for f in _fixture_functions(item) if (f.__module__ or "").startswith("tests")]
            if any(starts_processes(f) for f in [item.function, *fixtures]):
                markers.add("spawns")
        for marker in sorted(markers):
            item.add_marker(getattr(pytest.mark, marker))


# --- the marks checked as the tests run -----------------------------------------------------------------
_watch = {"quick": False, "events": []}


def _audit(event: str, args) -> None:
    # only the main thread: a server fixture's threads from an earlier (marked) test may start processes
    if _watch["quick"] and event in SPAWN_EVENTS and threading.current_thread() is threading.main_thread():
        first = args[0] if args else ""
        program = os.path.basename(os.fsdecode(first)) if isinstance(first, (str, bytes, os.PathLike)) else ""
        if program not in INCIDENTAL:
            _watch["events"].append(f"{event} {str(args)[:120]}")


sys.addaudithook(_audit)


def _check_spawning(item, phase: str):
    quick = not any(item.get_closest_marker(m) for m in QUICK_EXCLUDED)
    _watch.update(quick=quick, events=[])
    try:
        return (yield)
    finally:
        events, _watch["quick"] = _watch["events"], False
        if quick and events:
            pytest.fail(f"{item.nodeid} started a process in its {phase} ({events[0]}) but is not marked slow, "
                        "server or spawns, so `make test-quick` runs it: mark it (pytest.mark.slow or a fixture "
                        "of MARKING_FIXTURES), or teach tests/conftest.py's starts_processes to see it",
                        pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _check_spawning(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _check_spawning(item, "call"))
