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


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(*PACKAGES, include_external_packages=True)


def test_imports_point_down_the_layers(graph):
    illegal = [(d.importer, d.imported, sorted(h for r in d.routes for h in r.heads))
               for d in graph.find_illegal_dependencies_for_layers(layers=LAYERS)]
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

    stages = modules("tasks")
    assert stages and all(defines(m, Task) for m in stages), [m for m in stages if not defines(m, Task)]
    flows = modules("flows")
    assert flows and all(defines(m, Flow) for m in flows), [m for m in flows if not defines(m, Flow)]
    libraries = modules("integrations")
    assert not [m for m in libraries if defines(m, Task) or defines(m, Flow)]  # libraries, not stages


def test_no_private_name_of_a_library_is_used():
    """Libraries' underscored names change without notice (MLflow 3 and Prefect 3 moved many): the code
    imports and reaches only their public APIs. Fails on `from mlflow.x import _y`, `import a._b`, and any
    `obj._name` whose name the project does not define itself (e.g. a monitor's `._process`, a block's
    `._block_document_id`), but for the few torch and stdlib names below that have no public equivalent."""
    import ast
    from pathlib import Path

    allowed = {
        "_exit": "os._exit, the documented way to end a process whose main thread is stuck "
                 "(gptcore/training/watchdog.py)",
        "_orig_mod": "the module inside torch.compile's wrapper; torch has no public accessor",
        "_dynamo": "torch._dynamo.utils.counters: the only count of compiled graphs (tests assert it stays put)",
        "_is_mkldnn_bf16_supported": "whether the CPU has bf16 matmuls (a benchmark's choice); no public check",
        "_record_memory_history": "torch's CUDA memory snapshot, as its guide 'Understanding CUDA Memory Usage' "
                                  "documents it (gptcore/training/memory.py); no public name",
        "_dump_snapshot": "the same guide's way to write the snapshot for pytorch.org/memory_viz",
    }
    root = Path(__file__).resolve().parents[1]
    trees = {p: ast.parse(p.read_text(), str(p))
             for package in (*PACKAGES, "benchmarks", "deployments") for p in (root / package).rglob("*.py")}

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    ours = set()  # every name the project binds itself: its own underscored helpers and attributes are fine
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                ours.add(node.id if isinstance(node, ast.Name) else node.attr)
    found = []
    for path, tree in trees.items():
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] not in PACKAGES:
                names = node.module.split(".") + [a.name for a in node.names]
                found += [f"{where}:{node.lineno} from {node.module} import ..." for n in names
                          if private(n) and n not in allowed][:1]
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                          if any(private(n) and n not in allowed for n in a.name.split("."))]
            elif isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in ours | set(allowed):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert not found, "private names of libraries in use:\n" + "\n".join(found)


