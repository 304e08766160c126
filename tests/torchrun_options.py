"""torchrun's command-line options as data, read from a torch wheel's torch/distributed/run.py without
importing it (that torch need not be installed), so a test can parse the launcher's command with the
argument list of a torch we allow but do not install (tests/test_launch.py).

    python -m tests.torchrun_options torch-2.11.0-cp311-...whl > tests/fixtures/torchrun-2.11.0.json

The wheel comes from `pip download --no-deps torch==2.11.0`. Each option is {"flags": [...], "value": bool}:
whether it takes a value (torchrun's boolean switches use store_true or its own `check_env` action).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile

SWITCH_ACTIONS = {"store_true", "store_false", "check_env", "count"}


def options_from_source(source: str) -> list[dict]:
    """Every `parser.add_argument("--flag", ..., action=...)` with option strings, in file order."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        if not flags:
            continue  # the positional training_script and its arguments
        action = next((k.value for k in node.keywords if k.arg == "action"), None)
        name = action.value if isinstance(action, ast.Constant) else getattr(action, "id", None)
        out.append({"flags": flags, "value": name not in SWITCH_ACTIONS})
    return out


def parser_from(options: list[dict]) -> argparse.ArgumentParser:
    """An argument parser that accepts what that torchrun accepts (its positional script and the script's
    arguments last, as torchrun's own)."""
    p = argparse.ArgumentParser(prog="torchrun", exit_on_error=False)
    for o in options:
        if o["value"]:
            p.add_argument(*o["flags"])
        else:
            p.add_argument(*o["flags"], action="store_true")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str]) -> int:
    with zipfile.ZipFile(argv[0]) as whl:
        version = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        source = whl.read("torch/distributed/run.py").decode()
    options = ",\n  ".join(json.dumps(o) for o in options_from_source(source))  # one option a line
    print(f'{{"wheel": {json.dumps(argv[0].rsplit("/", 1)[-1])}, "metadata": {json.dumps(version)},\n'
          f' "options": [\n  {options}\n ]}}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
