"""Ship a training run's metrics to MLflow, from outside the training loop.

The trainer only appends JSON lines to `<run_dir>/metrics.jsonl` (gptcore.metrics); it never imports
mlflow, so a slow or dead tracking server cannot slow down or kill training. This module tails that
file and sends what is new with `MlflowClient.log_batch`:

    python -m integrations.tracking var/runs/tiny-cpu             # ship what is there, once (Shipper.ship_once)
    python -m integrations.tracking var/runs/tiny-cpu --follow    # keep shipping until the run is DONE
    Shipper(run_dir).start() ... .stop()                   # the same, as a background thread

Nothing lost, nothing duplicated:
- the JSONL file is the buffer. `<run_dir>/mlflow_cursor.json` holds the byte offset of the first line
  not yet acknowledged by the server (and the MLflow run id); it advances only after `log_batch`
  returned. While the server is down, lines simply wait in the file.
- a batch can still be sent twice (acknowledged, then the process dies before the cursor is saved).
  Every metric is sent with the record's own timestamp, so a resent batch is an exact copy of rows
  already stored: MLflow's SQL store keys metrics by (run, key, step, timestamp, value) and skips
  such copies (tests/test_tracking.py checks this against a real server).

System metrics: with `system_metrics_interval` > 0 (the train task passes `train.system_metrics_interval`,
default 10 s; 0 = off), the shipper also runs MLflow's SystemMetricsMonitor on the run, in its own thread:
`system/cpu_utilization_percentage`, `system/system_memory_usage_megabytes`, disk and network, and per GPU
utilisation, memory and power when nvidia-ml-py (a dependency) finds NVIDIA GPUs. The monitor
samples the machine the train task runs on (torchrun's ranks are its children). Training never waits for
it; during an MLflow outage its samples are dropped (they are not in metrics.jsonl, so nothing the shipper
owns is lost) and the shipper restarts it, continuing its step count, once the server answers again.

One MLflow run per training run identity (tags `gptpipe.run_name` + `gptpipe.identity_hash`, in
experiment `gpt2-pretrain`): a resumed or nightly-continued run logs into the same MLflow run, steps
continuing.
"""

from __future__ import annotations

# lazy imports: mlflow only once there is something to ship (the trainer starts without waiting for it)
import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from gptcore.checkpoints.run_files import DONE_FILE, RUN_FILE
from gptcore.config import ConfigError
from gptcore.files import read_json, write_json
from gptcore.metrics import METRICS_FILE, read_new_lines
from gptcore.overrides import from_dict
from gptcore.security import check_name
from integrations import mlflow_store as store

log = logging.getLogger("gptpipe.tracking")

CURSOR = "mlflow_cursor.json"
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
MAX_PARAMS_PER_BATCH = 100
MAX_READ_BYTES = 4 << 20  # per round, so a long backlog goes out in bounded pieces


# --- reading the run directory ---------------------------------------------------------------------

def run_identity(run_dir: Path) -> dict | None:
    """run_name, identity_hash, manifest_id, dataset_dir (when recorded) and the resolved config of a run
    directory, or None if the trainer has not written them yet."""
    config = read_json(run_dir / "config.json", {})  # damaged: the trainer rewrites it when it starts
    if not config:
        return None
    cfg = from_dict(config)
    ident = {"run_name": cfg.run_name, "identity_hash": cfg.identity_hash(), "manifest_id": "",
             "config": config}
    rj = read_json(run_dir / RUN_FILE, {})  # the trainer's own record wins (it is what resume checks)
    for key in ("run_name", "identity_hash", "manifest_id", "dataset_dir"):
        if rj.get(key):
            ident[key] = rj[key]
    return ident


def to_metrics(rec: dict) -> list:
    """The numeric entries of one train/eval record as MLflow Metrics, stamped with the record's time
    (so a resend is an exact duplicate)."""
    from mlflow.entities import Metric

    ts = int(round(float(rec["time"]) * 1000))
    step = int(rec["step"])
    return [Metric(key=k, value=float(v), timestamp=ts, step=step) for k, v in rec.items()
            if k not in ("step", "time", "kind") and isinstance(v, int | float) and not isinstance(v, bool)]


# --- the shipper -----------------------------------------------------------------------------------

