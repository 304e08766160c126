"""Contamination (gptcore/evals/scorers/contamination.py): evaluation examples that share a 13-token n-gram with the
training shards are found, the others are not, and the answer is cached beside the manifest."""

from __future__ import annotations

import numpy as np
import pytest

from gptcore.data.shard_format import Manifest, ShardInfo, write_shard
from gptcore.evals.scorers import contamination as C
from gptcore.evals.scorers import hellaswag
from tests.test_hellaswag import FIXTURE


def dataset(directory, planted: list[np.ndarray], val_plant: np.ndarray):
    rng = np.random.default_rng(0)
    directory.mkdir()
    infos = []
    for i in range(3):
        toks = rng.integers(0, 300, 5000)  # token ids no English word of the fixture uses
        if i == 1:  # the planted windows, in the middle of a train shard
            toks = np.concatenate([toks[:1000], *planted, toks[1000:]])
        if i == 0:  # a val shard may hold an example: it is not training data
            toks = np.concatenate([toks, val_plant])
        split = "val" if i == 0 else "train"
        name = f"c_{split}_{i}.bin"
        infos.append(ShardInfo(name, split, len(toks), write_shard(directory / name, toks)))
    Manifest(shard_tokens=10_000, source={"test": 0}, shards=infos).save(directory)
    return directory


def test_ngram_hashes_match_windows_not_neighbours():
    a = np.arange(40)
    h = C.ngram_hashes(a, 13)
    assert len(h) == 28 and len(set(h.tolist())) == 28
    assert C.ngram_hashes(a[5:18], 13)[0] == h[5]  # the same 13 tokens anywhere hash the same
    assert len(C.ngram_hashes(a[:12], 13)) == 0  # shorter than n: no n-gram
    assert C.ngram_hashes(np.zeros(13), 13)[0] != C.ngram_hashes(np.array([0] * 12 + [1]), 13)[0]


def test_planted_examples_are_found_and_clean_ones_not(tmp_path, monkeypatch):
    examples = [hellaswag.make_example(*r) for r in hellaswag.read_records(FIXTURE)]
    evals = [ex.tokens for ex in examples]
    assert len(evals) == 7 and min(len(t) for t in evals) > 20
    planted = [np.array(evals[1][3:16]),  # exactly 13 tokens of example 1's context
               np.array(evals[4][-20:])]  # the tail of example 4's last ending
    near_miss = np.array(evals[2][:12])  # 12 tokens of example 2: not a 13-gram
    d = dataset(tmp_path / "ds", [*planted, near_miss], val_plant=np.array(evals[5][:30]))
    report = C.contamination(d, {"hellaswag": evals})["hellaswag"]
    assert report["ids"] == [1, 4], report  # 2 (12 tokens) and 5 (in the val split only) are clean
    assert report["contaminated"] == 2 and report["examples"] == 7 and report["share"] == pytest.approx(2 / 7)
    cached = list((d / C.CACHE_DIR).glob("hellaswag-n13-*.json"))
    assert len(cached) == 1

    # the next evaluation (any run on this dataset) reads the answer instead of scanning again
    monkeypatch.setattr(C, "scan", lambda *a, **k: pytest.fail("scanned again"))
    assert C.contamination(d, {"hellaswag": evals})["hellaswag"] == report
    # other examples, or another n: a new scan
    with pytest.raises(pytest.fail.Exception):
        C.contamination(d, {"hellaswag": evals[:3]})


