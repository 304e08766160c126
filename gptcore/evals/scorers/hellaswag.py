"""HellaSwag (validation split) scored exactly as build-nanogpt does, but batched for speed.

Each example is a context and four endings. For every ending the model sees
`tokens(ctx) + tokens(" " + ending)` and we sum the cross-entropy over the ending tokens only:
`acc` picks the ending with the lowest summed loss, `acc_norm` the one with the lowest mean loss per
ending token. (GPT-2 124M scores acc 0.2859, acc_norm 0.2955 this way.)

Speed: the four endings of an example share one forward pass, several examples go in one batch, and
every batch is padded to one of a few fixed shapes (length buckets, a fixed number of rows), so a
torch.compile'd model compiles a handful of shapes once instead of once per example. Under DDP each
rank scores examples[rank::world] and the counts are all-reduced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import urllib.request
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from torch.nn import functional as F

from gptcore import distributed
from gptcore.config import RunConfig
from gptcore.files import atomic_write_bytes, pipeline_home
from gptcore.model.gpt import evaluating, unwrap
from gptcore.model.tokenizer import encode

log = logging.getLogger(__name__)

DEFAULT_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
URL_ENV = "GPTPIPE_HELLASWAG_URL"  # override the source (a mirror; tests serve a file on 127.0.0.1)
VAL_EXAMPLES = 10_042
# sha256 of the canonical hellaswag_val.jsonl. Unknown when this was written (no network); once a
# verified download exists, pin its digest here and every later download is checked against it.
VAL_SHA256 = ""
DOWNLOAD_TIMEOUT_S = 60


class HellaSwagError(ValueError):
    """A HellaSwag file is malformed; the message names the file and the line."""


@dataclass
class Example:
    ctx: str
    endings: list[str]
    label: int
    ctx_tokens: list[int]
    ending_tokens: list[list[int]]  # each ending encoded with its leading space, as build-nanogpt

    @property
    def tokens(self) -> list[int]:
        """The context and every ending: the example's text as a contamination check reads it."""
        return self.ctx_tokens + [t for ending in self.ending_tokens for t in ending]


# --- the file ------------------------------------------------------------------------------------

def parse_record(line: str, lineno: int, source: str | Path) -> tuple[str, list[str], int]:
    """(ctx, endings, label) of one jsonl line, or a HellaSwagError naming the file and line."""
    where = f"{source} line {lineno}"
    if not line.strip():
        raise HellaSwagError(f"{where} is empty; HellaSwag jsonl has one example per line (delete the file "
                             "to re-download it)")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise HellaSwagError(f"{where} is not valid JSON ({e}); the file is truncated or corrupt: "
                             "delete it so it is downloaded again, or fix the line") from None
    if not isinstance(obj, dict):
        raise HellaSwagError(f"{where} is a JSON {type(obj).__name__}, expected an object with "
                             "ctx/endings/label")
    ctx, endings, label = obj.get("ctx"), obj.get("endings"), obj.get("label")
    if not isinstance(ctx, str):
        raise HellaSwagError(f"{where} has no string 'ctx' field")
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
        raise HellaSwagError(f"{where}: 'endings' must be a list of 4 strings, got {endings!r:.80}")
    if isinstance(label, str) and label.isdigit():
        label = int(label)  # the Hugging Face copy stores labels as strings
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < 4):
        raise HellaSwagError(f"{where}: 'label' must be an integer 0..3, got {label!r}")
    return ctx, endings, label


def read_records(path: Path, limit: int = 0) -> list[tuple[str, list[str], int]]:
    path = Path(path)
    if not path.is_file():
        raise HellaSwagError(f"HellaSwag file {path} does not exist; set eval.hellaswag.path to the "
                             "hellaswag_val.jsonl file or leave it empty to download it")
    try:
        with open(path, encoding="utf-8") as f:
            return [parse_record(line, i, path) for i, line in enumerate(islice(f, limit or None), start=1)]
    except (OSError, UnicodeDecodeError) as e:  # a benchmark file that cannot be read must not stop a run
        raise HellaSwagError(f"cannot read {path} ({e}); it is corrupt or not UTF-8: delete it to re-download "
                             "it, or point eval.hellaswag.path at a good copy") from None


