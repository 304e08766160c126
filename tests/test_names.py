"""Names that cannot escape (issue #34): train.run_name and data.dataset_name become directories under
GPTPIPE_HOME and MLflow filter values, so a path in one is refused (exit 2, before anything is written); a
flow run's train.run_dir / data.dataset_dir must stay inside GPTPIPE_HOME unless the worker allows more."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptcore.config import ConfigError
from gptcore.overrides import from_dict, load_config
from gptcore.security import NAME_MAX, check_name

REPO = Path(__file__).resolve().parent.parent
RULE = "is not a usable name: use 1 to 100 letters, digits, '.', '_' and '-'"
# Absolute paths are probed under the test's own tmp dir (tests may run as root: never aim at /etc for real).
BAD = ["../x", "../../x", "{tmp}/etc", "a/b", "", "x" * 300, ".."]
CLIS = {"train.run_name": "gptcore.training.train", "data.dataset_name": "gptcore.data.build"}


def listing(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.mark.parametrize("key", CLIS)
@pytest.mark.parametrize("name", BAD, ids=["up", "up2", "abs", "slash", "empty", "long", "dotdot"])
def test_cli_refuses_a_name_that_is_a_path(tmp_path, key, name):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    name = name.format(tmp=tmp_path)
    inside, beside = listing(tmp_path), sorted(p.name for p in tmp_path.parent.iterdir())
    env = dict(os.environ, GPTPIPE_HOME=str(home), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", CLIS[key], "micro", f"{key}={name}"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{key} {name!r} {RULE}" in r.stderr, r.stderr[-2000:]
    assert "e.g. 'gpt2-124m-run1'" in r.stderr
    assert listing(tmp_path) == inside  # nothing under GPTPIPE_HOME, nor beside it
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == beside  # nor above it


def test_check_name_accepts_plain_names_and_refuses_paths():
    for good in ("e2e", "gpt2-124m", "run_1.5", "A", "x" * NAME_MAX):
        check_name("train.run_name", good)
    for bad in ("../x", "/etc", "a/b", "a\\b", "", ".", "..", "a..b", ".hidden", "-rf", "x" * (NAME_MAX + 1),
                "a b", "a'b", "run\n1", None):
        with pytest.raises(ConfigError, match="is not a usable name"):
            check_name("train.run_name", bad)


def test_config_validation_checks_both_names_and_keeps_the_defaults():
    cfg = load_config("micro", {"train.run_name": "gpt2-124m", "data.dataset_name": "run_1.5"})
    assert cfg.run_name == "gpt2-124m" and cfg.data.dataset_name == "run_1.5"
    assert load_config("micro").run_name == "micro"  # not given: "" = the preset's name, as before
    for key in ("train.run_name", "data.dataset_name"):
        for bad in ("../x", ""):  # given as "" is a mistake (e.g. an unset shell variable), not the default
            with pytest.raises(ConfigError, match=rf"^{key} '(\.\./x)?' is not a usable name"):
                load_config("micro", [f"{key}={bad}"])


def test_a_saved_config_with_default_names_still_loads(tmp_path):
    """A run's config.json holds "" for default names: as a config file or rebuilt, "" is the default."""
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(load_config("micro").to_dict()))
    assert load_config(str(saved)).run_name == "micro" and from_dict(load_config("micro").to_dict()).run_name == "micro"
    saved.write_text(json.dumps({"preset": "micro", "train": {"run_name": "../x"}}))
    with pytest.raises(ConfigError, match="train.run_name '../x' is not a usable name"):
        load_config(str(saved))


def test_flow_overrides_must_write_inside_home(tmp_path, monkeypatch):
    from flows.pretrain import check_config
    from integrations.write_dirs import ALLOW_OUTSIDE_HOME

    home, outside = tmp_path / "home", tmp_path / "elsewhere"
    (home / "runs").mkdir(parents=True), outside.mkdir()
    (home / "runs" / "link").symlink_to(outside)  # resolves outside: refused like the target itself
    monkeypatch.setenv("GPTPIPE_HOME", str(home))
    monkeypatch.delenv(ALLOW_OUTSIDE_HOME, raising=False)
    for key in ("train.run_dir", "data.dataset_dir"):
        for where in (outside, home, home / "runs" / ".." / ".." / "x", home / "runs" / "link" / "x"):
            with pytest.raises(ConfigError, match=rf"^{key}=.* is not a directory inside GPTPIPE_HOME"):
                check_config("micro", {key: str(where)}, 1)
            load_config("micro", {key: str(where)})  # the CLI does not check: a shell user owns the disk
        check_config("micro", {key: str(home / "runs" / "mine")}, 1)
    corpus = outside / "corpus"  # a read location: anywhere
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n")
    check_config("micro", {"data.source": str(corpus)}, 1)
    monkeypatch.setenv(ALLOW_OUTSIDE_HOME, "1")  # the worker's deployment allows another root
    cfg = check_config("micro", {"train.run_dir": str(outside / "run"), "data.dataset_dir": str(outside / "ds")}, 1)
    assert cfg.train.run_dir == str(outside / "run")
    assert sorted(p.name for p in outside.iterdir()) == ["corpus"]  # checking wrote nothing


