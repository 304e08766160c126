"""Hugging Face interop against real `transformers` GPT-2 models (random weights: the hub is unreachable
here). Both directions must give the same logits and loss within 1e-5 (fp32, CPU), an export must load
in transformers with no missing/unexpected keys and generate the same greedy tokens, and the hub path of
`from_pretrained` runs against a local HTTP server that serves the hub's resolve URLs."""

import hashlib
import json
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2Config, GPT2LMHeadModel

from gptcore.config import ModelConfig
from gptcore.model.gpt import GPT
from gptcore.model.hf import (
    HFError,
    export_hf,
    from_pretrained,
    load_hf_dir,
    load_hf_state_dict,
    model_config_from_hf,
)
from gptcore.model.tokenizer import N_VOCAB
from tests.local_http import end_body, serve

SMALL = dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=50257,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Fresh inits leave biases 0 and LayerNorms 1; randomise every tensor so a conversion that drops
    or mixes up any of them shows up in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(**SMALL)).eval()
    perturb(m, 1)
    return m


def tokens(B=2, T=64, seed=3):
    return torch.randint(0, N_VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def ours_loss(model, idx):
    """Our loss with HF's convention (labels = inputs, shifted inside): last position ignored (-1)."""
    targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -1)], dim=1)
    return model(idx, targets)


def assert_same(ours, hf, idx):
    with torch.no_grad():
        logits, loss = ours_loss(ours.eval(), idx)
        out = hf(idx, labels=idx)
    assert logits.shape == out.logits.shape == (*idx.shape, N_VOCAB)
    assert (logits - out.logits).abs().max().item() < 1e-5
    assert abs(loss.item() - out.loss.item()) < 1e-5


def test_hf_to_ours_same_logits_loss_and_zero_padding(hf_model):
    ours = GPT(model_config_from_hf(GPT2Config(**SMALL).to_dict()))
    assert ours.config.vocab_size == 50304 and ours.config.block_size == 64
    load_hf_state_dict(ours, hf_model.state_dict())
    assert_same(ours, hf_model, tokens())
    wte = ours.transformer.wte.weight
    assert torch.equal(wte[:N_VOCAB], hf_model.transformer.wte.weight)
    assert not wte[N_VOCAB:].any()  # padded rows zeroed
    assert ours.lm_head.weight is wte  # still tied after loading


def test_export_loads_in_transformers_same_logits_and_greedy_tokens(tmp_path):
    torch.manual_seed(0)
    ours = GPT(ModelConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))
    perturb(ours, 2)
    out = export_hf(ours, tmp_path / "export" / "hf")
    assert out == tmp_path / "export" / "hf"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "generation_config.json", "merges.txt", "model.safetensors",
                     "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no temp dir left behind
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # tied: stored once, as HF does
        assert f.get_tensor("transformer.wte.weight").shape == (N_VOCAB, 64)
        # Conv1D layout: (in, out)
        assert f.get_tensor("transformer.h.0.mlp.c_fc.weight").shape == (64, 256)

    hf, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    hf.eval()
    assert hf.config.vocab_size == N_VOCAB and hf.config.activation_function == "gelu_new"
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    assert_same(ours, hf, tokens(seed=4))

    prompt = tokens(B=1, T=8, seed=5)
    ref = hf.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=50256,
                      attention_mask=torch.ones_like(prompt))
    mine = ours.generate(prompt, max_new_tokens=24, temperature=0.0)
    assert torch.equal(mine, ref)
    assert len(set(mine[0, 8:].tolist())) > 1  # not a degenerate repeat that any model would match

    # and back: the export reloads into an identical model, drawing no random initialisation to overwrite
    rng = torch.random.get_rng_state()
    again = load_hf_dir(out)
    assert torch.equal(rng, torch.random.get_rng_state())
    sd, sd2 = ours.state_dict(), again.state_dict()
    for k in sd:
        want = sd[k][:N_VOCAB] if k in ("transformer.wte.weight", "lm_head.weight") else sd[k]
        got = sd2[k][:N_VOCAB] if k in ("transformer.wte.weight", "lm_head.weight") else sd2[k]
        assert torch.equal(want, got), k
    assert not again.lm_head.weight[N_VOCAB:].any()  # padded ids are zeros, not leftover host memory
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()


