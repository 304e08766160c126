"""The pretrain flow through a real Prefect server and worker (process pool) and a real MLflow server:
end to end, a no-op re-run, resume after the flow run's process is killed, concurrent runs of one
training run, and early failure on bad parameters. Preset `micro` with a few steps keeps it short."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from integrations.artifact_tables import from_rows
from tests.prefect_stack import artifacts, flow_logs, run_deployment_and_wait, task_run_states, task_runs, wait_final

pytestmark = pytest.mark.slow
HELLASWAG = Path(__file__).parent / "fixtures" / "hellaswag_mini.jsonl"


def micro(run_name: str, steps: int, **over) -> dict:
    overrides = {"train.max_steps": steps, "train.run_name": run_name, "train.checkpoint_interval": 4,
                 "eval.eval_interval": 4, "eval.sample_interval": 4, **over}
    return {"preset": "micro", "overrides": overrides, "model_name": f"micro-{run_name}"}


def untrained_val_loss(params: dict, home: Path) -> float:
    """The validation loss of the run's model at initialisation (the trainer's seed), on the same batches."""
    import torch

    from gptcore.data import location
    from gptcore.evals.validation import validation_loss
    from gptcore.model.gpt import GPT
    from gptcore.overrides import load_config

    cfg = load_config(params["preset"], params["overrides"])
    torch.manual_seed(cfg.train.seed)
    return validation_loss(GPT(cfg.model), cfg, home / "shards" / location.dataset_name(cfg), "cpu")


def started(names: dict[str, str], prefix: str) -> list[str]:
    return [n for n in names if n.startswith(prefix)]


def trainer_pids(run_name: str) -> list[int]:
    """Trainer processes (not torchrun) of one run (psutil): the train task launches them on its resolved
    config, a launch file named after the run (tasks.train.launch_config)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "gptcore.training.train" in cmd and any(a.endswith(f"/{run_name}.json") for a in cmd) and \
                "torch.distributed.run" not in cmd and "-c" not in cmd:
            out.append(p.pid)
    return out


TOY_STAGE = """
import json
from pathlib import Path

from tasks.stage import Stage


class Toy(Stage):
    name = "toy"

    def stored(self, run):
        path = Path(run.state["run_dir"]) / "toy.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def work(self, run):
        out = {"step": run.state["step"], "model": run.reg["model_uri"], "sample": run.sample["text"][:12]}
        (Path(run.state["run_dir"]) / "toy.json").write_text(json.dumps(out))
        return out

    def reason(self, run, result, ran):
        return f"wrote toy.json for step {result['step']}" if ran else f"toy.json holds step {result['step']}"


STAGE = Toy()
"""


