"""The test suite's own wiring: the markers that select `make test-quick` name fixtures that exist, and
the expected skips name tests that exist (a renamed test must not turn an allowed skip into a hidden one)."""

from __future__ import annotations

import ast
from pathlib import Path

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


def run_suite(tmp_path: Path, body: str, *args: str):
    """Run pytest on one test file under this suite's conftest (as a plugin), with CI's options."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    (tmp_path / "test_case.py").write_text(SUITE.format(body=body))
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
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


def test_the_readmes_test_counts_are_the_collected_ones():
    """README's counts come from `make readme-counts`, not from a hand: a test added or removed without
    running it leaves the table stale, and this fails naming the command."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tests.readme_counts", "--check"], cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
