"""gptcore.model.tokenizer: the GPT-2 BPE built offline from the shipped rank file must give exactly tiktoken's
own `r50k_base` ids (the encoding `gpt2` shares), work with the network off and an empty tiktoken cache,
and refuse a damaged rank file."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tiktoken

from gptcore.model import tokenizer
from gptcore.model.tokenizer import EOT, RANK_FILE, TokenizerError, decode, encode, get_encoding

R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
CORPUS = Path(tokenizer.__file__).parents[1] / "assets" / "corpus" / "shakespeare.parquet"
TRICKY = [
    "Hello world", "", " ", "\n\n\n", "  leading and trailing  ", "tabs\tand\r\nCRLF",
    "naïve café, Zürich — “quotes” …", "日本語のテキストと中文", "emoji 👩‍👩‍👧‍👦 🇺🇳 🙂!!",
    "combining: e\u0301 a\u0308", "Ελληνικά и русский", "مرحبا بالعالم", "I'm you're we'll they've it'd",
    "numbers 1234567890 3.14159 1e-5", "<|endoftext|> as plain text", "\u200bzero\u200dwidth\ufeff",
    "x" * 3000, "🙂" * 200, "\x00\x01 control \x7f", "a\u2028b\u2029c",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """tiktoken's own r50k_base definition (pattern, special tokens, n_vocab, sha256 check) fed the rank
    file through tiktoken's cache, the way it would arrive from OpenAI's blob store."""
    import tiktoken_ext.openai_public as openai_public

    cache = tmp_path_factory.mktemp("tiktoken_ref")
    shutil.copy(RANK_FILE, cache / hashlib.sha1(R50K_URL.encode()).hexdigest())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        return tiktoken.Encoding(**openai_public.r50k_base())


def test_known_gpt2_ids():
    assert encode("Hello world") == [15496, 995]
    assert encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert encode(" the") == [262]
    assert encode("\n") == [198]
    enc = get_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert decode([EOT]) == "<|endoftext|>"
    assert EOT not in encode("<|endoftext|>")  # in document text it is just text


def test_identical_to_tiktoken_reference(reference):
    ours = get_encoding()
    assert ours._pat_str == reference._pat_str
    assert ours._special_tokens == reference._special_tokens
    texts = TRICKY + pq.read_table(CORPUS, columns=["text"]).column("text").to_pylist()[:20]
    for t in texts:
        assert ours.encode_ordinary(t) == reference.encode_ordinary(t), t[:60]
    assert sum(len(t) for t in texts) > 50_000  # a real amount of text was compared
    # every single-token byte string maps to the same id
    assert all(ours.encode_single_token(reference.decode_single_token_bytes(i)) == i
               for i in range(0, 50257, 97))


def test_unicode_round_trip():
    for t in TRICKY:
        assert decode(encode(t)) == t
    # byte-level BPE: decoding never fails, even for ids that split a multi-byte character
    ids = encode("日本")
    assert len(ids) > 1
    assert decode(ids) == "日本"


def test_decode_drops_padded_ids():
    assert decode([15496, 50300, 995]) == "Hello world"


CHILD = r"""
import json, os, socket, sys
def deny(*a, **k):
    raise OSError("network disabled by the test")
socket.socket.connect = deny
socket.socket.connect_ex = deny
socket.create_connection = deny
socket.getaddrinfo = deny

import tiktoken
from gptcore.model import tokenizer
ids = tokenizer.encode("Hello world, naïve café 🙂")
out = {"ids": ids, "round_trip": tokenizer.decode(ids), "eot": tokenizer.get_encoding().eot_token,
       "cache": sorted(os.listdir(os.environ["TIKTOKEN_CACHE_DIR"]))}
try:  # proves the network really is off: tiktoken's own loader must fail
    tiktoken.get_encoding("gpt2")
    out["tiktoken_download"] = "succeeded"
except Exception as e:
    out["tiktoken_download"] = type(e).__name__
print(json.dumps(out))
"""


def test_works_offline_with_empty_tiktoken_cache(tmp_path):
    cache = tmp_path / "tiktoken_cache"
    cache.mkdir()
    bad_proxy = "http://127.0.0.1:9"
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(cache), "HTTP_PROXY": bad_proxy, "HTTPS_PROXY": bad_proxy,
           "http_proxy": bad_proxy, "https_proxy": bad_proxy, "NO_PROXY": "", "no_proxy": "",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ids"] == encode("Hello world, naïve café 🙂") and out["ids"][:2] == [15496, 995]
    assert out["round_trip"] == "Hello world, naïve café 🙂"
    assert out["eot"] == 50256
    assert out["cache"] == []  # nothing fetched or cached
    assert out["tiktoken_download"] != "succeeded"
    assert list(cache.iterdir()) == []


def test_corrupted_or_missing_rank_file_is_a_clear_error(tmp_path):
    data = bytearray(RANK_FILE.read_bytes())
    flipped = tmp_path / "flipped.tiktoken"
    data[1000] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.tiktoken"
    truncated.write_bytes(RANK_FILE.read_bytes()[:-100])
    for f in (flipped, truncated):
        with pytest.raises(TokenizerError, match=r"sha256 [0-9a-f]{64}, expected 306cd27f.*Reinstall"):
            get_encoding(f)
    with pytest.raises(TokenizerError, match="cannot read the GPT-2 rank file"):
        get_encoding(tmp_path / "missing.tiktoken")
    assert get_encoding(RANK_FILE).encode_ordinary("Hello world") == [15496, 995]
