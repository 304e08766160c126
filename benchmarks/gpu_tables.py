"""The GPU tables of README.md and docs/training.md, generated from the committed lease evidence
(docs/gpu/<lease>/rows.json, env.txt and logs.tar.gz), never copied by hand (issue 68):

    python -m benchmarks.gpu_tables            # rewrite every table between its markers
    python -m benchmarks.gpu_tables --check    # exit 1 naming each table that differs (tests/test_gpu_tables.py)
    python -m benchmarks.gpu_tables --print reference   # one table on stdout

A table sits between `<!-- gpu-table:NAME -->` and `<!-- /gpu-table:NAME -->`. Every MFU is recomputed in the
project's one convention (gptcore.model.gpt.flops_per_token: llm.c's 6N + 6*L*C*T, over the card's datasheet
dense bf16 peak); beside it the share of the matmul rate measured in the same call, where the row kept it.
A row asked for and not measured says why (its own FAIL or "not run" text). It reads files only, so it runs
on any machine (the FLOP count and the peaks come from gptcore.model.gpt).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "docs" / "gpu"
DOCS = (ROOT / "README.md", ROOT / "docs" / "training.md")
WARM_STEPS = 3  # gpu_check's family row: steps after the first three (the compile) are measured


@dataclass
class Lease:
    """One call's evidence folder: docs/gpu/<date>-<card>[-what]/."""
    folder: Path
    table: dict

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def card(self) -> str:
        return self.table["device"].split(" x ", 1)[-1]

    def row(self, name: str) -> dict | None:
        return next((r for r in self.table["rows"] if r["name"] == name), None)

    def kept(self, member: str) -> bytes | None:
        """One file of the lease's logs.tar.gz (a run's metrics.jsonl, config.json, ...), None when not kept."""
        with tarfile.open(self.folder / "logs.tar.gz") as tar:
            try:
                f = tar.extractfile(member)
            except KeyError:
                return None
            return f.read() if f else None

    def metrics(self, member: str) -> list[dict]:
        text = (self.kept(member) or b"").decode()
        return [json.loads(ln) for ln in text.splitlines() if ln.strip()]

    def config(self, member: str) -> dict:
        return json.loads(self.kept(member) or b"{}")


def leases(evidence: Path = EVIDENCE) -> list[Lease]:
    return [Lease(p.parent, json.loads(p.read_text())) for p in sorted(evidence.glob("*/rows.json"))]


def card_peak(card: str) -> float | None:
    # lazy: torch only once a table is generated (the docs check itself needs it for the FLOPs count)
    from gptcore.model.gpt import peak_flops_for
    return peak_flops_for(card)


def fpt_of(preset: str, seq_len: int = 1024) -> float:
    # lazy, as above
    from gptcore.model.gpt import flops_per_token
    from gptcore.overrides import load_config
    return flops_per_token(load_config(preset).model, seq_len)


def num(text: str) -> float:
    return float(text.replace(",", ""))


def cell(text: str) -> str:
    """Text safe in a markdown table cell."""
    return text.replace("|", "\\|")


def sci(x: float) -> str:
    return f"{x:.3e}".replace("e+0", "e").replace("e+", "e")


