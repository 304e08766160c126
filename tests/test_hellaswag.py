"""HellaSwag: file parsing, dataset download/cache, and the batched scorer against a reference."""

from __future__ import annotations

import http.server
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks.bench_hellaswag import reference_accuracy, reference_scores
from gptcore.evals.scorers import hellaswag
from gptcore.model.gpt import GPT
from gptcore.overrides import load_config
from gptcore.presets import model_preset

FIXTURE = Path(__file__).parent / "fixtures" / "hellaswag_mini.jsonl"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def micro_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(model_preset("micro")).eval()


# --- the file ------------------------------------------------------------------------------------

def load(path, limit=0):
    return [hellaswag.make_example(*r) for r in hellaswag.read_records(path, limit)]


def test_make_example_tokenizes_ctx_and_spaced_endings():
    ex = load(FIXTURE)
    assert len(ex) == 7 and [e.label for e in ex] == [0, 1, 2, 3, 0, 1, 2]
    first = ex[0]
    assert first.ctx == "A baker dusts a wooden table with flour. She"
    from gptcore.model.tokenizer import decode, encode
    assert first.ctx_tokens == encode(first.ctx)
    assert decode(first.ending_tokens[0]) == " " + first.endings[0]  # the leading space is part of it
    assert len(load(FIXTURE, limit=3)) == 3


