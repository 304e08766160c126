"""Distributed correctness with real torchrun + gloo on CPU.

One reference run (two torchrun agents, --nnodes=2, c10d rendezvous on 127.0.0.1, 1 rank each, so
2 ranks x accumulation 2, no evaluation) is compared against: 1 rank x accumulation 4 with synchronous
checkpoints; a SIGKILLed run started again with the same command (also while a background checkpoint
write is in flight); a run stopped on 2 ranks and resumed on 1; and the job as it runs on GPUs
(torch.compile, validation, HellaSwag, samples and checkpoints every few steps), whose evaluations must
leave the training trajectory untouched, also when they fail.
"""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import loss_compare
from gptcore.checkpoints import checkpoint as C
from gptcore.checkpoints import run_files as R
from gptcore.metrics import read_metrics
from gptcore.training.train import STOP_FILE
from tests.test_train_utils import (
    final_weights,
    free_port,
    kill_tree,
    losses,
    python_cmd,
    rank_exit_codes,
    start,
    torchrun_cmd,
    wait_for_step,
    wait_for_text,
)

pytestmark = pytest.mark.slow
STEPS = 14
HELLASWAG = Path(__file__).parent / "fixtures" / "hellaswag_mini.jsonl"
# the GPU job's cadence, compressed: evaluation and HellaSwag at every checkpoint step, and at the end
EVALS = ["eval.eval_interval=4", "eval.hellaswag.enabled=true", "eval.hellaswag.interval=4",
         f"eval.hellaswag.path={HELLASWAG}", "eval.sample_interval=4", "eval.sample_tokens=4"]


def args(ds, run, *extra):
    # B=2, T=32, 256 tokens per step: accumulation 4 on 1 rank, 2 on 2 ranks (no_sync exercised)
    return ["micro", f"data.dataset_dir={ds}", f"train.run_dir={run}", "train.micro_batch=2",
            "train.seq_len=32", "train.total_batch_tokens=256", f"train.max_steps={STEPS}",
            "train.checkpoint_interval=4", "train.keep_last=10", "optim.warmup_steps=3",
            "eval.eval_interval=0", "eval.sample_interval=0", "eval.val_tokens=128", *extra]


def assert_same_run(run, ref, tol, norm_tol=None):
    """The losses and final weights within `tol`, the gradient norms within `norm_tol` (default `tol`)."""
    got, want = losses(run / "metrics.jsonl"), losses(ref / "metrics.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= tol, f"max loss difference {worst}"
    # the users' tool agrees, on the losses and the gradient norms (benchmarks/loss_compare.py)
    assert loss_compare.main([str(run), str(ref), "--tolerance", str(norm_tol or tol)]) == 0
    a, b = final_weights(run, STEPS), final_weights(ref, STEPS)
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=0, msg=k)
    assert (run / "DONE").is_file()