def test_export_refuses_nonempty_dir_and_overwrites_on_request(tmp_path):
    ours = GPT(ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(ours, tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").exists()
    export_hf(ours, tmp_path / "hf", overwrite=True)
    assert not (tmp_path / "hf" / "keep.txt").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_layer"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_bias_free_model_exports_exactly(tmp_path):
    torch.manual_seed(0)
    ours = GPT(ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False))
    perturb(ours, 6)
    hf, info = GPT2LMHeadModel.from_pretrained(export_hf(ours, tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info
    assert_same(ours, hf.eval(), tokens(T=32, seed=7))


def test_hf_directory_formats(tmp_path, hf_model):
    idx = tokens(seed=8)
    # save_pretrained: model.safetensors, transformer.* keys, head dropped
    hf_model.save_pretrained(tmp_path / "st")
    assert_same(load_hf_dir(tmp_path / "st"), hf_model, idx)
    # sharded safetensors with an index
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="5MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same(load_hf_dir(tmp_path / "sharded"), hf_model, idx)
    # the original OpenAI/hub layout: pytorch_model.bin with GPT2Model keys, mask buffers, and the head
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf_model.state_dict().items()}
    sd["lm_head.weight"] = hf_model.lm_head.weight.clone()
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "bin").mkdir()
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text(json.dumps({**SMALL, "model_type": "gpt2"}))
    assert_same(load_hf_dir(tmp_path / "bin"), hf_model, idx)


def test_mismatches_are_clear_and_leave_the_model_untouched(tmp_path, hf_model):
    sd = hf_model.state_dict()
    for cfg, pattern in ((ModelConfig(block_size=64, n_layer=3, n_head=4, n_embd=64), "missing 12 tensors"),
                         (ModelConfig(block_size=64, n_layer=2, n_head=4, n_embd=128), r"shape \(64,"),
                         (ModelConfig(block_size=32, n_layer=2, n_head=4, n_embd=64), "wpe.weight")):
        model = GPT(cfg)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(HFError, match=pattern):
            load_hf_state_dict(model, sd)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    untied = dict(sd)
    untied["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(HFError, match="untied"):
        load_hf_state_dict(GPT(model_config_from_hf(GPT2Config(**SMALL).to_dict())), untied)
    with pytest.raises(HFError, match="unexpected"):
        load_hf_state_dict(GPT(model_config_from_hf(GPT2Config(**SMALL).to_dict())),
                           {**sd, "transformer.h.0.attn.q_proj.weight": torch.zeros(1)})

    for bad, pattern in (({"activation_function": "relu"}, "activation_function"),
                         ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
                         ({"n_inner": 100}, "n_inner"), ({"model_type": "llama"}, "model_type"),
                         ({"vocab_size": 32000}, "vocab_size"), ({"n_head": 5}, "not divisible")):
        with pytest.raises((HFError, ValueError), match=pattern):
            model_config_from_hf({**SMALL, **bad})

    with pytest.raises(HFError, match="no config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    with pytest.raises(HFError, match="no weights"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFError, match="not valid JSON"):
        load_hf_dir(tmp_path)


# --- from_pretrained through huggingface_hub against a local "hub" ------------------------------

class ModelHub:
    """Model repos ({repo_id: dir}) served at /<repo>/resolve/<rev>/<file> like huggingface.co."""

    def __init__(self, repos: dict[str, Path]):
        self.repos, self.requests = repos, []
        self.server = serve(self.handle)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def handle(self, h, head):
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path))
        body, found = b'{"error": "Entry not found"}', None
        for repo, root in self.repos.items():
            prefix = f"/{repo}/resolve/main/"
            if path.startswith(prefix) and (root / path[len(prefix):]).is_file():
                found = root / path[len(prefix):]
        if found is not None:
            body = found.read_bytes()
            h.send_response(200)
            h.send_header("X-Repo-Commit", "b" * 40)
            lfs = found.suffix in (".safetensors", ".bin")
            h.send_header("ETag", f'"{(hashlib.sha256 if lfs else hashlib.sha1)(body).hexdigest()}"')
        else:
            h.send_response(404)
            known = any(path.startswith(f"/{r}/") for r in self.repos)
            h.send_header("X-Error-Code", "EntryNotFound" if known else "RepoNotFound")
        end_body(h, head, body)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_from_pretrained_downloads_from_the_hub(tmp_path, monkeypatch, hf_model):
    repos = tmp_path / "repos"
    hf_model.save_pretrained(repos / "gpt2")  # config.json + model.safetensors
    (repos / "binonly").mkdir()
    torch.save(hf_model.state_dict(), repos / "binonly" / "pytorch_model.bin")
    (repos / "binonly" / "config.json").write_text(json.dumps(SMALL))
    hub = ModelHub({"openai-community/gpt2": repos / "gpt2", "someone/tiny-gpt2": repos / "binonly"})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.chdir(tmp_path)  # no ./gpt2 here: "gpt2" must mean the hub model
    cache = tmp_path / "cache"  # (HF_HOME is read when huggingface_hub is imported: pass the dir)
    try:
        idx = tokens(seed=9)
        assert_same(from_pretrained("gpt2", cache_dir=cache), hf_model, idx)  # -> openai-community/gpt2
        gets = [p for m, p in hub.requests if m == "GET"]
        assert "/openai-community/gpt2/resolve/main/model.safetensors" in gets
        assert not any("pytorch_model" in p for p in gets)  # only the first format is downloaded
        assert_same(from_pretrained("someone/tiny-gpt2", cache_dir=cache), hf_model, idx)  # the .bin
        assert_same(from_pretrained(repos / "gpt2"), hf_model, idx)  # a local dir needs no hub
        n = len(hub.requests)
        with pytest.raises(HFError, match="(?s)could not download nobody/nothing.*Check the name"):
            from_pretrained("nobody/nothing", cache_dir=cache)
        assert len(hub.requests) > n
        n = len(hub.requests)
        with pytest.raises(HFError, match="is not a directory"):  # a mistyped path never asks the hub
            from_pretrained(str(tmp_path / "no_such_dir"))
        assert len(hub.requests) == n
    finally:
        hub.close()
    # hub unreachable: a cached model still loads (huggingface_hub falls back to its cache at once;
    # an uncached one is retried with backoff for ~25 s before the same HFError, too slow to test here)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    assert_same(from_pretrained("gpt2", cache_dir=cache), hf_model, idx)


MULTILINGUAL = ("Hello, I'm a language model! Ça coûte 12,50 €. Größe, naïve café; 東京は日本の首都です。"
                " Москва — столица России. مرحبا بالعالم 🙂🚀\n\tcode: x += 1  # done <|endoftext|> end")


def test_export_holds_a_tokenizer_that_transformers_loads_offline(tmp_path, monkeypatch):
    """The exported directory carries GPT-2's tokenizer files, derived from the bundled rank file: the
    Hugging Face tokenizers (slow and fast) and pipeline('text-generation') load it with no network, and
    give our token ids."""
    from transformers import AutoTokenizer, pipeline

    from gptcore.model.tokenizer import encode

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    torch.manual_seed(0)
    out = export_hf(GPT(ModelConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)), tmp_path / "hf")
    ours, plain = encode(MULTILINGUAL), MULTILINGUAL.replace("<|endoftext|>", "")  # HF reads it as the special
    for fast in (False, True):
        tok = AutoTokenizer.from_pretrained(out, use_fast=fast)
        assert tok.encode(plain) == encode(plain)
        assert tok.decode(ours) == MULTILINGUAL
        assert tok.eos_token_id == 50256 and len(tok) == 50257
    gen = pipeline("text-generation", model=str(out), device="cpu")
    text = gen("Hello, I'm a language model,", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("Hello, I'm a language model,") and len(text) > len("Hello, I'm a language model,")


def test_a_damaged_export_is_an_error_line_in_evaluate(tmp_path, capsys):
    from gptcore.evals.evaluate import main

    ours = GPT(ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
    out = export_hf(ours, tmp_path / "hf")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a half-copied file
    assert main([str(out), "--no-hellaswag", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the weights in") and "cannot be read" in err and "export" in err
