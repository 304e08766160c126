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
    flags = " ".join(_flag(parser, k, v) for k, v in smoke.items())
    parser.add_argument("--smoke", action="store_true",
                        help=f"the smallest run, for a test that it works (not a timing): {flags}")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


def _flag(parser: argparse.ArgumentParser, dest: str, value) -> str:
    action = next(a for a in parser._actions if a.dest == dest)  # a typo in `smoke` fails here, at once
    values = value if isinstance(value, list | tuple) else [value]
    return " ".join([action.option_strings[0], *map(str, values)])