def test_end_to_end_then_rerun_is_a_no_op(prefect_stack):
    from mlflow import MlflowClient

    from gptcore.files import file_sha256

    # its own dataset (no other test builds it, so every stage runs whatever ran before) and a learning rate
    # at which 8 steps of the micro model learn well beyond noise
    # lm-evaluation-harness's own arc_easy task, its dataset served by the hub stand-in (tests/prefect_stack.py)
    params = micro("e2e", 8, **{"eval.hellaswag.enabled": True, "eval.hellaswag.path": str(HELLASWAG),
                                "eval.harness.tasks": "arc_easy", "eval.harness.limit": 8,
                                "data.dataset_name": "micro-e2e", "optim.max_lr": 1e-2, "optim.min_lr": 1e-3})
    fr = run_deployment_and_wait(params)
    assert fr.state.is_completed(), fr.state.message
    arts = artifacts(fr.id)
    summary = from_rows(arts["pretrain-summary"])
    assert summary["step"] == 8 and summary["done"] is True
    # the trainer evaluated its last checkpoint (val + HellaSwag); the stage added only the harness tasks,
    # which the trainer does not run (eval.harness.interval=0), as their own task run
    assert summary["stages"] == {"download": "ran", "tokenize": "ran", "train": "ran", "evaluate": "ran",
                                 "register": "ran", "sample": "ran"}
    assert all(r["detail"] for r in arts["e2e-stages"]), arts["e2e-stages"]  # each stage says what it did
    # the summary table's cells are plain values, not JSON text (integrations/artifact_tables.py)
    cells = {r["key"]: r["value"] for r in arts["pretrain-summary"]}
    assert cells["run_name"] == "e2e" and cells["stages.sample"] == "ran" and cells["step"] == 8
    evaluation = json.loads((Path(summary["checkpoint"]) / "eval.json").read_text())
    assert evaluation["by"] == "trainer"
    assert set(evaluation["settings"]["evaluations"]) == {"hellaswag", "harness"}
    arc = evaluation["harness"]["arc_easy"]
    assert arc["n"] == 8 and round(arc["acc"] * 8, 9).is_integer()
    assert arc["acc_stderr"] == pytest.approx((arc["acc"] * (1 - arc["acc"]) / 7) ** 0.5)
    assert any(line.startswith("harness: arc_easy/acc ") for line in summary["evaluation_summary"])
    # it learned: the same validation batches score well below the untrained model's (seeded like the run)
    untrained = untrained_val_loss(params, prefect_stack.home)
    assert summary["val_loss"] < untrained - 0.3, (summary["val_loss"], untrained)
    # HellaSwag: counts over the 7 examples, the numbers the trainer wrote, not a range that cannot fail
    hs = summary["evaluations"]["hellaswag"]
    assert hs["n"] == 7 and round(hs["acc_norm"] * 7, 9).is_integer() and round(hs["acc"] * 7, 9).is_integer()
    assert (hs["acc"], hs["acc_norm"]) == (evaluation["hellaswag"]["acc"], evaluation["hellaswag"]["acc_norm"])
    assert summary["model_version"] == "models:/micro-e2e/1"
    assert summary["sample"].startswith("Hello, I'm a language model,")
    # the UI artifacts
    shards = arts["e2e-shards"]
    assert {r["split"] for r in shards} == {"train", "val"} and sum(r["tokens"] for r in shards) > 100_000
    assert {r["metric"] for r in arts["e2e-eval"]} >= {"val_loss", "hellaswag_acc", "hellaswag_acc_norm"}
    # MLflow's UI opens in GenAI mode without the workflowType
    assert (f"{prefect_stack.mlflow_uri}/#/models/micro-e2e/versions/1?workflowType=machine_learning"
            in arts["e2e-mlflow"])
    assert re.search(r"/#/experiments/\d+/runs/\w+\?workflowType=machine_learning\)", arts["e2e-mlflow"])
    assert summary["sample"] in arts["e2e-sample"]
    assert arts["e2e-training"] == 100  # the train task's progress artifact reached the end
    board = arts["leaderboard-micro-e2e"]  # the registered versions, side by side (tasks/leaderboard.py)
    assert [(r["version"], r["aliases"], r["step"]) for r in board] == [(1, "best,latest", 8)]
    # what the run had cost at the registered step (no price set: hours only)
    assert summary["gpu_hours"] > 0 and summary["eta_s"] == 0 and summary["cost_usd"] is None
    assert board[0]["gpu_hours"] == pytest.approx(summary["gpu_hours"]) and board[0]["cost_usd"] is None
    assert board[0]["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert board[0]["hellaswag_acc_norm"] == pytest.approx(hs["acc_norm"])
    assert (board[0]["harness_arc_easy_acc"], board[0]["harness_arc_easy_acc_stderr"]) == \
        pytest.approx((arc["acc"], arc["acc_stderr"]))
    ran = task_runs(fr.id)
    for prefix in ("download", "train e2e", "harness step 8", "register micro-e2e step 8", "leaderboard", "sample"):
        assert [n for n in started(ran, prefix) if ran[n] == "Completed"], (prefix, ran)
    assert not started(ran, "val step 8") and not started(ran, "hellaswag step 8")  # the trainer's, kept
    # MLflow: the version holds this checkpoint, and the shipper sent the training curve
    mlc = MlflowClient(prefect_stack.mlflow_uri, registry_uri=prefect_stack.mlflow_uri)
    mv = mlc.get_model_version("micro-e2e", "1")
    ckpt = Path(summary["checkpoint"])
    assert mv.tags["checkpoint_sha256"] == file_sha256(ckpt / "model.safetensors")
    assert mv.tags["flow_run_id"] == str(fr.id)
    logged = {m.key: m.value for m in mlc.get_logged_model(mv.source.removeprefix("models:/")).metrics}
    assert (logged["harness/arc_easy/acc"], logged["harness/arc_easy/acc_stderr"]) == \
        pytest.approx((arc["acc"], arc["acc_stderr"]))
    losses = mlc.get_metric_history(mv.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 9))

    # second run of the same deployment: every stage finds its artifacts, nothing is redone
    run_dir = Path(summary["run_dir"])
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "train.lock"}
    t0 = time.monotonic()
    fr2 = run_deployment_and_wait(params)
    assert fr2.state.is_completed(), fr2.state.message
    s2 = from_rows(artifacts(fr2.id)["pretrain-summary"])
    assert s2["stages"] == {s: "skipped" for s in ("download", "tokenize", "train", "evaluate", "register", "sample")}
    assert s2["model_version"] == "models:/micro-e2e/1" and s2["val_loss"] == summary["val_loss"]
    # every stage is still a task run in the UI's graph: completed at once, "Skipped", with the reason
    skipped = task_run_states(fr2.id)
    assert sorted(skipped) == ["download", "evaluate step 8", "register micro-e2e step 8", "sample", "tokenize",
                              "train e2e"], skipped
    assert all(t == "COMPLETED" and n == "Skipped" and m.startswith("skipped: ") for t, n, m in skipped.values())
    assert "train tokens" in skipped["tokenize"][2] and "is DONE at step 8" in skipped["train e2e"][2]
    assert "not needed: the dataset" in skipped["download"][2]  # the source is not re-checked for a complete dataset
    # no work, asserted as work: no task but the Skipped markers ran (above), no file changed (below), and the
    # flow process imports neither torch nor mlflow (the probe at the end); not a number of seconds
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "train.lock"}
    assert after == before, "the re-run changed files in the run directory"
    assert len(mlc.search_model_versions("name = 'micro-e2e'")) == 1
    print(f"re-run took {time.monotonic() - t0:.1f}s wall, {fr2.total_run_time} in the flow")

    # the documented CLI after `make demo`, with no MLFLOW_TRACKING_URI: it finds the demo's MLflow server for
    # this pipeline home (the model's artifacts are served by it) instead of reading its database directly
    env = {k: v for k, v in prefect_stack.env().items() if k != "MLFLOW_TRACKING_URI"}
    r = subprocess.run([sys.executable, "-m", "tasks.generate", "models:/micro-e2e@best", "--prompt", "Hello",
                        "--max-new-tokens", "4"], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr[-2000:]

    # the skip decisions read files and MLflow's REST API: the flow process imports neither torch (~3 s)
    # nor mlflow (~1.3 s); this runs the real flow (nproc=0, i.e. "count the GPUs" unless skipped)
    probe = ("import json, sys\nfrom flows.pretrain import pretrain\n"
             f"s = pretrain(**json.loads({json.dumps(json.dumps(params))}))\n"
             "heavy = [m for m in ('torch', 'mlflow') if m in sys.modules]\n"
             "print(json.dumps({'stages': s['stages'], 'heavy': heavy}))")
    r = subprocess.run([sys.executable, "-c", probe], env=prefect_stack.env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["stages"].values()) == {"skipped"} and out["heavy"] == [], out

    # adding a stage is one module and one STAGES line (tasks/stage.py): a toy one, after sample, reads what
    # the stages before it left on the FlowRun; it runs once, then is found stored and shows as Skipped
    module = prefect_stack.home / "toystage"
    module.mkdir(exist_ok=True)
    (module / "toy_stage.py").write_text(TOY_STAGE)
    added = ("import json\nfrom flows import pretrain\nimport toy_stage\n"
             "pretrain.STAGES.append(toy_stage.STAGE)\n"  # the one line
             f"state = pretrain.pretrain(**json.loads({json.dumps(json.dumps(params))}), return_state=True)\n"
             "print(json.dumps({'id': str(state.state_details.flow_run_id), 'stages': state.result()['stages']}))")
    env = {**prefect_stack.env(), "PYTHONPATH": os.pathsep.join([str(module), os.environ.get("PYTHONPATH", "")])}
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", added], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert [o["stages"]["toy"] for o in outs] == ["ran", "skipped"], outs
    assert all(list(o["stages"])[-1] == "toy" for o in outs)
    toy = json.loads((run_dir / "toy.json").read_text())
    assert toy == {"step": 8, "model": "models:/micro-e2e/1", "sample": summary["sample"][:12]}
    assert task_run_states(outs[1]["id"])["toy"] == ("COMPLETED", "Skipped", "skipped: toy.json holds step 8")


def test_a_rerun_that_adds_an_evaluation_brings_its_scores_to_the_model(prefect_stack):
    """A finished run, run again with eval.harness.tasks added: the evaluate stage scores the harness task,
    and the register stage runs (the version holds the checkpoint but its logged model lacks those metrics),
    so the scores reach the logged model and the leaderboard. It used to skip register ("holds this
    checkpoint") and the scores never left eval.json."""
    from mlflow import MlflowClient

    params = micro("addeval", 4)
    fr = run_deployment_and_wait(params)
    assert fr.state.is_completed(), fr.state.message
    params["overrides"].update({"eval.harness.tasks": "arc_easy", "eval.harness.limit": 8})
    fr2 = run_deployment_and_wait(params)
    assert fr2.state.is_completed(), fr2.state.message
    arts = artifacts(fr2.id)
    s2 = from_rows(arts["pretrain-summary"])
    assert (s2["stages"]["train"], s2["stages"]["evaluate"], s2["stages"]["register"]) == ("skipped", "ran", "ran")
    assert s2["model_version"] == "models:/micro-addeval/1"  # the same version, not a new one
    arc = json.loads((Path(s2["checkpoint"]) / "eval.json").read_text())["harness"]["arc_easy"]
    mlc = MlflowClient(prefect_stack.mlflow_uri, registry_uri=prefect_stack.mlflow_uri)
    mv = mlc.get_model_version("micro-addeval", "1")
    logged = {m.key: m.value for m in mlc.get_logged_model(mv.source.removeprefix("models:/")).metrics}
    assert logged["harness/arc_easy/acc"] == pytest.approx(arc["acc"])
    board = arts["leaderboard-micro-addeval"]
    assert [r["version"] for r in board] == [1] and board[0]["harness_arc_easy_acc"] == pytest.approx(arc["acc"])


def automations_script(stack, *args) -> subprocess.CompletedProcess:
    script = Path(__file__).resolve().parents[1] / "deployments" / "automations.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PREFECT_API_URL": stack.prefect_api_url})


