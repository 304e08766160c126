"""lm-evaluation-harness on the project's GPT (gptcore/evals/scorers/harness.py): the adapter scores what the harness's
own Hugging Face model class scores on the HF export of the same weights (log-likelihoods to 1e-4, the same
greedy flags and accuracies), a task defined in a user's folder runs through the harness end to end with
standard errors, and a task that cannot run is skipped with the reason."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from gptcore.config import ModelConfig
from gptcore.evals.scorers.harness import GPTHarness, run_tasks
from gptcore.model.gpt import GPT
from gptcore.model.hf import export_hf
from gptcore.security import CODE_ROOTS

pytestmark = pytest.mark.slow

CONTEXTS = ["The cat sat on the", "Paris is the capital of", "1, 2, 3, 4,", "A long time ago in a galaxy far,"]
ENDINGS = [" mat", " France", " 5", " far away", " the", "!", " <|endoftext|> and more"]
DOCUMENT = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)  # > block_size tokens


def model() -> GPT:
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random everything (fresh inits leave LayerNorms 1 and biases 0)
        for p in gpt.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return gpt


@pytest.fixture(autouse=True)
def code_root(tmp_path, monkeypatch):
    """The tests' task folders live under tmp_path: the operator's allowed code root (GPTPIPE_CODE_ROOTS)."""
    monkeypatch.setenv(CODE_ROOTS, str(tmp_path))
    return tmp_path


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ours = model()
    hf_dir = export_hf(ours, tmp_path_factory.mktemp("export") / "hf")
    theirs = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=3, dtype="float32")
    return GPTHarness(ours, "cpu", batch_tokens=3 * 64), theirs


def test_log_likelihoods_equal_the_harness_hf_model_on_the_export(pair):
    ours, theirs = pair
    pairs = [(c, e) for c in CONTEXTS for e in ENDINGS] + [("", " hello world")]
    a = ours.loglikelihood(requests("loglikelihood", pairs))
    b = theirs.loglikelihood(requests("loglikelihood", pairs))
    assert len(a) == len(b) == len(pairs)
    for (la, ga), (lb, gb), p in zip(a, b, pairs, strict=True):
        assert la == pytest.approx(lb, abs=1e-4), p
        assert ga == gb, p
    # whole documents longer than the model's context: the same windows, the same sums
    docs = [(DOCUMENT,), ("short one",)]
    ra = ours.loglikelihood_rolling(requests("loglikelihood_rolling", docs))
    rb = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", docs))
    assert ra == pytest.approx(rb, abs=1e-3) and ra[0] < ra[1] < 0


def toy_task(folder, n: int = 24, rows: list[dict] | None = None, name: str = "toy_choice"):
    """A multiple-choice task in a user's folder (the harness's include path), its data in a local file:
    `rows` of {question, choices, label}, by default n questions alike but for their number."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = rows or [{"question": f"Question {i}: which word follows 'the quick brown'?",
                     "choices": ["fox", "sky", "cat"], "label": i % 3} for i in range(n)]
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return folder


def test_a_task_from_a_users_folder_runs_through_the_harness_with_error_bars(pair, tmp_path):
    ours, theirs = pair
    folder = toy_task(tmp_path / "tasks")
    got = run_tasks(ours.model, ["toy_choice", "no_such_task"], "cpu", include_path=str(folder))
    toy = got["toy_choice"]
    assert toy["n"] == 24 and set(toy) >= {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    p = toy["acc"]
    assert toy["acc_stderr"] == pytest.approx((p * (1 - p) / 23) ** 0.5)
    assert "no task 'no_such_task'" in got["no_such_task"]["skipped"]
    # the harness's own HF model class on the export scores the same accuracies
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ref = simple_evaluate(model=theirs, tasks=["toy_choice"], task_manager=TaskManager(include_path=str(folder)),
                          bootstrap_iters=1000, log_samples=False)["results"]["toy_choice"]
    assert (toy["acc"], toy["acc_norm"]) == (ref["acc,none"], ref["acc_norm,none"])


def test_a_task_whose_data_cannot_be_had_is_skipped_with_the_reason(pair, tmp_path, monkeypatch):
    ours, _ = pair
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "gone.yaml").write_text("""task: gone
dataset_path: json
dataset_kwargs:
  data_files:
    test: /nonexistent/gone.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{c}}"
doc_to_target: 0
metric_list:
  - metric: acc
""")
    got = run_tasks(ours.model, ["gone"], "cpu", include_path=str(folder))
    assert "could not be loaded" in got["gone"]["skipped"] and "eval.harness.include_path" in got["gone"]["skipped"]


