"""Evaluations are components (gptcore/evals): one defined and registered inside this test, with no other
file changed, is run by the evaluate stage, stored in eval.json with its settings, becomes metrics of the
registered version's logged model in MLflow (with its standard error) and a leaderboard column."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow import MlflowClient

from gptcore import evals
from gptcore.checkpoints import checkpoint
from gptcore.model.gpt import GPT
from gptcore.overrides import load_config
from tasks import leaderboard, register
from tasks.evaluate import evaluate_dir, stored_evaluation

pytestmark = pytest.mark.slow


class MeanWeight(evals.Evaluation):
    """A toy evaluation: the mean of the final LayerNorm's weight (a number that differs per checkpoint)."""
    name = "meanweight"
    headline = "score"

    def settings(self, cfg) -> dict:
        return {"what": "ln_f.weight"}

    def run(self, ctx: evals.Context) -> dict:
        w = ctx.model.transformer.ln_f.weight.detach().float()
        return {"score": float(w.mean()), "score_stderr": float(w.std() / len(w) ** 0.5), "n": len(w)}


@pytest.fixture
def toy():
    evaluation = evals.register(MeanWeight())
    try:
        yield evaluation
    finally:
        evals.unregister(evaluation.name)


def test_a_new_evaluation_reaches_eval_json_the_logged_model_and_the_leaderboard(toy, mlflow_server, tmp_path):
    cfg = load_config("micro", ["train.run_name=toy", "eval.hellaswag.enabled=false"])
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(0.75)
    ckpt = checkpoint.save_checkpoint(tmp_path / "toy", 4, model, {"optimizer": {}},
                                      {"config": cfg.to_dict(), "run_name": "toy", "val_loss": 9.0,
                                       "identity_hash": cfg.identity_hash()}, keep_last=3)
    assert stored_evaluation(ckpt, cfg, val=False) is None
    result = evaluate_dir(ckpt, val=False, device="cpu")
    stored = json.loads((ckpt / "eval.json").read_text())
    assert stored["meanweight"] == result["meanweight"] == {"score": 0.75, "score_stderr": 0.0, "n": cfg.model.n_embd}
    assert stored["settings"]["evaluations"] == {"meanweight": {"what": "ln_f.weight"}}
    assert stored_evaluation(ckpt, cfg, val=False) == stored  # done: the next stage run skips it

    uri = mlflow_server.uri
    r = register.register_checkpoint(ckpt, model_name="toy-eval", tracking_uri=uri, hf=False)
    metrics = {m.key: m.value for m in MlflowClient(uri, registry_uri=uri).get_logged_model(r["model_id"]).metrics}
    assert metrics["meanweight/score"] == 0.75 and metrics["meanweight/score_stderr"] == 0.0
    board = leaderboard.leaderboard("toy-eval", uri)
    assert list(board["meanweight_score"]) == [0.75] and list(board["meanweight_score_stderr"]) == [0.0]
    assert list(board["meanweight_score_vs_best"]) == ["best"]  # its headline, compared as HellaSwag's is

    # without it registered, the same checkpoint's stored evaluation no longer matches the settings
    evals.unregister("meanweight")
    assert stored_evaluation(ckpt, cfg, val=False) is None
    assert "meanweight" not in evaluate_dir(ckpt, val=False, device="cpu")


class Planted(evals.Evaluation):
    """A toy evaluation with documents: the contamination scan covers it with no line of its own."""
    name = "planted"
    has_documents = True

    def __init__(self, docs):
        self.docs = docs

    def documents(self, ctx: evals.Context) -> dict:
        return {"planted/found": self.docs, "planted/missing": "no such split here"}


def test_contamination_scans_every_evaluations_documents(tmp_path):
    """Contamination names no evaluation: it loops over the registry's `documents`. A toy evaluation
    registered here gets its documents scanned against the training shards (the one planted in a train
    shard found, the other not) and its settings are part of contamination's, so a change re-scans."""
    import numpy as np

    from gptcore.evals.contamination import Contamination
    from tests.test_contamination import dataset

    rng = np.random.default_rng(7)
    inside, outside = [int(t) for t in rng.integers(0, 50000, 20)], [int(t) for t in rng.integers(0, 50000, 20)]
    d = dataset(tmp_path / "ds", [np.array(inside)], val_plant=np.array(outside[:5]))
    cfg = load_config("micro", ["eval.hellaswag.enabled=false", "eval.contamination.ngram=13"])
    toy = evals.register(Planted([inside, outside]))
    try:
        contamination = Contamination()
        assert contamination.enabled(cfg) and contamination.settings(cfg)["documents"] == {"planted": {}}
        result = contamination.run(evals.Context(None, cfg, "cpu", data_dir=d))
    finally:
        evals.unregister(toy.name)
    assert result["planted"]["found"]["examples"] == 2 and result["planted"]["found"]["contaminated"] == 1
    assert result["planted"]["missing"] == {"skipped": "no such split here"}
    assert not contamination.enabled(cfg)  # with no evaluation that has documents, nothing to scan