@pytest.fixture(scope="module")
def reference(ds, tmp_path_factory):
    """Two torchrun agents (--nnodes=2) that rendezvous over c10d on 127.0.0.1 and train together."""
    tmp = tmp_path_factory.mktemp("ref")
    run = tmp / "run"
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-ddp",
           "--max-restarts=0", "-m", "gptcore.training.train", *args(ds, run)]
    agents = [start(cmd, tmp, tmp / f"agent{i}.log") for i in range(2)]
    try:
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    logs = "".join((tmp / f"agent{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs
    assert "world=2 accum=2" in logs and f"RUN_DONE run=micro step={STEPS}" in logs
    return run


def evals_of(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl", "eval")}


def test_two_ranks_accum_k_equal_one_rank_accum_2k(ds, reference, tmp_path):
    """Also: synchronous checkpoints (train.async_checkpoint=false) train and save what async ones do."""
    run = tmp_path / "one"
    proc = start(python_cmd(args(ds, run, "train.async_checkpoint=false")), tmp_path, tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()
    assert "world=1 accum=4" in (tmp_path / "log").read_text()
    assert_same_run(run, reference, 1e-5)


def test_loss_compare_names_the_first_step_where_two_runs_part(reference, tmp_path, capsys):
    """benchmarks/loss_compare on a real run and a copy of it: identical -> exit 0 with --assert-equal; one
    loss moved by 1e-3 at step 7 -> exit 1 naming step 7, within --tolerance 1e-2 -> 0; a step missing ->
    exit 1 naming it; without a check it only prints the table (exit 0)."""
    copy = tmp_path / "copy"
    copy.mkdir()
    rows = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    write = lambda rs: (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))  # noqa: E731
    write(rows)
    assert loss_compare.main([str(reference), str(copy), "--assert-equal"]) == 0
    assert f"{STEPS} steps agree (bit-identical)" in capsys.readouterr().out
    moved = [dict(r, **{"train/loss": r["train/loss"] + 1e-3}) if r.get("kind") == "train" and r["step"] == 7 else r
             for r in rows]
    write(moved)
    assert loss_compare.main([str(reference), str(copy), "--assert-equal"]) == 1
    err = capsys.readouterr().err
    assert "the runs part at step 7: train/loss" in err and "difference 0.001" in err
    assert loss_compare.main([str(reference), str(copy), "--tolerance", "1e-2"]) == 0
    write([r for r in rows if not (r.get("kind") == "train" and r["step"] == STEPS)])
    assert loss_compare.main([str(reference), str(copy), "--tolerance", "1"]) == 1
    assert f"step {STEPS} is only in run A" in capsys.readouterr().err
    assert loss_compare.main([str(reference), str(copy)]) == 0
    with pytest.raises(SystemExit, match="has no metrics.jsonl"):
        loss_compare.main([str(reference), str(tmp_path / "nothing")])


def test_sigkill_then_same_command_resumes_exactly(ds, reference, tmp_path):
    run = tmp_path / "killed"
    cmd = torchrun_cmd(args(ds, run))
    proc = start(cmd, tmp_path, tmp_path / "log1")
    wait_for_step(proc, run / "metrics.jsonl", 6)
    # the step-4 checkpoint is written in the background: on a loaded machine it can still be in flight at
    # step 6, and then there is nothing to resume from. Kill once it has landed (the test is about resuming)
    deadline = time.monotonic() + 120
    while R.latest_checkpoint(run) is None:
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint landed"
        time.sleep(0.02)
    kill_tree(proc)  # SIGKILL to torchrun and both workers at once
    killed_at = read_metrics(run / "metrics.jsonl", "train")[-1]["step"]
    assert killed_at < STEPS and not (run / "DONE").exists()
    resume_from = R.read_meta(R.latest_checkpoint(run))["step"]
    assert 4 <= resume_from <= killed_at
    proc = start(cmd, tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log2").read_text()
    assert f"resuming from step_{resume_from:08d}" in (tmp_path / "log2").read_text()
    assert_same_run(run, reference, 1e-6)


def test_stop_on_two_ranks_resume_on_one_continues_the_global_data_order(ds, reference, tmp_path):
    run = tmp_path / "resized"
    proc = start(torchrun_cmd(args(ds, run)), tmp_path, tmp_path / "log1")
    wait_for_step(proc, run / "metrics.jsonl", 5)
    (run / STOP_FILE).touch()  # graceful stop request: checkpoint, every rank and torchrun exit 0
    assert proc.wait(timeout=120) == 0, (tmp_path / "log1").read_text()
    stopped = R.read_meta(R.latest_checkpoint(run))["step"]
    assert stopped < STEPS and "stopped at step" in (tmp_path / "log1").read_text()
    state = C.load_trainer_state(R.latest_checkpoint(run))
    assert state["world"] == 2 and state["loader"]["position"] == stopped * 256 // 32
    assert len(state["rng"]) == 2  # every rank's RNG state
    proc = start(python_cmd(args(ds, run)), tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log2").read_text()
    assert "world=1 accum=4" in (tmp_path / "log2").read_text()
    assert_same_run(run, reference, 1e-5)


@pytest.fixture(scope="module")
def eager_job(ds, tmp_path_factory):
    """The whole job, eager, on two ranks: validation, HellaSwag, samples and checkpoints every 4 steps."""
    tmp = tmp_path_factory.mktemp("eagerjob")
    run = tmp / "run"
    proc = start(torchrun_cmd(args(ds, run, *EVALS)), tmp, tmp / "log")
    assert proc.wait(timeout=300) == 0, (tmp / "log").read_text()[-3000:]
    return run


def test_the_compiled_job_with_evaluation_trains_and_evaluates_like_eager(ds, reference, eager_job, tmp_path):
    """What GPUs run: DDP wrapped first, then torch.compile (DDPOptimizer splits the graph at bucket
    boundaries), with validation, HellaSwag, samples and checkpoints on, and an lm-evaluation-harness task
    at its own interval (rank 0 scores it while rank 1 waits). The training losses are the eager run's
    without evaluation (evaluation leaves the trajectory alone), val loss and HellaSwag are the eager run's,
    each checkpoint carries its evaluation, validation runs through its own compiled forward (within 1e-4 of
    eager), and no evaluation after the first makes dynamo compile a graph."""
    from tests.test_harness import toy_task

    run = tmp_path / "compiled"
    tasks = toy_task(tmp_path / "tasks", n=8)
    harness = ["eval.harness.tasks=toy_choice", f"eval.harness.include_path={tasks}", "eval.harness.interval=8"]
    proc = start(torchrun_cmd(args(ds, run, *EVALS, *harness, "train.compile=true")), tmp_path, tmp_path / "log",
                 GPTPIPE_CODE_ROOTS=str(tasks))  # the operator's root for task folders
    assert proc.wait(timeout=900) == 0, (tmp_path / "log").read_text()[-3000:]
    log = (tmp_path / "log").read_text()
    assert "world=2 accum=2" in log and "compile=True" in log
    assert_same_run(run, reference, 1e-4)
    got, want = evals_of(run), evals_of(eager_job)
    assert sorted(got) == sorted(want) == [4, 8, 12, 14]
    for s in want:
        assert got[s]["val/loss"] == pytest.approx(want[s]["val/loss"], abs=1e-4), s
        assert got[s]["hellaswag/n"] == want[s]["hellaswag/n"] == 7
        assert (got[s]["hellaswag/acc"], got[s]["hellaswag/acc_norm"]) == \
            (want[s]["hellaswag/acc"], want[s]["hellaswag/acc_norm"]), s
        ev = json.loads((R.step_dir(run, s) / R.EVAL_FILE).read_text())  # evaluated after the checkpoint
        assert ev["val_loss"] == got[s]["val/loss"] and ev["hellaswag"]["n"] == 7
        # the harness at its interval (8) and the end, with its standard errors; not in between
        assert ("harness" in ev) == (s in (8, 14)) == ("harness/toy_choice/acc_stderr" in got[s]), s
        if s in (8, 14):
            assert ev["harness"]["toy_choice"]["n"] == 8
            assert ev["settings"]["evaluations"]["harness"]["tasks"] == ["toy_choice"]
    graphs = [got[s]["compile/unique_graphs"] for s in sorted(got)]  # torch._dynamo's own counter
    assert graphs[0] > 0 and len(set(graphs)) == 1, graphs  # no graph compiled after the first evaluation
    # validation ran through its compiled forward (one graph, at the first evaluation): no fallback event
    assert not read_metrics(run / "metrics.jsonl", "event")
    assert sorted(r["step"] for r in read_metrics(run / "metrics.jsonl", "sample")) == [4, 8, 12, 14]


def test_failing_evaluations_are_events_and_training_goes_on(ds, reference, tmp_path):
    """Rank 0's first evaluation raises and its second runs out of memory (test-only faults; rank 1
    finishes its share each time, so the failure must be agreed on, not hang): both are events, every
    checkpoint is written, evaluation is off after eval.max_failures=2 failures in a row, and the weights
    are those of the run without evaluation."""
    run = tmp_path / "evalfail"
    proc = start(torchrun_cmd(args(ds, run, *EVALS, "eval.max_failures=2")), tmp_path, tmp_path / "log",
                 GPTPIPE_TEST_FAULT="evalfail@1,evaloom@2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    events = [r for r in read_metrics(run / "metrics.jsonl", "event")]
    assert [e["step"] for e in events] == [4, 8], events
    assert "rank 0: RuntimeError: injected" in events[0]["event"] and "tried again" in events[0]["event"]
    assert "rank 0: OutOfMemoryError" in events[1]["event"] and "evaluation is off" in events[1]["event"]
    assert "python -m gptcore.evals.evaluate" in events[1]["event"]
    assert not evals_of(run)  # off for the rest of the invocation
    assert [c.name for c in R.list_checkpoints(run)] == [R.step_dir(run, s).name for s in (4, 8, 12, 14)]
    assert_same_run(run, reference, 1e-6)


def test_sigkill_while_a_checkpoint_is_written_in_the_background_loses_nothing(ds, reference, tmp_path):
    """Each write takes 20 s (a test-only delay) while the ranks train on; SIGKILL while the step-8 write
    is in flight leaves step 4 intact, and the same command resumes from it to the reference's weights."""
    run = tmp_path / "killed-writing"
    cmd = torchrun_cmd(args(ds, run))
    proc = start(cmd, tmp_path, tmp_path / "log1", GPTPIPE_TEST_CHECKPOINT_DELAY="20")
    wait_for_text(tmp_path / "log1", "checkpoint write delayed", 2, timeout=180)  # step 8's write began
    assert wait_for_step(proc, run / "metrics.jsonl", 10) >= 10  # the ranks train on while it is written
    kill_tree(proc)
    assert [c.name for c in R.list_checkpoints(run)] == ["step_00000004"]
    C.load_for_resume(R.step_dir(run, 4), C.load_model(R.step_dir(run, 4))[0])  # complete and verified
    proc = start(cmd, tmp_path, tmp_path / "log2")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log2").read_text()
    log = (tmp_path / "log2").read_text()
    assert "resuming from step_00000004" in log
    assert_same_run(run, reference, 1e-6)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # the killed temp is swept


def test_bf16_gradient_compression_trains_close_to_fp32_all_reduce(ds, reference, tmp_path):
    run = tmp_path / "bf16grads"
    proc = start(torchrun_cmd(args(ds, run, "train.ddp_bf16_grads=true")), tmp_path, tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    got, want = losses(run / "metrics.jsonl"), losses(reference / "metrics.jsonl")
    assert sorted(got) == sorted(want)
    assert got != want  # the hook really ran (bf16 sums differ in the last bits)
    assert max(abs(got[s] - want[s]) for s in want) < 1e-2


def test_an_unwritable_checkpoint_stops_both_ranks_without_a_hang(ds, tmp_path):
    """Rank 0 cannot write the step-4 checkpoint (a file-size limit stands in for a full disk): it tells
    rank 1, both exit with the error (no rank left waiting at the next collective), nothing is kept."""
    import resource
    import signal
    import subprocess

    from tests.test_train_utils import env

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the weights are ~6 MB

    run = tmp_path / "full"
    proc = subprocess.run(torchrun_cmd(args(ds, run)), cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)
    out = proc.stdout + proc.stderr
    # each rank exits with gptcore.training.train's EXIT_BAD_INPUT (2); the torchrun agent itself always exits 1 when
    # a worker fails, and lists every failed rank's own exit code in its ChildFailedError report
    assert proc.returncode == 1, (proc.returncode, out[-3000:])
    codes = rank_exit_codes(out)
    # the first rank to exit gives 2; torchrun then SIGTERMs the rest, which may beat their own exit 2 (-15);
    # a rank that hung and was killed at the timeout, or crashed with a traceback, gives something else
    assert set(codes) == {"0", "1"} and "2" in codes.values() and set(codes.values()) <= {"2", "-15"}, \
        (codes, out[-3000:])
    assert out.count("error: checkpoint step 4 could not be written") == 2, out[-3000:]  # both ranks
    assert not list((run / "checkpoints").iterdir())


def test_a_profile_at_launch_and_on_demand_on_every_rank_reaches_mlflow(ds, tmp_path, mlflow_server):
    """`train.profile_steps=2` records steps 2-3 of the launch (after the compile step) and a PROFILE file
    asking for 2 steps, seen at the next poll (step 5), records steps 5-6: on both ranks, a Chrome trace and
    a table of the top operators each, the file removed afterwards, one `profile` row and event per
    recording. The MLflow shipper attaches both recordings to the run as artifacts, and the MLflow run
    compares equal to its run directory, step by step (benchmarks/loss_compare with runs:/<id>)."""
    from integrations import tracking

    run = tmp_path / "profiled"
    run.mkdir()
    (run / "PROFILE").write_text("2\n")
    proc = start(torchrun_cmd(args(ds, run, "train.profile_steps=2", "train.max_steps=8")), tmp_path,
                 tmp_path / "log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
    folders = sorted(p.name for p in (run / "profiles").iterdir())
    assert folders == ["step_00000002-00000003", "step_00000005-00000006"]
    for folder in folders:
        for rank in (0, 1):
            trace = json.loads((run / "profiles" / folder / f"rank{rank}.trace.json").read_text())
            names = {e.get("name", "") for e in trace["traceEvents"]}
            assert any(n.startswith("aten::") for n in names), folder  # the steps' operators are in it
            top = (run / "profiles" / folder / f"rank{rank}.top.txt").read_text()
            assert f"rank {rank}" in top and "Self CPU" in top
    assert not (run / "PROFILE").exists() and not list((run / "profiles").rglob("*.tmp"))
    rows = read_metrics(run / "metrics.jsonl", "profile")
    assert [(r["first_step"], r["last_step"], r["dir"]) for r in rows] == [
        (2, 3, "profiles/step_00000002-00000003"), (5, 6, "profiles/step_00000005-00000006")]
    assert "profiled steps 5-6: profiles/step_00000005-00000006/" in (tmp_path / "log").read_text()
    shipper = tracking.Shipper(run, mlflow_server.uri)
    shipper.ship_once(final=True)
    from mlflow import MlflowClient

    listed = [f.path for f in MlflowClient(mlflow_server.uri).list_artifacts(shipper.run_id,
                                                                               "profiles/step_00000005-00000006")]
    assert sorted(listed) == [f"profiles/step_00000005-00000006/rank{r}.{kind}" for r in (0, 1)
                              for kind in ("top.txt", "trace.json")]
    # the MLflow run is the same run, step for step: loss_compare reads it back from the server
    uri = ["--tracking-uri", mlflow_server.uri]
    assert loss_compare.main([f"runs:/{shipper.run_id}", str(run), *uri, "--assert-equal"]) == 0
    with pytest.raises(SystemExit, match="has no train/loss metrics on this server; check the run id"):
        loss_compare.main(["runs:/0123456789abcdef0123456789abcdef", str(run), *uri])
