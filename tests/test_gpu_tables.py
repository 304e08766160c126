"""The GPU tables in README.md and docs/training.md are generated from the committed lease evidence
(benchmarks/gpu_tables.py), never copied: a table that differs from what the evidence gives fails here, and
each MFU is the one convention (llm.c's count over the card's datasheet peak), pinned on lease 6's and
lease 3's own rows (issue 68)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import gpu_tables


def test_every_table_in_the_docs_is_what_the_evidence_gives():
    """Rerun `python -m benchmarks.gpu_tables` and commit the result when this fails."""
    assert gpu_tables.stale() == []
    names = {m["name"] for doc in gpu_tables.DOCS for m in gpu_tables.MARKED.finditer(doc.read_text())}
    assert names == set(gpu_tables.TABLES)  # every table is shown somewhere, and nothing unknown is marked


def test_a_changed_lease_row_makes_the_docs_stale(tmp_path):
    """The check would catch a figure left behind: one lease's reference tokens/s changed in a copy of the
    evidence, and the README's and docs/training.md's reference tables are stale, nothing else."""
    evidence = tmp_path / "gpu"
    shutil.copytree(gpu_tables.EVIDENCE, evidence)
    rows_file = evidence / "2026-11-27-h100-lease6" / "rows.json"
    table = json.loads(rows_file.read_text())
    ref = next(r for r in table["rows"] if r["name"] == "reference")
    ref["detail"] = ref["detail"].replace("491,226 vs", "501,226 vs")
    rows_file.write_text(json.dumps(table))
    assert gpu_tables.stale(evidence=evidence) == ["README.md: reference", "docs/training.md: reference"]


def test_the_figures_are_recomputed_in_the_one_mfu_convention():
    tables = gpu_tables.generate()
    # lease 6's reference row printed "MFU 55.2% vs 53.8% of the 760.6 TFLOP/s matmul rate" (nanoGPT's count
    # over the measured rate); by llm.c's count: 39.9% vs 38.9% of the H100's 989, 51.9% vs 50.6% of 760.6
    [row] = [ln for ln in tables["reference"].splitlines() if ln.startswith("| 2026-11-27-h100-lease6 |")]
    assert "| 491,226 | 478,586 | **1.026x** (mean of 2: 1.025, 1.027) | 39.9% vs 38.9% | 51.9% vs 50.6% of 760.6 |" \
        in row
    # the family from its kept metrics: lease 3's 774m at 89,595 tok/s is 44.6% (47.1% by nanoGPT's count)
    assert ("| 2026-11-27-h100-lease3 | gpt2-774m | none | 32 of 32 | 89,595 (88,600-90,578), 5 steps | 44.6% | "
            "not kept | 67.2 GiB |") in tables["family"]
    assert "| 46.4% | 61.1% of 750.5 |" in tables["family"]  # lease 3's 1558m, its call's matmul rate
    # a row asked for and not measured says why, in its own words
    assert ("| 2026-11-27-h100-lease6 | resume after SIGKILL | not run: needs the train micro row |"
            in tables["acceptance"])
    assert "| 2026-11-27-h100-lease4-cdt | NVIDIA H100 80GB HBM3 | FAIL: TimeoutError: killed after 323 s" \
        in tables["reference"]
    assert "| FLOPs per token (fwd+bwd, llm.c's count) | 8.035e8 |" in tables["projection"]


def test_an_unknown_table_marker_is_refused():
    with pytest.raises(SystemExit, match="unknown table 'nope'"):
        gpu_tables.render("<!-- gpu-table:nope -->\nx\n<!-- /gpu-table:nope -->\n", {"reference": ""})


def test_the_pending_table_counts_a_row_only_when_measured_as_issue_68_asks(tmp_path):
    """Earlier leases' family rows (2 micro-steps, 5 steps) and 2-round reference ratios do not count as the
    steady-state rows; a lease whose rows say 3 rounds and the presets' own steps does, and a sustained row's
    figures are read from its own text."""
    old = gpu_tables.pending_table(gpu_tables.leases())
    assert "| family (at the presets' own steps over 60 s) | **pending**: no lease yet |" in old
    assert "| reference (3 alternated rounds) | **pending**: no lease yet |" in old
    assert "| sustained | **pending**: no lease yet | `CALL=sustained bash benchmarks/gpu_lease.sh`" in old
    sustained = ("150 steps after the first 3, 181 s of steps in 189 s of wall time; tokens/s first 60 s 490,100, "
                 "last 60 s 487,000 (99.4%; pass >= 95%); outside steps 3.9% of steps + outside (pass <= 5%): ...")
    rows = [{"name": "reference", "status": "PASS", "seconds": 400,
             "detail": "491,226 vs 478,586 tok/s: median 1.026x over 3 alternated rounds (ABBAAB; ...)"},
            {"name": "family", "status": "PASS", "seconds": 400,
             "detail": "matmul 760.6 TFLOP/s; steps after the first 3; gpt2-350m (none): micro_batch 32 of 32 x 16 "
                       "micro-steps (524,288-token steps), 180,000 tok/s (179,000-181,000) over 20 steps, 60 s"},
            {"name": "sustained", "status": "PASS", "seconds": 260, "detail": sustained}]
    new = gpu_tables.Lease(tmp_path / "2026-12-01-h100", {"device": "1 x NVIDIA H100 80GB HBM3", "rows": rows})
    table = gpu_tables.pending_table([*gpu_tables.leases(), new])
    for key in ("family (at the presets' own steps over 60 s)", "reference (3 alternated rounds)", "sustained"):
        assert f"| {key} | 2026-12-01-h100 |  |" in table, table
    assert gpu_tables.figure(rows[2]) == ("PASS: 181 s of steps: 490,100 -> 487,000 tok/s first to last minute "
                                          "(99.4%), 3.9% of wall time outside steps, measured")
