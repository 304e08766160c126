"""Helpers shared by the training tests (no tests here): build a small dataset with the real shard
writer, launch the trainer as a real process (plain python or torchrun), read its metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gptcore import launch
from gptcore.checkpoints.checkpoint import load_model
from gptcore.checkpoints.run_files import step_dir
from gptcore.data.shard_format import Manifest, ShardInfo, write_shard
from gptcore.metrics import read_metrics
from integrations.processes import tree_of

REPO = Path(__file__).resolve().parents[1]


def make_dataset(directory: Path, sizes=(4000, 6000, 5000, 7000), seed: int = 0,
                 tokenizer: str = "gpt2") -> Path:
    """A val shard plus train shards of learnable tokens (a short repeating pattern with noise)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    infos = []
    for i, n in enumerate(sizes):
        split = "val" if i == 0 else "train"
        base = np.repeat(rng.integers(0, 300, n // 4 + 1), 4)[:n]
        noise = rng.random(n) < 0.1
        toks = np.where(noise, rng.integers(0, 50257, n), base)
        name = f"test_{split}_{i:06d}.bin"
        infos.append(ShardInfo(name, split, n, write_shard(directory / name, toks)))
    m = Manifest(tokenizer=tokenizer, shard_tokens=max(sizes), source={"test": seed}, shards=infos)
    m.save(directory)
    return directory


def env(home: Path | None = None) -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if home is not None:
        e["GPTPIPE_HOME"] = str(home)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "gptcore.training.train", *args]


def torchrun_cmd(args: list[str], nproc: int = 2) -> list[str]:
    """The command the train task runs (gptcore.launch), for a preset and `key=value` overrides as a list."""
    return launch.torchrun_cmd(args[0], None, nproc) + list(args[1:])


def run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], cwd: Path, log: Path, **extra_env: str) -> subprocess.Popen:
    """Start in its own session so the whole tree (torchrun agent + workers) can be signalled."""
    return subprocess.Popen(cmd, cwd=cwd, env={**env(), **extra_env}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout: float = 120) -> int:
    """Poll metrics.jsonl until a train row with step >= `step` appears; returns that step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = read_metrics(metrics, "train")
        if rows and rows[-1]["step"] >= step:
            return rows[-1]["step"]
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} before step {step}")
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout}s")


def wait_for_text(log: Path, text: str, count: int = 1, timeout: float = 120) -> None:
    """Poll a log file until `text` appears in it `count` times."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.is_file() and log.read_text().count(text) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not seen {count}x in {log} within {timeout}s:\n{log.read_text()[-3000:]}")


def descendants(pid: int) -> list[int]:
    """Child processes, recursively (torchrun starts its workers in new sessions, so a process-group
    signal does not reach them): integrations.processes, psutil's tree without `pid` itself."""
    return [p for p in tree_of(pid) if p != pid]


def kill_tree(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    """Signal the launcher and all its descendants at once (SIGKILL: a machine-crash stand-in)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def losses(metrics: Path) -> dict[int, float]:
    """train/loss per step; a step repeated after a resume keeps its latest value."""
    return {r["step"]: r["train/loss"] for r in read_metrics(metrics, "train")}


def final_weights(run: Path, step: int) -> dict:
    """The weights (state dict) of a run's checkpoint at `step`, which must say it is that step's."""
    model, meta = load_model(step_dir(run, step))
    assert meta["step"] == step
    return model.state_dict()


def rank_exit_codes(out: str) -> dict[str, str]:
    """Each failed rank's own exit code, from torchrun's failure report (torchrun itself exits 1)."""
    return dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", out))
