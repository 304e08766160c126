"""The shell's shape, checked on its import graph (grimp, the graph library behind import-linter): each
folder holds one kind of thing, imports point down the layers, no two stage modules import each other,
and gptcore (which runs under plain torchrun) never imports Prefect or MLflow."""

from __future__ import annotations

import importlib
import pkgutil

import grimp
import pytest

PACKAGES = ("devstack", "flows", "tasks", "integrations", "gptcore")
LAYERS = ["devstack", "flows", "tasks", "integrations", "gptcore"]  # each may import only those below it
ALIASES = {"flows.demo", "tasks.tracking"}  # `python -m` names kept for one release; they only forward


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, include_external_packages=True)


def test_imports_point_down_the_layers(graph):
    illegal = [(d.importer, d.imported, sorted(h for r in d.routes for h in r.heads))
               for d in graph.find_illegal_dependencies_for_layers(layers=LAYERS)]
    illegal = [(a, b, heads) for a, b, heads in illegal if set(heads) - ALIASES]
    assert not illegal, illegal


def test_gptcore_never_imports_prefect_or_mlflow(graph):
    for external in ("prefect", "mlflow", "prefect_dask"):
        chain = graph.find_shortest_chains(importer="gptcore", imported=external, as_packages=True)
        assert not chain, f"gptcore imports {external}: {chain}"


def test_no_two_stage_modules_import_each_other(graph):
    stages = sorted(m for m in graph.modules if m.startswith(("tasks.", "flows.")))
    cycles = [(a, b) for a in stages for b in stages
              if a < b and graph.chain_exists(a, b) and graph.chain_exists(b, a)]
    assert not cycles, cycles


def modules(package: str) -> list[str]:
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(package).__path__)]


def test_each_folder_holds_one_kind_of_thing():
    from prefect import Flow, Task

    def defines(module: str, kind) -> bool:
        return any(isinstance(v, kind) for v in vars(importlib.import_module(module)).values())

    stages = [m for m in modules("tasks") if m not in ALIASES]
    assert stages and all(defines(m, Task) for m in stages), [m for m in stages if not defines(m, Task)]
    flows = [m for m in modules("flows") if m not in ALIASES]
    assert flows and all(defines(m, Flow) for m in flows), [m for m in flows if not defines(m, Flow)]
    libraries = modules("integrations")
    assert not [m for m in libraries if defines(m, Task) or defines(m, Flow)]  # libraries, not stages