def make_example(ctx: str, endings: list[str], label: int) -> Example:
    return Example(ctx, endings, label, encode(ctx), [encode(" " + e) for e in endings])


def verify_bytes(data: bytes) -> str:
    """'' if `data` is a complete HellaSwag validation file, else what is wrong with it."""
    if VAL_SHA256 and hashlib.sha256(data).hexdigest() != VAL_SHA256:
        return f"sha256 {hashlib.sha256(data).hexdigest()} != pinned {VAL_SHA256}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text ({e})"
    lines = text.splitlines()
    if len(lines) != VAL_EXAMPLES:
        return f"{len(lines)} lines, expected {VAL_EXAMPLES} (truncated or not the validation split)"
    try:
        for i, line in enumerate(lines, start=1):
            parse_record(line, i, "download")
    except HellaSwagError as e:
        return str(e)
    return ""


def fetch(cfg: RunConfig) -> tuple[Path | None, str]:
    """(path, '') when the dataset is available, else (None, why not)."""
    path = cfg.eval.options("hellaswag").path
    if path:
        p = Path(path).expanduser()
        if p.is_file():
            return p, ""
        return None, (f"eval.hellaswag.path={p} does not exist; point it at a hellaswag_val.jsonl file "
                      "or set it to '' to download the dataset")
    dest = pipeline_home() / "hellaswag" / "hellaswag_val.jsonl"
    if dest.is_file():  # only ever written (atomically) after verification
        return dest, ""
    url = os.environ.get(URL_ENV) or DEFAULT_URL
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r:
            data = r.read()
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        return None, (f"cannot download {url} ({e}); on an air-gapped machine copy hellaswag_val.jsonl "
                      f"to {dest} or set eval.hellaswag.path (or {URL_ENV} to a reachable mirror)")
    problem = verify_bytes(data)
    if problem:
        return None, f"the file downloaded from {url} failed verification: {problem}"
    atomic_write_bytes(dest, [data])
    log.info("HellaSwag validation split cached at %s", dest)
    return dest, ""


def shared_examples(cfg: RunConfig, path: Path | None = None, limit: int = 0,
                    master: bool = True) -> tuple[list[Example] | None, str]:
    """The examples on every rank, read (or downloaded) by rank 0 alone and broadcast: ranks on nodes
    without a shared home get the same list, no rank downloads on its own, and either every rank scores
    or none does. (None, why) when the dataset cannot be had; a bad explicit `path` raises
    HellaSwagError on every rank."""
    status, payload = "skip", ""
    if master:
        p, why = (Path(path), "") if path else fetch(cfg)
        try:
            status, payload = ("ok", read_records(p, limit)) if p is not None else ("skip", why)
        except HellaSwagError as e:
            status, payload = "error", str(e)
    status, payload = distributed.broadcast_object((status, payload))
    if status == "error":
        raise HellaSwagError(payload)
    if status == "skip":
        return None, payload
    return [make_example(*r) for r in payload], ""


# --- scoring -------------------------------------------------------------------------------------

