"""Process trees from /proc, and stopping them: shared by the trainer launcher (tasks/train.py) and the
demo's services (flows/services.py).

A process is named by (pid, start time): a pid is only signalled while its recorded start time still
matches, so a recycled pid is never hit. A zombie counts as gone (it keeps its /proc entry until its
parent reaps it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """The kernel's start time of a live process (field 22 of /proc/<pid>/stat), else None."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else fields[19]


def tree_of(pid: int) -> dict[int, str]:
    """`pid` and every process below it that is alive now (pid -> start time). torchrun starts each trainer
    in its own session, so signalling a process group alone would miss them."""
    parent_of = {}
    for d in Path("/proc").iterdir():
        fields = _stat(d.name) if d.name.isdigit() else None
        if fields is not None and fields[0] not in ("Z", "X"):
            parent_of[int(d.name)] = (int(fields[1]), fields[19])
    found = {pid: parent_of[pid][1]} if pid in parent_of else {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, started) in parent_of.items():
            if ppid == parent and child not in found:
                found[child] = started
                todo.append(child)
    return found


def alive(tree: dict[int, str]) -> list[int]:
    return [pid for pid, started in tree.items() if start_time(pid) == started]


def _signal(group: int, tree: dict[int, str], sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in alive(tree):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(tree: dict[int, str], seconds: float, poll: Callable[[], object]) -> bool:
    end = time.monotonic() + seconds
    while alive(tree):
        if time.monotonic() > end:
            return False
        poll()
        time.sleep(0.1)
    return True


def stop_tree(group: int, tree: dict[int, str], grace: float, poll: Callable[[], object] = lambda: None) -> bool:
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