@pytest.mark.parametrize("mutate, line, words", [
    (lambda lines: lines[:-1] + [lines[-1][: len(lines[-1]) // 2]], 7, "not valid JSON"),  # truncated
    (lambda lines: lines[:2] + ['{"ctx": "x", "endings": ["a", "b", "c"], "label": 0}'] + lines[3:], 3,
     "4 strings"),
    (lambda lines: lines[:4] + [lines[4].replace('"label": 0', '"label": 7')] + lines[5:], 5, "label"),
    (lambda lines: lines[:1] + [""] + lines[1:], 2, "empty"),
    (lambda lines: lines[:5] + ["[1, 2]"] + lines[5:], 6, "JSON list"),
    (lambda lines: [lines[0].replace('"ctx":', '"context":')] + lines[1:], 1, "ctx"),
])
def test_malformed_jsonl_error_names_the_line(tmp_path, mutate, line, words):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(mutate(FIXTURE.read_text().splitlines())) + "\n")
    with pytest.raises(hellaswag.HellaSwagError) as e:
        hellaswag.read_records(bad)
    assert f"{bad} line {line}" in str(e.value) and words in str(e.value)


def test_missing_file_error_says_what_to_do(tmp_path):
    with pytest.raises(hellaswag.HellaSwagError, match="eval.hellaswag.path"):
        hellaswag.read_records(tmp_path / "nope.jsonl")


# --- download and cache --------------------------------------------------------------------------

def full_size_file() -> bytes:
    """A synthetic 10,042-example file (fixture examples cycled): passes the line-count check."""
    lines = FIXTURE.read_text().splitlines()
    return ("\n".join(lines[i % len(lines)] for i in range(hellaswag.VAL_EXAMPLES)) + "\n").encode()


@pytest.fixture
def http_server():
    """Serves {path: bytes} on 127.0.0.1; records request paths."""
    files: dict[str, bytes] = {}
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", files, hits, srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTPIPE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_fetch_downloads_once_then_uses_cache(home, http_server, monkeypatch):
    url, files, hits, srv = http_server
    data = full_size_file()
    files["/hellaswag_val.jsonl"] = data
    monkeypatch.setenv(hellaswag.URL_ENV, url + "/hellaswag_val.jsonl")
    cfg = load_config("micro")
    path, _ = hellaswag.fetch(cfg)
    assert path == home / "hellaswag" / "hellaswag_val.jsonl" and path.read_bytes() == data
    assert hits == ["/hellaswag_val.jsonl"]
    assert [p.name for p in path.parent.iterdir()] == ["hellaswag_val.jsonl"]  # no temp files left
    srv.shutdown()  # the second call must not need the network
    assert hellaswag.fetch(cfg) == (path, "") and hits == ["/hellaswag_val.jsonl"]
    assert len(hellaswag.read_records(path)) == hellaswag.VAL_EXAMPLES


def test_fetch_verifies_pinned_sha256(home, http_server, monkeypatch):
    url, files, _, _ = http_server
    data = full_size_file()
    files["/v.jsonl"] = data
    monkeypatch.setenv(hellaswag.URL_ENV, url + "/v.jsonl")
    monkeypatch.setattr(hellaswag, "VAL_SHA256", "0" * 64)
    path, reason = hellaswag.fetch(load_config("micro"))
    assert path is None and "sha256" in reason and not (home / "hellaswag" / "hellaswag_val.jsonl").exists()
    import hashlib
    monkeypatch.setattr(hellaswag, "VAL_SHA256", hashlib.sha256(data).hexdigest())
    assert hellaswag.fetch(load_config("micro"))[0] is not None


def test_fetch_rejects_incomplete_download(home, http_server, monkeypatch):
    url, files, _, _ = http_server
    files["/short.jsonl"] = FIXTURE.read_bytes()  # valid lines, but 7 instead of 10,042
    monkeypatch.setenv(hellaswag.URL_ENV, url + "/short.jsonl")
    path, reason = hellaswag.fetch(load_config("micro"))
    assert path is None and "7 lines, expected 10042" in reason
    assert not (home / "hellaswag" / "hellaswag_val.jsonl").exists()
    monkeypatch.setenv(hellaswag.URL_ENV, url + "/moved.jsonl")  # HTTP 404
    path, reason = hellaswag.fetch(load_config("micro"))
    assert path is None and "404" in reason


def test_fetch_unreachable_returns_none_with_reason(home, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(hellaswag.URL_ENV, f"http://127.0.0.1:{port}/hellaswag_val.jsonl")
    path, reason = hellaswag.fetch(load_config("micro"))
    assert path is None and f"127.0.0.1:{port}" in reason
    assert "cannot download" in reason and "eval.hellaswag.path" in reason


def test_fetch_local_path(home, tmp_path, monkeypatch):
    monkeypatch.setenv(hellaswag.URL_ENV, "http://127.0.0.1:9/never-used")
    cfg = load_config("micro", [f"eval.hellaswag.path={FIXTURE}"])
    assert hellaswag.fetch(cfg) == (FIXTURE, "")
    cfg = load_config("micro", [f"eval.hellaswag.path={tmp_path / 'missing.jsonl'}"])
    path, reason = hellaswag.fetch(cfg)
    assert path is None and "missing.jsonl does not exist" in reason


# --- scoring -------------------------------------------------------------------------------------

def test_batched_scores_equal_per_ending_reference():
    model = micro_model()
    records = hellaswag.read_records(FIXTURE)
    examples = [hellaswag.make_example(*r) for r in records]
    ref_sums, ref_means = reference_scores(model, records)
    # 2 examples per forward: several batches, the last one padded with empty rows
    sums, counts = hellaswag.score(model, examples, "cpu", batch_tokens=2 * 4 * 32)
    torch.testing.assert_close(sums, torch.tensor(ref_sums, dtype=torch.float64), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums / counts, torch.tensor(ref_means, dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [[len(t) for t in ex.ending_tokens] for ex in examples]
    got, want = hellaswag.evaluate(model, examples, "cpu"), reference_accuracy(model, records)
    assert {k: got[k] for k in want} == want
    n = want["n"]  # the binomial standard error lm-evaluation-harness reports: sample std / sqrt(n)
    for k in ("acc", "acc_norm"):
        outcomes = [1.0] * round(want[k] * n) + [0.0] * (n - round(want[k] * n))
        assert got[f"{k}_stderr"] == pytest.approx(statistics.stdev(outcomes) / math.sqrt(n))


@pytest.mark.slow  # torch.compile
def test_a_compiled_model_is_scored_eagerly_on_the_plain_model():
    """The trainer's model is torch.compile(DDP(gpt)): scoring unwraps it and runs the plain GPT eagerly, so
    HellaSwag's many shapes (35 examples over every bucket of the micro model, rows longer than the block
    included) compile no graph at all (before: one per bucket shape, on top of the training graph, up to
    the recompile limit), and the scores are the eager ones."""
    model = micro_model()
    graphs = []

    def counting_backend(gm, example_inputs):  # dynamo's hook: called once per compiled graph
        graphs.append([tuple(t.shape) for t in example_inputs if t.dtype == torch.long])
        return gm.forward

    torch._dynamo.reset()
    model.train()  # as the trainer's model is
    compiled = torch.compile(model, backend=counting_backend, dynamic=False)
    base = load(FIXTURE)
    examples = [hellaswag.make_example(" word" * n + ex.ctx, ex.endings, ex.label)
                for n in (0, 8, 20, 30, 60) for ex in base]
    bt = 3 * 4 * 48  # 4, 3 and 2 examples per forward for lengths 32, 48, 64
    sums, counts = hellaswag.score(compiled, examples, "cpu", batch_tokens=bt)
    assert graphs == [] and model.training
    eager_sums, eager_counts = hellaswag.score(model, examples, "cpu", batch_tokens=bt)
    assert torch.equal(sums, eager_sums) and torch.equal(counts, eager_counts) and (counts > 0).all()
    torch._dynamo.reset()


def train_to_prefer(model: GPT, examples, choice: list[int], steps: int = 40) -> None:
    """Teach the model ctx + endings[choice] for each example."""
    seqs = [ex.ctx_tokens + ex.ending_tokens[c] for ex, c in zip(examples, choice, strict=True)]
    T = max(map(len, seqs))
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    y = torch.full((len(seqs), T), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, :len(s)] = torch.tensor(s)
        y[i, :len(s) - 1] = torch.tensor(s[1:])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.mark.slow  # trains a model for a few hundred steps in-process
def test_model_taught_the_labelled_endings_scores_one():
    examples = load(FIXTURE)
    # Teach a different ending than the fixture's label: (label + 2) % 4. Relabelled, every example must
    # be right (1.0); against the original labels every one must be wrong (0.0), so the score follows
    # what the model learned rather than a quirk of the fixture (an untrained model gets acc_norm 1.0
    # on it, since the fixture's true endings are longer and more ordinary).
    taught = [(ex.label + 2) % 4 for ex in examples]
    model = micro_model(1)
    train_to_prefer(model, examples, taught)
    relabelled = [hellaswag.Example(ex.ctx, ex.endings, t, ex.ctx_tokens, ex.ending_tokens)
                  for ex, t in zip(examples, taught, strict=True)]
    certain = {"acc_stderr": 0.0, "acc_norm_stderr": 0.0, "n": 7}  # every outcome the same: no spread
    assert hellaswag.evaluate(model, relabelled, "cpu") == {"acc": 1.0, "acc_norm": 1.0, **certain}
    assert hellaswag.evaluate(model, examples, "cpu") == {"acc": 0.0, "acc_norm": 0.0, **certain}


DDP_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from gptcore.evals.scorers import hellaswag
from gptcore.overrides import load_config
from gptcore.presets import model_preset
from gptcore.model.gpt import GPT
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = GPT(model_preset("micro")).eval()
# only rank 0 can read the file (as on nodes without a shared home): the others get its copy
mine = sys.argv[1] if rank == 0 else "/nonexistent/hellaswag_val.jsonl"
try:
    examples, _ = hellaswag.shared_examples(load_config("micro"), mine, 0, master=rank == 0)
except hellaswag.HellaSwagError as e:  # rank 0 could not read it either: every rank says so, none hangs
    open(sys.argv[2] + f".error{rank}", "w").write(str(e))
    dist.destroy_process_group()  # exiting with a live gloo group can abort at interpreter shutdown
    sys.exit(0)
res = hellaswag.evaluate(model, examples, "cpu", rank=rank, world=world)
sums, _ = hellaswag.score(model, examples[rank::world], "cpu")
if rank == 0:
    json.dump(res, open(sys.argv[2], "w"))
json.dump(sums.tolist(), open(sys.argv[2] + f".rank{rank}", "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_two_ranks_gives_the_same_counts(tmp_path):
    examples = load(FIXTURE)  # 7 examples: ranks get 4 and 3
    model = micro_model(0)
    single = hellaswag.evaluate(model, examples, "cpu")
    sums, _ = hellaswag.score(model, examples, "cpu")
    script = tmp_path / "ddp_eval.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "res.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={port}", str(script), str(FIXTURE), str(out)],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == single and single["n"] == 7
    per_rank = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    torch.testing.assert_close(torch.tensor(per_rank[0], dtype=torch.float64), sums[0::2])
    torch.testing.assert_close(torch.tensor(per_rank[1], dtype=torch.float64), sums[1::2])
    # rank 0 cannot read it: both ranks get the same error at once instead of one waiting forever
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={port}", str(script), str(tmp_path / "missing.jsonl"), str(out)],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [Path(f"{out}.error{r}").read_text() for r in (0, 1)]
    assert errors[0] == errors[1] and "missing.jsonl does not exist" in errors[0]