def bucket_lengths(block_size: int) -> list[int]:
    """Padded sequence lengths 32, 48, 64, 96, 128, 192, ... (< 1/3 padding), capped by the block size.
    HellaSwag rows (up to ~200 tokens) touch only a few of them, so a compiled model sees few shapes."""
    out, n = [], 32
    while n < block_size:
        out += [m for m in (n, n * 3 // 2) if m < block_size]
        n *= 2
    return out + [block_size]


def example_rows(ex: Example, block_size: int) -> list[tuple[list[int], int]]:
    """Per ending: (tokens, how many trailing tokens are ending tokens to score). Rows longer than the
    block keep their last block_size tokens (only matters for models with a block smaller than
    HellaSwag's longest example, ~200 tokens)."""
    rows = []
    for end in ex.ending_tokens:
        toks = (ex.ctx_tokens + end)[-block_size:]
        rows.append((toks, min(len(end), len(toks) - 1)))  # the first token of a row has no prediction
    return rows


@torch.no_grad()
def score(model: torch.nn.Module, examples: list[Example], device, autocast_ctx=None,
          batch_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, ending token count), each (len(examples), 4) float64 on the CPU."""
    block = unwrap(model).config.block_size
    buckets = bucket_lengths(block)
    # Logits are (rows, length, 50257). A GPU wants big batches (8192 tokens = 0.8 GB of bf16 logits);
    # a CPU is compute-bound and runs fastest while the logits stay small (512 tokens = 0.1 GB).
    batch_tokens = batch_tokens or (8192 if torch.device(device).type == "cuda" else 512)
    sums = torch.zeros(len(examples), 4, dtype=torch.float64)
    counts = torch.zeros(len(examples), 4, dtype=torch.float64)

    rows = [example_rows(ex, block) for ex in examples]
    by_bucket: dict[int, list[int]] = {}
    for i, ex_rows in enumerate(rows):
        longest = max(len(t) for t, _ in ex_rows)
        by_bucket.setdefault(next(b for b in buckets if b >= longest), []).append(i)

    with evaluating(model) as plain:
        for length, idxs in sorted(by_bucket.items()):
            per_batch = max(1, batch_tokens // (4 * length))  # examples per forward: fixed for this bucket
            for start in range(0, len(idxs), per_batch):
                chunk = idxs[start:start + per_batch]
                # the last chunk is padded with empty rows, so every forward of this bucket has one shape
                x = torch.zeros(4 * per_batch, length, dtype=torch.long)
                y = torch.full((4 * per_batch, length), -1, dtype=torch.long)
                for j, i in enumerate(chunk):
                    for k, (toks, n_end) in enumerate(rows[i]):
                        n = len(toks)
                        x[4 * j + k, :n] = torch.tensor(toks)
                        # position p predicts token p+1: score the predictions of the last n_end tokens
                        y[4 * j + k, n - 1 - n_end:n - 1] = torch.tensor(toks[n - n_end:])
                x, y = x.to(device), y.to(device)
                with autocast_ctx or nullcontext():
                    logits, _ = plain(x)
                mask = y >= 0
                # only the ending positions' logits are upcast and normalised, not the context or padding
                logp = F.log_softmax(logits[mask].float(), dim=-1)
                nll = -logp.gather(1, y[mask].unsqueeze(1)).squeeze(1).double()
                row_sum = torch.zeros(x.size(0), dtype=torch.float64, device=nll.device)
                row_sum.index_add_(0, mask.nonzero()[:, 0], nll)
                n_rows = 4 * len(chunk)
                sums[chunk] = row_sum[:n_rows].view(-1, 4).cpu()
                counts[chunk] = mask.sum(1)[:n_rows].view(-1, 4).double().cpu()
    return sums, counts


def local_counts(model: torch.nn.Module, examples: list[Example], device, autocast_ctx=None,
                 rank: int = 0, world: int = 1) -> torch.Tensor:
    """This rank's [correct, correct by length-normalised loss, examples] over its share
    examples[rank::world] (float64, on `device`); no collective."""
    mine = examples[rank::world]
    sums, counts = score(model, mine, device, autocast_ctx)
    labels = torch.tensor([ex.label for ex in mine], dtype=torch.long)
    correct = [int((s.argmin(1) == labels).sum()) for s in (sums, sums / counts)]  # acc, acc_norm
    return torch.tensor([*correct, len(mine)], dtype=torch.float64, device=device)


def stderr(p: float, n: int) -> float:
    """The standard error of an accuracy p over n examples: the sample standard deviation of the 0/1
    outcomes over sqrt(n), sqrt(p (1 - p) / (n - 1)), as lm-evaluation-harness reports it."""
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def summary(totals) -> dict:
    """{"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n"} from the summed local_counts: 200
    examples score +-3.5 points (one standard error at acc 0.3), so two checkpoints whose accuracies differ
    by less than about twice that are not told apart."""
    c, cn, n = (int(v) for v in totals)
    acc, acc_norm = (c / n, cn / n) if n else (0.0, 0.0)
    return {"acc": acc, "acc_stderr": stderr(acc, n), "acc_norm": acc_norm,
            "acc_norm_stderr": stderr(acc_norm, n), "n": n}


def evaluate(model: torch.nn.Module, examples: list[Example], device, autocast_ctx=None,
             rank: int = 0, world: int = 1) -> dict:
    """{"acc", "acc_norm", "n"} over all examples; under DDP every rank must call this."""
    totals = local_counts(model, examples, device, autocast_ctx, rank, world)
    if world > 1:
        distributed.all_reduce_sum(totals)
    return summary(totals)
