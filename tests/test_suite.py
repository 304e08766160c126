"""The test suite's own wiring: the markers that select `make test-quick` name fixtures that exist, and
the expected skips name tests that exist (a renamed test must not turn an allowed skip into a hidden one)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import EXPECTED_SKIPS, MARKING_FIXTURES

TESTS = Path(__file__).resolve().parent


def defined(kind: str) -> set[str]:
    """Names of the fixtures (kind='fixture') or test functions (kind='test') defined under tests/."""
    out = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            is_fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            if (kind == "fixture") == is_fixture and (kind == "fixture" or node.name.startswith("test_")):
                out.add(f"{path.name}::{node.name}" if kind == "test" else node.name)
    return out


def test_marking_fixtures_exist_and_are_unique():
    fixtures = defined("fixture")
    assert set(MARKING_FIXTURES) <= fixtures, set(MARKING_FIXTURES) - fixtures
    # a name that marks must mean one fixture: the same name in two modules would mark both
    for name in MARKING_FIXTURES:
        homes = [p.name for p in TESTS.glob("*.py") if f"def {name}(" in p.read_text()]
        assert len(homes) == 1, (name, homes)


def test_expected_skips_name_real_tests():
    tests = defined("test")
    for nodeid in EXPECTED_SKIPS:
        path, _, name = nodeid.partition("::")
        assert f"{Path(path).name}::{name.split('[')[0]}" in tests, nodeid


def _inner_import():
    import subprocess as sp  # noqa: F401 - what a test that spawns inside its own body looks like

    return sp


def _through_a_project_class(tmp):
    from devstack.services import Service

    return Service("x", tmp).spawn  # names the method that starts a process


def _in_process():
    return sum(range(10))


def test_the_detector_sees_spawns_in_local_imports_and_project_methods():
    """What leaked into `make test-quick` before: `import subprocess` inside the test function
    (test_contamination's CLI test) and a project class that starts the process (test_services)."""
    from tests.conftest import starts_processes

    assert starts_processes(_inner_import) and starts_processes(_through_a_project_class)
    assert not starts_processes(_in_process)


SUITE = '''
import subprocess, sys
import pytest

{body}
'''


def run_suite(tmp_path: Path, body: str, *args: str, **env_vars: str | None):
    """Run pytest on one test file under this suite's conftest (as a plugin), with CI's options."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    (tmp_path / "test_case.py").write_text(SUITE.format(body=body))
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), **env_vars}
    env = {k: v for k, v in env.items() if v is not None}  # a setting given as None: left out
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_case.py"), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_collection_skips_and_xfails_count_as_unexpected_skips(tmp_path):
    """A module-level importorskip makes its tests vanish at collection, and an xfail passes quietly: both
    fail CI's --fail-on-unexpected-skips, naming the test."""
    r = run_suite(tmp_path, 'pytest.importorskip("no_such_module_here")\n\ndef test_a():\n    pass\n',
                  "--fail-on-unexpected-skips")
    assert r.returncode != 0 and "UNEXPECTED SKIP test_case.py" in r.stdout, r.stdout[-2000:]
    r = run_suite(tmp_path, '@pytest.mark.xfail(reason="flaky")\ndef test_b():\n    assert False\n',
                  "--fail-on-unexpected-skips")
    assert r.returncode != 0 and "UNEXPECTED SKIP test_case.py::test_b: xfail: flaky" in r.stdout, r.stdout[-2000:]


def test_an_unmarked_test_that_starts_a_process_fails(tmp_path):
    """The marks checked as the tests run: a spawn the detector cannot see (here through getattr) in a test
    left in the quick loop fails it, naming the event."""
    body = ('def test_hidden():\n    mod = __import__("subprocess")\n'
            '    getattr(mod, "run")([sys.executable, "-c", "pass"], check=True)\n')
    r = run_suite(tmp_path, body.replace("import subprocess, sys", "import sys"))
    assert r.returncode != 0 and "started a process in its call (subprocess.Popen" in r.stdout, r.stdout[-2000:]


def test_a_disk_too_full_for_the_suite_stops_it_at_the_start_naming_the_cause(tmp_path):
    """CI once ran on a disk that old runs had filled: 200 tests failed one by one with ENOSPC. Now the run
    stops before the first test, saying how much space there is, where, and what to do. (With room it runs:
    the other run_suite tests here.)"""
    r = run_suite(tmp_path, "def test_a():\n    pass\n", GPTPIPE_TEST_MIN_FREE_GB="1e9")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout[-2000:]
    out = r.stdout + r.stderr
    assert "GB free in" in out and "the suite needs 1e+09 GB there" in out and "1 passed" not in out, out[-2000:]


def test_the_suite_runs_one_openmp_thread_per_process_unless_told_otherwise(tmp_path):
    """Two workers on two cores: torch's default of a thread per core in every process oversubscribed them
    (the in-process tests 104-105 s, against 84-95 s with one). conftest sets it before torch is imported,
    so torch itself runs one thread; set after the import it would not reach the OpenMP pool."""
    body = ('def test_threads():\n    import os, torch\n'
            '    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1, '
            'torch.get_num_threads()\n')
    r = run_suite(tmp_path, body, OMP_NUM_THREADS=None)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:]