def test_one_name_rule_for_models_and_experiments(tmp_path, monkeypatch, capsys):
    """The flow's model_name, `tasks.register --name` and an experiment name (`integrations.tracking
    --experiment`) follow check_name, as run and dataset names do: no '..', no path, at most NAME_MAX."""
    from flows.pretrain import check_params
    from integrations import tracking
    from tasks import register

    check_params(1, 0, "gpt2-124m")
    for bad in ("a..b", "x" * (NAME_MAX + 1), "../x", "a/b", "a'b"):
        with pytest.raises(ConfigError, match=rf"^model_name {bad!r} {RULE}"):
            check_params(1, 0, bad)
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    (tmp_path / "run").mkdir()
    for bad in ("a..b", "x" * (NAME_MAX + 1)):
        assert register.main([str(tmp_path / "ckpt"), "--name", bad]) == 2
        assert f"error: --name {bad!r} {RULE}" in capsys.readouterr().err
        assert tracking.main([str(tmp_path / "run"), "--experiment", bad]) == 2
        assert f"error: --experiment {bad!r} {RULE}" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()  # refused before any store was opened


def test_every_mlflow_filter_value_goes_through_quoted():
    """MLflow's filter grammar has no escape, so a value is put in a filter only by mlflow_store.quoted
    (which refuses quotes); a hand-written '{value}' literal in an f-string is how one slipped through."""
    import re

    hand_quoted = re.compile(r"""\s(=|!=|LIKE|ILIKE)\s*'\{[A-Za-z_]""", re.IGNORECASE)  # e.g. name = '{name}'
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
             for top in ("tasks", "integrations", "flows", "gptcore", "devstack") for p in (REPO / top).rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if hand_quoted.search(line)]
    assert not found, found


def test_flow_write_dirs_are_never_the_servers_state_nor_another_runs(tmp_path, monkeypatch):
    """<home>/services (the TLS key, the MLflow auth config), the MLflow store and its auth folder, Prefect's
    home and another run's directory are refused as train.run_dir / data.dataset_dir, even on a worker that
    allows directories outside GPTPIPE_HOME; the run's own directory stays allowed."""
    from flows.pretrain import check_config
    from integrations.write_dirs import ALLOW_OUTSIDE_HOME

    home, auth = tmp_path / "home", tmp_path / "mlflow-auth"
    runs = home / "runs"
    for d in (home / "services" / "tls", home / "mlflow" / "auth", home / "prefect", runs / "victim", runs / "micro",
              auth):
        d.mkdir(parents=True)
    (runs / "victim" / "run.json").write_text(json.dumps({"run_name": "victim"}))
    (runs / "micro" / "run.json").write_text(json.dumps({"run_name": "micro"}))
    (home / "services" / "link").symlink_to(runs / "victim")  # resolved: still the victim's directory
    monkeypatch.setenv("GPTPIPE_HOME", str(home))
    monkeypatch.setenv("MLFLOW_AUTH_DIR", str(auth))
    before = listing(tmp_path)
    for allow in ("", "1"):
        monkeypatch.setenv(ALLOW_OUTSIDE_HOME, allow)
        for key in ("train.run_dir", "data.dataset_dir"):
            for where, why in ((home / "services", "the servers' own state"),
                               (home / "services" / "tls", "the servers' own state"),
                               (home / "mlflow" / "auth", "the servers' own state"),
                               (home / "mlflow", "the servers' own state"),
                               (home / "prefect" / "x", "the servers' own state"),
                               (runs, "holds every run's directory"),
                               (runs / "victim", "the directory of run 'victim'"),
                               (home / "services" / "link", "the directory of run 'victim'"),
                               (runs / "micro" / "checkpoints", "the directory of run 'micro'")):
                with pytest.raises(ConfigError, match=rf"^{key}=.* resolves to .*{why}.*must not write there"):
                    check_config("micro", {key: str(where)}, 1)
        for key in ("train.run_dir", "data.dataset_dir"):  # MLflow's auth folder, outside the home
            with pytest.raises(ConfigError, match="the servers' own state" if allow else "not a directory inside"):
                check_config("micro", {key: str(auth / "x")}, 1)
        with pytest.raises(ConfigError, match="the directory of run 'micro'"):  # a run dir is no dataset dir
            check_config("micro", {"data.dataset_dir": str(runs / "micro")}, 1)
        check_config("micro", {"train.run_dir": str(runs / "micro")}, 1)  # its own directory
        check_config("micro", {"train.run_dir": str(runs / "new"), "data.dataset_dir": str(home / "shards" / "x")}, 1)
    assert listing(tmp_path) == before  # checking wrote nothing
