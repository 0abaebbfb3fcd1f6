"""python -m parties: what every party shares on the command line (certs: a development CA and one
certificate per party; verify-log: check a session log's hash chain and sum it up)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from parties.cli import command, configure_logging, description, run_cli
from parties.errors import ConfigError, LogTampered
from parties.storage.session_log import verify_log
from parties.transport.tls import DEFAULT_HOSTS, write_dev_pki

#: The integer fields a summary line adds up: what a PSI session's peer declared, sent, and what came of it.
SUMMED = ("declared", "received", "result")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parties", description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    certs = command(sub, "certs", "create a development CA and party certificates", handler=_certs_command)
    certs.add_argument("--out", type=Path, required=True, help="folder for ca.pem and NAME.pem/NAME.key")
    certs.add_argument("--party", action="append", default=[], metavar="NAME=ROLE",
                       help="a party and its role (bank, partner or compute); repeat per party")
    certs.add_argument("--host", action="append", default=None,
                       help=f"a host name or IP the services answer on (default: {', '.join(DEFAULT_HOSTS)})")
    certs.add_argument("--days", type=int, default=365, help="how long the certificates are valid (default %(default)s)")

    verify = command(sub, "verify-log", "check a session log's hash chain and count its sessions per peer and event",
                     handler=_verify_log_command)
    verify.add_argument("path", type=Path, metavar="PATH", help="the session log (JSON lines)")
    verify.add_argument("--json", action="store_true", help="print the records as a JSON list instead of the summary")
    verify.add_argument("--against", type=Path, default=None, metavar="PEER_LOG",
                        help="the peer's own session log (its operator sends it): every chain head of the peer that "
                             "PATH kept must be in it, or the peer rewrote or cut its log; give --peer too")
    verify.add_argument("--peer", default=None, help="the peer whose log --against is (its name in PATH's records)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("WARNING")
    return int(args.handler(args))


def _certs_command(args: argparse.Namespace) -> int:
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


def _verify_log_command(args: argparse.Namespace) -> int:
    records = verify_log(args.path)  # a damaged log raises LogTampered: run_cli prints it and exits 2
    if args.json:
        print(json.dumps(list(records), ensure_ascii=False, indent=2))
        return 0
    for line in _summary_lines(records):
        print(line)
    tail = f"; the torn line {len(records) + 1} (a write cut short by a crash) was left out" if records.torn else ""
    print(f"{_records(len(records))}, chain intact{tail}")
    if args.against is None:
        return 0
    if not args.peer:
        raise ConfigError("--against needs --peer NAME: whose log it is")
    peer_records = verify_log(args.against)
    problems = unanchored(records, peer_records, args.peer) + disagreeing(records, peer_records, args.peer)
    kept = {str(r["peer_head"]) for r in records if r.get("peer") == args.peer and r.get("peer_head")}
    if problems:
        line, why = problems[0]
        raise LogTampered(f"{args.against} and {args.path} disagree at {len(problems)} records of {args.peer!r} (first "
                          f"at line {line} of {args.path}: {why}): one of the two logs was rewritten or cut, or "
                          f"{args.peer} withheld what its log should hold")
    loose = [n for n, r in enumerate(peer_records, start=1) if r.get("session") and r["hash"] not in kept]
    print(f"{args.against}: holds every record of {args.peer!r} that {args.path} kept the hash of ({len(kept)}), each "
          "of its own session, and the sizes of every session both logged agree")
    if loose:
        print(f"  not anchored here, so {args.peer} could rewrite them unseen: lines {_lines(loose)} of {args.against} "
              "(records this party was never sent the hash of: a session's last one, refusals, aborts)")
    return 0


def disagreeing(records: list[dict[str, object]], peer_records: list[dict[str, object]],
                peer: str) -> list[tuple[int, str]]:
    """(line, why) for each session opened in both logs whose sizes differ: what one side brought is what the
    other says the peer declared."""
    theirs = {r.get("session"): r for r in peer_records if r["event"] == "opened"}
    out = []
    for n, r in enumerate(records, start=1):
        other = theirs.get(r.get("session")) if r.get("peer") == peer and r["event"] == "opened" else None
        if other is not None and (r.get("own"), r.get("declared")) != (other.get("declared"), other.get("own")):
            out.append((n, f"this side brought {r.get('own')} and the peer {r.get('declared')} IDs, but the peer "
                            f"logged {other.get('declared')} and {other.get('own')}"))
    return out


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:12]))
    return shown + (f" and {len(numbers) - 12} more" if len(numbers) > 12 else "")


def unanchored(records: list[dict[str, object]], peer_records: list[dict[str, object]],
               peer: str) -> list[tuple[int, str]]:
    """Where ``records`` (this party's log) and ``peer_records`` (``peer``'s) disagree: (line, why) for each record
    of ``peer`` here whose kept hash is no record of that session in the peer's log, and each commit here
    that kept none."""
    sessions = {str(r["hash"]): r.get("session") for r in peer_records}
    out = []
    for n, r in enumerate(records, start=1):
        if r.get("peer") != peer:
            continue
        head = r.get("peer_head")
        if head is None:
            if r.get("event") == "committed":
                out.append((n, "a commit without the peer's record hash"))
        elif head not in sessions:
            out.append((n, "the peer's record hash it kept is not in the peer's log"))
        elif sessions[str(head)] != r.get("session"):
            out.append((n, "the peer's record hash it kept is of another session"))
    return out


def _summary_lines(records: list[dict[str, object]]) -> list[str]:
    """One line per (peer, event): how many records, and the sums of the integer fields in ``SUMMED``."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    sums: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for record in records:
        key = (str(record.get("peer", "-")), str(record["event"]))
        counts[key] += 1
        for field in SUMMED:
            value = record.get(field)
            if isinstance(value, int) and not isinstance(value, bool):
                sums[key][field] = sums[key].get(field, 0) + value
    return [
        f"peer {peer}, event {event}: {_records(counts[peer, event])}"
        + "".join(f", {field} {sums[peer, event][field]}" for field in SUMMED if field in sums[peer, event])
        for peer, event in sorted(counts)
    ]


def _records(n: int) -> str:
    return f"{n} record" if n == 1 else f"{n} records"


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
