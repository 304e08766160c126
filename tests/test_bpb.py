"""Bits per byte (gptcore/evals/bpb.py), the evaluation added as a newcomer adds one: its module, its
registration line, this test. A model that predicts every token with probability 1/50257 must score
exactly log2(50257) bits per token over the bytes those tokens are, on HellaSwag's correct endings and on
a text with multi-byte characters; split across ranks it adds up to the same; the standalone command runs
it from `--set eval.bpb.*` like the trainer's settings, and `--set` wins over the shorthand flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gptcore import evals
from gptcore.checkpoints import checkpoint
from gptcore.config import ConfigError
from gptcore.evals import evaluate
from gptcore.evals.scorers.hellaswag import read_records
from gptcore.model.gpt import GPT
from gptcore.model.tokenizer import N_VOCAB, decode, encode
from gptcore.overrides import load_config

HELLASWAG = Path(__file__).parent / "fixtures" / "hellaswag_mini.jsonl"
TEXT = "Wherefore art thou, Romeo? Ça va — naïve café, 東京, and 🙂 too.\n" * 12  # 1-4 byte characters


def config(tmp_path, *extra):
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    return load_config("micro", ["eval.bpb.enabled=true", f"eval.bpb.text={tmp_path / 'text.txt'}",
                                 "eval.hellaswag.enabled=true", f"eval.hellaswag.path={HELLASWAG}", *extra])


def uniform_model(cfg) -> GPT:
    model = GPT(cfg.model)
    with torch.no_grad():
        model.transformer.wte.weight.zero_()  # the tied head: every logit 0, every token 1/50257
    return model.eval()


def run(cfg, model, rank=0, world=1, cache=None) -> dict:
    """One rank's share. Rank 0 reads HellaSwag; under torchrun it broadcasts the examples, here the other
    "rank" is handed rank 0's cache instead."""
    ev = evals.EVALUATIONS["bpb"]
    ctx = evals.Context(model, cfg, "cpu", rank=rank, world=world, cache={} if cache is None else cache)
    ev.prepare(ctx)
    return ev.share(ctx)


def test_a_uniform_model_scores_log2_of_the_vocabulary_per_token_over_the_bytes(tmp_path):
    cfg = config(tmp_path)
    assert len(encode(TEXT)) > 3 * cfg.model.block_size  # several windows of the block
    result = evals.EVALUATIONS["bpb"].combine([run(cfg, uniform_model(cfg))])
    per_token = math.log2(N_VOCAB)
    # the text: every token after the first predicted once; its bytes are the text's bytes but the first token's
    tokens = encode(TEXT)
    first = len(decode(tokens[:1]).encode("utf-8"))  # "Wherefore"
    want = (len(tokens) - 1) * per_token / (len(TEXT.encode("utf-8")) - first)
    assert result["text"]["bytes"] == len(TEXT.encode("utf-8")) - first
    assert result["text"]["bpb"] == pytest.approx(want, rel=1e-6)
    # HellaSwag: the correct ending of each example, scored as " " + ending (build-nanogpt's encoding)
    records = read_records(HELLASWAG)
    endings = [" " + endings[label] for _, endings, label in records]
    n_tokens, n_bytes = sum(len(encode(e)) for e in endings), sum(len(e.encode("utf-8")) for e in endings)
    assert result["hellaswag"]["bytes"] == n_bytes
    assert result["hellaswag"]["bpb"] == pytest.approx(n_tokens * per_token / n_bytes, rel=1e-6)


def test_ranks_add_up_to_one_rank_and_training_lowers_it(tmp_path):
    cfg = config(tmp_path)
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    ev = evals.EVALUATIONS["bpb"]
    one = ev.combine([run(cfg, model)])
    cache: dict = {}
    two = ev.combine([run(cfg, model, r, 2, cache) for r in range(2)])
    for part in ("text", "hellaswag"):
        assert two[part]["bytes"] == one[part]["bytes"]
        assert two[part]["bpb"] == pytest.approx(one[part]["bpb"], rel=1e-6)
    # a few steps on the text itself: its bits per byte must fall (the number tracks the likelihood)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.tensor(encode(TEXT)[:cfg.model.block_size + 1])
    model.train()
    for _ in range(20):
        _, loss = model(x[None, :-1], x[None, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = ev.combine([run(cfg, model.eval())])
    assert after["text"]["bpb"] < one["text"]["bpb"] - 0.5, (one["text"], after["text"])


def test_the_standalone_command_takes_eval_settings_and_set_wins_over_flags(tmp_path, capsys):
    cfg = config(tmp_path)
    model = uniform_model(cfg)
    ckpt = checkpoint.save_checkpoint(tmp_path / "run", 4, model, {"optimizer": {}},
                                      {"config": cfg.to_dict(), "run_name": "micro"}, keep_last=3)
    rc = evaluate.main([str(ckpt), "--device", "cpu", "--hellaswag", str(HELLASWAG),
                        "--set", "eval.bpb.enabled=true", "eval.bpb.text_bytes=200", "eval.hellaswag.limit=3"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert 150 < out["bpb"]["text"]["bytes"] < 200  # text_bytes reached it: 200 bytes, less the first token
    assert out["hellaswag"]["n"] == 3  # --set's limit, not the --limit flag's default of 0 (all)
    endings = [" " + endings[label] for _, endings, label in read_records(HELLASWAG)[:3]]
    want = sum(len(encode(e)) for e in endings) * math.log2(N_VOCAB) / sum(len(e.encode()) for e in endings)
    assert out["bpb"]["hellaswag"]["bpb"] == pytest.approx(want, rel=1e-6)  # the same 3 examples
    # a text that is not there is a clear error naming the setting, exit 2
    rc = evaluate.main([str(ckpt), "--device", "cpu", "--set", "eval.bpb.text=/nonexistent.txt"])
    assert rc == 2 and "eval.bpb.text=/nonexistent.txt is not a file" in capsys.readouterr().err


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="eval.bpb.interval and eval.bpb.text_bytes must be >= 0"):
        load_config("micro", ["eval.bpb.text_bytes=-1"])


def test_the_default_text_is_the_built_in_corpus_held_out_work():
    from gptcore.evals.bpb import BitsPerByteSettings, text_tokens

    tokens = text_tokens(BitsPerByteSettings(text_bytes=2000))
    assert 300 < len(tokens) < 700  # ~4 bytes a token of English