def test_killed_flow_run_resumes_from_its_checkpoint(prefect_stack):
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    # the unresponsive-run automation for this deployment (heartbeats every 30 s here: prefect_stack)
    r = automations_script(prefect_stack, "--deployment", "tiny", "--silence-seconds", "60")
    assert r.returncode == 0, r.stderr[-2000:]
    params = micro("killed", 2000, **{"eval.eval_interval": 1000, "eval.sample_interval": 1000,
                                      "train.price_per_gpu_hour": 3.0})
    params.update(register=False, evaluate=False)
    fr_id = run_deployment("pretrain/tiny", parameters=params, timeout=0)
    run_dir = prefect_stack.home / "runs" / "killed"
    end = time.monotonic() + 240
    from gptcore.checkpoints.run_files import latest_checkpoint, read_meta

    def newest_step() -> int:
        ck = latest_checkpoint(run_dir)
        try:
            return read_meta(ck)["step"] if ck else 0
        except Exception:  # noqa: BLE001 -- pruned between listing and reading: look again
            return 0

    seen, described = [], {}  # the live progress artifact while it trains, and what the UI shows beside it
    while newest_step() < 8 or len(seen) < 2 or "cost $" not in described.get("killed-training", ""):
        assert time.monotonic() < end, f"no checkpoint appeared (progress seen: {seen}, {described})"
        p = artifacts(fr_id.id, described).get("killed-training")
        if p is not None and (not seen or p != seen[-1]):
            seen.append(p)
        time.sleep(0.3)
    assert all(0 <= p < 100 for p in seen) and seen == sorted(seen) and seen[-1] > 0, seen
    # ETA and cost, where an operator looks (train.price_per_gpu_hour=3.0)
    text = described["killed-training"]
    assert "whole run: ETA " in text and " so far, $" in text and " projected" in text, text
    # a crash of the worker machine: SIGKILL the worker's process group and the flow run's process
    # (Prefect starts flow runs in their own session, so killing the worker alone would not stop it)
    holder = json.loads((run_dir / "train.lock").read_text())  # the trainer's lock names its launcher
    assert holder["launched_by"]["flow_run_id"] == str(fr_id.id)
    os.killpg(prefect_stack.worker.state()["pid"], signal.SIGKILL)
    os.killpg(holder["launched_by"]["pid"], signal.SIGKILL)
    end = time.monotonic() + 60
    while trainer_pids("killed"):
        assert time.monotonic() < end, "the trainer outlived its flow run (orphan)"
        time.sleep(0.5)
    step = read_meta(latest_checkpoint(run_dir))["step"]
    hours_then = read_meta(latest_checkpoint(run_dir))["gpu_hours"]  # the killed invocation's, at its checkpoint
    assert 8 <= step < 2000 and hours_then > 0
    # the whole machine went down: the Prefect server too. Its concurrency leases (the run's train slot,
    # held by the killed flow run) must outlive the restart, or the slot stays taken for ever
    prefect_stack.prefect.stop()
    prefect_stack.up()
    # the dead flow run does not stay Running for ever: without heartbeats it is marked Crashed (and the
    # failure notification, a Crashed event, would fire)
    end = time.monotonic() + 300
    with get_client(sync_client=True) as c:
        while (state := c.read_flow_run(fr_id.id).state).type.value != "CRASHED":
            assert state.is_running() and time.monotonic() < end, state
            time.sleep(2)
    assert "no heartbeat for 60s" in state.message
    for name in ("pretrain/tiny: unresponsive run -> crashed", "pretrain/tiny: failed or crashed"):
        Automation.read(name=name).delete()

    prefect_stack.start_worker()
    # same run identity (max_steps is part of it); a time budget bounds this invocation
    params["overrides"]["train.max_minutes"] = 0.1
    params["wait_seconds"] = 150  # the killed holder's lease (60 s) expires well before
    fr2 = run_deployment_and_wait(params, timeout=400)
    assert fr2.state.is_completed(), fr2.state.message
    logs = "\n".join(flow_logs(fr2.id))
    assert f"resuming from step {step}" in logs, logs[-3000:]
    assert f"resuming from step_{step:08d} at step {step}/2000" in logs
    assert "starting at step 0" not in logs
    assert f"step {step + 1:6d}/2000" in logs  # the first step trained is the one after the checkpoint
    assert read_meta(latest_checkpoint(run_dir))["step"] > step
    # the flow's summary (what the demo prints): the hours so far, carried across both invocations, their cost
    # at $3 an hour, and what is left of a run this night's budget did not finish
    s2 = from_rows(artifacts(fr2.id)["pretrain-summary"])
    assert s2["done"] is False and s2["eta_s"] > 0, s2
    assert s2["gpu_hours"] > hours_then, s2
    assert s2["cost_usd"] == pytest.approx(3.0 * s2["gpu_hours"], abs=1e-3)
    assert s2["cost_projected_usd"] > s2["cost_usd"]