def test_imports_inside_functions_say_why():
    """Imports sit at the top of a module, where its dependencies show, unless laziness is the point (a
    no-op flow re-run must not import torch or mlflow; lm-eval and the hub clients load only when asked
    for): then the module says why in one `# lazy imports: ...` comment, or the import's own line does."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    unexplained = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            if "# lazy imports:" in text:
                continue
            lines = text.splitlines()
            for fn in ast.walk(ast.parse(text)):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(fn):
                        if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1] \
                                and not lines[node.lineno - 2].strip().startswith("#"):
                            where = f"{path.relative_to(root)}:{node.lineno}"
                            unexplained.append(f"{where} {lines[node.lineno - 1].strip()}")
    assert not unexplained, "imports inside functions with no reason given:\n" + "\n".join(unexplained)


# --- gptcore's rooms ---------------------------------------------------------------------------------
ROOMS = ["base", "model", "data", "checkpoints", "evals", "training"]  # imports point down this list only


def room_of(module: str) -> str:
    part = module.split(".")[1] if module.count(".") else ""
    return part if part in ROOMS else "base"


def test_gptcore_rooms_import_downwards_only_and_without_cycles(graph):
    """A room imports only the rooms below it (base < model < data < checkpoints < evals < training), and no
    two gptcore modules import each other, directly or through others (lazy imports inside functions
    count: they are the same dependency, deferred)."""
    mods = sorted(m for m in graph.modules if m.startswith("gptcore"))
    upward = [(m, i) for m in mods for i in graph.find_modules_directly_imported_by(m)
              if i.startswith("gptcore") and ROOMS.index(room_of(i)) > ROOMS.index(room_of(m))]
    assert not upward, upward
    cycles = [(a, b) for a in mods for b in mods
              if a < b and graph.chain_exists(a, b) and graph.chain_exists(b, a)]
    assert not cycles, cycles


def test_gptcore_is_rooms_and_architecture_names_them():
    """At most 12 modules at gptcore's top level; each room says what it may import; ARCHITECTURE.md's
    table of rooms names exactly the modules in the tree."""
    import re
    from pathlib import Path

    root = Path(importlib.import_module("gptcore").__path__[0])
    top = sorted(p.stem for p in root.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, top
    for room in ROOMS[1:]:
        doc = importlib.import_module(f"gptcore.{room}").__doc__ or ""
        assert "May import" in doc or "may import" in doc, f"gptcore/{room}/__init__.py does not say what it may import"
    tree = {("base" if p.parent == root else p.relative_to(root).parts[0],
             "/".join(p.relative_to(root).with_suffix("").parts[1:]) or p.stem)
            for p in root.rglob("*.py") if p.stem != "__init__" and "assets" not in p.parts}
    text = (root.parent / "ARCHITECTURE.md").read_text()
    named = {(room, m.strip()) for room, mods in re.findall(r"^\| (\w+) \| ([\w/, ]+) \|", text, re.M)
             if room in ROOMS for m in mods.split(",")}
    assert named == tree, {"not in ARCHITECTURE.md": sorted(tree - named), "not in the tree": sorted(named - tree)}


def test_every_stage_is_a_stage_in_its_own_module_and_the_flow_only_composes_them():
    """flows/pretrain.py's STAGES are `Stage` objects (tasks/stage.py), each defined in its own module (the
    one that holds its Prefect tasks); no `done()` variant is left; the flow module defines no stage."""
    import inspect

    from flows import pretrain
    from tasks.stage import Stage

    assert [s.name for s in pretrain.STAGES] == ["download", "tokenize", "train", "evaluate", "register", "sample"]
    homes = [type(s).__module__ for s in pretrain.STAGES]
    assert homes == ["tasks.download", "flows.dataset", "tasks.train", "tasks.evaluate", "tasks.register",
                     "tasks.generate"]
    for stage in pretrain.STAGES:
        assert isinstance(stage, Stage) and type(stage).stored is not Stage.stored, stage
    for module in ("tokenize", "train", "evaluate", "register", "generate"):
        assert not hasattr(importlib.import_module(f"tasks.{module}"), "done"), f"tasks.{module} still has done()"
    defined = [name for name, obj in vars(pretrain).items()
               if inspect.isclass(obj) and obj.__module__ == "flows.pretrain"]
    assert defined == [], defined


def test_no_module_of_an_entrypoint_folder_shadows_the_standard_library():
    """A deployment's entrypoint folder (flows/: deployments/prefect.yaml names flows/<file>.py:<flow>) is on
    sys.path in the flow run's process: a flows/tokenize.py there made `import tokenize` (linecache, inspect)
    load it, and every process the flow run started died (BrokenProcessPool). Packages imported by name
    (tasks.tokenize, integrations.secrets) shadow nothing."""
    import re
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    folders = set(re.findall(r"entrypoint: *(\w+)/", (root / "deployments" / "prefect.yaml").read_text()))
    assert folders == {"flows"}, folders
    shadows = [str(p.relative_to(root)) for folder in folders for p in (root / folder).glob("*.py")
               if p.stem in sys.stdlib_module_names]
    assert not shadows, shadows


def test_config_holds_settings_only():
    """gptcore/config.py is the settings classes and their checks: the presets (presets.py), the parsing of
    files and overrides (overrides.py), a value from text (coerce.py), the security checks on names and code
    folders (security.py) and the pipeline home (files.py) each live in their own module, and the flow's
    write-directory policy and MLflow links in integrations/ (write_dirs.py, mlflow_links.py), not in
    flows/pretrain.py."""
    import gptcore.config as config
    from flows import pretrain

    own = {n for n, v in vars(config).items() if getattr(v, "__module__", None) == "gptcore.config"}
    elsewhere = {"check_name", "check_code_path", "code_roots", "MODEL_PRESETS", "PRESETS", "preset", "model_preset",
                 "load_config", "apply_overrides", "from_dict", "flatten", "RENAMED_KEYS", "pipeline_home",
                 "coerce"}
    assert not own & elsewhere, own & elsewhere
    assert not {n for n in elsewhere if n in vars(config) and n not in ("check_name", "coerce")}, "config re-exports"
    flow_own = {n for n, v in vars(pretrain).items() if getattr(v, "__module__", None) == "flows.pretrain"}
    assert not flow_own & {"check_write_dirs", "check_not_protected", "server_dirs", "owning_run", "mlflow_links",
                           "flow_links"}, flow_own
