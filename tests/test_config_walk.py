"""benchmarks/config_walk.py counts what its definition says: a toy chain of functions under a root of its
own, with a known number of calls carrying the config (a RunConfig, cfg.to_dict(), the preset's name, a
RunConfig held by an object), is counted exactly, in-process and through the hook in a child process. The
full measurement (one flow run, a minute or more) is `python -m benchmarks.config_walk`, not run here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from benchmarks.config_walk import Walker, collect, hook_env
from gptcore.config import RunConfig

TOY = '''
class Run:  # holds the config, as the flow's FlowRun does
    def __init__(self, cfg):
        self.cfg = cfg

def stage(run):            # held RunConfig: 1
    return handoff(run.cfg)

def handoff(cfg):          # RunConfig: 1
    return [read(cfg.to_dict()) for _ in range(2)]

def read(d):               # dict: 2
    return name(d["preset"]) + unrelated(len(d))

def name(preset):          # preset: 2
    return len(preset)

def unrelated(n):          # carries nothing: 0
    return n

def failing(cfg):          # RunConfig: 1, its return by the exception
    raise ValueError(cfg.preset)

def gen(cfg):              # RunConfig: one step per resume (3: two yields and the end)
    yield 1
    yield 2

def walk(cfg):             # RunConfig: 1
    total = stage(Run(cfg))
    try:
        failing(cfg)
    except ValueError:
        pass
    return total, list(gen(cfg)), unrelated(0), name("other")
'''
# walk 1 + stage 1 + handoff 1 + read 2 + name 2 + failing 1 + gen 3 (Run.__init__ carries cfg too: 1)
EXPECTED = {"toy.py:walk": 1, "toy.py:stage": 1, "toy.py:handoff": 1, "toy.py:read": 2, "toy.py:name": 2,
            "toy.py:failing": 1, "toy.py:gen": 3, "toy.py:Run.__init__": 1}
KINDS = {"RunConfig": 7, "held RunConfig": 1, "dict": 2, "preset": 2}


def toy_module(root, monkeypatch=None):
    (root / "toy.py").write_text(TOY)
    if monkeypatch is None:
        return None
    spec = importlib.util.spec_from_file_location("config_walk_toy", root / "toy.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "config_walk_toy", module)  # its classes are known as the project's by it
    spec.loader.exec_module(module)
    return module


def test_a_toy_chain_is_counted_exactly(tmp_path, monkeypatch):
    toy = toy_module(tmp_path, monkeypatch)
    cfg = RunConfig(preset="micro")
    with Walker(tmp_path, "micro") as walker:
        toy.walk(cfg)
    got = walker.result()
    assert {f: s for f, (s, _) in got["functions"].items()} == EXPECTED
    assert all(s == r for s, r in got["functions"].values()), got["functions"]  # every step returned
    assert (got["steps"], got["returns"]) == (sum(EXPECTED.values()),) * 2 == (12, 12)
    assert got["modules"] == {"toy.py": [12, 12]} and got["kinds"] == KINDS
    # gptcore's own calls (cfg.to_dict(), RunConfig.validate) are not under the toy's root: not counted
    assert not any(f.startswith("gptcore") for f in got["functions"])


@pytest.mark.spawns
def test_the_hook_counts_a_child_process(tmp_path):
    """The sitecustomize hook traces a Python process started with hook_env's variables and appends its
    counts at exit, as it does for the flow run's processes (the flow, the trainers)."""
    root = tmp_path / "root"
    root.mkdir()
    toy_module(root)
    out = tmp_path / "walk.jsonl"
    env = hook_env(out, root, "micro", tmp_path / "hook")
    code = "import toy\nfrom gptcore.config import RunConfig\ntoy.walk(RunConfig(preset='micro'))"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = collect(out)
    assert [p["what"] for p in got["processes"]] == ["-c import toy"]
    assert (got["steps"], got["returns"]) == (12, 12)
    assert {f: s for f, (s, _) in got["functions"].items()} == EXPECTED
    assert got["processes"][0]["argv"][:2] == [sys.executable, "-c"] and got["lost"] == []