def wait_for(what: str, check, timeout: float = 240.0, every: float = 0.3):
    """Poll `check()` until it returns something truthy (returned); the deadline only bounds a hang."""
    end = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(every)
    return got


def test_concurrent_runs_never_train_one_run_dir_twice(prefect_stack):
    """Two flow runs of one training run: the second waits for the run's concurrency slot (visible in the
    UI), then finds the run complete; one whose wait_seconds runs out fails, naming the slot and the fix.
    The first run's trainer is held still (SIGSTOP) while the others arrive, so they meet a taken slot
    however fast or slow this machine is."""
    from prefect.deployments import run_deployment

    params = micro("twin", 24)
    params.update(register=False, evaluate=False)
    a = run_deployment("pretrain/tiny", parameters=params, timeout=0)
    held = wait_for("the first flow run's trainer", lambda: trainer_pids("twin"))
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        impatient = run_deployment("pretrain/tiny", parameters={**params, "wait_seconds": 3}, timeout=0)
        fi = wait_final(impatient.id, timeout=240)
        assert fi.state.is_failed(), fi.state
        logs = "\n".join(flow_logs(fi.id))
        assert "another flow run is training run 'twin'" in logs and "stayed taken for 3s" in logs, logs[-3000:]
        assert "prefect gcl update train-twin" in logs or "freed within" in logs  # the fix is named
        b = run_deployment("pretrain/tiny", parameters=params, timeout=0)
        wait_for("the second flow run to reach the train slot",
                 lambda: task_runs(b.id).get("train twin") == "Running")
        assert trainer_pids("twin") == held  # it waits; no second trainer
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    most = 0
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        end = time.monotonic() + 300
        while not all(c.read_flow_run(x.id).state.is_final() for x in (a, b)):
            most = max(most, len(trainer_pids("twin")))
            assert time.monotonic() < end
            time.sleep(0.2)
    fa, fb = wait_final(a.id), wait_final(b.id)
    assert fa.state.is_completed() and fb.state.is_completed(), (fa.state.message, fb.state.message)
    assert most == 1  # a trainer ran, never two at once
    run_dir = prefect_stack.home / "runs" / "twin"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line]
    assert steps == list(range(1, 25)), "every step trained exactly once"
    # what each flow run's train stage did, from its stages artifact: the first trained the whole run, the
    # second waited for the slot and then found the run complete
    def train_stage(fr):
        return [(r["status"], r["detail"]) for r in artifacts(fr.id)["twin-stages"] if r["stage"] == "train"]

    assert train_stage(fa) == [("ran", "steps 0 -> 24")], train_stage(fa)
    assert train_stage(fb) == [("ran", "steps 24 -> 24")], train_stage(fb)
    second = "\n".join(flow_logs(fb.id))
    assert "waited" in second and "for concurrency slot train-twin" in second, second[-3000:]
    assert "already complete at step 24" in second


