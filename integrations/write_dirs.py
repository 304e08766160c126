"""Where a flow run may write: the directories its overrides name (train.run_dir, data.dataset_dir).

Anyone who can start a flow run chooses its overrides, so those directories must resolve (symlinks
followed) inside GPTPIPE_HOME, unless the worker is set up with GPTPIPE_ALLOW_OUTSIDE_HOME=1 (e.g. run
dirs on a shared filesystem elsewhere); and never, whatever the worker allows, onto the servers' own state
or another run's directory. The checks on names and code folders are gptcore/security.py's.

    check_write_dirs(cfg)   ConfigError naming the setting, where it resolves and the fix
"""

from __future__ import annotations

import os
from pathlib import Path

from gptcore.checkpoints.run_files import RUN_FILE
from gptcore.config import ConfigError, RunConfig
from gptcore.files import pipeline_home, read_json

ALLOW_OUTSIDE_HOME = "GPTPIPE_ALLOW_OUTSIDE_HOME"  # =1 in the worker's environment: write dirs may be anywhere
WRITE_DIRS = ("train.run_dir", "data.dataset_dir")  # the overrides that name a directory the flow run writes


def check_write_dirs(cfg: RunConfig) -> None:
    """Anyone who can start a flow run chooses its overrides, so the directories it writes must resolve
    (symlinks followed) inside GPTPIPE_HOME, unless the worker is set up with GPTPIPE_ALLOW_OUTSIDE_HOME=1
    (e.g. run dirs on a shared filesystem elsewhere); and never, whatever the worker allows, onto the
    servers' own state or another run's directory (check_not_protected). Not checked on the CLI: a shell
    user owns the disk."""
    home = pipeline_home()
    for key in WRITE_DIRS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if not value:
            continue
        where = Path(value).expanduser().resolve()
        if os.environ.get(ALLOW_OUTSIDE_HOME) != "1" and (where == home or not where.is_relative_to(home)):
            raise ConfigError(f"{key}={value!r} is not a directory inside GPTPIPE_HOME ({home}): a flow run writes "
                              f"only under it; leave {key} unset for the default there, or set "
                              f"{ALLOW_OUTSIDE_HOME}=1 in the worker's environment to allow other directories")
        check_not_protected(key, value, where, cfg, home)


def server_dirs(home: Path) -> list[Path]:
    """The servers' own state, never a flow run's to write: devstack's services/ (the TLS key, the MLflow
    auth config), the embedded MLflow store with its user database (mlflow/auth/), Prefect's home, and the
    MLflow auth folder wherever MLFLOW_AUTH_DIR puts it."""
    dirs = [home / "services", home / "mlflow", home / "prefect"]
    if os.environ.get("MLFLOW_AUTH_DIR"):
        dirs.append(Path(os.environ["MLFLOW_AUTH_DIR"]).expanduser().resolve())
    return dirs


def owning_run(where: Path) -> tuple[Path, str] | None:
    """The run directory `where` is or lies in (the nearest one holding run.json), with its run name."""
    for d in (where, *where.parents):
        if (d / RUN_FILE).is_file():
            return d, str(read_json(d / RUN_FILE, {}).get("run_name"))
    return None


def check_not_protected(key: str, value: str, where: Path, cfg: RunConfig, home: Path) -> None:
    """ConfigError when a write directory is, holds or lies in a server's state folder, holds the runs'
    folder, or is (or lies in) a run directory that is not this run's own: run.json names its run."""
    def refuse(what: str):
        raise ConfigError(f"{key}={value!r} resolves to {where}, {what}: a flow run must not write there; "
                          f"leave {key} unset for the default, or name a directory of its own")

    for d in server_dirs(home):
        if where == d or where.is_relative_to(d) or d.is_relative_to(where):
            refuse(f"which is or holds the servers' own state ({d})")
    if (home / "runs").is_relative_to(where):
        refuse(f"which holds every run's directory ({home / 'runs'})")
    owner = owning_run(where)
    if owner and not (key == "train.run_dir" and owner == (where, cfg.run_name)):
        refuse(f"which is or lies in the directory of run {owner[1]!r} ({owner[0]})")
