"""The Prefect stages against a real `prefect server` on 127.0.0.1: the tokenize flow maps one
`tokenize-piece` task per piece on a process pool, produces the same bytes as the plain CLI, and a
second run skips."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.mlflow_server import free_port

ROOT = Path(__file__).resolve().parents[1]
OV = ["data.shard_tokens=20000", "data.max_docs=8", "data.piece_bytes=150000", "data.num_workers=2"]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{api}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError((home / "server.log").read_text()[-2000:]) from None
                time.sleep(0.5)
        else:
            raise RuntimeError("prefect server did not start in 120 s")
        yield api, home
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)


def test_tokenize_flow_maps_pieces_and_matches_cli(prefect_api, tmp_path):
    api, phome = prefect_api
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(phome), "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GPTPIPE_HOME": str(tmp_path / "flow")}
    code = ("import sys; from gptcore.overrides import load_config; from flows.dataset import tokenize_dataset;"
            "from tasks.download import download_task; from prefect import flow\n"
            "@flow\ndef pipe(ov):\n    cfg = load_config('micro', ov)\n    download_task(cfg)\n"
            "    return tokenize_dataset(cfg)\n"
            f"print('DATASET', pipe({OV!r}))")
    r = _run(code, env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = Path(r.stdout.split("DATASET ")[1].strip())
    assert out == tmp_path / "flow" / "shards" / "shakespeare-8docs-20K"

    ref_env = {**env, "GPTPIPE_HOME": str(tmp_path / "cli")}
    ref = subprocess.run([sys.executable, "-m", "gptcore.data.build", "micro", *OV], cwd=ROOT, env=ref_env,
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    ref_dir = tmp_path / "cli" / "shards" / out.name
    names = sorted(p.name for p in ref_dir.glob("*.bin"))
    assert names and names == sorted(p.name for p in out.glob("*.bin"))
    assert all((out / n).read_bytes() == (ref_dir / n).read_bytes() for n in names)
    assert (out / "manifest.json").read_bytes() == (ref_dir / "manifest.json").read_bytes()

    req = urllib.request.Request(f"{api}/task_runs/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    runs = json.loads(urllib.request.urlopen(req, timeout=10).read())
    pieces = [t for t in runs if t["name"].startswith("tokenize-piece")]
    assert len(pieces) == 4 and all(t["state_type"] == "COMPLETED" for t in pieces)
    # the data stage's progress artifact counted every piece
    body = json.dumps({"artifacts": {"key": {"any_": ["shakespeare-8docs-20k-tokenize"]}}}).encode()
    req_art = urllib.request.Request(f"{api}/artifacts/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    arts = json.loads(urllib.request.urlopen(req_art, timeout=10).read())
    assert len(arts) == 1 and arts[0]["type"] == "progress" and arts[0]["data"] == 100, arts
    assert arts[0]["description"].startswith("4 / 4 pieces tokenized"), arts[0]["description"]

    # second run: complete and verified -> returns at once, no new task runs
    t0 = time.perf_counter()
    r2 = _run(code, env)
    assert r2.returncode == 0, r2.stderr[-3000:]
    runs2 = json.loads(urllib.request.urlopen(req, timeout=10).read())
    assert len([t for t in runs2 if t["name"].startswith("tokenize-piece")]) == 4
    assert time.perf_counter() - t0 < 60


DASK_OV = ["data.shard_tokens=50000", "data.piece_bytes=60000", "data.num_workers=2"]  # ~60 pieces, whole corpus
DASK_FLOW = (
    "import sys; from gptcore.overrides import load_config; from flows.dataset import tokenize_dataset\n"
    "from prefect_dask import DaskTaskRunner\n"
    "runner = DaskTaskRunner(cluster_class='distributed.LocalCluster',\n"
    "                        cluster_kwargs={'n_workers': 2, 'threads_per_worker': 1, 'processes': True,\n"
    "                                        'dashboard_address': None})\n"
    "print('DATASET', tokenize_dataset(load_config('micro', sys.argv[1:]), task_runner=runner))\n")


def _dask_env(api, phome, home):
    return {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(phome), "OMP_NUM_THREADS": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GPTPIPE_HOME": str(home)}


def _same_dataset(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("*.bin"))
    assert names and names == sorted(p.name for p in b.glob("*.bin"))
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory):
    home = tmp_path_factory.mktemp("cli")
    r = subprocess.run([sys.executable, "-m", "gptcore.data.build", "micro", *DASK_OV], cwd=ROOT,
                       env={**os.environ, "GPTPIPE_HOME": str(home), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return next((home / "shards").iterdir())


def test_tokenize_flow_on_a_dask_cluster_matches_the_process_pool(prefect_api, cli_reference, tmp_path):
    """prefect-dask's DaskTaskRunner on a real distributed.LocalCluster of 2 worker processes."""
    api, phome = prefect_api
    r = subprocess.run([sys.executable, "-c", DASK_FLOW, *DASK_OV], cwd=ROOT,
                       env=_dask_env(api, phome, tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _same_dataset(Path(r.stdout.split("DATASET ")[1].strip()), cli_reference)


def _worker_pids(pid: int) -> list[int]:
    """The Dask worker processes under the flow's process (multiprocessing children of its nannies)."""
    from tests.test_train_utils import descendants

    out = []
    for p in descendants(pid):
        try:
            cmd = " ".join(psutil.Process(p).cmdline())
        except psutil.Error:
            continue
        if "multiprocessing" in cmd and "resource_tracker" not in cmd:
            out.append(p)
    return out


def test_a_dask_worker_killed_mid_piece_changes_nothing(prefect_api, cli_reference, tmp_path):
    api, phome = prefect_api
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, "-c", DASK_FLOW, *DASK_OV], cwd=ROOT, env=_dask_env(api, phome, home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        records = list(home.glob("shards/*/.pieces/piece_*.json"))
        workers = _worker_pids(proc.pid)
        if records and workers:  # tokenizing has started: kill one worker in the middle of its pieces
            killed = workers[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    assert killed is not None, "no worker to kill (the run finished too fast)"
    assert proc.returncode == 0, err[-3000:]
    _same_dataset(Path(out.split("DATASET ")[1].strip()), cli_reference)