BAD_PARAMETERS = {  # the message each one fails the flow run with
    "unknown preset 'nope'": {"preset": "nope"},
    "does not exist": {"preset": "micro", "overrides": {"data.source": "/nonexistent/corpus"}},
    "unknown config key 'train.max_stepz'": {"preset": "micro", "overrides": {"train.max_stepz": 3}},
    "nproc must be an integer >= 0": {"preset": "micro", "nproc": -1},
    "wait_seconds must be >= 0": {"preset": "micro", "wait_seconds": -5},
    "model_name 'bad name/x' is not a usable name": {"preset": "micro", "model_name": "bad name/x"},
    "is not a Dask scheduler address": {"preset": "micro", "dask_address": "scheduler:8786"},
    "train.run_name '../x' is not a usable name": {"preset": "micro", "overrides": {"train.run_name": "../x"}},
    "is not a directory inside GPTPIPE_HOME": {"preset": "micro", "overrides": {"train.run_dir": "/tmp/elsewhere"}},
}
# through the server: one of each check the flow makes before any task (its parameters, the config, where it
# writes: the worker's GPTPIPE_HOME); every message is checked against the flow's own checks below
THROUGH_THE_SERVER = ("nproc must be an integer >= 0", "unknown preset 'nope'",
                      "is not a directory inside GPTPIPE_HOME")


