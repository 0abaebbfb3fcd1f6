"""python -m alignment: private set intersection tools (bench: measure PSI on this machine)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alignment.bench import format_result, run_bench, to_json
from parties.cli import command, configure_logging, description, run_cli
from parties.files import atomic_write_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m alignment", description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    b = command(sub, "bench", "run both PSI roles here and report time, bytes and rates")
    b.add_argument("--size", type=int, default=1 << 16, help="IDs per party (default %(default)s; the target is 1048576)")
    b.add_argument("--overlap", type=float, default=0.5,
                   help="share of each party's IDs the other also holds (default %(default)s)")
    b.add_argument("--seed", type=int, default=0, help="seed of the generated IDs (default %(default)s)")
    b.add_argument("--workers", type=int, default=None, help="worker processes per party (default: every core)")
    b.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("WARNING")
    result = run_bench(args.size, args.overlap, args.seed, args.workers)
    print(format_result(result))
    if args.json:
        atomic_write_text(args.json, to_json(result) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
