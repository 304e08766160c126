"""The security checks on what a setting or a flow parameter may name: anyone who can start a flow run
chooses its parameters, so a name must stay a name and a folder that code is loaded from must lie where the
operator allows. (Where a flow run may write is the flow's policy: integrations/write_dirs.py.)

    check_name("train.run_name", "gpt2-124m-run1")         one plain directory name, never a path
    check_code_path("eval.harness.include_path", folder)    inside the operator's GPTPIPE_CODE_ROOTS
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix. (Imported from gptcore.config
    everywhere else: it lives here because gptcore.config's checks use these.)"""


NAME_KEYS = ("train.run_name", "data.dataset_name")  # directories: <home>/runs/<name>, <home>/shards/<name>
NAME_MAX = 100  # characters: a directory name, an MLflow tag value and a Prefect limit name with room to spare
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}")


def check_name(key: str, value) -> None:
    """The one rule for every name that becomes a path, an MLflow name or a filter value (run, dataset,
    registered model, experiment): such names are joined into paths and MLflow filter strings, and a flow
    run's parameters come from anyone who can start one, so each must be one plain directory name, never a
    path (no '/', no '..'), at most NAME_MAX characters."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{key} {value!r} is not a usable name: use 1 to {NAME_MAX} letters, digits, '.', '_' "
                          "and '-', starting with a letter or digit, with no '/' and no '..' (e.g. "
                          "'gpt2-124m-run1')")


# Where code may come from. A harness task YAML runs Python (`process_docs: !function evil.f` imports
# evil.py beside it when the task loads), so the folders such settings name must lie under a root the
# operator sets in the evaluating process's environment (the worker's), never one a flow parameter sets.
# eval.harness.include_path is the one such setting today (the rest name data: sources, HellaSwag's jsonl)
CODE_ROOTS = "GPTPIPE_CODE_ROOTS"  # absolute folders, os.pathsep-separated; unset = no such setting allowed


def code_roots() -> list[Path]:
    """The operator's allowed code roots (symlinks resolved); ConfigError for a relative entry."""
    roots = []
    for entry in os.environ.get(CODE_ROOTS, "").split(os.pathsep):
        if not entry.strip():
            continue
        if not Path(entry).expanduser().is_absolute():
            raise ConfigError(f"{CODE_ROOTS} entry {entry!r} is not an absolute path; list absolute folders, "
                              f"separated by {os.pathsep!r}")
        roots.append(Path(entry).expanduser().resolve())
    return roots


def check_code_path(key: str, value: str) -> None:
    """A setting whose folder a library runs code from must resolve, symlinks followed, inside
    one of the operator's CODE_ROOTS; "" (not set) is always fine."""
    if not value:
        return
    where, roots = Path(value).expanduser().resolve(), code_roots()
    if any(where.is_relative_to(root) for root in roots):
        return
    allowed = os.pathsep.join(map(str, roots)) if roots else "unset"
    raise ConfigError(f"{key}={value!r} (resolved: {where}) is outside the folders allowed to hold task code "
                      f"({CODE_ROOTS}: {allowed}). A harness task YAML can run Python (`!function`), so it is "
                      f"loaded only from there. Fix: put the task folder under an allowed root, or have the "
                      f"operator add its folder to {CODE_ROOTS} in the environment of the process that evaluates "
                      f"(the worker's for flow runs; it cannot be a flow parameter)")