def test_bad_parameters_fail_the_flow_run_early(prefect_stack, monkeypatch):
    from prefect.deployments import run_deployment

    from flows.pretrain import check_config, check_params
    from gptcore.config import ConfigError

    runs = {msg: run_deployment("pretrain/tiny", parameters=BAD_PARAMETERS[msg], timeout=0)
            for msg in THROUGH_THE_SERVER}
    # the rest through the same two checks the flow makes first (a flow run per case cost ~5 s each)
    monkeypatch.setenv("GPTPIPE_HOME", str(prefect_stack.home))  # as the worker's flow runs have it
    for msg, p in BAD_PARAMETERS.items():
        with pytest.raises(ConfigError) as e:
            check_params(p.get("nproc", 1), p.get("wait_seconds", 0), p.get("model_name", "micro"),
                         p.get("dask_address", ""))
            check_config(p["preset"], p.get("overrides"), p.get("nproc", 1))
        assert msg in str(e.value), (msg, str(e.value))
    for msg, fr in runs.items():
        fr = wait_final(fr.id, timeout=180)
        assert fr.state.is_failed(), (msg, fr.state)
        assert msg in fr.state.message, fr.state.message
        assert not task_runs(fr.id), "nothing may start before the config is valid"


def test_the_deployment_tokenizes_on_the_dask_cluster_it_is_given(prefect_stack, monkeypatch):
    """`prefect deployment run pretrain/tiny --param dask_address=tcp://...`: the flow run (on the process
    worker) maps its tokenize-piece tasks onto a real distributed.LocalCluster whose workers share the
    pipeline home, and the dataset equals the one the local process pool makes."""
    from distributed import Client, LocalCluster

    from gptcore.data import build, location, shard_format
    from gptcore.overrides import load_config

    monkeypatch.setenv("GPTPIPE_HOME", str(prefect_stack.home))  # the cluster's workers inherit these
    monkeypatch.setenv("PREFECT_API_URL", prefect_stack.prefect_api_url)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    over = {"data.dataset_name": "dask-e2e", "data.piece_bytes": 200_000, "data.max_docs": 12,
            "data.shard_tokens": 50_000}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        params = micro("dask-e2e", 2, **over)
        params.update(register=False, evaluate=False, dask_address=cluster.scheduler_address)
        fr = run_deployment_and_wait(params)
        assert fr.state.is_completed(), fr.state.message
        prefixes = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.task_prefixes))
    assert "tokenize_piece_task" in prefixes, prefixes  # the pieces ran on the cluster
    cfg = load_config("micro", {k: v for k, v in over.items()})
    built = location.dataset_dir(cfg)
    reference = build.run(load_config("micro", {**over, "data.dataset_name": "dask-reference"}), workers=1)
    assert [s.sha256 for s in reference.shards] == [s.sha256 for s in shard_format.Manifest.load(built).shards]