class Shipper:
    """Tails `<run_dir>/metrics.jsonl` into one MLflow run. `ship_once()` sends everything complete
    that is not yet acknowledged; `start()`/`stop()` run it every `interval` seconds in a daemon thread
    that swallows (and logs) tracking-server errors, backing off while the server is down."""

    def __init__(self, run_dir: str | Path, tracking_uri: str | None = None, experiment: str = store.EXPERIMENT,
                 flow_run_id: str | None = None, interval: float = 5.0,
                 max_backoff: float = 30.0, system_metrics_interval: float = 0.0):
        self.run_dir = Path(run_dir)
        self.uri = tracking_uri or store.tracking_uri()
        self.experiment = experiment
        self.flow_run_id = flow_run_id
        self.interval = interval
        self.max_backoff = max_backoff  # longest pause between attempts while the server is down
        self.shipped = 0  # records acknowledged by this Shipper
        self.last_error: str | None = None
        self._client = None
        self.run_id: str | None = None  # the MLflow run, once this session has set it up
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final_ok = False
        self.system_metrics_interval = system_metrics_interval  # seconds between samples; 0 = off
        self._monitor = None  # mlflow's SystemMetricsMonitor, while it runs
        self._monitor_thread: threading.Thread | None = None  # its loop's thread

    # cursor: {"tracking_uri", "run_id", "offset"}; another server means starting over at offset 0
    def _load_cursor(self) -> dict:
        cur = read_json(self.run_dir / CURSOR, {})
        if cur.get("tracking_uri") != self.uri or not isinstance(cur.get("offset"), int) or cur["offset"] < 0:
            cur = {"tracking_uri": self.uri, "run_id": None, "offset": 0}
        return cur

    def _setup(self, cur: dict) -> bool:
        """Find or create the MLflow run and record this invocation (params, tags, config). False while
        the trainer has not written its config yet."""
        ident = run_identity(self.run_dir)
        if ident is None:
            return False
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        mlc = self._client = self._client or store.client(self.uri)
        run = None
        if cur.get("run_id"):
            try:
                run = mlc.get_run(cur["run_id"])
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                log.warning("MLflow run %s is gone from %s; shipping %s again from the start",
                            cur["run_id"], self.uri, self.run_dir)
                cur["offset"] = 0
        if run is None:
            run = store.find_or_create_run(mlc, ident["run_name"], ident["identity_hash"], self.experiment)
        run_id = run.info.run_id
        # Params are immutable in MLflow: the first invocation's values stay; settings that may change
        # between invocations (time budget, device, cadence) are in each invocation's config artifact.
        params = store.as_params(ident["config"])
        params["data.manifest_id"] = ident["manifest_id"]
        params["code_version"] = store.code_version()
        tags = {store.TAG_MANIFEST: ident["manifest_id"], store.TAG_CODE: params["code_version"]}
        if self.flow_run_id:
            params["prefect.flow_run_id"] = tags[store.TAG_FLOW_RUN] = self.flow_run_id
        new = [Param(k, v) for k, v in sorted(params.items()) if k not in run.data.params]
        for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
            mlc.log_batch(run_id, params=new[i:i + MAX_PARAMS_PER_BATCH], synchronous=True)
        mlc.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        mlc.log_dict(run_id, ident["config"], "config.json")
        if ident.get("dataset_dir"):  # lineage: the run page lists the dataset (manifest id, hub repo@commit)
            store.log_datasets(mlc, run_id, ident["dataset_dir"])
        if run.info.status != "RUNNING" and not (self.run_dir / DONE_FILE).exists():
            mlc.update_run(run_id, status="RUNNING")  # a resumed run is running again
        cur["run_id"] = self.run_id = run_id
        write_json(self.run_dir / CURSOR, cur)
        return True

    def ship_once(self, final: bool = False) -> None:
        """Send every complete, unacknowledged line (`shipped` counts the records acknowledged).
        Raises on tracking-server errors (the cursor keeps what was not acknowledged)."""
        with self._lock:
            cur = self._load_cursor()
            if self.run_id is None or cur.get("run_id") != self.run_id:
                if not self._setup(cur):
                    return
            mlc, path = self._client, self.run_dir / METRICS_FILE
            if path.is_file() and path.stat().st_size < cur["offset"]:
                log.warning("%s is shorter than the shipped offset %d (rewritten?); re-shipping it from the "
                            "start (duplicates are skipped by the server)", path, cur["offset"])
                cur["offset"] = 0
            while lines := read_new_lines(path, cur["offset"], MAX_READ_BYTES):
                self._ship_lines(mlc, cur, lines)
            if final and (self.run_dir / DONE_FILE).exists() and mlc.get_run(self.run_id).info.status != "FINISHED":
                mlc.set_terminated(self.run_id, "FINISHED")

    def _ship_lines(self, mlc, cur: dict, lines: list[tuple[int, bytes]]) -> None:
        batch, end, n = [], cur["offset"], 0

        def flush():
            nonlocal batch
            if batch:
                mlc.log_batch(self.run_id, metrics=batch, synchronous=True)
            cur["offset"] = end  # acknowledged: advance
            write_json(self.run_dir / CURSOR, cur)
            batch = []

        for line_end, line in lines:
            try:
                rec = json.loads(line)
                kind = rec.get("kind", "train")
                metrics = to_metrics(rec) if kind not in ("sample", "profile", "memory") else []
            except (ValueError, KeyError, TypeError):
                log.warning("skipping a malformed line in %s at byte %d: %.80r", METRICS_FILE, end, line)
                end = line_end
                continue
            if len(batch) + len(metrics) > MAX_METRICS_PER_BATCH:
                flush()
            if kind == "sample" and isinstance(rec.get("text"), str):
                flush()  # keep acknowledgements in file order
                mlc.log_text(self.run_id, rec["text"], f"samples/step_{int(rec['step']):08d}.txt")
            if kind in ("profile", "memory") and rec.get("dir") and (self.run_dir / str(rec["dir"])).is_dir():
                # the traces of a profile (gptcore/training/profiling.py), an out-of-memory record (memory.py)
                flush()
                mlc.log_artifacts(self.run_id, str(self.run_dir / rec["dir"]), artifact_path=rec["dir"])
            batch += metrics
            end, n = line_end, n + 1
        flush()
        self.shipped += n

    # --- background thread ---

    def start(self) -> Shipper:
        self._thread = threading.Thread(target=self._loop, name=f"mlflow-shipper:{self.run_dir.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        backoff = self.interval
        while not self._stop.is_set():
            if self._try_ship(final=False):
                backoff = self.interval
                self._keep_monitoring()
            else:
                backoff = min(backoff * 2, max(self.max_backoff, self.interval))
            self._stop.wait(backoff)
        self._final_ok = self._try_ship(final=True)

    def _keep_monitoring(self) -> None:
        """(Re)start the system-metrics monitor: it ends itself when it cannot reach the server."""
        if not self.system_metrics_interval or self.run_id is None:
            return
        if self._monitor_thread is not None and self._monitor_thread.is_alive():
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        try:
            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.system_metrics_interval,
                                                 resume_logging=True, tracking_uri=self.uri)
            before = set(threading.enumerate())
            self._monitor.start()
            # the monitor's own thread (its loop ends when the server cannot be reached), found through
            # threading's public API rather than the monitor's private attribute
            self._monitor_thread = next((t for t in threading.enumerate() if t not in before
                                         and t.name == "SystemMetricsMonitor"), None)
        except Exception as e:  # noqa: BLE001 -- system metrics are a view, never a reason to stop
            log.warning("system metrics are off for this run (%s: %s)", type(e).__name__, e)
            self.system_metrics_interval = 0.0

    def _stop_monitoring(self, timeout: float) -> None:
        """Stop the monitor and flush its last samples, waiting at most `timeout` seconds (a dead server)."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        done = threading.Thread(target=monitor.finish, name="system-metrics-finish", daemon=True)
        done.start()
        done.join(timeout)

    def _try_ship(self, final: bool) -> bool:
        try:
            self.ship_once(final=final)
            if self.last_error:
                log.info("tracking server reachable again; shipping resumed")
            self.last_error = None
            return True
        except Exception as e:  # noqa: BLE001 -- never let tracking take the caller down
            if self.last_error is None:
                log.warning("MLflow shipping paused (%s: %s); metrics stay in %s and are sent when the "
                            "server is back", type(e).__name__, e, self.run_dir / METRICS_FILE)
            self.last_error = f"{type(e).__name__}: {e}"
            return False

    def stop(self, timeout: float = 60.0) -> bool:
        """Make a final attempt to ship everything and stop; True if all was shipped. Waits at most
        `timeout` seconds: MLflow's HTTP client retries a dead server for minutes, and the caller (the
        train task) must not hang on it. What is left stays in the file for the next shipper."""
        if self._thread is None:
            return self._try_ship(final=True)
        self._stop.set()
        started = time.monotonic()
        self._thread.join(timeout)
        self._stop_monitoring(max(1.0, min(10.0, timeout - (time.monotonic() - started))))
        if self._thread.is_alive():
            log.warning("MLflow shipping did not finish within %.0fs (%s); the rest stays in %s and is "
                        "sent by the next shipper", timeout, self.last_error or "server slow",
                        self.run_dir / METRICS_FILE)
            return False
        return self._final_ok

    def pending_bytes(self) -> int:
        path = self.run_dir / METRICS_FILE
        size = path.stat().st_size if path.is_file() else 0
        return max(0, size - self._load_cursor()["offset"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Ship a run's metrics.jsonl to MLflow (idempotent, resumable).")
    p.add_argument("run_dir", help="a training run directory, e.g. var/runs/tiny-cpu")
    p.add_argument("--follow", action="store_true", help="keep shipping until the run is DONE (or SIGTERM)")
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--experiment", default=store.EXPERIMENT)
    p.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or the embedded store")
    p.add_argument("--flow-run-id", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = Path(args.run_dir)
    try:
        check_name("--experiment", args.experiment)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not run_dir.is_dir():
        print(f"error: run directory {run_dir} does not exist; pass <home>/runs/<run_name>", file=sys.stderr)
        return 2
    s = Shipper(run_dir, args.tracking_uri, args.experiment, args.flow_run_id, interval=args.interval)
    if args.follow:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        s.start()
        try:
            while not stop.is_set() and not ((run_dir / DONE_FILE).exists() and s.pending_bytes() == 0):
                stop.wait(args.interval)
        except KeyboardInterrupt:
            pass
    if not s.stop():  # without --follow (no thread started): one final attempt
        print(f"error: could not ship to {s.uri}: {s.last_error}. Nothing is lost: the unsent lines stay "
              f"in {run_dir / METRICS_FILE}; run this command again when the server is reachable.",
              file=sys.stderr)
        return 1
    print(json.dumps({"run_id": s.run_id, "shipped": s.shipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