def test_the_evaluate_command_reports_it_for_the_checkpoints_dataset(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from gptcore.checkpoints import checkpoint
    from gptcore.model.gpt import GPT
    from gptcore.overrides import load_config

    examples = [hellaswag.make_example(*r) for r in hellaswag.read_records(FIXTURE)]
    d = dataset(tmp_path / "ds", [np.array(examples[6].tokens[:40])], val_plant=np.arange(5))
    cfg = load_config("micro", [f"data.dataset_dir={d}", "train.run_name=cont"])
    torch.manual_seed(0)
    ckpt = checkpoint.save_checkpoint(tmp_path / "run", 3, GPT(cfg.model), {"optimizer": {}},
                                      {"config": cfg.to_dict(), "run_name": "cont"}, keep_last=2)
    r = subprocess.run([sys.executable, "-m", "gptcore.evals.evaluate", str(ckpt), "--hellaswag", str(FIXTURE),
                        "--contamination", "13", "--set", "eval.hellaswag.exclude_contaminated=true",
                        "--device", "cpu"],
                       capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["contamination"] == {"hellaswag": {"n": 13, "examples": 7, "contaminated": 1, "share": 1 / 7}}
    assert out["hellaswag"]["n"] == 7
    # eval.hellaswag.exclude_contaminated: HellaSwag on its clean examples too (example 6 left out)
    assert out["hellaswag"]["clean_n"] == 6 and 0 <= out["hellaswag"]["clean_acc"] <= 1
    assert "clean_acc_norm_stderr" in out["hellaswag"]


def test_the_scan_finds_n_grams_across_its_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "CHUNK", 100)  # a shard is hashed 100 n-grams at a time
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 50000, 1000)
    d = tmp_path / "d"
    d.mkdir()
    info = ShardInfo("a_train_0.bin", "train", 1000, write_shard(d / "a_train_0.bin", toks))
    Manifest(shard_tokens=1000, source={"t": 0}, shards=[info]).save(d)
    m = Manifest.load(d)
    for start in (0, 90, 95, 99, 100, 187, 987):  # inside, straddling and at the edges of chunks
        wanted = np.unique(C.ngram_hashes(toks[start:start + 13], 13))
        assert C.scan(d, m, wanted, 13).all(), start
    assert not C.scan(d, m, np.unique(C.ngram_hashes(np.arange(13) + 60000, 13)), 13).any()


def test_harness_task_documents_are_scanned_in_the_same_pass(tmp_path, monkeypatch):
    """A harness task's documents (prompt and choices, tokenized as the model reads them) are checked too:
    the one planted in a train shard is found, the others are not, and a task that cannot load is a skip."""
    import torch

    monkeypatch.setenv("GPTPIPE_CODE_ROOTS", str(tmp_path))  # the operator's root for task folders

    from gptcore.evals.evaluate import evaluate_model
    from gptcore.evals.scorers.harness import task_documents
    from gptcore.model.gpt import GPT
    from gptcore.overrides import load_config
    from tests.test_harness import toy_task

    words = np.random.default_rng(3).permutation(["river", "candle", "orbit", "velvet", "harbor", "meadow",
                                                  "pepper", "glacier", "lantern", "compass", "saddle", "thistle"])
    rows = [{"question": f"Story {i}: the {words[i]} met the {words[(i + 5) % 12]} near the {words[(i + 7) % 12]} "
                         f"and then the {words[(i + 3) % 12]} said what?", "choices": ["yes", "no"], "label": 0}
            for i in range(8)]
    folder = toy_task(tmp_path / "tasks", rows=rows, name="distinct")
    docs = task_documents(["distinct"], str(folder))["distinct"]
    assert len(docs) == 8 and all(len(d) >= 18 for d in docs)
    d = dataset(tmp_path / "ds", [np.array(docs[5][2:18])], val_plant=np.array(docs[1]))
    cfg = load_config("micro", [f"data.dataset_dir={d}", "eval.hellaswag.enabled=false", "eval.contamination.ngram=13",
                                "eval.harness.tasks=distinct,no_such_task", f"eval.harness.include_path={folder}"])
    torch.manual_seed(0)
    out = evaluate_model(GPT(cfg.model), cfg, "cpu", only=["contamination"])["contamination"]
    assert out["harness"]["distinct"] == {"n": 13, "examples": 8, "contaminated": 1, "share": 1 / 8}
    assert "skipped" in out["harness"]["no_such_task"] and "hellaswag" not in out
    assert "harness" not in evaluate_model(GPT(cfg.model), cfg, "cpu", only=["contamination"])  # only asked part