def test_concurrency_slot_set_up_by_many_flow_runs_at_once(prefect_stack):
    """Flow runs of one training run that start together all set up its concurrency limit: Prefect's upsert
    is read-then-create, so all but one see the limit created under them (ObjectAlreadyExists). Seen in CI
    as a failed flow run in the concurrent-runs test; here 8 threads race on a fresh limit name."""
    import contextvars
    import threading

    from prefect.client.orchestration import get_client

    from tasks.train import prefect_slot

    run_name = f"race-{os.getpid()}-{time.monotonic_ns()}"
    start, errors = threading.Barrier(8), []

    def set_up():
        start.wait()
        try:
            prefect_slot(run_name, timeout=5)
        except Exception as e:  # noqa: BLE001 - any failure is what this test reports
            errors.append(repr(e))

    # each thread in a copy of this context, which holds the stack's Prefect API URL
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(set_up,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(f"train-{run_name}").limit == 1


def test_failure_automation_for_the_nightly_deployment_is_created(prefect_stack, tmp_path):
    """deployments/automations.py creates (then updates, by name) the automation that fires on a Failed or
    Crashed flow run of pretrain/gpt2-124m, on the real server; with a notification block it sends
    through it."""

    from prefect.automations import Automation
    from prefect.blocks.notifications import SlackWebhook
    from prefect.client.orchestration import get_client

    def run(*args):
        return automations_script(prefect_stack, *args)

    r = run()
    assert r.returncode == 0, r.stderr[-2000:]
    with get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name("pretrain/gpt2-124m")
    auto = Automation.read(name="pretrain/gpt2-124m: failed or crashed")
    assert auto.enabled and set(auto.trigger.expect) == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}
    related = auto.trigger.match_related
    related = related[0] if isinstance(related, list) else related
    assert related.model_dump() == {"prefect.resource.id": f"prefect.deployment.{dep.id}"}  # a ResourceSpecification
    assert [a.type for a in auto.actions] == ["do-nothing"]
    # point it at a notification block (never called here: nothing fails)
    SlackWebhook(url="http://127.0.0.1:9/hook").save("nightly-alerts", overwrite=True)
    r = run("--notify-block", "slack-webhook/nightly-alerts")
    assert r.returncode == 0, r.stderr[-2000:]
    again = Automation.read(name="pretrain/gpt2-124m: failed or crashed")
    assert again.id == auto.id and [a.type for a in again.actions] == ["send-notification"]
    r = run("--notify-block", "slack-webhook/no-such-block")
    assert r.returncode == 2 and "error: notification block" in r.stderr
    r = run("--deployment", "nope")
    assert r.returncode == 2 and "deploy it first" in r.stderr
    # the unresponsive-run automation: a flow run of the deployment silent for 600 s is marked Crashed
    zombie = Automation.read(name="pretrain/gpt2-124m: unresponsive run -> crashed")
    t = zombie.trigger
    assert t.posture == "Proactive" and t.within.total_seconds() == 600 and set(t.after) == {
        "prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Crashed"} <= set(t.expect)
    related = t.match_related[0] if isinstance(t.match_related, list) else t.match_related
    assert related.model_dump() == {"prefect.resource.id": f"prefect.deployment.{dep.id}"}
    assert [(a.type, a.state.value) for a in zombie.actions] == [("change-flow-run-state", "CRASHED")]
    r = run("--silence-seconds", "20")
    assert r.returncode == 2 and "too short" in r.stderr


