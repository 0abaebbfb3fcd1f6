"""python -m parties: what every party shares on the command line (pki: each party's key and certificate
request, a CA that signs and revokes; certs: a development CA and every party's certificate in one folder;
verify-log: check a session log's hash chain and sum it up)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from parties.cli import command, configure_logging, description, run_cli
from parties.errors import ConfigError, LogTampered
from parties.storage.files import atomic_write_bytes
from parties.storage.session_log import verify_log
from parties.transport import pki
from parties.transport.tls import DEFAULT_HOSTS, ROLES
from parties.transport.trust import read_certificates

#: The integer fields a summary line adds up: what a PSI session's peer declared, sent, and what came of it.
SUMMED = ("declared", "received", "result")


def build_parser(prog: str = "python -m parties") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    certs = command(sub, "certs", "create a development CA and party certificates", handler=_certs_command)
    certs.add_argument("--out", type=Path, required=True, help="folder for ca.pem and NAME.pem/NAME.key")
    certs.add_argument("--party", action="append", default=[], metavar="NAME=ROLE",
                       help="a party and its role (bank, partner or compute); repeat per party")
    certs.add_argument("--host", action="append", default=None,
                       help=f"a host name or IP the services answer on (default: {', '.join(DEFAULT_HOSTS)})")
    certs.add_argument("--days", type=int, default=365, help="how long the certificates are valid (default %(default)s)")

    _pki_parser(command(sub, "pki", "certificates where each organisation keeps its own key: request, ca, sign, "
                                "revoke, bundle, show"))

    verify = command(sub, "verify-log", "check a session log's hash chain and count its sessions per peer and event",
                     handler=_verify_log_command)
    verify.add_argument("path", type=Path, metavar="PATH", help="the session log (JSON lines)")
    verify.add_argument("--json", action="store_true", help="print the records as a JSON list instead of the summary")
    verify.add_argument("--against", type=Path, default=None, metavar="PEER_LOG",
                        help="the peer's own session log (its operator sends it): every chain head of the peer that "
                             "PATH kept must be in it, or the peer rewrote or cut its log; give --peer too")
    verify.add_argument("--peer", default=None, help="the peer whose log --against is (its name in PATH's records)")
    return parser


def _pki_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="pki_command", required=True)
    r = command(sub, "request", "make this party's key (0600, never copied) and a signing request to send its CA",
                handler=_pki_request)
    r.add_argument("--name", required=True, help="this party's name (the certificate's CN)")
    r.add_argument("--role", required=True, choices=ROLES, help="its role (the certificate's OU)")
    r.add_argument("--out", type=Path, required=True, help="the party's own folder: NAME.key and NAME.csr go here")
    r.add_argument("--host", action="append", default=None,
                   help=f"a host name or IP the service answers on; repeat (default: {', '.join(DEFAULT_HOSTS)})")
    r.add_argument("--organisation", default=None, help="the organisation (O) in the request, e.g. 'Telco plc'")

    c = command(sub, "ca", "make a CA: ca.pem for every party that trusts it, ca.key (0600) to keep", handler=_pki_ca)
    c.add_argument("--out", type=Path, required=True, help="the CA's folder")
    c.add_argument("--name", required=True, help="the CA's name, e.g. 'Bank CA' (distinct per organisation)")
    c.add_argument("--days", type=int, default=1825, help="how long the CA is valid (default %(default)s)")

    s = command(sub, "sign", "sign a party's request with a CA: the certificate to send back", handler=_pki_sign)
    s.add_argument("csr", type=Path, metavar="CSR", help="the party's NAME.csr")
    s.add_argument("--ca", type=Path, required=True, help="the CA's folder (ca.pem, ca.key)")
    s.add_argument("--out", type=Path, default=None,
                   help="the certificate (default: NAME.pem beside the request; ca.pem, the CA's own, goes beside it "
                        "when that folder has none)")
    s.add_argument("--days", type=int, default=365, help="how long it is valid (default %(default)s)")

    v = command(sub, "revoke", "revoke a certificate: re-signs the CA's list, crl.pem, for every party to read",
                handler=_pki_revoke)
    v.add_argument("cert", type=Path, metavar="CERT", help="the certificate to revoke (PEM)")
    v.add_argument("--ca", type=Path, required=True, help="the CA's folder that issued it")
    v.add_argument("--days", type=int, default=30, help="until when the list is current (default %(default)s)")

    b = command(sub, "bundle", "put the CA certificates a party trusts in one file (its ca.pem or --tls-ca)",
                handler=_pki_bundle)
    b.add_argument("cas", type=Path, nargs="+", metavar="CA_PEM")
    b.add_argument("--out", type=Path, required=True, help="the bundle")

    w = command(sub, "show", "what certificates say: party, role, issuer, serial, expiry", handler=_pki_show)
    w.add_argument("certs", type=Path, nargs="+", metavar="PEM")


def _pki_request(args: argparse.Namespace) -> int:
    key, csr = pki.make_request(args.out, args.name, args.role, hosts=args.host or DEFAULT_HOSTS,
                                organisation=args.organisation or "Cutlayer party")
    print(f"key: {key} (keep it here; it never leaves this folder)")
    print(f"request: {csr} (send it to the CA; it holds no secret)")
    return 0


def _pki_ca(args: argparse.Namespace) -> int:
    ca = pki.make_ca(args.out, args.name, days=args.days)
    print(f"CA: {ca} (give it to every party that trusts this CA); its key: {args.out / 'ca.key'} (keep it here)")
    return 0


def _pki_sign(args: argparse.Namespace) -> int:
    issued = pki.sign_request(args.ca, args.csr, args.out, days=args.days)
    print(f"{issued.path}: {pki.describe(issued.certificate)} (send it back to the party)")
    anchor = issued.path.parent / "ca.pem"
    if not anchor.exists():  # the party's folder gets the CA's certificate too, as --tls-dir reads it
        atomic_write_bytes(anchor, (args.ca / "ca.pem").read_bytes())
        print(f"{anchor}: the CA's certificate, which the party trusts (with two CAs: pki bundle)")
    return 0


def _pki_revoke(args: argparse.Namespace) -> int:
    crl, count = pki.revoke(args.ca, args.cert, days=args.days)
    print(f"{crl}: {count} revoked; give it to every party that trusts this CA (--tls-crl, or crl.pem in --tls-dir)")
    return 0


def _pki_bundle(args: argparse.Namespace) -> int:
    certs = pki.bundle(args.out, args.cas)
    print(f"{args.out}: " + "; ".join(pki.describe(c) for c in certs))
    return 0


def _pki_show(args: argparse.Namespace) -> int:
    for path in args.certs:
        for cert in read_certificates(path, "certificate"):
            print(f"{path}: {pki.describe(cert)}")
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m parties") -> int:
    args = build_parser(prog).parse_args(argv)
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
    if (args.out / "ca.key").exists():
        raise ConfigError(f"{args.out} already holds a CA (ca.key): keys are never overwritten; give another --out")
    files = pki.write_dev_pki(args.out, parties, hosts=args.host or DEFAULT_HOSTS, days=args.days)
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
