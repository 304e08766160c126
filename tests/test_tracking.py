"""Metric shipping (integrations/tracking.py) against a real `mlflow server` with a SQLite backend."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gptcore.metrics import read_metrics
from gptcore.overrides import load_config
from integrations import mlflow_store as store
from integrations import tracking
from tests.mlflow_server import free_port
from tests.test_train_utils import kill_tree, make_dataset, python_cmd, start

REPO = Path(__file__).resolve().parent.parent
T0 = 1_760_000_000.0


@pytest.fixture(autouse=True)
def fast_failures(monkeypatch):
    # MLflow's HTTP client retries a refused connection for minutes by default; the shipper has its own
    # retry loop, so tests let a dead server surface at once.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def ship(run_dir, uri=None, flow_run_id=None) -> dict:
    """Ship once, as `python -m integrations.tracking <run_dir>` does."""
    s = tracking.Shipper(run_dir, uri, flow_run_id=flow_run_id)
    s.ship_once(final=True)
    return {"run_id": s.run_id, "shipped": s.shipped}


def make_run_dir(root: Path, run_name: str, manifest_id: str = "manifest-abc") -> Path:
    cfg = load_config("micro", [f"train.run_name={run_name}"])
    rd = root / "runs" / run_name
    rd.mkdir(parents=True)
    (rd / "config.json").write_text(json.dumps(cfg.to_dict()))
    (rd / "run.json").write_text(json.dumps({"run_name": run_name, "identity_hash": cfg.identity_hash(),
                                             "manifest_id": manifest_id}))
    return rd


def records(steps, eval_every: int = 10) -> list[dict]:
    """What the trainer writes: a train record per step, eval + sample records every eval_every steps."""
    out = []
    for s in steps:
        t = T0 + s * 0.25
        out.append({"step": s, "time": t, "kind": "train", "train/loss": 11.0 - 0.01 * s,
                    "train/lr": 1e-3 * s, "train/tokens_per_s": 1000.0 + s})
        if s % eval_every == 0:
            out.append({"step": s, "time": t + 0.1, "kind": "eval", "val/loss": 10.5 - 0.01 * s,
                        "hellaswag/acc": 0.25 + s / 1e4, "hellaswag/acc_norm": 0.26 + s / 1e4})
            out.append({"step": s, "time": t + 0.2, "kind": "sample", "text": f"sample at step {s}"})
    return out


def append(rd: Path, recs: list[dict]) -> None:
    with open(rd / "metrics.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
            f.flush()


def expected(recs: list[dict], key: str) -> list[tuple[int, float]]:
    return sorted((r["step"], r[key]) for r in recs if isinstance(r.get(key), int | float))


def history(mlc: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlc.get_metric_history(run_id, key))


def count_rounds(shipper: tracking.Shipper) -> list[bool]:
    """Record each shipping round of the shipper's thread (one ship_once call each; call before start()),
    so a test waits for rounds, not for seconds that a loaded machine may not fill."""
    rounds, real = [], shipper.ship_once
    shipper.ship_once = lambda final=False: rounds.append(final) or real(final=final)
    return rounds


KEYS = ["train/loss", "train/lr", "train/tokens_per_s", "val/loss", "hellaswag/acc", "hellaswag/acc_norm"]


def test_gptcore_never_imports_mlflow():
    # training must not depend on the tracking server: the trainer side cannot even import mlflow
    offenders = [p.name for p in (REPO / "gptcore").glob("*.py")
                 if "import mlflow" in p.read_text() or "from mlflow" in p.read_text()]
    assert offenders == []


def test_ship_values_steps_params_artifacts_and_no_duplicates(mlflow_server, tmp_path):
    rd = make_run_dir(tmp_path, "ship-basic")
    recs = records(range(1, 31))
    append(rd, recs)
    with open(rd / "metrics.jsonl", "a") as f:  # the trainer is mid-way through writing a line
        f.write('{"step": 31, "time": 1760000007.75, "kind": "train", "train/lo')

    out = ship(rd, mlflow_server.uri, flow_run_id="flow-123")
    assert out["shipped"] == len(recs)
    mlc = MlflowClient(mlflow_server.uri, registry_uri=mlflow_server.uri)
    run_id = out["run_id"]
    for key in KEYS:
        assert history(mlc, run_id, key) == expected(recs, key), key
    # timestamps are the records' own (what makes a resend an exact duplicate)
    assert {m.timestamp for m in mlc.get_metric_history(run_id, "val/loss")} == \
        {int(round(r["time"] * 1000)) for r in recs if "val/loss" in r}
    run = mlc.get_run(run_id)
    assert run.data.params["model.n_layer"] == "2" and run.data.params["train.run_name"] == "ship-basic"
    assert run.data.params["data.manifest_id"] == "manifest-abc"
    assert run.data.params["prefect.flow_run_id"] == "flow-123"
    assert run.data.params["code_version"]
    ident = load_config("micro", ["train.run_name=ship-basic"]).identity_hash()
    assert run.data.tags[store.TAG_IDENTITY] == ident
    assert run.data.tags[store.TAG_FLOW_RUN] == "flow-123"
    arts = {a.path for a in mlc.list_artifacts(run_id)}
    assert {"config.json", "samples"} <= arts
    samples = sorted(a.path for a in mlc.list_artifacts(run_id, "samples"))
    assert samples == ["samples/step_00000010.txt", "samples/step_00000020.txt", "samples/step_00000030.txt"]
    dl = Path(mlc.download_artifacts(run_id, "samples/step_00000020.txt", str(tmp_path)))
    assert dl.read_text() == "sample at step 20"
    cursor = json.loads((rd / tracking.CURSOR).read_text())
    assert cursor["run_id"] == run_id
    assert cursor["offset"] == sum(len(json.dumps(r)) + 1 for r in recs)  # stops before the partial line

    # A crash after the server acknowledged a batch but before the cursor was saved: everything is
    # sent again. The server must keep exactly one copy of each point.
    cursor["offset"] = 0
    (rd / tracking.CURSOR).write_text(json.dumps(cursor))
    assert ship(rd, mlflow_server.uri)["shipped"] == len(recs)
    for key in KEYS:
        assert history(mlc, run_id, key) == expected(recs, key), key

    # A cursor naming a run the server does not know (e.g. its database was replaced): found again by
    # the identity tags and re-shipped from the start, still without duplicates.
    cursor["run_id"] = "f" * 32
    (rd / tracking.CURSOR).write_text(json.dumps(cursor))
    assert ship(rd, mlflow_server.uri)["run_id"] == run_id
    for key in KEYS:
        assert history(mlc, run_id, key) == expected(recs, key), key

    # The trainer finishes the line, resumes in a later invocation (new process, new flow run): same
    # MLflow run, steps continuing; params keep the first invocation's values.
    rest = records(range(31, 41))
    with open(rd / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rest[0])[len('{"step": 31, "time": 1760000007.75, "kind": "train", "train/lo'):]
                + "\n")
    append(rd, rest[1:])
    (rd / "DONE").write_text("")
    out2 = ship(rd, mlflow_server.uri, flow_run_id="flow-456")
    assert out2["run_id"] == run_id and out2["shipped"] == len(rest)
    for key in KEYS:
        assert history(mlc, run_id, key) == expected(recs + rest, key), key
    run = mlc.get_run(run_id)
    assert run.data.params["prefect.flow_run_id"] == "flow-123"
    assert run.data.tags[store.TAG_FLOW_RUN] == "flow-456"
    assert run.info.status == "FINISHED"  # DONE was written

    # Another training run identity gets its own MLflow run, found again on the next ship
    rd2 = make_run_dir(tmp_path, "ship-other")
    append(rd2, records(range(1, 3)))
    other = ship(rd2, mlflow_server.uri)["run_id"]
    assert other != run_id
    (rd2 / tracking.CURSOR).unlink()  # even without the cursor, the identity tags find the run
    assert ship(rd2, mlflow_server.uri)["run_id"] == other
    assert len(mlc.get_metric_history(other, "train/loss")) == 2


def test_training_run_survives_server_restart(mlflow_server, tmp_path):
    """The real trainer runs while the tracking server is killed and restarted: training goes on, the
    shipper pauses and catches up, and MLflow ends up with every metric of metrics.jsonl exactly once.
    System metrics (CPU, memory) are recorded in the same run, before the outage and again after it, their
    steps continuing."""
    ds = make_dataset(tmp_path / "ds")
    rd = tmp_path / "runs" / "restart"
    cmd = python_cmd(["micro", f"data.dataset_dir={ds}", f"train.run_dir={rd}", "train.micro_batch=2",
                      "train.seq_len=32", "train.total_batch_tokens=128", "train.max_steps=100000",
                      "train.checkpoint_interval=100000", "optim.warmup_steps=10",
                      "eval.eval_interval=10", "eval.sample_interval=10", "eval.val_tokens=128"])
    proc = start(cmd, tmp_path, tmp_path / "train.log")
    try:  # a failed assertion must not leave a 100000-step trainer running after the test
        shipper = tracking.Shipper(rd, mlflow_server.uri, interval=0.2, max_backoff=1.0, system_metrics_interval=0.5)
        rounds = count_rounds(shipper)
        shipper.start()
        try:
            deadline = time.monotonic() + 120
            while shipper.shipped < 20 and time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "train.log").read_text()[-2000:]
                time.sleep(0.1)
            assert shipper.shipped >= 20, shipper.last_error
            mlc = MlflowClient(mlflow_server.uri)
            while not mlc.get_metric_history(shipper.run_id, "system/cpu_utilization_percentage"):
                assert time.monotonic() < deadline, "no system metrics before the outage"
                time.sleep(0.2)
            mlflow_server.stop(kill=True)  # a crash, not a graceful shutdown
            deadline = time.monotonic() + 30
            while shipper.last_error is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert shipper.last_error is not None  # it noticed the outage...
            shipped, tried = shipper.shipped, len(rounds)
            lines_at_outage = len(read_metrics(rd / "metrics.jsonl"))
            deadline = time.monotonic() + 120
            while len(rounds) < tried + 3 or len(read_metrics(rd / "metrics.jsonl")) <= lines_at_outage:
                assert time.monotonic() < deadline, "no retries, or no training, during the outage"
                time.sleep(0.1)
            # ...and in three more rounds against the dead server, with new lines waiting, nothing was
            # acknowledged
            assert shipper.shipped == shipped and shipper.last_error is not None
        finally:
            mlflow_server.start()
        restarted_ms = time.time() * 1000
        # training went on during the outage, unaffected
        assert proc.poll() is None and len(read_metrics(rd / "metrics.jsonl")) > lines_at_outage
        proc.send_signal(signal.SIGTERM)  # the trainer checkpoints and exits 0
        assert proc.wait(timeout=120) == 0
        deadline = time.monotonic() + 120
        while (shipper.pending_bytes() > 0 or shipper.last_error) and time.monotonic() < deadline:
            time.sleep(0.2)
        mlc = MlflowClient(mlflow_server.uri, registry_uri=mlflow_server.uri)
        while not any(m.timestamp > restarted_ms for m in
                      mlc.get_metric_history(shipper.run_id, "system/cpu_utilization_percentage")):
            assert time.monotonic() < deadline, "system metrics did not resume after the outage"
            time.sleep(0.2)
        assert shipper.stop() is True and shipper.pending_bytes() == 0

        written = read_metrics(rd / "metrics.jsonl")
        assert len([r for r in written if r["kind"] == "eval"]) >= 1
        keys = {k for r in written if r["kind"] != "sample" for k, v in r.items()
                if k not in ("step", "time", "kind") and isinstance(v, int | float)}
        assert {"train/loss", "train/lr", "train/grad_norm", "val/loss"} <= keys
        for key in sorted(keys):
            assert history(mlc, shipper.run_id, key) == expected(written, key), key
        cpu = mlc.get_metric_history(shipper.run_id, "system/cpu_utilization_percentage")
        steps = [m.step for m in sorted(cpu, key=lambda m: m.timestamp)]
        assert steps == sorted(set(steps)), steps  # the restarted monitor continues the step count
        assert mlc.get_metric_history(shipper.run_id, "system/system_memory_usage_megabytes")
        samples = {a.path for a in mlc.list_artifacts(shipper.run_id, "samples")}
        assert samples == {f"samples/step_{r['step']:08d}.txt" for r in written if r["kind"] == "sample"}
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def test_cli_errors_and_outage(tmp_path, capsys):
    assert tracking.main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err

    rd = make_run_dir(tmp_path, "cli-down")
    append(rd, records(range(1, 5)))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert tracking.main([str(rd), "--tracking-uri", dead]) == 1
    assert "Nothing is lost" in capsys.readouterr().err
    assert not (rd / tracking.CURSOR).exists()  # nothing acknowledged, nothing recorded as shipped


def test_embedded_sqlite_store(tmp_path, monkeypatch):
    """Without MLFLOW_TRACKING_URI everything lands under the pipeline home: <home>/mlflow/."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    uri = store.tracking_uri()
    assert uri == f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}"
    rd = make_run_dir(tmp_path / "home", "embedded")
    recs = records(range(1, 11))
    append(rd, recs)
    out = ship(rd)
    mlc = MlflowClient(uri, registry_uri=uri)
    assert history(mlc, out["run_id"], "val/loss") == expected(recs, "val/loss")
    art_root = tmp_path / "home" / "mlflow" / "artifacts"
    assert list(art_root.rglob("config.json")) and list(art_root.rglob("step_00000010.txt"))
    # the UI opens the pipeline's experiment on training runs and models, not MLflow 3's GenAI views
    exp = mlc.get_experiment(mlc.get_run(out["run_id"]).info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_stop_is_bounded_while_the_server_hangs(tmp_path, monkeypatch):
    """The shipping thread is stuck in a request to the tracking server (one that accepts and never
    answers; MLflow's client retrying a dead server for minutes is the same to stop()): the train task
    calling stop() must not hang with it."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")  # the request ends when this test says so
    rd = make_run_dir(tmp_path, "bounded")
    append(rd, records(range(1, 5)))
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(120)
    conn = None
    try:
        shipper = tracking.Shipper(rd, f"http://127.0.0.1:{server.getsockname()[1]}", interval=0.1).start()
        conn, _ = server.accept()  # the thread is now inside a request that gets no answer
        stopped = []
        stopper = threading.Thread(target=lambda: stopped.append(shipper.stop(timeout=1.0)), daemon=True)
        stopper.start()
        stopper.join(120)  # bounds a hang only: a stop() that waits for the shipping thread never returns
        assert stopped == [False], "stop() waited for the hung request"
        assert shipper._thread.is_alive()  # stop() came back while the request still hung
        assert not (rd / tracking.CURSOR).exists()
    finally:
        if conn is not None:
            conn.close()  # the hung request fails; the final attempt is refused
        server.close()
    shipper._thread.join(60)  # no thread outlives the test
    assert not shipper._thread.is_alive()


@pytest.mark.parametrize("cursor", ["[]", "null", '{"tracking_uri": "URI", "offset": "7"}',
                                    '{"tracking_uri": "URI", "offset": -1}'])
def test_a_cursor_of_the_wrong_shape_starts_over_instead_of_breaking_the_shipper(tmp_path, cursor):
    uri = "http://127.0.0.1:9"
    (tmp_path / tracking.CURSOR).write_text(cursor.replace("URI", uri))
    s = tracking.Shipper(tmp_path, tracking_uri=uri)
    assert s._load_cursor() == {"tracking_uri": uri, "run_id": None, "offset": 0}
    assert s.pending_bytes() == 0


def test_system_metrics_switch_off(mlflow_server, tmp_path):
    """train.system_metrics_interval=0 (what the train task passes the shipper) records none; a negative
    interval is a config error."""
    from gptcore.config import ConfigError

    with pytest.raises(ConfigError, match="system_metrics_interval must be >= 0"):
        load_config("micro", ["train.system_metrics_interval=-1"])
    assert load_config("micro", ["train.system_metrics_interval=0"]).train.system_metrics_interval == 0
    rd = make_run_dir(tmp_path, "no-system-metrics")
    append(rd, records(range(1, 5)))
    shipper = tracking.Shipper(rd, mlflow_server.uri, interval=0.1, system_metrics_interval=0)
    rounds = count_rounds(shipper)
    shipper.start()
    deadline = time.monotonic() + 120
    # five whole rounds (the sixth has begun), the records shipped: each round ends with the monitor check
    while shipper.shipped < 4 or len(rounds) < 6:
        assert time.monotonic() < deadline, (shipper.shipped, len(rounds), shipper.last_error)
        time.sleep(0.1)
    assert shipper._monitor is None  # before stop(), which clears it either way
    assert shipper.stop() is True
    run = MlflowClient(mlflow_server.uri).get_run(shipper.run_id)
    assert "train/loss" in run.data.metrics and not [k for k in run.data.metrics if k.startswith("system/")]
