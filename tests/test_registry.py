"""Checkpoint registration (tasks/register.py) and loading back (tasks/generate.py) against a real
`mlflow server` with a SQLite backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow.artifacts
import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus
from transformers import GPT2LMHeadModel

from gptcore.checkpoints import checkpoint, run_files
from gptcore.model.gpt import GPT
from gptcore.model.hf import load_hf_dir
from gptcore.model.tokenizer import decode, encode
from gptcore.overrides import load_config
from integrations.mlflow_store import resolve_model_uri
from tasks import register
from tasks.generate import load
from tests.test_hf import assert_same, tokens

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Hello, I'm a language model,"
PARAMS = {"max_new_tokens": 12, "temperature": 1.0, "top_k": 50, "seed": 7}


def save_ckpt(run_dir: Path, step: int, val_loss: float | None, seed: int, hellaswag=None) -> Path:
    cfg = load_config("micro", [f"train.run_name={run_dir.name}"])
    torch.manual_seed(seed)
    model = GPT(cfg.model)
    meta = {"tokens_seen": step * cfg.train.total_batch_tokens, "val_loss": val_loss, "hellaswag": hellaswag,
            "config": cfg.to_dict(), "manifest_id": "manifest-xyz", "run_name": cfg.run_name,
            "identity_hash": cfg.identity_hash()}
    return checkpoint.save_checkpoint(run_dir, step, model, {"optimizer": {}}, meta, keep_last=10)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    a = save_ckpt(root / "micro", 5, 9.0, seed=1, hellaswag={"acc": 0.25, "acc_norm": 0.26, "n": 20})
    b = save_ckpt(root / "micro-b", 10, 9.5, seed=2)  # worse, and from another run of the same preset
    c = save_ckpt(root / "micro", 15, 8.0, seed=3)  # better
    return a, b, c


def test_register_versions_tags_aliases_idempotent(mlflow_server, ckpts, monkeypatch, tmp_path):
    monkeypatch.setenv("GPTPIPE_CODE_VERSION", "test-commit")
    a, b, c = ckpts
    uri = mlflow_server.uri
    mlc = MlflowClient(uri, registry_uri=uri)

    r1 = register.register_checkpoint(a, tracking_uri=uri, flow_run_id="flow-1", hf=True)
    assert (r1["name"], r1["version"], r1["created"]) == ("micro", "1", True)
    assert r1["aliases"] == ["best", "latest"]
    assert r1["headline"] == {"hellaswag/acc_norm": "0.2600"}  # each evaluation's headline (no stderr recorded)
    meta = run_files.read_meta(a)
    mv = mlc.get_model_version("micro", "1")
    assert mv.tags["step"] == "5"  # identity stays a tag; measurements are metrics of the logged model
    assert not {"val_loss", "tokens_seen", "hellaswag_acc", "hellaswag_acc_norm"} & set(mv.tags)
    measured = {m.key: (m.value, m.step) for m in mlc.get_logged_model(r1["model_id"]).metrics}
    assert measured == {"val/loss": (9.0, 5), "hellaswag/acc": (0.25, 5), "hellaswag/acc_norm": (0.26, 5),
                        "train/step": (5.0, 5), "train/tokens_seen": (float(meta["tokens_seen"]), 5)}
    assert mv.tags["manifest_id"] == "manifest-xyz" and mv.tags["config_hash"] == meta["identity_hash"]
    assert mv.tags["code_version"] == "test-commit" and mv.tags["flow_run_id"] == "flow-1"
    assert mv.tags["checkpoint_sha256"] == meta["model_sha256"]
    assert (mv.tags["optimizer"], mv.tags["schedule"]) == ("adamw", "cosine")  # the recipe, for comparisons
    # MLflow 3: the version comes from a LoggedModel linked to the training run's MLflow run
    lm = mlc.get_logged_model(r1["model_id"])
    assert mv.source == f"models:/{lm.model_id}" and lm.status == LoggedModelStatus.READY
    run = mlc.get_run(lm.source_run_id)
    assert run.data.tags["gptpipe.run_name"] == "micro"
    assert lm.model_id in [o.model_id for o in run.outputs.model_outputs]
    arts = {f.path for f in mlc.list_logged_model_artifacts(lm.model_id)}
    assert {"MLmodel", "artifacts", "code"} <= arts, arts
    # the Hugging Face export rides along with the logged model: downloaded from the server, it loads in
    # transformers with every tensor in place and gives the checkpoint's own logits, loss and greedy tokens
    hf = {f.path for f in mlc.list_logged_model_artifacts(lm.model_id, "hf")}
    assert {"hf/config.json", "hf/model.safetensors"} <= hf, hf
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # resolves the logged model's mlflow-artifacts: location
    hf_dir = mlflow.artifacts.download_artifacts(artifact_uri=f"{lm.artifact_location}/hf",
                                                 dst_path=str(tmp_path), tracking_uri=uri)
    hf_model, info = GPT2LMHeadModel.from_pretrained(hf_dir, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    ours, _ = checkpoint.load_model(a, device="cpu")
    assert_same(ours, hf_model.eval(), tokens(B=2, T=ours.config.block_size, seed=11))  # within 1e-5
    prompt = torch.tensor([encode(PROMPT)])
    greedy = hf_model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=50256,
                               attention_mask=torch.ones_like(prompt))
    assert torch.equal(greedy, ours.generate(prompt, max_new_tokens=8, temperature=0.0))
    assert_same(load_hf_dir(hf_dir), hf_model, tokens(B=1, T=16, seed=12))  # and it reads back into gptcore

    assert register.registered_version(a, tracking_uri=uri)["version"] == "1"
    assert register.registered_version(b, tracking_uri=uri) is None
    # the same checkpoint again: the existing version, nothing new; what was recorded stays
    (a / "eval.json").write_text(json.dumps({"val_loss": 9.1, "hellaswag": {"acc": 0.3, "acc_norm": 0.31}}))
    again = register.register_checkpoint(a, tracking_uri=uri, flow_run_id="flow-2", hf=True)
    assert (again["version"], again["created"]) == ("1", False)
    assert len(mlc.search_model_versions("name = 'micro'")) == 1
    assert again["tags"]["flow_run_id"] == "flow-1"
    assert len(mlc.get_logged_model(r1["model_id"]).metrics) == 5

    # worse val loss (other run, same preset -> same registered model): latest moves, best stays
    r2 = register.register_checkpoint(b, tracking_uri=uri, hf=True)
    assert (r2["name"], r2["version"], r2["aliases"]) == ("micro", "2", ["latest"])
    assert mlc.get_model_version_by_alias("micro", "best").version == "1"
    assert resolve_model_uri("models:/micro@latest") == "models:/micro/latest"

    # better val loss: best moves
    r3 = register.register_checkpoint(c, tracking_uri=uri, hf=True)
    assert (r3["version"], r3["aliases"]) == ("3", ["best", "latest"])
    assert mlc.get_model_version_by_alias("micro", "best").version == "3"
    # re-registering the old best does not take the alias back
    assert register.register_checkpoint(a, tracking_uri=uri, hf=True)["aliases"] == []
    assert mlc.get_model_version_by_alias("micro", "best").version == "3"
    # a diverged run (val loss NaN) never becomes best
    d = save_ckpt(c.parent.parent, 20, float("nan"), seed=4)
    r4 = register.register_checkpoint(d, tracking_uri=uri, hf=False)
    assert (r4["version"], r4["aliases"]) == ("4", ["latest"])
    assert "val/loss" not in {m.key for m in mlc.get_logged_model(r4["model_id"]).metrics}
    assert mlc.get_model_version_by_alias("micro", "best").version == "3"
    # never one model per run (the session's server also holds other tests' models, under other names)
    assert [m.name for m in mlc.search_registered_models("name LIKE 'micro%'")] == ["micro"]

    # the flow's read-only lookup (REST, no mlflow import) describes a version exactly as the client does
    for ck, version in ((a, "1"), (c, "3"), (d, "4")):
        over_rest = register.registered_version(ck, tracking_uri=uri)
        by_client = register._describe(mlc, "micro", version, False, uri)
        assert over_rest == by_client, (over_rest, by_client)


def test_load_by_alias_generates_the_checkpoints_tokens(mlflow_server, ckpts):
    _, _, c = ckpts
    uri = mlflow_server.uri
    register.register_checkpoint(c, tracking_uri=uri, hf=True)  # idempotent if the test above ran
    model, _ = checkpoint.load_model(c)
    out = model.generate(torch.tensor([encode(PROMPT)]), PARAMS["max_new_tokens"],
                         temperature=PARAMS["temperature"], top_k=PARAMS["top_k"], seed=PARAMS["seed"])
    want = decode(out[0].tolist())

    # the registered weights (sha256-checked against the version's tag), never the stored pyfunc code:
    # tests/test_generate.py covers tampering
    registered = load("models:/micro@best", uri)
    assert registered.predict([PROMPT], params=PARAMS) == [want]
    for (k, v), (k2, v2) in zip(model.state_dict().items(), registered.model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k
    # `@latest` (a reserved alias name in MLflow) means the newest version
    mlc = MlflowClient(uri, registry_uri=uri)
    newest = max(mlc.search_model_versions("name = 'micro'"), key=lambda v: int(v.version))
    latest = load("models:/micro@latest", uri)
    assert latest.meta["model_sha256"] == newest.tags["checkpoint_sha256"] == latest.sha256
    assert latest.version == newest.version
    # the same generation via the command line, in a fresh process
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "tasks.generate", "models:/micro@best", "--prompt", PROMPT,
                        "--max-new-tokens", "12", "--seed", "7"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == want.splitlines()[0]


def test_bad_checkpoints_are_refused(mlflow_server, tmp_path, ckpts, capsys):
    with pytest.raises(register.RegistryError, match="not a checkpoint"):
        register.register_checkpoint(tmp_path / "nope", tracking_uri=mlflow_server.uri)
    a = ckpts[0]
    bad = tmp_path / "step_00000005"
    bad.mkdir()
    (bad / "meta.json").write_text((a / "meta.json").read_text())
    weights = bytearray((a / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF  # one flipped bit in the weights
    (bad / "model.safetensors").write_bytes(bytes(weights))
    before = len(MlflowClient(mlflow_server.uri, registry_uri=mlflow_server.uri).search_model_versions())
    with pytest.raises(register.RegistryError, match="corrupt"):
        register.register_checkpoint(bad, tracking_uri=mlflow_server.uri)
    assert len(MlflowClient(mlflow_server.uri, registry_uri=mlflow_server.uri).search_model_versions()) == before
    assert register.main([str(tmp_path / "nope"), "--tracking-uri", mlflow_server.uri]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    (bad / "meta.json").write_text('{"step": 5')  # truncated
    assert register.main([str(bad), "--tracking-uri", mlflow_server.uri, "--no-hf"]) == 2
    assert "meta.json cannot be read (JSONDecodeError" in capsys.readouterr().err


def test_an_unreachable_tracking_server_is_one_error_line(ckpts, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once instead of backing off
    assert register.main([str(ckpts[0]), "--tracking-uri", "http://127.0.0.1:9", "--no-hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the MLflow tracking server http://127.0.0.1:9 failed") and "idempotent" in err


def test_evaluate_a_registered_model_like_its_checkpoint(mlflow_server, ckpts, capsys):
    """`python -m tasks.evaluate models:/<name>@<alias>` scores the registered weights: the same numbers
    as evaluating the checkpoint they came from."""
    from tasks import evaluate as task_eval

    _, _, c = ckpts
    uri = mlflow_server.uri
    register.register_checkpoint(c, tracking_uri=uri, hf=False)  # idempotent if the tests above ran
    fixture = str(Path(__file__).parent / "fixtures" / "hellaswag_mini.jsonl")
    assert task_eval.main([str(c), "--hellaswag", fixture]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert task_eval.main(["models:/micro@best", "--hellaswag", fixture, "--tracking-uri", uri]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["target"] == "models:/micro@best" and got["step"] == 15
    assert got["hellaswag"] == direct["hellaswag"] and got["hellaswag"]["n"] == 7
    assert task_eval.main(["models:/micro@nope", "--tracking-uri", uri]) == 2
    assert "cannot fetch models:/micro@nope" in capsys.readouterr().err
    assert task_eval.main(["models:/micro@best", "--tracking-uri"]) == 2
    assert "--tracking-uri needs a value" in capsys.readouterr().err


def test_concurrent_registrations_of_one_checkpoint_make_one_version(mlflow_server, tmp_path):
    """Four `python -m tasks.register` processes at once on one checkpoint: one version survives (each
    creator removes its duplicate of an older version); the same weights from another run (another run
    identity) are a registration of their own."""
    ck = save_ckpt(tmp_path / "racer", 7, 8.5, seed=11)
    name = "race-model"
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPTPIPE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "tasks.register", str(ck), "--name", name, "--tracking-uri", mlflow_server.uri,
           "--no-hf"]
    procs = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    versions = {json.loads(o[0])["version"] for o in outs}
    mlc = MlflowClient(mlflow_server.uri, registry_uri=mlflow_server.uri)
    alive = mlc.search_model_versions(f"name = '{name}'")
    assert len(alive) == 1 and versions == {alive[0].version}, (versions, [v.version for v in alive])
    # the same weights, trained in another run: not "already registered"
    other_run = tmp_path / "other" / "checkpoints"
    other_run.mkdir(parents=True)
    ck2 = other_run / ck.name
    import shutil
    shutil.copytree(ck, ck2)
    meta = json.loads((ck2 / "meta.json").read_text())
    meta["identity_hash"], meta["run_name"] = "another-identity", "other"
    (ck2 / "meta.json").write_text(json.dumps(meta))
    assert register.registered_version(ck2, name, tracking_uri=mlflow_server.uri) is None
    r = register.register_checkpoint(ck2, name, tracking_uri=mlflow_server.uri, hf=False)
    assert r["created"] and r["version"] != alive[0].version


def test_the_training_dataset_is_an_input_of_the_run_and_tied_to_the_model(mlflow_server, tmp_path):
    """Lineage: the registered model's run lists its training dataset (name, digest = the manifest id,
    source = the hub repo at the recorded commit, config and split), and the logged model carries a metric
    tied to that dataset, so models:/<name>/<version> -> dataset -> source files is traceable."""
    from gptcore.data.shard_format import Manifest
    from tests.test_train_utils import make_dataset

    ds = make_dataset(tmp_path / "ds")
    m = Manifest.load(ds)
    commit = "c" * 40
    m.source = {**m.source, "source": "hf", "hf": {"repo": "someone/corpus", "config": "", "split": "train",
                                                 "revision": "main", "commit": commit}}
    m.save(ds)
    m = Manifest.load(ds)
    run_dir = tmp_path / "lineage"
    ck = save_ckpt(run_dir, 4, 9.1, seed=4)
    (run_dir / run_files.RUN_FILE).write_text(json.dumps({"run_name": "lineage", "dataset_dir": str(ds)}))
    uri = mlflow_server.uri
    mlc = MlflowClient(uri, registry_uri=uri)
    r = register.register_checkpoint(ck, model_name="lineage", tracking_uri=uri, hf=False)
    lm = mlc.get_logged_model(r["model_id"])
    inputs = mlc.get_run(lm.source_run_id).inputs.dataset_inputs
    context = {[t.value for t in i.tags if t.key == "mlflow.data.context"][0]: i.dataset for i in inputs}
    assert sorted(context) == ["training", "validation"]
    d = context["training"]
    assert (d.name, d.digest, d.source_type) == ("ds", m.id, "hugging_face")
    assert (context["validation"].name, context["validation"].digest) == ("ds/val", m.id)
    source = json.loads(d.source)
    assert (source["path"], source["revision"], source["split"]) == ("someone/corpus", commit, "train")
    tied = {x.key: (x.dataset_name, x.dataset_digest) for x in lm.metrics}
    assert tied["train/tokens_seen"] == ("ds", m.id) and tied["val/loss"] == ("ds/val", m.id)
    register.register_checkpoint(ck, model_name="lineage", tracking_uri=uri, hf=False)  # again: no new input
    assert len(mlc.get_run(lm.source_run_id).inputs.dataset_inputs) == 2

    local_ds = make_dataset(tmp_path / "local-ds")  # a local source: its path is the source
    run_dir = tmp_path / "lineage-local"
    ck = save_ckpt(run_dir, 4, 9.2, seed=5)
    (run_dir / run_files.RUN_FILE).write_text(json.dumps({"run_name": "lineage-local", "dataset_dir": str(local_ds)}))
    r = register.register_checkpoint(ck, model_name="lineage-local", tracking_uri=uri, hf=False)
    d = next(i.dataset for i in mlc.get_run(mlc.get_logged_model(r["model_id"]).source_run_id).inputs.dataset_inputs
             if i.dataset.name == "local-ds")
    assert (d.digest, d.source_type, json.loads(d.source)["uri"]) == (Manifest.load(local_ds).id, "local",
                                                                       str(local_ds))


def test_models_compare_by_their_metrics_and_the_leaderboard(mlflow_server, tmp_path, capsys):
    """Two registrations with different val losses: the logged models carry the values as metrics,
    search_logged_models orders them by val loss, `best` is the lower, a tie keeps the older version, and
    the pandas leaderboard (and its CLI, CSV included) has one row per version with the right values."""
    import pandas as pd

    from tasks import leaderboard

    uri = mlflow_server.uri
    mlc = MlflowClient(uri, registry_uri=uri)
    worse = save_ckpt(tmp_path / "board", 10, 7.5, seed=11, hellaswag={"acc": 0.3, "acc_norm": 0.32, "n": 20})
    better = save_ckpt(tmp_path / "board", 20, 7.25, seed=12)
    r1 = register.register_checkpoint(worse, model_name="board", tracking_uri=uri, hf=False)
    assert r1["aliases"] == ["best", "latest"]
    r2 = register.register_checkpoint(better, model_name="board", tracking_uri=uri, hf=False)
    assert r2["aliases"] == ["best", "latest"] and mlc.get_model_version_by_alias("board", "best").version == "2"
    exp = mlc.get_logged_model(r1["model_id"]).experiment_id
    ranked = mlc.search_logged_models([exp], filter_string="name = 'board'",
                                      order_by=[{"field_name": "metrics.val/loss", "ascending": True}])
    assert [lm.model_id for lm in ranked] == [r2["model_id"], r1["model_id"]]
    tie = save_ckpt(tmp_path / "board", 30, 7.25, seed=13)  # as good as version 2: best stays on 2
    assert register.register_checkpoint(tie, model_name="board", tracking_uri=uri, hf=False)["aliases"] == ["latest"]

    board = leaderboard.leaderboard("board", uri)
    assert list(board["version"]) == [1, 2, 3]
    assert list(board.columns) == [*leaderboard.FIRST, "hellaswag_acc_norm", "hellaswag_acc_norm_stderr",
                                   "hellaswag_acc_norm_vs_best", "cost_usd", "gpu_hours", "hellaswag_acc",
                                   *leaderboard.LAST]
    assert board["gpu_hours"].isna().all()  # checkpoints made by hand record no hours (a trainer's do)
    assert list(board["val_loss"]) == [7.5, 7.25, 7.25] and list(board["step"]) == [10, 20, 30]
    assert list(board["aliases"]) == ["", "best", "latest"]
    assert board.loc[0, "hellaswag_acc"] == 0.3 and pd.isna(board.loc[1, "hellaswag_acc"])
    tokens = load_config("micro").train.total_batch_tokens
    assert list(board["tokens_seen"]) == [10 * tokens, 20 * tokens, 30 * tokens]
    assert set(board["optimizer"]) == {"adamw"} and set(board["run_name"]) == {"board"}
    assert list(board["run_id"]) == [r1["run_id"]] * 3 and board.loc[1, "model_id"] == r2["model_id"]
    assert leaderboard.best_version(board) == "2"
    # best by val loss, but its HellaSwag was not measured: not `best` on it, and nothing to compare with
    assert list(board["hellaswag_acc_norm_vs_best"]) == [None, "not measured", "not measured"]

    out = tmp_path / "board.csv"
    assert leaderboard.main(["board", "--tracking-uri", uri, "--csv", str(out), "--sort", "val_loss"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:5] == ["version", "aliases", "step", "tokens_seen", "val_loss"]
    assert list(pd.read_csv(out)["version"]) == [2, 3, 1]
    assert leaderboard.main(["nobody", "--tracking-uri", uri]) == 2
    assert "has no versions" in capsys.readouterr().err


def test_a_skipped_evaluation_never_makes_a_version_best_on_it():
    """`best` is the lowest val loss; a version whose HellaSwag was skipped (offline) has no number to be
    best on: the board says so instead of crowning it, and still ranks the measured ones against a measured
    best."""
    import pandas as pd

    from tasks import leaderboard

    nan = float("nan")
    board = pd.DataFrame({"version": [1, 2, 3], "aliases": ["best", "", "latest"], "val_loss": [7.0, 7.5, 8.0],
                          "hellaswag_acc_norm": [nan, 0.35, 0.05],
                          "hellaswag_acc_norm_stderr": [nan, 0.03, 0.01]})
    assert leaderboard.best_version(board) == "1"
    assert list(leaderboard.compared_with_best(board, "hellaswag_acc_norm")) == ["not measured", None, None]
    measured_best = board.assign(hellaswag_acc_norm=[0.31, 0.35, nan], hellaswag_acc_norm_stderr=[0.03, 0.03, nan])
    assert list(leaderboard.compared_with_best(measured_best, "hellaswag_acc_norm")) == \
        ["best", "within 2 SE", "not measured"]


def test_error_bars_and_harness_scores_reach_the_logged_model_and_the_leaderboard(mlflow_server, tmp_path):
    """eval.json as the evaluate stage writes it (HellaSwag with standard errors, lm-evaluation-harness
    tasks): each number becomes a metric of the logged model (<metric>_stderr beside it) and a leaderboard
    column, and the board marks a version whose accuracy is within two standard errors of best's."""
    from tasks import leaderboard

    uri = mlflow_server.uri
    mlc = MlflowClient(uri, registry_uri=uri)
    evals = [  # version 1 is best (lower val loss); 2 is within noise of it on acc_norm; 3 is clearly worse
        (7.0, {"acc": 0.30, "acc_stderr": 0.03, "acc_norm": 0.31, "acc_norm_stderr": 0.03, "n": 240}),
        (7.5, {"acc": 0.33, "acc_stderr": 0.03, "acc_norm": 0.35, "acc_norm_stderr": 0.03, "n": 240}),
        (8.0, {"acc": 0.05, "acc_stderr": 0.01, "acc_norm": 0.05, "acc_norm_stderr": 0.01, "n": 240}),
    ]
    for i, (val, hs) in enumerate(evals):
        ckpt = save_ckpt(tmp_path / "bars", 10 * (i + 1), val, seed=20 + i)
        (ckpt / "eval.json").write_text(json.dumps({
            "val_loss": val, "hellaswag": hs,
            "harness": {"toy_choice": {"acc": 0.5 + i / 10, "acc_stderr": 0.1, "n": 24},
                        "gone": {"skipped": "its dataset could not be loaded"}}}))
        r = register.register_checkpoint(ckpt, model_name="bars", tracking_uri=uri, hf=False)
    metrics = {m.key: m.value for m in mlc.get_logged_model(r["model_id"]).metrics}
    assert metrics["hellaswag/acc_norm_stderr"] == 0.01 and metrics["harness/toy_choice/acc"] == 0.7
    assert metrics["harness/toy_choice/acc_stderr"] == 0.1 and not any("gone" in k for k in metrics)

    board = leaderboard.leaderboard("bars", uri)
    assert list(board["hellaswag_acc_norm_stderr"]) == [0.03, 0.03, 0.01]
    assert list(board["harness_toy_choice_acc"]) == [0.5, 0.6, 0.7]
    assert list(board["hellaswag_acc_norm_vs_best"]) == ["best", "within 2 SE", "worse"]
    assert list(board.columns[-4:]) == ["run_id", "manifest_id", "model_id", "created"]
