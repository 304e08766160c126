"""Process trees, and stopping them: shared by the trainer launcher (tasks/train.py) and the demo's
services (devstack/services.py). psutil reads the process table (on every OS it supports).

A process is named by (pid, start time): a pid is only signalled while its recorded start time still
matches, so a recycled pid is never hit. A zombie counts as gone (it stays in the process table until its
parent reaps it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psutil


def _started(p: psutil.Process) -> float | None:
    """The start time of a live process (seconds since the epoch, as psutil reads it), else None."""
    try:
        return None if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def start_time(pid: int) -> float | None:
    """The start time of live process `pid`, else None."""
    try:
        return _started(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return None


def tree_of(pid: int) -> dict[int, float]:
    """`pid` and every process below it that is alive now (pid -> start time). torchrun starts each trainer
    in its own session, so signalling a process group alone would miss them."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    return {p.pid: t for p in procs if (t := _started(p)) is not None}


def alive(tree: dict[int, float]) -> list[int]:
    return [pid for pid, started in tree.items() if start_time(pid) == started]


def _signal(group: int, tree: dict[int, float], sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in alive(tree):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(tree: dict[int, float], seconds: float, poll: Callable[[], object]) -> bool:
    end = time.monotonic() + seconds
    while alive(tree):
        if time.monotonic() > end:
            return False
        poll()
        time.sleep(0.1)
    return True


def stop_tree(group: int, tree: dict[int, float], grace: float, poll: Callable[[], object] = lambda: None) -> bool:
    """SIGTERM the process group `group` and the processes of `tree` (which may have left the group);
    SIGKILL what is left after `grace` seconds, and the group's stragglers in any case. `poll` runs while
    waiting (e.g. Popen.poll, so an exited child is reaped). False if SIGTERM was not enough."""
    _signal(group, tree, signal.SIGTERM)
    gentle = _wait(tree, grace, poll)
    if not gentle:
        _signal(group, tree, signal.SIGKILL)
        _wait(tree, 5.0, poll)
    _signal(group, {}, signal.SIGKILL)  # whatever is left in the group
    return gentle
