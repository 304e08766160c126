"""Hugging Face GPT-2 interop: load OpenAI's released weights (or any HF GPT-2) into our GPT, and export
ours so that `transformers.GPT2LMHeadModel.from_pretrained(dir)` loads it.

The two models are the same network with different parameter layouts:
- HF stores the four projection matrices as `Conv1D` weights, shape (in, out): the transpose of
  nn.Linear's (out, in). Everything else (embeddings, LayerNorms, biases) matches 1:1.
- HF's vocabulary is the real 50257 tokens; ours is padded to 50304. Import copies the 50257 real rows
  and zeroes the padding (our forward never returns logits for the padded ids anyway); export drops them.
- Both tie the token embedding to the output head, so the head is stored once, as HF does
  (`transformer.wte.weight`; safetensors refuses to store two names for one tensor).
- Old HF checkpoints carry the causal-mask buffers `attn.bias` / `attn.masked_bias`: not weights, skipped.

    model = from_pretrained("gpt2")            # hub download (cached by huggingface_hub), or a local dir
    export_hf(model, Path("out/hf"))           # config.json, model.safetensors, generation + tokenizer files
"""

from __future__ import annotations

# lazy imports: huggingface_hub only when a model is downloaded from the hub
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gptcore.config import ModelConfig
from gptcore.files import READ_ERRORS, atomic_dir
from gptcore.model.gpt import GPT, clean_state_dict, empty_on_host, unwrap
from gptcore.model.tokenizer import EOT, N_VOCAB, hf_tokenizer_files

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks in old checkpoints (not `c_attn.bias`)
WTE, HEAD = "transformer.wte.weight", "lm_head.weight"
HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # openai-community/<name> on the hub
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class HFError(ValueError):
    """A Hugging Face checkpoint we cannot load (or a model we cannot export); the message says why."""


# --- import -------------------------------------------------------------------------------------

