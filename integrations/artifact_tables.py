"""A nested dict as a Prefect table artifact whose cells read plainly, and back.

Prefect's UI shows a string cell as markdown and any other cell as JSON, so a value stored as JSON text
shows its quotes ("tiny-cpu" for tiny-cpu) and a dict shows as a JSON object. Here every leaf is its own
row, keyed by its path, with its value as it is (Prefect stores the table as JSON, so numbers, booleans and
None come back as they went in):

    {"step": 120, "stages": {"train": "ran"}, "lines": ["a", "b"]}
    -> step | 120,  stages.train | ran,  lines[0] | a,  lines[1] | b

`from_rows` rebuilds the dict exactly. A dict whose keys cannot be written in a path (a key with ".", "["
or "]", or not a string) and an empty dict or list stay whole in one cell, so nothing is lost.
"""

from __future__ import annotations

import re
from typing import Any

SEGMENT = re.compile(r"\[(\d+)\]|\.?([^.\[\]]+)")  # [3]: a list index; key or .key: a dict key


def _plain_key(key: Any) -> bool:
    return isinstance(key, str) and bool(key) and not re.search(r"[.\[\]]", key)


def _leaves(value: Any, path: str):
    if isinstance(value, dict) and value and all(_plain_key(k) for k in value):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def to_rows(data: dict) -> list[dict]:
    """One row {"key": path, "value": leaf} per leaf of `data`, in order (its top-level keys must be plain)."""
    bad = [k for k in data if not _plain_key(k)]
    if bad:
        raise ValueError(f"top-level keys {bad} cannot be written as a path")
    return [{"key": path, "value": v} for k, value in data.items() for path, v in _leaves(value, k)]


def from_rows(rows: list[dict]) -> dict:
    """The dict `to_rows` was given, from its rows as read back from Prefect."""
    out: dict = {}
    for row in rows:
        path = [int(i) if i else k for i, k in SEGMENT.findall(row["key"])]
        node: Any = out
        for seg, nxt in zip(path, path[1:], strict=False):  # each parent: a list when what follows is an index
            node = _child(node, seg, [] if isinstance(nxt, int) else {})
        _child(node, path[-1], row["value"])
    return out


def _child(node: dict | list, seg: str | int, new: Any) -> Any:
    """node[seg], set to `new` first when it is not there yet (rows come in order: a list's next index is
    always its length)."""
    if isinstance(node, list):
        if seg == len(node):
            node.append(new)
    else:
        node.setdefault(seg, new)
    return node[seg]