def whole_suite_ids(session) -> tuple[list[str], list[str]] | None:
    """The node ids of the whole suite and of `make test-quick`'s selection, from this session's own
    collection (every xdist worker collects all of it), or None when this run collected a part only."""
    opt = session.config.option
    files = {str(item.path) for item in session.items}
    if opt.keyword or opt.markexpr or session.config.getoption("deselect") or \
            files != {str(p) for p in TESTS.glob("test_*.py") if "def test_" in p.read_text()}:
        return None
    every = [item.nodeid for item in session.items]
    quick = [item.nodeid for item in session.items
             if not any(item.get_closest_marker(m) for m in ("slow", "server", "spawns"))]
    return every, quick


def test_the_readmes_test_counts_are_the_collected_ones(request):
    """README's counts come from `make readme-counts`, not from a hand: a test added or removed without
    running it leaves the table stale, and this fails naming the command. In a whole-suite run the counts
    come from the run's own collection (two more collections cost ~35 s); else `readme_counts --check`."""
    import subprocess
    import sys

    from tests import readme_counts

    ids = whole_suite_ids(request.session)
    if ids is not None:
        assert readme_counts.QUICK == "not slow and not server and not spawns"  # what whole_suite_ids selects
        now = readme_counts.table(*ids)
        assert readme_counts.readme_table() == now, f"README.md's test counts are stale; run `make " \
                                                    f"readme-counts`. Now:\n{now}"
        return
    r = subprocess.run([sys.executable, "-m", "tests.readme_counts", "--check"], cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def run_standin_files(tmp_path: Path, counts: dict[str, int], workers: int) -> list[tuple[str, str]]:
    """Run stand-in test files (name -> number of tests) named as the suite's, under xdist with this suite's
    report plugin and `--dist loadfile`, as `make test` runs; (xdist worker, module) of each test, in the
    order they ran."""
    import os
    import subprocess
    import sys

    (tmp_path / "tests").mkdir()
    ran = tmp_path / "ran.txt"
    for name, count in counts.items():
        body = "".join(f"def test_{i}():\n    import os\n    open({str(ran)!r}, 'a').write("
                       f"os.environ['PYTEST_XDIST_WORKER'] + ' ' + __name__ + '\\n')\n\n" for i in range(count))
        (tmp_path / "tests" / name).write_text(body)
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_report", "-p", "no:cacheprovider",
                        "-n", str(workers), "--dist", "loadfile", "tests"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [tuple(line.split()) for line in ran.read_text().splitlines()]


def test_xdist_runs_the_longest_file_first_whatever_its_number_of_tests(tmp_path):
    """The schedule is tests/file_durations.json's (longest first): xdist's loadfile would otherwise hand
    out files by their number of tests, and the one-test demo (the longest file) ran last and alone. Three
    files named as measured ones, run by one xdist worker with this suite's report plugin: the order of
    their first tests is the measured order, not the count order."""
    import json

    from tests.suite_report import FILE_DURATIONS

    seconds = json.loads(FILE_DURATIONS.read_text())
    names = ["test_demo.py", "test_hellaswag.py", "test_serving.py"]  # 1 test, 5 tests, 3 tests
    assert all(f"tests/{n}" in seconds for n in names)
    ran = run_standin_files(tmp_path, dict(zip(names, (1, 5, 3), strict=True)), workers=1)
    first = list(dict.fromkeys(module for _, module in ran))
    want = sorted(names, key=lambda n: -seconds[f"tests/{n}"])
    assert first == [f"tests.{n[:-3]}" for n in want] or first == [n[:-3] for n in want], first


def test_the_stack_files_are_the_prefect_stack_users():
    """tests/suite_report.py's STACK_FILES are one work unit so that one worker runs them and the suite
    starts one `prefect_stack`: a new user of the fixture left out would start a second stack on the other
    worker (a minute of CPU), and a file that stopped using it would tie the others to its worker."""
    import re

    from tests.suite_report import STACK_FILES

    uses = re.compile(r"def \w+\([^)]*\bprefect_stack\b|getfixturevalue\(\"prefect_stack\"\)")
    users = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py") if uses.search(p.read_text()))
    assert users == sorted(STACK_FILES), users


def test_xdist_runs_the_stack_files_on_one_worker(tmp_path):
    """Two xdist workers, the stack's files named as the real ones: test_flow.py (3 tests here) and
    test_deployments.py run on one worker, one after the other. With a work unit per file the other worker,
    given the one-test demo, would take test_deployments.py as soon as it asked (and start a second stack)."""
    import json

    from tests.suite_report import FILE_DURATIONS, STACK_FILES

    seconds = json.loads(FILE_DURATIONS.read_text())
    counts = {"test_flow.py": 3, "test_deployments.py": 1, "test_demo.py": 1, "test_hellaswag.py": 5,
              "test_serving.py": 3}
    assert {"tests/test_flow.py", "tests/test_deployments.py"} <= set(STACK_FILES)
    # the order that makes the unit visible: per file, the demo would go out between the two stack files
    assert seconds["tests/test_flow.py"] > seconds["tests/test_demo.py"] > seconds["tests/test_deployments.py"]
    lines = run_standin_files(tmp_path, counts, workers=2)
    worker = {module.rsplit(".", 1)[-1]: w for w, module in lines}
    assert worker["test_flow"] == worker["test_deployments"], lines
    on_it = [module.rsplit(".", 1)[-1] for w, module in lines if w == worker["test_flow"]]
    assert on_it[:4] == ["test_flow"] * 3 + ["test_deployments"], lines
