"""Run a build-nanogpt-style training script from its own file: karpathy/build-nanogpt's train_gpt2.py
(fetched at a pinned commit into the ignored folder reference/, never into this repository:
benchmarks/fetch_reference.sh), or our stand-in of the same form (benchmarks/reference_standin.py).

    python -m benchmarks.reference_run FILE --workdir DIR --set max_steps=12 --set use_compile=True

The file's own classes, optimizer, data loader and step loop run unchanged. What changes is only a few of its
module-level settings (`--set NAME=VALUE`, each must be a top-level assignment of the file, or it is an
error naming the name), and, offline, its `enc = tiktoken.get_encoding("gpt2")` takes the identical GPT-2
encoding built from the project's rank file (tiktoken would download its files). The file runs with DIR as
its working directory (it reads edu_fineweb10B/ and writes log/ there), with its own folder first on
sys.path. Its `from hellaswag import ...` gets a stand-in whose functions raise: the file calls them only
with use_compile=False, and the real module downloads its tokenizer and data when imported.
On CUDA the allocator's peak is read and reset as each step line is printed (the file prints it after the
step's synchronize), and last it prints `reference peak memory per step: STEP:GiB,...`: the peak over the same
steps as the trainer's `train/peak_memory_gib` rows, so the two sides are compared over one span.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import os
import re
import sys
import types
from pathlib import Path

import torch

from gptcore.model.tokenizer import get_encoding

OFFLINE_ENCODING = "__offline_gpt2_encoding__"
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss: ([-\d.naif]+) \|.*\| dt: ([\d.]+)ms \| tok/sec: ([\d.]+)")
PEAK_LINE = re.compile(r"^reference peak memory per step: (.*)$")


def rewrite(source: str, filename: str, settings: dict) -> ast.Module:
    """The file's syntax tree with each module-level `NAME = ...` in `settings` given the new value, and
    its `enc = tiktoken.get_encoding(...)` reading the offline encoding."""
    tree = ast.parse(source, filename)
    found = set()
    for node in tree.body:  # module level only: that is where a script keeps its settings
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name in settings:
            node.value = ast.copy_location(ast.Constant(settings[name]), node.value)
            found.add(name)
        elif name == "enc" and "get_encoding" in ast.unparse(node.value):
            node.value = ast.copy_location(ast.Name(OFFLINE_ENCODING, ast.Load()), node.value)
    missing = sorted(set(settings) - found)
    if missing:
        raise SystemExit(f"reference_run: {filename} has no module-level assignment of {', '.join(missing)}: "
                         "it is not the file this harness was written for; use the commit pinned in "
                         "benchmarks/fetch_reference.sh")
    return ast.fix_missing_locations(tree)


def literal(text: str):
    """`--set` values are Python literals (12, True, 65536); anything else stays a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def stand_in_hellaswag() -> None:
    """The file's `from hellaswag import render_example, iterate_examples`, answered by a module whose
    functions raise: the file calls them only with use_compile=False (the speed row compiles), and the real
    module downloads its tokenizer and dataset when imported (it needs the network and `requests`)."""
    def unavailable(*_, **__):
        raise RuntimeError("reference_run: the reference's HellaSwag is not run here (use_compile=True skips it)")

    stand_in = types.ModuleType("hellaswag")
    stand_in.render_example = stand_in.iterate_examples = unavailable
    sys.modules["hellaswag"] = stand_in


def parse_steps(output: str) -> dict[int, tuple[float, float, float]]:
    """{step: (loss, dt seconds, tokens/s)} from the script's own per-step lines."""
    steps = {}
    for line in output.splitlines():
        m = STEP_LINE.match(line.strip())
        if m:
            steps[int(m[1])] = (float(m[2]), float(m[3]) / 1000, float(m[4]))
    return steps


def parse_peak_memory(output: str) -> dict[int, float]:
    """{step: the allocator's peak GiB over that step} from the harness's last line (none off CUDA)."""
    m = next((PEAK_LINE.match(line) for line in output.splitlines() if PEAK_LINE.match(line)), None)
    pairs = (item.split(":") for item in m[1].split(",") if item) if m else ()
    return {int(step): float(gib) for step, gib in pairs}


def step_peak_print(peaks: dict[int, float]):
    """The file's `print`, which also records the allocator's peak since the previous step line when it
    prints a step line, and starts a new count: build-nanogpt prints each step's line after synchronizing,
    so each count is one step (its evaluation, at step 0 and the last, included in that step's)."""
    def recording_print(*args, **kwargs):
        builtins.print(*args, **kwargs)
        m = STEP_LINE.match(" ".join(map(str, args)).strip())
        if m and torch.cuda.is_available() and torch.cuda.is_initialized():
            peaks[int(m[1])] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()

    return recording_print


def run_as_main(tree: ast.Module, path: Path, peaks: dict[int, float]) -> None:
    """Execute the file as Python runs a script: in a real module registered as sys.modules["__main__"],
    with its `__file__`. A plain dict would do for the steps, but not for the file's last step: it pickles a
    dataclass defined in the file (torch.save of `raw_model.config`), and pickle finds `__main__.GPTConfig`
    by looking it up in sys.modules["__main__"], which would otherwise be this harness."""
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    module.__builtins__ = __builtins__
    module.print = step_peak_print(peaks)  # the file's global `print` (its functions look it up there too)
    setattr(module, OFFLINE_ENCODING, get_encoding())
    harness, sys.modules["__main__"] = sys.modules.get("__main__"), module
    try:
        exec(compile(tree, str(path), "exec"), module.__dict__)  # noqa: S102 - running the reference is our job
    finally:
        if harness is not None:
            sys.modules["__main__"] = harness


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--workdir", type=Path, required=True, help="holds edu_fineweb10B/; log/ is written here")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    a = ap.parse_args(argv)
    if not a.file.is_file():
        raise SystemExit(f"reference_run: {a.file} does not exist; fetch it with benchmarks/fetch_reference.sh")
    settings = {}
    for item in a.set:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"reference_run: --set {item!r} is not NAME=VALUE")
        settings[name] = literal(value)
    path = a.file.resolve()
    tree = rewrite(path.read_text(), str(path), settings)
    sys.path.insert(0, str(path.parent))  # the file's folder first, as when it runs as a script
    stand_in_hellaswag()
    os.chdir(a.workdir)
    peaks: dict[int, float] = {}
    run_as_main(tree, path, peaks)
    if peaks:
        print(f"reference peak memory per step: {','.join(f'{s}:{g:.3f}' for s, g in sorted(peaks.items()))}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
