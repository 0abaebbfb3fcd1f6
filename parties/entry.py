"""``cutlayer``: every entry point under one command on the PATH (``pip install`` puts it there).

``cutlayer bank serve ...`` runs ``python -m bank serve ...``, and so on: the first word names the entry
point, the rest are its own arguments. ``python -m ...`` keeps working; both run the same code.
The entry points are named here by module, so this shared package imports no role's code until one is asked for.
"""

from __future__ import annotations

import importlib
import sys

from parties.cli import run_cli

__all__ = ["ENTRY_POINTS", "main"]

#: The first word, the module whose ``main(argv, prog)`` runs, whether the word is kept as its first argument,
#: and what it is for. ``pki``, ``certs`` and ``verify-log`` are commands of ``python -m parties``.
ENTRY_POINTS: dict[str, tuple[str, bool, str]] = {
    "bank": ("bank.__main__", False, "the label holder: its service, the walkthrough, training, scoring"),
    "partner": ("partner.__main__", False, "a partner's service (serve), a compute party's, a branch's"),
    "data": ("data.__main__", False, "datasets: download, partition, schema files"),
    "pki": ("parties.__main__", True, "certificates: a key and a request per party, a CA that signs, revocation"),
    "certs": ("parties.__main__", True, "a development CA and every party's certificate in one folder"),
    "verify-log": ("parties.__main__", True, "check a session log's hash chain"),
    "lab": ("bank.lab.__main__", False, "research tools: benches, privacy and attack studies, reports"),
}


def _usage() -> str:
    width = max(map(len, ENTRY_POINTS))
    lines = ["usage: cutlayer COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, _, about) in ENTRY_POINTS.items()]
    lines += ["", "cutlayer COMMAND --help tells more; `python -m bank ...` and the others run the same code."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    word, rest = argv[0], argv[1:]
    if word not in ENTRY_POINTS:
        print(f"error: {word!r} is not a cutlayer command\n\n{_usage()}", file=sys.stderr)
        return 2
    module, keep, _ = ENTRY_POINTS[word]
    entry = importlib.import_module(module)
    if keep:
        return int(entry.main([word, *rest], prog="cutlayer") or 0)
    return int(entry.main(rest, prog=f"cutlayer {word}") or 0)


def script() -> None:
    """The console script's function: ``main`` with clean error exits."""
    run_cli(main)
