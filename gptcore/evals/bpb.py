"""Bits per byte: how many bits the model needs, per UTF-8 byte, to encode text it is shown.

At 124M HellaSwag's accuracy sits a few points above chance (25%) and a step's gain hides inside its error
bar; the log-likelihood of the correct continuation moves with every improvement, and counted per byte it
does not depend on the tokenizer (OLMo's `*_bpb` tasks, nanochat's validation bpb). Two parts:

    hellaswag   the correct ending of each HellaSwag example given its context: the same examples and
                tokens HellaSwag scores (gptcore/evals/scorers/hellaswag.py computes the losses)
    text        a UTF-8 text (eval.bpb.text; default: the first eval.bpb.text_bytes of the built-in
                corpus's last work, held out from FineWeb-Edu runs, not from the demo's, which trains on
                it), in windows of the model's block size, every token after the first predicted once

bits per byte = summed cross-entropy in nats / ln 2 / the bytes those tokens decode to. Lower is better.
Under DDP each rank scores its share (examples[rank::world], windows[rank::world]) and the sums are added.
Settings: eval.bpb.* (below); off by default; during training every eval.bpb.interval steps.
"""

from __future__ import annotations

# lazy imports: the registry is read by the flow's no-op re-run, which must not import torch
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from gptcore.config import ConfigError
from gptcore.evals.base import Context, Evaluation
from gptcore.evals.hellaswag import examples


@dataclass
class BitsPerByteSettings:
    enabled: bool = False
    interval: int = 1000  # steps between evaluations (at an eval step); 0 = only at the end
    text: str = ""  # a UTF-8 text file; "" = the built-in corpus's last work
    text_bytes: int = 100_000  # score its first N bytes (0 = all of it)

    def validate(self) -> None:
        if self.interval < 0 or self.text_bytes < 0:
            raise ConfigError(f"eval.bpb.interval and eval.bpb.text_bytes must be >= 0, got {self.interval} "
                              f"and {self.text_bytes}")
        if self.text and not Path(self.text).is_file():
            raise ConfigError(f"eval.bpb.text={self.text} is not a file; give a UTF-8 text file, or '' for the "
                              "built-in one")


class BitsPerByte(Evaluation):
    name = "bpb"
    Settings = BitsPerByteSettings

    def settings(self, cfg) -> dict:
        o = self.options(cfg)
        return {"text": o.text or "builtin", "text_bytes": o.text_bytes,
                "hellaswag_limit": cfg.eval.options("hellaswag").limit}

    def prepare(self, ctx: Context) -> None:
        examples(ctx)  # rank 0 reads HellaSwag and shares it (collective), as HellaSwag's own prepare

    def share(self, ctx: Context) -> dict:
        found, why = examples(ctx)
        o = self.options(ctx.cfg)
        key = ("bpb-text", o.text, o.text_bytes)  # read and tokenized once per invocation (the trainer keeps ctx.cache)
        if key not in ctx.cache:
            ctx.cache[key] = text_tokens(o)
        out = {"text": text_sums(ctx, ctx.cache[key])}
        out["hellaswag"] = {"skipped": why} if found is None else hellaswag_sums(ctx, found[ctx.rank::ctx.world])
        return out

    def combine(self, shares: list[dict]) -> dict:
        out = {}
        for part in ("hellaswag", "text"):
            if "skipped" in shares[0][part]:
                out[part] = shares[0][part]
                continue
            nats, n_bytes = (sum(s[part][k] for s in shares) for k in ("nats", "bytes"))
            out[part] = {"bpb": nats / math.log(2) / n_bytes, "bytes": n_bytes} if n_bytes else \
                {"skipped": f"no {part} bytes to score (an empty text, or no examples)"}
        return out


def token_bytes(tokens) -> int:
    """The UTF-8 bytes a token sequence decodes to (counted per token: a cut never splits a character)."""
    from gptcore.model.tokenizer import get_encoding

    enc = get_encoding()
    return sum(len(enc.decode_single_token_bytes(t)) for t in tokens)


def hellaswag_sums(ctx: Context, mine: list) -> dict:
    """This rank's summed loss (nats) over the correct endings of its examples, and their bytes."""
    from gptcore.evals.scorers.hellaswag import score

    if not mine:
        return {"nats": 0.0, "bytes": 0}
    sums, counts = score(ctx.model, mine, ctx.device, ctx.autocast_ctx)
    nats, n_bytes = 0.0, 0
    for i, ex in enumerate(mine):
        n = int(counts[i, ex.label])  # the ending's tokens that were scored (all, unless cut to the block)
        nats += float(sums[i, ex.label])
        n_bytes += token_bytes(ex.ending_tokens[ex.label][-n:])
    return {"nats": nats, "bytes": n_bytes}


def text_tokens(o: BitsPerByteSettings) -> list[int]:
    from gptcore.model.tokenizer import encode

    if o.text:
        data = Path(o.text).read_bytes()
    else:
        import pyarrow.parquet as pq

        from gptcore.data.source_builtin import builtin_file

        works = pq.read_table(builtin_file().path, columns=["text"]).column("text")
        data = works[len(works) - 1].as_py().encode("utf-8")
    if o.text_bytes:
        data = data[:o.text_bytes]
    return encode(data.decode("utf-8", errors="ignore"))  # a cut inside a character drops that character


def text_sums(ctx: Context, tokens: list[int]) -> dict:
    """This rank's summed loss over its windows of the text: window k holds tokens k*B .. k*B+B and predicts
    the last B of them, so every token after the first is predicted once, with up to B tokens of context."""
    import torch
    from torch.nn import functional as F

    from gptcore.model.gpt import unwrap

    block = unwrap(ctx.model).config.block_size
    starts = list(range(0, max(len(tokens) - 1, 0), block))[ctx.rank::ctx.world]
    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for s in starts:
            window = torch.tensor(tokens[s:s + block + 1], dtype=torch.long, device=ctx.device)
            with ctx.autocast_ctx or nullcontext():
                logits, _ = ctx.model(window[None, :-1])
            nats += float(F.cross_entropy(logits[0].float(), window[1:], reduction="sum"))
            n_bytes += token_bytes(tokens[s + 1:s + block + 1])
    return {"nats": nats, "bytes": n_bytes}

