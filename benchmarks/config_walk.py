"""Following `preset`: how many calls into the project's own code carry the config through one real flow run.

    python -m benchmarks.config_walk [--repo PATH] [--preset micro] [--steps 4] [--out var/config_walk.json]
    python -m benchmarks.config_walk --repo /tmp/walk-base --out var/config_walk-base.json   # a baseline

Definition (the same for any checkout, whatever its module paths):
- What runs: one real `pretrain` flow run (flows/pretrain.py of the checkout given by --repo, which must take
  `pretrain(preset, overrides, nproc, model_name=...)`) on `--preset` with a few steps, in a fresh
  GPTPIPE_HOME and PREFECT_HOME, so nothing is found done: data, train, register and sample run; evaluate is
  skipped when the trainer already evaluated the last checkpoint, as it does at --steps (eval_interval is
  set to it); against Prefect's ephemeral server and MLflow's embedded SQLite store. 2-3 minutes on a
  2-core CPU. The same checkout and parameters give the same counts, run after run. The flow is called in
  a Python process of its own (`python -c`, cwd = the checkout, which comes first on sys.path, so its own
  modules load), and so are the ones it starts: the tokenizer's process pool, torchrun and the trainers.
- How it is followed: every Python process of the run (found by a `sitecustomize` on PYTHONPATH that each
  interpreter loads, driven by CONFIG_WALK_* variables) traces itself and all its threads with
  `sys.settrace`/`threading.settrace` from interpreter start; at exit (atexit, or multiprocessing's
  finalizers in a forked worker) it appends its counts to one JSON-lines file. Not traced: the Prefect
  server (uvicorn) and MLflow server processes (no project code runs there). A process that ends without
  running its exit handlers (SIGKILL, a bare os._exit, an exec into another program) loses its counts: each
  process also writes a line when it starts, so the report lists those as `lost` beside the `processes`
  that reported (a process that execs keeps its pid: the program it became reports for it, as torchrun
  does for the train task's exec wrapper).
- What counts: a call event of a function whose file lies under the checkout (not .venv, not site-packages,
  not this tool) whose arguments carry the config, at that moment (the trace's "call" event, when locals
  are still the arguments):
    preset    a str equal to the preset name ("micro")
    RunConfig an instance of a class named RunConfig (`self` included: cfg.validate(), cfg.to_dict(), ...)
    dict      a dict with a "preset" key (cfg.to_dict(), a saved config)
  either as the argument itself (or an element of *args / a value of **kwargs), or held one level down: an
  element of a list/tuple/set (the first 64), a value of a dict (the first 64), or an attribute of an
  instance of one of the project's classes (a FlowRun holding cfg). The kind recorded is the argument's
  own when it carries directly, else "held <kind>".
  A "step" is such a call event; a "return" is that frame's return event (also when it exits by an
  exception). A generator's or coroutine's frame counts a step each time it resumes and a return each time
  it yields. Equal strings are not told apart: a function handed the literal "micro" (a preset's own
  model_preset("micro")) counts like one handed the flow's parameter.
- Reported: totals (steps, returns), per module (its path relative to the checkout: entries = steps),
  per function, per kind, per process; the flow's stages (each must have run for the figure to be the
  whole path).

Comparable before/after: run it on a worktree of an older commit (--repo) with this checkout's tool and
.venv; e.g. the commit before "one config handoff" (4d6dd50). A checkout with uncommitted .py changes is
measured as it is, and the report says so (`uncommitted_py`): for a commit's own figure use a worktree.
    git worktree add --detach /tmp/walk-base 4d6dd50^
    python -m benchmarks.config_walk --repo /tmp/walk-base --out var/config_walk-base.json
    git worktree remove /tmp/walk-base

Issue 46's target: following `preset` takes <= 40 returns. The hook is this same file, loaded by path
(it imports only the standard library); `Walker` also counts in-process (start/stop), as its test does.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# the variables that turn the hook on in every process of a run (sitecustomize reads them)
ENV_OUT, ENV_ROOT, ENV_PRESET, ENV_TOOL, ENV_SKIP = ("CONFIG_WALK_OUT", "CONFIG_WALK_ROOT", "CONFIG_WALK_PRESET",
                                                     "CONFIG_WALK_TOOL", "CONFIG_WALK_SKIP")
# processes not traced: servers the run talks to, where no project code runs (substrings of their argv)
SKIP = ("uvicorn", "mlflow.server", "gunicorn", "prefect.server")
HELD_ITEMS = 64  # how many items of a list/tuple/set/dict argument are looked into
REPO = Path(__file__).resolve().parents[1]
TOOL = Path(__file__).resolve()

SITECUSTOMIZE = f"""\
# written by benchmarks/config_walk.py: trace this interpreter when {ENV_OUT} is set
import os
if os.environ.get("{ENV_OUT}"):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_config_walk_hook", os.environ["{ENV_TOOL}"])
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.hook_from_env()
"""

# the flow run, in a process of its own (cwd: the checkout); argv[1] holds the flow's parameters as JSON
# (and the files of the checkout's packages that it loaded from elsewhere: there must be none)
DRIVER = """\
import json, os, sys
import flows.pretrain
summary = flows.pretrain.pretrain(**json.loads(sys.argv[1]))
root = os.path.realpath(os.getcwd())
tops = {p for p in os.listdir(root) if os.path.isfile(os.path.join(root, p, "__init__.py"))}
elsewhere = sorted({getattr(m, "__file__", None) or "" for n, m in list(sys.modules.items())
                    if n.split(".")[0] in tops and getattr(m, "__file__", None)
                    and not os.path.realpath(m.__file__).startswith(root + os.sep)})
