"""Benchmarks: `python -m benchmarks.<name>`, each against a baseline measured in the same run.

Every benchmark takes --smoke: its smallest setting (seconds on a 2-core CPU, not minutes), which runs the
same code and prints the same result lines as a full run; its numbers say nothing about speed.
tests/test_benchmarks.py runs each one so, so that none of them rots unseen.
"""

from __future__ import annotations

import argparse


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, smoke: dict) -> argparse.Namespace:
    """`parser.parse_args(argv)` with a --smoke flag that makes `smoke` ({dest: value}) the defaults: an
    option given on the command line still wins over its smoke value."""
    flags = " ".join(_flag(k, v) for k, v in smoke.items())
    parser.add_argument("--smoke", action="store_true",
                        help=f"the smallest run, for a test that it works (not a timing): {flags}")
    args = parser.parse_args(argv)
    unknown = set(smoke) - set(vars(args))
    if unknown:  # a typo in `smoke` fails at once, not as a silently full-size run
        raise ValueError(f"--smoke names options this benchmark does not have: {sorted(unknown)}")
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


def _flag(dest: str, value) -> str:
    values = value if isinstance(value, list | tuple) else [value]
    return " ".join(["--" + dest.replace("_", "-"), *map(str, values)])
