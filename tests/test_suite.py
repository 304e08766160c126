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
