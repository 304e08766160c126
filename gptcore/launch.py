"""The torchrun command that runs the trainer, in one place: the Prefect train stage (tasks/train.py) and
the GPU acceptance check (benchmarks/gpu_check.py) both launch it, and the check must run on a bare CUDA
image without Prefect or MLflow, so it lives here, beside the trainer.

    torchrun_cmd("gpt2-124m", {"train.max_steps": 100}, nproc=8, max_restarts=1)
"""

from __future__ import annotations

import sys

from gptcore.config import flatten

# SIGTERM -> SIGKILL, for torchrun's workers: time for a 124M stop checkpoint (1.5 GB with optimizer state)
# even on slow shared storage; torchrun's own default of 30 s is not (measured: docs/training.md).
SHUTDOWN_SECONDS = 300


def override_args(overrides: dict | None) -> list[str]:
    """{"train.max_steps": 50, "model": {"n_layer": 2}} -> ["train.max_steps=50", "model.n_layer=2"]."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flatten(overrides or {}).items()]


def torchrun_cmd(preset: str, overrides: dict | None, nproc: int, max_restarts: int = 0,
                 shutdown_seconds: float = SHUTDOWN_SECONDS) -> list[str]:
    """`python -m torch.distributed.run --standalone ... -m gptcore.train <preset> <overrides>`. With
    max_restarts > 0 torchrun restarts every rank when one exits non-zero (the hang watchdog's exit, a
    crash), and the trainer continues from its newest checkpoint; a run that ends with a known verdict
    (bad input 2, diverged 3, replicas disagreeing 4) gains nothing from a restart but costs one start-up.
    `shutdown_seconds`: how long torchrun waits after SIGTERM before SIGKILL (a stopped or hung rank never
    exits on SIGTERM: a restart after a hang waits this long for it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", f"--shutdown-timeout={shutdown_seconds:g}",
            "-m", "gptcore.train", preset, *override_args(overrides)]