def test_the_evaluate_command_scores_a_checkpoint_on_harness_tasks(tmp_path):
    """`python -m gptcore.evals.evaluate <checkpoint> --tasks ... --include-path DIR` (what `python -m
    tasks.evaluate models:/name@alias --tasks ...` runs after fetching the version's weights)."""
    import subprocess
    import sys
    from pathlib import Path

    from gptcore.checkpoints import checkpoint
    from gptcore.overrides import load_config

    cfg = load_config("micro", ["train.run_name=harness"])
    ckpt = checkpoint.save_checkpoint(tmp_path / "run", 5, model(), {"optimizer": {}},
                                      {"config": cfg.to_dict(), "run_name": "harness"}, keep_last=3)
    folder = toy_task(tmp_path / "tasks", n=12)
    r = subprocess.run([sys.executable, "-m", "gptcore.evals.evaluate", str(ckpt), "--no-hellaswag", "--tasks",
                        "toy_choice", "--include-path", str(folder), "--device", "cpu"],
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["harness"]["toy_choice"]["n"] == 12 and "acc_norm_stderr" in out["harness"]["toy_choice"]


# --- task code only from the operator's roots -----------------------------------------------------------

def evil_task(folder, marker):
    """A task folder whose YAML runs Python when the task loads (`process_docs: !function evil.f`): evil.py
    writes `marker` on import."""
    toy_task(folder, n=4, name="evil")
    with open(folder / "evil.yaml", "a") as f:
        f.write("process_docs: !function evil.f\n")
    (folder / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                    "def f(dataset):\n    return dataset\n")
    return folder


def test_task_code_loads_only_from_an_allowed_root(tmp_path, monkeypatch):
    """eval.harness.include_path names a folder whose task YAMLs can run Python, so it must resolve (symlinks
    followed) under a root the operator lists in GPTPIPE_CODE_ROOTS: outside it the evaluate command exits
    2 naming the setting, the path and the fix, and the task's code never runs: given on the command line
    or recorded in a checkpoint's (a registered version's) meta.json. Inside it, the same folder runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from gptcore.checkpoints import checkpoint
    from gptcore.config import ConfigError
    from gptcore.overrides import load_config
    from gptcore.security import check_code_path

    repo, marker = Path(__file__).resolve().parents[1], tmp_path / "marker"
    folder = evil_task(tmp_path / "outside" / "tasks", marker)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(folder)  # inside the root by name, outside once resolved
    cfg = load_config("micro", ["train.run_name=evil", f"eval.harness.include_path={folder}"])  # allowed now
    ckpt = checkpoint.save_checkpoint(tmp_path / "run", 5, model(), {"optimizer": {}},
                                      {"config": cfg.to_dict(), "run_name": "evil"}, keep_last=3)

    def evaluate(root: Path, *extra: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, **{CODE_ROOTS: str(root)})
        return subprocess.run([sys.executable, "-m", "gptcore.evals.evaluate", str(ckpt), "--no-hellaswag", "--tasks",
                               "evil", "--device", "cpu", *extra], env=env, capture_output=True, text=True,
                              timeout=600, cwd=repo)

    for extra in (["--include-path", str(folder)], []):  # given, or taken from the checkpoint's meta.json
        r = evaluate(allowed, *extra)
        assert r.returncode == 2, r.stderr[-3000:]
        assert f"eval.harness.include_path={str(folder)!r} (resolved: {folder}) is outside the folders allowed " \
               f"to hold task code ({CODE_ROOTS}: {allowed})" in r.stderr, r.stderr[-3000:]
        assert "Fix: put the task folder under an allowed root" in r.stderr
        assert not marker.exists()
    monkeypatch.setenv(CODE_ROOTS, str(allowed))
    for where in (folder, allowed / "link", allowed / ".." / "outside" / "tasks"):
        with pytest.raises(ConfigError, match=r"is outside the folders allowed to hold task code"):
            check_code_path("eval.harness.include_path", str(where))
        with pytest.raises(ConfigError, match=r"is outside the folders allowed"):  # the harness checks too
            run_tasks(model(), ["evil"], "cpu", include_path=str(where))
    monkeypatch.delenv(CODE_ROOTS)  # unset: no folder at all
    with pytest.raises(ConfigError, match=rf"\({CODE_ROOTS}: unset\)"):
        load_config("micro", [f"eval.harness.include_path={allowed}"])
    monkeypatch.setenv(CODE_ROOTS, "relative/tasks")
    with pytest.raises(ConfigError, match=rf"{CODE_ROOTS} entry 'relative/tasks' is not an absolute path"):
        load_config("micro", [f"eval.harness.include_path={allowed}"])
    assert not marker.exists()

    # the operator's root: the very same folder loads, and its code runs (so the refusals above mattered)
    r = evaluate(folder.parent, "--include-path", str(folder))
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.read_text() == "ran" and json.loads(r.stdout)["harness"]["evil"]["n"] == 4


# --- eval.harness.dtype: the precision harness log-likelihoods are scored in ---------------------------

def test_the_config_rejects_an_unknown_harness_dtype():
    from gptcore.config import ConfigError
    from gptcore.overrides import load_config

    assert load_config("micro").eval.options("harness").dtype == "float32"
    assert load_config("micro", ["eval.harness.dtype=autocast"]).eval.options("harness").dtype == "autocast"
    with pytest.raises(ConfigError, match=r"eval\.harness\.dtype='bf16'; use float32 .* or autocast"):
        load_config("micro", ["eval.harness.dtype=bf16"])


def plain_fp32_scores(gpt: GPT, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Each continuation's log-likelihood from a plain fp32 forward of its sequence alone."""
    out = []
    with torch.no_grad():
        for context, continuation in pairs:
            logits, _ = gpt(torch.tensor(context + continuation)[None, :-1])
            lp = torch.log_softmax(logits[0, -len(continuation):].float(), dim=-1)
            out.append(float(lp.gather(1, torch.tensor(continuation)[:, None]).sum()))
    return out


def test_harness_scores_are_fp32_by_default_whatever_autocast_the_caller_passes():
    from gptcore.model.tokenizer import get_encoding

    gpt, enc = model(), get_encoding()
    texts = [(c, e) for c in CONTEXTS[:3] for e in ENDINGS[:3]]
    # tokens as the harness splits a pair: the whole text's, past the context's
    pairs = [(enc.encode(c), enc.encode(c + e, allowed_special="all")[len(enc.encode(c)):]) for c, e in texts]
    want = plain_fp32_scores(gpt, pairs)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)  # what a CPU run's evaluation would pass
    for lm in (GPTHarness(gpt, "cpu", bf16), GPTHarness(gpt, "cpu", bf16, dtype="float32")):
        got = [s for s, _ in lm.loglikelihood(requests("loglikelihood", texts))]
        assert got == pytest.approx(want, abs=1e-5)
    # "autocast" scores under the caller's context: bf16 moves them (the setting is used)
    moved = [s for s, _ in GPTHarness(gpt, "cpu", bf16, dtype="autocast").loglikelihood(
        requests("loglikelihood", texts))]
    assert max(abs(a - b) for a, b in zip(moved, want, strict=True)) > 1e-3
    with pytest.raises(ValueError, match="eval.harness.dtype='bf16'"):
        GPTHarness(gpt, "cpu", dtype="bf16")


def test_the_harness_evaluation_records_its_dtype_and_passes_it_on(monkeypatch):
    from gptcore.evals import Context
    from gptcore.evals.harness import Harness
    from gptcore.evals.scorers import harness
    from gptcore.overrides import load_config

    cfg = load_config("micro", ["eval.harness.tasks=toy_choice", "eval.harness.dtype=autocast"])
    assert Harness().settings(cfg)["dtype"] == "autocast"  # eval.json: fp32 and autocast results never mixed
    seen = {}
    monkeypatch.setattr(harness, "run_tasks", lambda *a, **kw: seen.update(kw) or {})
    Harness().run(Context(model(), cfg, "cpu"))
    assert seen["dtype"] == "autocast"


def test_the_adapter_scoring_matches_transformers_fp32_forward_of_the_export():
    """The GPU acceptance row (benchmarks/harness_parity.py), run on CPU."""
    from benchmarks.harness_parity import check_harness_parity

    ok, detail = check_harness_parity(torch.device("cpu"))
    assert ok is True, detail
    assert "over 16 sequences" in detail
