"""``python -m bank``: serve the bank, drive alignment, or run the whole walkthrough."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from bank.operator import BankOperator
from bank.service import create_app
from bank.walkthrough import WalkthroughConfig, run_walkthrough
from parties.cli import add_service_arguments, configure_logging, run_cli, service_values
from parties.dataset import load_party_table
from parties.errors import ConfigError
from parties.protocol import AlignmentRequest
from parties.server import serve
from parties.settings import BankSettings, load_settings
from parties.tls import TLSFiles

logger = logging.getLogger("bank")


def _partners(items: list[str]) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise ConfigError(f"--partner takes NAME=URL, got {item!r}")
        out[name] = url
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bank", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the bank's coordinator endpoints")
    add_service_arguments(s)
    s.add_argument("--label", default=None, help="label column (default: y)")
    s.add_argument("--partner", action="append", default=[], metavar="NAME=URL", help="repeat per partner")

    a = sub.add_parser("align", help="align customers with every partner, through the running bank service")
    a.add_argument("--url", required=True, help="the bank service, e.g. https://127.0.0.1:8443")
    a.add_argument("--name", default="bank", help="the bank's party name (its certificate)")
    a.add_argument("--tls-dir", type=Path, default=None)
    a.add_argument("--insecure", action="store_true")
    a.add_argument("--partners", default=None, help="comma-separated subset of partners")
    a.add_argument("--min-intersection", type=int, default=None)
    a.add_argument("--log-level", default="WARNING")

    w = sub.add_parser("walkthrough", help="run the bank-marketing walkthrough end to end")
    w.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<timestamp>)")
    w.add_argument("--partners", type=int, default=1)
    w.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--cache-dir", type=Path, default=None, help="where bank-full.csv is cached")
    w.add_argument("--no-download", action="store_true")
    w.add_argument("--workers", type=int, default=None)
    w.add_argument("--log-level", default="WARNING")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "serve":
        settings = load_settings(
            BankSettings, **service_values(args), label=args.label, partners=_partners(args.partner)
        )
        assert isinstance(settings, BankSettings)
        if settings.insecure:
            logger.warning("--insecure: plain HTTP, no certificates; callers are not authenticated. Never use across organisations.")
        table = load_party_table(settings.data, settings.id_column, settings.label, schema_path=settings.schema_file)
        serve(create_app(settings, table), settings.tls_files(), settings.host, settings.port, settings.ready_file)
        return 0
    if args.command == "align":
        if args.tls_dir is None and not args.insecure:
            raise ConfigError("give --tls-dir (the bank's certificate) or --insecure")
        tls = None if args.insecure else TLSFiles.from_dir(args.tls_dir, args.name)
        request = AlignmentRequest(
            partners=args.partners.split(",") if args.partners else None, min_intersection=args.min_intersection
        )
        with BankOperator(args.url, tls, args.name) as operator:
            result = operator.wait(operator.start_alignment(request), on_progress=lambda m: print(f"... {m}", file=sys.stderr))
        print(json.dumps(result, indent=2))
        return 0
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    summary = run_walkthrough(
        WalkthroughConfig(out=out, partners=args.partners, rows=args.rows, seed=args.seed,
                          cache_dir=args.cache_dir, download=not args.no_download, workers=args.workers)
    )
    alignment = summary["alignment"]
    assert isinstance(alignment, dict)
    print(f"\nRun folder: {out}")
    print(f"{'party':<12}{'customers':>10}")
    for name, n in summary["rows_per_party"].items():  # type: ignore[union-attr]
        print(f"{name:<12}{n:>10}")
    print(f"{'aligned':<12}{alignment['rows']:>10}   (alignment {alignment['alignment_id']})")
    print(f"wall time: {summary['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