def short(x: float) -> str:
    """A learning rate as the docs write it: 6e-4, 2.5e-4, 0."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def pct(x: float) -> str:
    return f"{x:.1%}"


def why(row: dict) -> str:
    """A row that did not measure: its status and its own reason, shortened."""
    detail = row["detail"].split(" (the log is kept")[0]
    return f"{row['status']}: {detail[:140]}"


# --- tables ------------------------------------------------------------------------------------------------

REFERENCE = re.compile(r"([\d,]+) vs ([\d,]+) tok/s: (mean|median|one) ([\d.]+)x over (\d+) alternated rounds "
                       r"\(\w+; per round ([\d., ]+);")
MEASURED = re.compile(r"of the ([\d.]+) TFLOP/s matmul rate")
MEMORY = re.compile(r"peak memory ([\d.]+) vs ([\d.]+) GiB")


def reference_table(all_leases: list[Lease]) -> str:
    """Ours against build-nanogpt's own train_gpt2.py (gpt2-124m, 524,288-token steps, ABBA), per lease."""
    fpt = fpt_of("gpt2-124m")
    lines = ["| lease | card | ours tok/s | build-nanogpt tok/s | ratio (per round) | MFU ours vs theirs "
             "(llm.c's count, of the card's datasheet peak) | of the matmul rate measured in the call | "
             "peak memory ours vs theirs |", "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for lease in all_leases:
        row = lease.row("reference")
        if row is None:
            continue
        m = REFERENCE.search(row["detail"])
        if not m:
            lines.append(f"| {lease.name} | {lease.card} | {cell(why(row))} | | | | | |")
            continue
        ours, theirs, middle, ratio, rounds, per = m.groups()
        ratios.append(float(ratio))
        peak, rate, mem = card_peak(lease.card), MEASURED.search(row["detail"]), MEMORY.search(row["detail"])
        card = f"{pct(fpt * num(ours) / peak)} vs {pct(fpt * num(theirs) / peak)}" if peak else "card unknown"
        measured = (f"{pct(fpt * num(ours) / (float(rate[1]) * 1e12))} vs "
                    f"{pct(fpt * num(theirs) / (float(rate[1]) * 1e12))} of {rate[1]}" if rate else "not kept")
        lines.append(f"| {lease.name} | {lease.card} | {ours} | {theirs} | **{ratio}x** ({middle} of {rounds}: "
                     f"{per.strip()}) | {card} | {measured} | "
                     f"{f'{mem[1]} vs {mem[2]} GiB' if mem else 'not kept'} |")
    if ratios:
        lines.append("")
        lines.append(f"{len(ratios)} leases measured the ratio: {min(ratios):.3f}x to {max(ratios):.3f}x "
                     f"(median {statistics.median(ratios):.3f}x); target 1.03x.")
    return "\n".join(lines)


FAMILY_RATE = re.compile(r"matmul ([\d.]+) TFLOP/s")


def family_table(all_leases: list[Lease]) -> str:
    """Each size of the family through the trainer (torchrun, compile, bf16, micro_batch=auto), from the
    kept metrics: the median tokens/s of the steps after the first three, its spread, MFU, peak memory."""
    lines = ["| lease | preset | checkpointing | micro-batch | tokens/s median (min-max), steps | MFU (llm.c's "
             "count, of the card's datasheet peak) | of the matmul rate measured in the call | peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    for lease in all_leases:
        row = lease.row("family")
        if row is None:
            continue
        rate = FAMILY_RATE.search(row["detail"])
        found = False
        for preset in ("gpt2-350m", "gpt2-774m", "gpt2-1558m"):
            base = f"family/family-{preset}"
            steps = [r for r in lease.metrics(f"{base}/metrics.jsonl")
                     if r.get("kind") == "train" and r["step"] > WARM_STEPS]
            if not steps:
                continue
            found = True
            cfg = lease.config(f"{base}/config.json")
            tok = [r["train/tokens_per_s"] for r in steps]
            tok_s, seq = statistics.median(tok), cfg["train"]["seq_len"]
            fpt, peak = fpt_of(preset, seq), card_peak(lease.card)
            micro = cfg["train"]["micro_batch"]
            memory = max(r.get("train/peak_memory_gib", 0.0) for r in steps)
            measured = f"{pct(fpt * tok_s / (float(rate[1]) * 1e12))} of {rate[1]}" if rate else "not kept"
            lines.append(
                f"| {lease.name} | {preset} | {cfg['train']['activation_checkpointing']} | "
                f"{micro} of {cfg['train']['micro_batch_max']} | "
                f"{tok_s:,.0f} ({min(tok):,.0f}-{max(tok):,.0f}), {len(tok)} steps | "
                f"{pct(fpt * tok_s / peak) if peak else 'card unknown'} | {measured} | {memory:.1f} GiB |")
        if not found:
            lines.append(f"| {lease.name} | | | | {cell(why(row))} | | | |")
    return "\n".join(lines)


OTHER_ROWS = ("train gpt2-124m", "outside steps gpt2-124m", "harness parity", "guards gpt2-124m",
              "micro-batch auto", "train micro", "resume after SIGKILL", "ranks", "out of memory", "profile", "fp8",
              "sustained")
FIGURES = {  # what each row is read for, from its own text (a row that measured nothing says why instead)
    "train gpt2-124m": (r"loss [\d.]+ -> [\d.]+", "{0}"),
    "train micro": (r"loss [\d.]+ -> [\d.]+", "{0}"),
    "outside steps gpt2-124m": (r"a checkpoint blocked (\d+) ms.*val ([\d.]+) s per 10M tokens, HellaSwag ([\d.]+) "
                                r"s per 10,042 examples.*: ([\d.]+)% of wall time",
                                "{4}% of wall time projected at the preset's cadence (validation {2} s per 10M "
                                "tokens, HellaSwag {3} s per 10,042 examples); a checkpoint blocks {1} ms"),
    "harness parity": (r"max \|log-likelihood difference\| ([\d.e+-]+) nats", "{1} nats"),
    "guards gpt2-124m": (r"consistency check ([\d.]+) ms per call.*?: ([\d.]+%) of wall time",
                         "{1} ms per call, {2} of wall time"),
    "micro-batch auto": (r"micro_batch \d+ of at most \d+", "{0}"),
    "resume after SIGKILL": (r"worst loss gap [\d.e+-]+", "{0}"),
    "profile": (r"ours ([\d.]+) ms.*plain ([\d.]+) ms", "one micro-step: ours {1} ms, the plain loop {2} ms"),
    "sustained": (r"([\d,]+) s of steps.*tokens/s first \d+ s ([\d,]+), last \d+ s ([\d,]+) \(([\d.]+)%.*outside "
                  r"steps ([\d.]+)%", "{1} s of steps: {2} -> {3} tok/s first to last minute ({4}%), {5}% of wall "
                                      "time outside steps, measured"),
}


def figure(row: dict) -> str:
    """A row's status and its figure, read from its own text; what it says when it measured nothing."""
    pattern, form = FIGURES.get(row["name"], (None, None))
    m = re.search(pattern, row["detail"], re.S) if pattern else None
    if m is None:
        return why(row)
    return f"{row['status']}: {form.format(m[0], *m.groups())}"


def acceptance_table(all_leases: list[Lease]) -> str:
    """The other rows of each lease, one line per row asked for: its status and its figure, or why not."""
    lines = ["| lease | row | result |", "|---|---|---|"]
    for lease in all_leases:
        for row in lease.table["rows"]:
            if row["name"].startswith(OTHER_ROWS) or row["name"].endswith("ranks == 1 rank"):
                lines.append(f"| {lease.name} | {row['name']} | {cell(figure(row))} |")
    return "\n".join(lines)


def projection_table() -> str:
    """gpt2-124m's whole run on 8xH100 at 40% and 60% MFU (benchmarks.bench_train.gpu_projection)."""
    # lazy: bench_train imports torch and the model
    from benchmarks.bench_train import gpu_projection

    p = gpu_projection()
    return "\n".join([
        "| | value |", "|---|---|",
        f"| FLOPs per token (fwd+bwd, llm.c's count) | {sci(p['flops_per_token'])} |",
        f"| tokens per step | {p['tokens'] // p['steps']:,} |",
        f"| FLOPs per step | {sci(p['flops_per_step'])} |",
        f"| steps | {p['steps']:,} (≈ {p['tokens'] / 1e9:.1f}B tokens) |",
        f"| total FLOPs | {sci(p['total_flops'])} |",
        f"| at 40% MFU | {p['step_s_at_40pct']:.3f} s/step, **{p['hours_at_40pct_mfu_8xH100']:.2f} h** |",
        f"| at 60% MFU | {p['step_s_at_60pct']:.3f} s/step, **{p['hours_at_60pct_mfu_8xH100']:.2f} h** |",
    ])


def presets_table() -> str:
    """The family's presets: shape, recipe, FLOPs per token (llm.c's count) and the whole run on 8xH100 at
    40% MFU (989 TFLOP/s dense bf16 each); 16 bytes per parameter of weights, gradients and AdamW moments."""
    # lazy, as above
    from benchmarks.bench_train import H100_BF16_PEAK
    from gptcore.model.gpt import flops_per_token
    from gptcore.overrides import load_config

    lines = ["| preset | params | layers x width | lr (peak -> end) | tokens/step | steps | tokens | FLOPs/token | "
             "weights+grads+AdamW | step / total at 40% MFU on 8xH100 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for preset in ("gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1558m"):
        c = load_config(preset)
        n, tokens = c.model.approx_params(), c.train.total_batch_tokens
        step_s = flops_per_token(c.model, c.train.seq_len) * tokens / (8 * H100_BF16_PEAK * 0.4)
        lines.append(f"| {preset} | {n / 1e6:.0f}M | {c.model.n_layer} x {c.model.n_embd} | "
                     f"{short(c.optim.max_lr)} -> {short(c.optim.min_lr)} | {tokens:,} | {c.train.max_steps:,} | "
                     f"{tokens * c.train.max_steps / 1e9:.1f}B | {sci(flops_per_token(c.model, c.train.seq_len))} | "
                     f"{16 * n / 2**30:.1f} GiB | {step_s:.2f} s / {step_s * c.train.max_steps / 3600:.1f} h |")
    return "\n".join(lines)


# gpu_check's rows (its --rows names) as their rows.json names begin, and the lease call that measures each
ROW_NAMES = {"micro-batch": "micro-batch auto", "train": "train gpt2-124m", "reference": "reference",
             "harness": "harness parity", "guards": "guards", "resume": "resume after SIGKILL", "ranks": "ranks",
             "oom": "out of memory", "profile": "profile", "family": "family", "fp8": "fp8",
             "sustained": "sustained"}
# a row measured the way issue 68 asks only once its text says so: earlier leases' rows do not count for these
METHOD = {"reference": ("3 alternated rounds", r"over [3-9]\d* alternated rounds"),
          "family": ("at the presets' own steps over 60 s", r"-token steps\), [\d,]+ tok/s .* over \d+ steps")}
NEXT_CALLS = {  # in the order a lease should spend its time: what no lease has measured first (issue 68)
    "fp8": "`CALL=fp8 bash benchmarks/gpu_lease.sh` (torchao's wheel carried in wheels/)",
    "sustained": "`CALL=sustained bash benchmarks/gpu_lease.sh` (HellaSwag's file carried as "
                 "wheels/hellaswag_val.jsonl)",
    "oom": "`CALL=sustained bash benchmarks/gpu_lease.sh` (its second row)",
    "family": "`CALL=family bash benchmarks/gpu_lease.sh`, then `CALL=family-1558m`",
    "reference": "`CALL=reference bash benchmarks/gpu_lease.sh` (build-nanogpt carried in reference/)",
    "ranks": "`CALL=acceptance bash benchmarks/gpu_lease.sh` on a machine with >= 2 GPUs",
}


def measured(lease: Lease, key: str) -> bool:
    """Whether the lease ran gpu_check's row `key` to a figure (PASS, FAIL on its target, or info), by the
    method METHOD asks for where it names one."""
    prefix, ranks = ROW_NAMES[key], key == "ranks"
    method = METHOD.get(key, ("", ""))[1]
    return any((r["name"].startswith(prefix) or ranks and r["name"].endswith("ranks == 1 rank"))
               and r["status"] != "not run" and "Error" not in r["detail"].split(":")[0]
               and re.search(method, r["detail"]) is not None
               for r in lease.table["rows"])


def pending_table(all_leases: list[Lease]) -> str:
    """gpu_check's rows that no lease has measured yet, and the call that would: the lease plan's order."""
    lines = ["| row | measured by | next |", "|---|---|---|"]
    for key in [*NEXT_CALLS, *(k for k in ROW_NAMES if k not in NEXT_CALLS)]:
        by = [lease.name for lease in all_leases if measured(lease, key)]
        name = f"{key} ({METHOD[key][0]})" if key in METHOD else key
        lines.append(f"| {name} | {', '.join(by) if by else '**pending**: no lease yet'} | "
                     f"{NEXT_CALLS.get(key, 'rerun with the default call') if not by else ''} |")
    return "\n".join(lines)


TABLES = {"reference": reference_table, "family": family_table, "acceptance": acceptance_table,
          "projection": lambda _: projection_table(), "presets": lambda _: presets_table(),
          "pending": pending_table}
MARKED = re.compile(r"(<!-- gpu-table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /gpu-table:(?P=name) -->)", re.S)


def render(text: str, tables: dict[str, str]) -> str:
    """`text` with every marked table replaced by its generated body; an unknown name is an error."""
    def body(m: re.Match) -> str:
        if m["name"] not in tables:
            raise SystemExit(f"error: unknown table {m['name']!r} in a gpu-table marker; known: {sorted(tables)}")
        return f"{m[1]}{tables[m['name']]}\n{m[4]}"
    return MARKED.sub(body, text)


def generate(evidence: Path = EVIDENCE) -> dict[str, str]:
    all_leases = leases(evidence)
    return {name: make(all_leases) for name, make in TABLES.items()}


def stale(docs=DOCS, evidence: Path = EVIDENCE) -> list[str]:
    """'<file>: <table>' for each marked table whose text differs from what the evidence gives."""
    tables, out = generate(evidence), []
    for doc in docs:
        text = doc.read_text()
        fresh = render(text, tables)
        for old, new in zip(MARKED.finditer(text), MARKED.finditer(fresh), strict=True):
            if old["body"] != new["body"]:
                out.append(f"{doc.relative_to(ROOT)}: {old['name']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a table in the docs differs")
    ap.add_argument("--print", dest="show", choices=sorted(TABLES), help="print one table and exit")
    a = ap.parse_args(argv)
    if a.show:
        print(generate()[a.show])
        return 0
    if a.check:
        differ = stale()
        for d in differ:
            print(f"stale: {d} (run `python -m benchmarks.gpu_tables` and commit the result)", file=sys.stderr)
        return 1 if differ else 0
    tables = generate()
    for doc in DOCS:
        text = doc.read_text()
        fresh = render(text, tables)
        if fresh != text:
            tmp = doc.with_suffix(doc.suffix + ".tmp")
            tmp.write_text(fresh)
            tmp.replace(doc)  # never a half-written README
            print(f"rewrote {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
