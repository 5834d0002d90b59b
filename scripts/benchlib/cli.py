"""Command-line conventions of the benchmark scripts: where they write (an untracked folder unless --out says
otherwise) and tolerance of options meant for another benchmark (`make bench` hands one BENCH_ARGS to all)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "out"  # ignored by git (.gitignore); the tracked results/ is written only when --out results says so


def add_out_argument(parser, writes: str) -> None:
    """--out DIR, its default (out/ in the repository) shown in --help."""
    parser.add_argument("--out", default=str(OUT), help=f"output folder for {writes} (default: %(default)s, not "
                                                        "tracked by git; --out results updates the tracked results)")


def parse_bench_args(parser, argv, name: str):
    """parser.parse_known_args: `make bench` hands one BENCH_ARGS to every scripts/bench_*.py, so options meant
    for another benchmark are reported and ignored, not fatal."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"{name}: ignoring options meant for other benchmarks: {unknown}", file=sys.stderr)
    return args


def config_names(arg: str, known) -> list[str]:
    """The comma list of --configs, each one of `known` (else exit naming the bad one and what is allowed)."""
    names = arg.split(",")
    for name in names:
        if name not in known:
            raise SystemExit(f"--configs: {name!r} is not one of {', '.join(known)}")
    return names
