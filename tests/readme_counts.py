"""README's test counts, produced by collecting the suite rather than typed.

    python -m tests.readme_counts            print the table
    python -m tests.readme_counts --write    rewrite README.md's table between its `<!-- counts` markers
    python -m tests.readme_counts --check    exit 1 when README.md's table differs (tests/test_suite.py)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import EXPECTED_SKIPS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
QUICK = "not slow and not server and not spawns"  # the Makefile's test-quick selection
BLOCK = re.compile(r"(<!-- counts:[^\n]*-->\n)(.*?)(<!-- /counts -->)", re.S)


def collected(marker: str | None = None) -> list[str]:
    """The node ids pytest collects (with `-m marker`)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd + (["-m", marker] if marker else []), cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    if r.returncode != 0 or not ids:
        sys.exit(f"collecting the tests failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return ids


def table(every: list[str] | None = None, quick: list[str] | None = None) -> str:
    """From the node ids of the whole suite and of its quick selection (collected here when not given)."""
    every = collected() if every is None else every
    quick = collected(QUICK) if quick is None else quick
    skips = lambda ids: sum(any(i.startswith(s) for s in EXPECTED_SKIPS) for i in ids)  # noqa: E731
    return ("| suite | tests | expected skips (no CUDA) |\n| --- | --- | --- |\n"
            f"| `make test` | {len(every)} | {skips(every)} |\n"
            f"| `make test-quick` | {len(quick)} | {skips(quick)} |\n")


def readme_table() -> str:
    found = BLOCK.search(README.read_text())
    if found is None:
        sys.exit("README.md has no `<!-- counts: ... -->` ... `<!-- /counts -->` block")
    return found.group(2)


def main(argv: list[str]) -> int:
    text, now = README.read_text(), table()
    found = BLOCK.search(text)
    if found is None:
        sys.exit("README.md has no `<!-- counts: ... -->` ... `<!-- /counts -->` block")
    if "--write" in argv:
        tmp = README.with_suffix(".md.tmp")
        tmp.write_text(text[:found.start(2)] + now + text[found.end(2):])
        tmp.replace(README)
    elif "--check" in argv and found.group(2) != now:
        print(f"README.md's test counts are stale; run `make readme-counts`. Now:\n{now}")
        return 1
    print(now, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