@pytest.mark.parametrize("nproc, world, engine", [(2, 2, "fsdp"), (0, 1, "single")])
def test_a_flow_run_trains_on_the_processes_it_is_given(prefect_stack, nproc, world, engine):
    """nproc=2: the deployment's trainer is a 2-rank gloo job under torchrun, here FSDP2 (train.parallel; the
    launch is the same for DDP, whose training tests/test_ddp.py runs through the same torchrun command);
    nproc=0 ("one per GPU", the nightly deployments' value) is one process on a machine without CUDA. Each
    trains every step once and evaluates the final checkpoint; the FSDP run registers its consolidated model
    as a version."""
    run = f"procs{nproc}{engine}"
    params = micro(run, 4, **({"train.parallel": engine} if world > 1 else {}))
    params.update(register=engine == "fsdp", nproc=nproc)
    fr = run_deployment_and_wait(params)
    assert fr.state.is_completed(), fr.state.message
    logs = "\n".join(flow_logs(fr.id))
    assert f"run {run}: starting on {world} process(es)" in logs, logs[-3000:]
    assert f"--nproc_per_node={world}" in logs, logs[-3000:]  # the launch line
    train_log = (prefect_stack.home / "runs" / run / "train.log").read_text()
    assert f"world={world} " in train_log and f"parallel={engine} " in train_log, train_log[-2000:]
    steps = [json.loads(line)["step"] for line in (prefect_stack.home / "runs" / run / "metrics.jsonl")
             .read_text().splitlines() if '"kind": "train"' in line]
    assert steps == [1, 2, 3, 4]
    summary = from_rows(artifacts(fr.id)["pretrain-summary"])
    assert summary["step"] == 4 and summary["done"] is True and summary["val_loss"] > 0
    if engine == "fsdp":  # the consolidated model of a sharded run, as a registry version
        assert summary["stages"]["register"] == "ran" and summary["model_version"] == f"models:/micro-{run}/1"
        import torch  # only this case reads weights
        from safetensors.torch import load_file

        from gptcore.checkpoints import checkpoint
        from gptcore.checkpoints.run_files import latest_checkpoint, read_meta

        step = latest_checkpoint(prefect_stack.home / "runs" / run)
        whole = step / "consolidated"
        assert read_meta(step)["format"] == "sharded" and not (step / "model.safetensors").exists()
        assert read_meta(whole)["consolidated_from"]["shards_sha256"] == read_meta(step)["shards_sha256"]
        from_shards, registered = checkpoint.load_model(step)[0].state_dict(), load_file(whole / "model.safetensors")
        assert registered and all(torch.equal(v, from_shards[k]) for k, v in registered.items())


def test_cancelling_a_flow_run_in_prefect_stops_the_trainer_with_a_checkpoint(prefect_stack):
    """Cancel from the UI/CLI (`prefect flow-run cancel`): the server marks the run Cancelling, the worker
    ends the flow run's process, the train task's clean-up SIGTERMs the trainer, which writes a stop
    checkpoint and exits: no orphan keeps the GPU, the lock is free, the next run resumes."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from gptcore.checkpoints.run_files import latest_checkpoint, read_meta

    params = micro("cancelled", 5000, **{"eval.eval_interval": 1000, "eval.sample_interval": 1000,
                                         "train.checkpoint_interval": 1000})
    params.update(register=False, evaluate=False)
    fr = run_deployment("pretrain/tiny", parameters=params, timeout=0)
    run_dir = prefect_stack.home / "runs" / "cancelled"
    wait_for("the trainer to take steps", lambda: trainer_pids("cancelled") and (run_dir / "metrics.jsonl").exists()
             and '"kind": "train"' in (run_dir / "metrics.jsonl").read_text())
    with get_client(sync_client=True) as c:
        c.set_flow_run_state(fr.id, Cancelling(), force=True)
    final = wait_final(fr.id, timeout=240)
    assert final.state.is_cancelled(), final.state
    wait_for("the trainer to exit", lambda: not trainer_pids("cancelled"), timeout=120)
    ck = latest_checkpoint(run_dir)
    assert ck is not None, "the cancelled trainer left no checkpoint"
    meta = read_meta(ck)
    assert meta["reason"] == "stop" and 0 < meta["step"] < 5000, meta
    assert not (run_dir / "DONE").exists()