def _to_ours(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Rename/transpose an HF GPT-2 state dict into our layout; returns (weights, lm_head or None)."""
    out, head = {}, None
    for k, v in clean_state_dict(sd).items():
        if k.endswith(BUFFERS):
            continue
        if k == HEAD:
            head = v
            continue
        if not k.startswith("transformer."):  # GPT2Model checkpoints (e.g. the hub's `gpt2`) lack it
            k = "transformer." + k
        out[k] = v.t() if k.endswith(CONV1D) else v
    return out, head


def load_hf_state_dict(model: GPT, sd: dict[str, torch.Tensor]) -> GPT:
    """Copy an HF GPT-2 state dict (GPT2LMHeadModel or GPT2Model keys) into `model` in place.
    Every key and shape is checked before anything is written, so a mismatch leaves `model` untouched."""
    ours, head = _to_ours(sd)
    target = model.state_dict()  # shares storage with the parameters
    expected = set(target) - {HEAD}
    problems = []
    if missing := sorted(expected - set(ours)):
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:4]}")
    if unexpected := sorted(set(ours) - expected):
        problems.append(f"unexpected tensors (not GPT-2?) e.g. {unexpected[:4]}")
    for k in sorted(expected & set(ours)):
        want, got = tuple(target[k].shape), tuple(ours[k].shape)
        if k == WTE:  # any vocabulary from the real 50257 up to our (padded) size fits
            ok = len(got) == 2 and got[1] == want[1] and N_VOCAB <= got[0] <= want[0]
        else:
            ok = got == want
        if not ok:
            problems.append(f"{k}: checkpoint shape {got} vs model {want}")
    wte = ours.get(WTE)
    if head is not None and wte is not None and head.shape == wte.shape and not torch.equal(head, wte):
        problems.append("lm_head.weight differs from transformer.wte.weight; our GPT ties them, so an "
                        "untied checkpoint cannot be represented")
    if problems:
        raise HFError("Hugging Face GPT-2 state dict does not fit the model "
                      f"(n_layer={model.config.n_layer}, n_embd={model.config.n_embd}, "
                      f"block_size={model.config.block_size}): " + "; ".join(problems))
    with torch.no_grad():
        for k, v in ours.items():
            if k == WTE:
                target[k][: v.shape[0]].copy_(v)
                target[k][v.shape[0]:].zero_()  # padded ids: never sampled, never in the loss
            else:
                target[k].copy_(v)
    return model


def model_config_from_hf(hf: dict, vocab_size: int = 50304, dropout: float = 0.0) -> ModelConfig:
    """Our ModelConfig for an HF GPT2Config dict, refusing variants our GPT does not compute exactly."""
    def bad(what: str) -> HFError:
        return HFError(f"unsupported Hugging Face GPT-2 config: {what}; gptcore.model.gpt.GPT implements the "
                       "original GPT-2 only")

    if missing := [k for k in ("n_layer", "n_head", "n_embd") if k not in hf]:
        raise bad(f"missing {missing}")
    if hf.get("model_type", "gpt2") != "gpt2":
        raise bad(f"model_type={hf.get('model_type')!r} (expected 'gpt2')")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise bad(f"activation_function={hf['activation_function']!r} (ours is the tanh GELU, 'gelu_new')")
    if abs(float(hf.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        raise bad(f"layer_norm_epsilon={hf['layer_norm_epsilon']} (ours is 1e-5)")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise bad(f"n_inner={hf['n_inner']} (ours is 4*n_embd)")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(flag):
            raise bad(f"{flag}=true")
    if not hf.get("scale_attn_weights", True):
        raise bad("scale_attn_weights=false")
    if not hf.get("tie_word_embeddings", True):
        raise bad("tie_word_embeddings=false (ours ties wte and lm_head)")
    if not N_VOCAB <= hf.get("vocab_size", N_VOCAB) <= vocab_size:
        raise bad(f"vocab_size={hf.get('vocab_size')} (the GPT-2 tokenizer has {N_VOCAB})")
    cfg = ModelConfig(block_size=hf.get("n_positions", hf.get("n_ctx", 1024)), vocab_size=vocab_size,
                      n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=dropout,
                      bias=True)
    cfg.validate()
    return cfg


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of an HF checkpoint directory: safetensors preferred, sharded files supported."""
    for name in WEIGHT_FILES:
        f = path / name
        if not f.is_file():
            continue
        sd = {}
        try:
            if name.endswith(".index.json"):  # sharded: {"weight_map": {tensor: file}}
                files = sorted(set(json.loads(f.read_text())["weight_map"].values()))
            else:
                files = [name]
            for shard in files:
                if shard.endswith(".safetensors"):
                    sd.update(load_file(str(path / shard)))
                else:
                    sd.update(torch.load(path / shard, map_location="cpu", weights_only=True))
        except (*READ_ERRORS, KeyError, TypeError) as e:
            raise HFError(f"the weights in {path} ({name}) cannot be read ({type(e).__name__}: {e}); the export is "
                          "damaged: export or download it again") from e
        return sd
    raise HFError(f"{path} has no weights: expected one of {list(WEIGHT_FILES)}")


def load_hf_dir(path: str | Path, vocab_size: int = 50304, dropout: float = 0.0) -> GPT:
    """A GPT built from a Hugging Face GPT-2 checkpoint directory (config.json + weights)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HFError(f"{path} is not a Hugging Face checkpoint directory: no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"{cfg_file} is not valid JSON ({e}); re-download or re-export it") from None
    # every weight is loaded next (a missing one is refused), so no random initialisation is drawn first
    model = empty_on_host(model_config_from_hf(hf, vocab_size, dropout))
    return load_hf_state_dict(model, _read_weights(path))


def from_pretrained(name_or_dir: str | Path, revision: str = "main", vocab_size: int = 50304,
                    dropout: float = 0.0, cache_dir: str | Path | None = None) -> GPT:
    """Load a local HF GPT-2 directory, or download a hub model (`gpt2`, `gpt2-medium`, `gpt2-large`,
    `gpt2-xl`, or any `owner/name` GPT-2 repo) into huggingface_hub's cache (or `cache_dir`). HF_ENDPOINT
    and HF_TOKEN are honoured; once cached, loading works offline (the hub falls back to the cache)."""
    if Path(name_or_dir).is_dir():
        return load_hf_dir(name_or_dir, vocab_size, dropout)
    looks_like_path = isinstance(name_or_dir, Path) or str(name_or_dir).startswith(("/", ".", "~"))
    if looks_like_path or Path(name_or_dir).exists():
        raise HFError(f"{name_or_dir} is not a directory; pass an existing Hugging Face checkpoint "
                      "directory or a hub name such as 'gpt2'")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    repo = str(name_or_dir)
    repo = f"openai-community/{repo}" if repo in HUB_MODELS else repo
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at huggingface_hub import time

    def fetch(filename: str) -> Path:
        return Path(hf_hub_download(repo, filename, revision=revision, endpoint=endpoint,
                                    cache_dir=cache_dir))

    try:
        snapshot = fetch("config.json").parent  # every file of one revision lands in one snapshot dir
        for name in WEIGHT_FILES:  # download only the first format the repo has (not all of them)
            try:
                f = fetch(name)
            except EntryNotFoundError:
                continue
            if name.endswith(".index.json"):
                for shard in sorted(set(json.loads(f.read_text())["weight_map"].values())):
                    fetch(shard)
            break
        else:
            raise HFError(f"hub repo {repo}@{revision} has none of {list(WEIGHT_FILES)}")
    except HFError:
        raise
    except Exception as e:  # network, auth, missing repo: say what to do instead
        raise HFError(f"could not download {repo}@{revision} from {endpoint or 'huggingface.co'}: "
                      f"{type(e).__name__}: {e}. Check the name and the network (HF_ENDPOINT, HF_TOKEN), "
                      "or pass a local directory holding config.json and model.safetensors") from e
    return load_hf_dir(snapshot, vocab_size, dropout)


# --- export -------------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The GPT2Config (as JSON) describing our model."""
    name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": N_VOCAB, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": EOT, "eos_token_id": EOT,
        "dtype": name, "torch_dtype": name,  # transformers >= 4.56 reads `dtype`, older `torch_dtype`
    }


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our weights in GPT2LMHeadModel's layout: Conv1D transposes, 50257 vocab rows, head stored once.
    A bias-free model exports zero biases (exactly equivalent; HF GPT-2 always has biases)."""
    m = unwrap(model)
    sd = clean_state_dict(m.state_dict())
    sd.pop(HEAD)
    out = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        if k == WTE:
            v = v[:N_VOCAB]
        out[k] = (v.t() if k.endswith(CONV1D) else v).contiguous().clone()  # own storage: no sharing
    if not m.config.bias:
        for name, mod in m.named_modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.LayerNorm)) and name != "lm_head":
                out[f"{name}.bias"] = torch.zeros(mod.weight.shape[0], dtype=mod.weight.dtype)
    return out


def export_hf(model: torch.nn.Module, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write a directory `transformers.GPT2LMHeadModel.from_pretrained(out_dir)` loads. Written into a
    temp dir beside out_dir and renamed, so out_dir is either absent or complete."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True or choose a new dir")
    m = unwrap(model)
    tensors = hf_state_dict(m)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(m.config, tensors[WTE].dtype), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": EOT, "eos_token_id": EOT}, indent=2) + "\n")
        for name, body in hf_tokenizer_files().items():  # AutoTokenizer / pipeline() load offline
            (tmp / name).write_text(body, encoding="utf-8")
    return out_dir
