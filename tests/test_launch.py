"""The torchrun command parses on every torch pyproject allows (>= 2.11): with the installed torchrun's own
parser, and with torch 2.11's argument list (tests/fixtures/torchrun-2.11.0.json, read from the 2.11
wheel by tests/torchrun_options.py). torch 2.11's torchrun has no --shutdown-timeout and exits 2 on it:
that broke every launch on the first GPU (issue 43)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from torch.distributed import run as torchrun

from gptcore import launch
from tests.test_docker import DOCKER, clean_env, run
from tests.torchrun_options import options_from_source, parser_from

FIXTURE = Path(__file__).parent / "fixtures" / "torchrun-2.11.0.json"


def torch_211_parser():
    return parser_from(json.loads(FIXTURE.read_text())["options"])


@pytest.fixture
def torch_211(monkeypatch):
    """The installed torch answers as torch 2.11's torchrun would (its argument list, not its code)."""
    monkeypatch.setattr(torchrun, "get_args_parser", torch_211_parser)
    launch.accepts.cache_clear()
    yield
    launch.accepts.cache_clear()


def launcher_args(cmd: list[str]) -> list[str]:
    """What torchrun itself parses: everything after `python -m torch.distributed.run`."""
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    return cmd[3:]


def test_the_command_parses_with_the_installed_torchrun():
    cmd = launch.torchrun_cmd("micro", {"train.max_steps": 5}, nproc=2, max_restarts=1)
    args = torchrun.get_args_parser().parse_args(launcher_args(cmd))
    assert args.nproc_per_node == "2" and args.max_restarts == 1 and args.module
    assert args.training_script == "gptcore.training.train"
    assert args.training_script_args == ["micro", "train.max_steps=5"]
    assert args.shutdown_timeout == launch.SHUTDOWN_SECONDS  # the pinned torch has the flag: it is passed


def test_the_command_parses_with_torch_211s_torchrun(torch_211, capsys):
    cmd = launch.torchrun_cmd("gpt2-124m", {"train.max_steps": 5}, nproc=8, max_restarts=1)
    args = torch_211_parser().parse_args(launcher_args(cmd))
    assert args.training_script == "gptcore.training.train" and args.training_script_args[0] == "gpt2-124m"
    assert not any(a.startswith("--shutdown-timeout") for a in cmd)
    assert "fixed 30 s" in capsys.readouterr().err  # says what a stop then waits for


def test_torch_211s_torchrun_rejects_the_old_command():
    """The fixture is the real constraint: the command the launcher used to build fails to parse with it."""
    old = ["--standalone", "--nproc_per_node=8", "--max-restarts=1", "--shutdown-timeout=300", "-m",
           "gptcore.training.train", "gpt2-124m"]
    with pytest.raises(SystemExit):
        torch_211_parser().parse_args(old)
    torch_211_parser().parse_args([a for a in old if not a.startswith("--shutdown")])


def test_the_fixture_reader_agrees_with_the_installed_torchrun():
    """The same source reader on the installed run.py finds what its real parser accepts, so the 2.11
    fixture is read the way torchrun reads its own arguments."""
    source = Path(torchrun.__file__).read_text()
    mine = parser_from(options_from_source(source))
    cmd = launcher_args(launch.torchrun_cmd("micro", {"train.max_steps": 5}, nproc=2, max_restarts=1))
    assert vars(mine.parse_args(cmd))["shutdown_timeout"] == str(launch.SHUTDOWN_SECONDS)
    flags = {f for o in options_from_source(source) for f in o["flags"]}
    for flag in ("--standalone", "--nproc-per-node", "--max-restarts", "--shutdown-timeout", "-m"):
        assert flag in flags
        assert launch.accepts(flag)
    assert not launch.accepts("--no-such-flag")


def test_multinode_script_leaves_the_flag_out_where_torchrun_lacks_it(tmp_path):
    """docker/torchrun-multinode.sh asks `python -m gptcore.launch accepts`: exit 3 means the flag is
    missing (a stand-in python answers as torch 2.11's would)."""
    shim = tmp_path / "python"
    shim.write_text('#!/bin/sh\n[ "$1 $2 $3" = "-m gptcore.launch accepts" ] && exit 3\nexit 0\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    r = run([str(DOCKER / "torchrun-multinode.sh"), "-m", "gptcore.training.train", "micro"],
            env=clean_env(DRY_RUN="1", PYTHON=str(shim)))
    assert r.returncode == 0, r.stderr
    assert "--shutdown-timeout" not in r.stdout and "--max-restarts=0" in r.stdout
    assert "no --shutdown-timeout" in r.stderr


def test_launch_cli_answers_for_the_installed_torchrun():
    assert launch.main(["accepts", "--shutdown-timeout"]) == 0
    assert launch.main(["accepts", "--no-such-flag"]) == 3
    assert launch.main(["accepts"]) == 2
