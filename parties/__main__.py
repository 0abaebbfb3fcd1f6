"""python -m parties: what every party shares on the command line (certs: a development CA and one
certificate per party)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parties.cli import command, configure_logging, description, run_cli
from parties.errors import ConfigError
from parties.transport.tls import DEFAULT_HOSTS, write_dev_pki


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parties", description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    certs = command(sub, "certs", "create a development CA and party certificates")
    certs.add_argument("--out", type=Path, required=True, help="folder for ca.pem and NAME.pem/NAME.key")
    certs.add_argument("--party", action="append", default=[], metavar="NAME=ROLE",
                       help="a party and its role (bank, partner or compute); repeat per party")
    certs.add_argument("--host", action="append", default=None,
                       help=f"a host name or IP the services answer on (default: {', '.join(DEFAULT_HOSTS)})")
    certs.add_argument("--days", type=int, default=365, help="how long the certificates are valid (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("WARNING")
    parties = {}
    for item in args.party:
        name, sep, role = item.partition("=")
        if not sep:
            raise ConfigError(f"--party takes NAME=ROLE, got {item!r}")
        parties[name] = role
    if not parties:
        raise ConfigError("give at least one --party NAME=ROLE")
    files = write_dev_pki(args.out, parties, hosts=args.host or DEFAULT_HOSTS, days=args.days)
    print(f"CA: {args.out / 'ca.pem'}")
    for name, f in files.items():
        print(f"{name} ({parties[name]}): {f.cert}, {f.key}")
    return 0


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
