"""The GPT-2 BPE (tiktoken's `gpt2` / `r50k_base`) built offline from a rank file shipped in the package.

tiktoken.get_encoding("gpt2") downloads its files from OpenAI's blob store on first use; training
clusters are often air-gapped, so we build the identical Encoding from package data, after checking
the file's sha256 so a corrupted or substituted rank file can never silently change token ids.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import json
from pathlib import Path

import tiktoken

RANK_FILE = Path(__file__).parents[1] / "assets" / "r50k_base.tiktoken"
RANK_FILE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT = 50256  # <|endoftext|>: separates documents
N_VOCAB = 50257  # real token ids are < N_VOCAB; the model pads its vocabulary beyond (ids never produced)
# The GPT-2 pre-tokenisation regex (identical to tiktoken's r50k_pat_str).
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class TokenizerError(RuntimeError):
    pass


def _load_ranks(path: Path) -> dict[bytes, int]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read the GPT-2 rank file {path} ({e.strerror}); reinstall the "
                             "package (pip install -e .) to restore it") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANK_FILE_SHA256:
        raise TokenizerError(
            f"GPT-2 rank file {path} has sha256 {digest}, expected {RANK_FILE_SHA256}: it is corrupted "
            "or not the GPT-2 vocabulary. Reinstall the package (pip install -e .) to restore it.")
    return {binascii.a2b_base64(token): int(rank) for token, rank in (ln.split() for ln in data.splitlines() if ln)}


@functools.cache
def get_encoding(rank_file: Path = RANK_FILE) -> tiktoken.Encoding:
    """The process-wide GPT-2 Encoding, built once (tiktoken encodings are thread-safe) from a (verified) rank
    file without touching the network."""
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=PAT_STR,
        mergeable_ranks=_load_ranks(Path(rank_file)),
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=N_VOCAB,
    )


# --- the same vocabulary as Hugging Face GPT-2 tokenizer files (vocab.json + merges.txt) ----------------

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (its vocab.json is written in them)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))  # the other bytes, in byte order, take the characters from U+0100 on
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _split_at_rank(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts BPE merged last to make `token`: byte-level BPE with only the merges ranked below
    the token's own (each token of GPT-2's vocabulary is exactly one merge of two lower-ranked ones)."""
    parts, limit = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        best = min((ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1))
        if best[0] >= limit:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"token {token!r} is not one merge of two lower-ranked tokens")
    return parts[0], parts[1]


def hf_tokenizer_files() -> dict[str, str]:
    """vocab.json, merges.txt, tokenizer_config.json and special_tokens_map.json for Hugging Face's
    GPT2Tokenizer, derived offline from the verified rank file (no hub download)."""
    ranks, b2u = _load_ranks(RANK_FILE), _byte_to_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    vocab["<|endoftext|>"] = EOT
    merges = [_split_at_rank(ranks, t) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1]
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "".join(f"{text(a)} {text(b)}\n" for a, b in merges),
        "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024,
                                             "add_prefix_space": False, **special}, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


def encode(text: str) -> list[int]:
    """Encode plain text; special-token strings in the text are treated as ordinary text."""
    return get_encoding().encode_ordinary(text)


def decode(ids) -> str:
    return get_encoding().decode([int(i) for i in ids if int(i) < N_VOCAB])
