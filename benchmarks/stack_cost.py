"""What a devstack Stack (Prefect server + worker + MLflow server, as `make demo` and the tests start it)
costs this machine: CPU seconds of its processes from start to `--idle` seconds after it is healthy, the
CPU it then spends per minute idling, its number of processes and their memory (USS). Rounds alternate
MLflow's GenAI job runner off (docker/start-mlflow.sh's default) and on, so the two are compared on the
same machine in the same run.

    python -m benchmarks.stack_cost [--rounds 2] [--idle 45]

Session 37 (docs/testing.md): 21-26 s of CPU, 4 processes, 760 MiB with the runner off; 44-49 s, 12
processes, 2,227 MiB with it on; ~3 s of CPU a minute idle (the Prefect server's services).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from devstack.services import Stack


def stack_processes(home: str) -> list[psutil.Process]:
    """The processes started for the stack in `home` (its path is in their command line or environment)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if home in " ".join(p.info["cmdline"] or []) or home in " ".join(p.environ().values()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def cpu_and_memory(procs: list[psutil.Process]) -> tuple[float, float]:
    cpu = uss = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            cpu, uss = cpu + t.user + t.system, uss + p.memory_full_info().uss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return cpu, uss / 2**20


def measure(job_runner: bool, idle: float) -> dict:
    os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = str(job_runner).lower()  # start-mlflow.sh reads it
    with tempfile.TemporaryDirectory(prefix="stack-cost-") as home:
        stack = Stack(Path(home), prefect_port=0, mlflow_port=0, ui=False, extra_env={"OMP_NUM_THREADS": "1"})
        t0 = time.monotonic()
        stack.up()
        try:
            up_s = time.monotonic() - t0
            time.sleep(idle)
            procs = stack_processes(home)
            cpu, uss = cpu_and_memory(procs)
            time.sleep(60)
            idle_cpu = cpu_and_memory(procs)[0] - cpu
        finally:
            stack.down()
    return {"up_s": up_s, "cpu_s": cpu, "processes": len(procs), "uss_mib": uss, "idle_cpu_per_min": idle_cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--idle", type=float, default=45.0, help="seconds after healthy before the CPU is read")
    args = p.parse_args(argv)
    results: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for runner in (False, True):
            r = measure(runner, args.idle)
            results[runner].append(r)
            print(f"job runner {'on ' if runner else 'off'}: up {r['up_s']:.1f} s, CPU {r['cpu_s']:.1f} s, "
                  f"{r['processes']} processes, {r['uss_mib']:.0f} MiB USS, idle {r['idle_cpu_per_min']:.1f} "
                  "s CPU/min", flush=True)
    off, on = (statistics.median(x["cpu_s"] for x in results[k]) for k in (False, True))
    mem_off, mem_on = (statistics.median(x["uss_mib"] for x in results[k]) for k in (False, True))
    print(f"start-up CPU off/on {off / on:.2f}x ({off:.1f} vs {on:.1f} s), memory off/on {mem_off / mem_on:.2f}x "
          f"({mem_off:.0f} vs {mem_on:.0f} MiB), medians of {args.rounds} alternated rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