print("CONFIG_WALK_RESULT " + json.dumps({"flow_file": flows.pretrain.__file__, "stages": summary.get("stages"),
                                          "step": summary.get("step"), "elsewhere": elsewhere}))
"""


# --- counting --------------------------------------------------------------------------------------------

class Walker:
    """Counts calls into code under `root` whose arguments carry the config of preset `preset` (the module
    docstring's definition), on every thread started after start() and the one that calls it."""

    def __init__(self, root: str | os.PathLike, preset: str, exclude: tuple[str, ...] = ()):
        self.root = os.path.realpath(root) + os.sep
        self.preset = preset
        self.exclude = tuple(os.path.realpath(p) for p in (os.path.join(self.root, ".venv"), str(TOOL), *exclude))
        self.lock = threading.Lock()
        self._codes: dict[int, tuple] = {}  # id(code) -> (code, (label, qualname, argnames, star, starstar) | None)
        self._types: dict[type, bool] = {}  # a class of the project's own?
        self.reset()

    def reset(self) -> None:
        self.steps: collections.Counter = collections.Counter()  # (module, function) -> call events
        self.returns: collections.Counter = collections.Counter()
        self.kinds: collections.Counter = collections.Counter()
        self.pid = os.getpid()

    # which code is the project's, and its argument names
    def _info(self, code):
        path = os.path.realpath(code.co_filename) if code.co_filename[:1] not in ("<", "") else ""
        if not path.startswith(self.root) or path.startswith(self.exclude) or os.sep + "site-packages" + os.sep in path:
            info = None
        else:
            n = code.co_argcount + code.co_kwonlyargcount
            star = code.co_varnames[n] if code.co_flags & 0x04 else None  # CO_VARARGS
            starstar = code.co_varnames[n + (star is not None)] if code.co_flags & 0x08 else None  # CO_VARKEYWORDS
            info = (path[len(self.root):], code.co_qualname, code.co_varnames[:n], star, starstar)
        self._codes[id(code)] = (code, info)  # the code object kept alive: its id is never reused
        return info

    def _ours(self, cls: type) -> bool:
        ours = self._types.get(cls)
        if ours is None:
            module = sys.modules.get(getattr(cls, "__module__", "") or "")
            path = os.path.realpath(getattr(module, "__file__", None) or "/") if module is not None else "/"
            ours = self._types[cls] = path.startswith(self.root) and not path.startswith(self.exclude)
        return ours

    def _direct(self, v) -> str | None:
        t = type(v)
        if t is str:
            return "preset" if v == self.preset else None
        if t.__name__ == "RunConfig":
            return "RunConfig"
        if isinstance(v, dict) and "preset" in v:
            return "dict"
        return None

    def _held(self, v) -> str | None:
        if isinstance(v, list | tuple | set | frozenset):
            items = v
        elif isinstance(v, dict):
            items = v.values()
        elif self._ours(type(v)) and isinstance(getattr(v, "__dict__", None), dict):
            items = v.__dict__.values()
        else:
            return None
        for i, item in enumerate(items):
            if i == HELD_ITEMS:
                break
            if (kind := self._direct(item)) is not None:
                return f"held {kind}"
        return None

    def carried(self, frame, info) -> str | None:
        """The kind of config the frame's arguments carry, or None."""
        loc = frame.f_locals
        values = [loc.get(name) for name in info[2]]
        if info[3] is not None:
            values += list(loc.get(info[3]) or ())
        if info[4] is not None:
            values += list((loc.get(info[4]) or {}).values())
        for v in values:
            if (kind := self._direct(v)) is not None:
                return kind
        for v in values:
            if (kind := self._held(v)) is not None:
                return kind
        return None

    # the trace functions: a global one sees every call; only a counted frame gets a local one (for its return)
    def _trace(self, frame, event, arg):
        if event != "call":
            return None
        code = frame.f_code
        entry = self._codes.get(id(code))
        info = entry[1] if entry is not None else self._info(code)
        if info is None:
            return None
        kind = self.carried(frame, info)
        if kind is None:
            return None
        key = (info[0], info[1])
        with self.lock:
            self.steps[key] += 1
            self.kinds[kind] += 1
        frame.f_trace_lines = False

        def local(frame, event, arg):
            if event == "return":
                with self.lock:
                    self.returns[key] += 1
            return local

        return local

    def start(self) -> Walker:
        self._previous = (sys.gettrace(), threading.gettrace())
        threading.settrace(self._trace)
        sys.settrace(self._trace)
        return self

    def stop(self) -> Walker:
        sys.settrace(self._previous[0])
        threading.settrace(self._previous[1])
        return self

    def __enter__(self) -> Walker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def result(self) -> dict:
        """Totals and per module / function / kind: {"steps", "returns", "modules": {path: [steps, returns]},
        "functions": {"path:qualname": [steps, returns]}, "kinds": {kind: steps}}."""
        with self.lock:
            steps, returns, kinds = dict(self.steps), dict(self.returns), dict(self.kinds)
        modules: dict[str, list[int]] = {}
        for (module, _), n in steps.items():
            modules.setdefault(module, [0, 0])[0] += n
        for (module, _), n in returns.items():
            modules.setdefault(module, [0, 0])[1] += n
        return {"steps": sum(steps.values()), "returns": sum(returns.values()), "modules": modules,
                "functions": {f"{m}:{f}": [n, returns.get((m, f), 0)] for (m, f), n in steps.items()},
                "kinds": kinds}


# --- the hook every process of a run loads ---------------------------------------------------------------

def hook_env(out: Path, root: Path, preset: str, hook_dir: Path, env: dict | None = None) -> dict:
    """`env` (default: os.environ) with the hook on: each Python process started with it traces itself and
    appends its counts to `out` (JSON lines) when it exits. `hook_dir` gets the sitecustomize.py."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ if env is None else env)
    path = [str(hook_dir), str(root), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env.update({"PYTHONPATH": os.pathsep.join(path), ENV_OUT: str(out), ENV_ROOT: str(root), ENV_PRESET: preset,
                ENV_TOOL: str(TOOL)})
    return env


def hook_from_env() -> Walker | None:
    """Called by the sitecustomize at interpreter start: trace this process unless it is a server of SKIP,
    and write its counts at exit (atexit; in a forked worker, multiprocessing's exit finalizers)."""
    argv = " ".join(getattr(sys, "orig_argv", sys.argv))
    skip = [s for s in os.environ.get(ENV_SKIP, ",".join(SKIP)).split(",") if s]
    if any(s in argv for s in skip):
        return None
    walker = Walker(os.environ[ENV_ROOT], os.environ[ENV_PRESET])
    out = os.environ[ENV_OUT]

    def flush() -> None:
        if walker.pid != os.getpid():  # a forked child's inherited handler: the child writes its own
            return
        walker.stop()
        line = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(getattr(sys, "orig_argv", sys.argv)),
                **walker.result()}
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        walker.pid = -1  # written once

    def in_child() -> None:  # a forked worker starts from zero; it ends through multiprocessing, not atexit
        walker.reset()
        started(out)
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            util.Finalize(None, flush, exitpriority=100)

    atexit.register(flush)
    os.register_at_fork(after_in_child=in_child)
    started(out)
    return walker.start()


def started(out: str) -> None:
    """A process's first line: one that never writes its counts (killed, exec'd) shows as lost."""
    with open(out, "a") as f:
        f.write(json.dumps({"started": os.getpid(), "ppid": os.getppid(),
                            "argv": list(getattr(sys, "orig_argv", sys.argv))}) + "\n")


def collect(path: Path) -> dict:
    """The processes' lines of one run, summed."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    starts, lines = [x for x in lines if "started" in x], [x for x in lines if "started" not in x]
    reported = {x["pid"] for x in lines}
    modules: dict[str, list[int]] = {}
    functions: dict[str, list[int]] = {}
    kinds: collections.Counter = collections.Counter()
    for line in lines:
        for into, part in ((modules, line["modules"]), (functions, line["functions"])):
            for name, (s, r) in part.items():
                into.setdefault(name, [0, 0])
                into[name][0] += s
                into[name][1] += r
        kinds.update(line["kinds"])
    by_steps = lambda d: dict(sorted(d.items(), key=lambda kv: (-kv[1][0], kv[0])))  # noqa: E731
    return {"steps": sum(x["steps"] for x in lines), "returns": sum(x["returns"] for x in lines),
            "distinct_functions": len(functions), "modules": by_steps(modules), "functions": by_steps(functions),
            "kinds": dict(kinds.most_common()),
            "processes": [{"pid": x["pid"], "ppid": x["ppid"], "what": what(x["argv"]), "argv": x["argv"],
                           "steps": x["steps"], "returns": x["returns"]} for x in lines],
            # started but never wrote their counts: exec'd into another program (which reports itself), or
            # killed before their exit handlers ran; their counts are not in the totals
            "lost": [{"pid": x["started"], "ppid": x["ppid"], "what": what(x["argv"]), "argv": x["argv"]}
                     for x in starts if x["started"] not in reported]}


def what(argv: list[str]) -> str:
    """A process, shortly: its module (-m) or 'python -c' with its first words."""
    if "-m" in argv[:-1]:
        return "-m " + argv[argv.index("-m") + 1]
    if "-c" in argv[:-1]:
        code = argv[argv.index("-c") + 1]
        return "-c " + ("flow run" if "flows.pretrain" in code else code.split("\n")[0][:40])
    return " ".join(argv[1:3])


# --- one flow run ----------------------------------------------------------------------------------------

def flow_params(preset: str, steps: int, nproc: int, model_name: str) -> dict:
    """The flow's parameters: `preset` with a few steps (a checkpoint, an evaluation and a sample at the last),
    its own run name (so a run_name is never the preset's string), model_name as given ('' = the preset)."""
    overrides = {"train.max_steps": steps, "train.run_name": "config-walk", "train.checkpoint_interval": steps,
                 "eval.eval_interval": steps, "eval.sample_interval": steps}
    return {"preset": preset, "overrides": overrides, "nproc": nproc, "model_name": model_name}


def git_commit(repo: Path) -> str:
    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def git_changes(repo: Path) -> list[str]:
    """Tracked files of `repo` that differ from its commit (and new ones): the figure is then not the
    commit's. A checkout others edit while it runs is measured best on a worktree of the commit."""
    r = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    return [line[3:] for line in r.stdout.splitlines() if line.endswith(".py")] if r.returncode == 0 else []


def walk_flow(repo: Path, params: dict, timeout: float, keep: Path | None = None) -> dict:
    """One flow run of `repo` with the hook on in every process; the summed counts and what the run did."""
    repo = repo.resolve()
    with tempfile.TemporaryDirectory(prefix="config-walk-") as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        out = work / "walk.jsonl"
        out.unlink(missing_ok=True)
        base = {k: v for k, v in os.environ.items()
                if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PYTHONPATH", "GPTPIPE_ALLOW_OUTSIDE_HOME")}
        base.update(GPTPIPE_HOME=str(work / "home"), PREFECT_HOME=str(work / "prefect"), OMP_NUM_THREADS="1",
                    MKL_NUM_THREADS="1",
                    # the ephemeral server's 20 s to start is short on a busy 2-core machine
                    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
        env = hook_env(out, repo, params["preset"], work / "hook", base)
        before = git_changes(repo)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(params)], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=timeout)
        seconds = time.monotonic() - t0
        result = [line for line in r.stdout.splitlines() if line.startswith("CONFIG_WALK_RESULT ")]
        if r.returncode != 0 or not result:
            raise SystemExit(f"error: the flow run failed (exit {r.returncode}); its output's end:\n"
                             f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        ran = json.loads(result[-1].split(" ", 1)[1])
        if ran["elsewhere"] or not os.path.realpath(ran["flow_file"]).startswith(str(repo) + os.sep):
            raise SystemExit(f"error: the flow run loaded the checkout's modules from elsewhere than {repo}: "
                             f"{[ran['flow_file'], *ran['elsewhere']]}")
        changes = sorted(set(before) | set(git_changes(repo)))  # before the run, or during it
        return {"repo": str(repo), "commit": git_commit(repo), "uncommitted_py": changes, "params": params,
                "seconds": round(seconds, 1),
                "stages": ran["stages"], "trained_to": ran["step"], **collect(out)}


def table(report: dict, top: int) -> str:
    commit = (report.get("commit") or "")[:7]
    at = f" ({commit})" if commit else ""
    if report.get("uncommitted_py"):
        at += f" + {len(report['uncommitted_py'])} uncommitted .py files (not the commit's figure)"
    lines = [f"config walk: preset {report['params']['preset']!r} through one flow run of {report['repo']}{at}, "
             f"{len(report['processes'])} processes reported, {report['seconds']:.0f} s",
             f"  stages: {', '.join(f'{k} {v}' for k, v in (report.get('stages') or {}).items())}",
             f"  steps {report['steps']}   returns {report['returns']}   in {report['distinct_functions']} "
             "functions   (issue 46's target: <= 40 returns)",
             f"  kinds: {', '.join(f'{k} {n}' for k, n in report['kinds'].items())}",
             f"  {'module':<44} {'entries':>7} {'returns':>7}"]
    lines += [f"  {m:<44} {s:>7} {r:>7}" for m, (s, r) in list(report["modules"].items())[:top]]
    lines.append(f"  {'function':<72} {'entries':>7}")
    lines += [f"  {f[:72]:<72} {s:>7}" for f, (s, _) in list(report["functions"].items())[:top]]
    lines.append(f"  {'process':<44} {'steps':>7} {'returns':>7}")
    lines += [f"  {p['what'][:44]:<44} {p['steps']:>7} {p['returns']:>7}" for p in report["processes"]]
    lines += [f"  {p['what'][:44]:<44} {'lost':>7}   (exec'd or killed: not counted)" for p in report["lost"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose flow runs (default: this one)")
    p.add_argument("--preset", default="micro")
    p.add_argument("--steps", type=int, default=4, help="train.max_steps of the run")
    p.add_argument("--nproc", type=int, default=1, help="trainer processes")
    p.add_argument("--model-name", default="", help="the flow's model_name ('' = the preset's name, its default)")
    p.add_argument("--out", type=Path, default=Path("var/config_walk.json"), help="the JSON report")
    p.add_argument("--top", type=int, default=12, help="rows of each table")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the flow run may take")
    p.add_argument("--keep", type=Path, help="run in this folder and keep it (home, hook, walk.jsonl)")
    args = p.parse_args(argv)
    if not (args.repo / "flows" / "pretrain.py").is_file():
        p.error(f"{args.repo} has no flows/pretrain.py")
    report = walk_flow(args.repo, flow_params(args.preset, args.steps, args.nproc, args.model_name), args.timeout,
                       args.keep)
    report = {"definition": "benchmarks/config_walk.py's docstring", "tool_commit": git_commit(REPO), **report}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report, args.top))
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
