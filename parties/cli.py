"""What every command-line entry point shares: logging set-up and clean error exits."""

from __future__ import annotations

import argparse
import math
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ValidationError

from parties.errors import ConfigError, CutlayerError

__all__ = [
    "add_log_level",
    "add_psi_limit_arguments",
    "add_quota_arguments",
    "add_service_arguments",
    "command",
    "apply_process_settings",
    "configure_logging",
    "default_of",
    "description",
    "number",
    "psi_limit_values",
    "quota_values",
    "run_cli",
    "service_values",
    "show",
]


def show(value: object) -> str:
    """A default as a person reads it in ``--help``: ``64,32`` for a tuple, ``0.005`` for a float."""
    if isinstance(value, (tuple, list)):
        return ",".join(show(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def default_of(model: type[BaseModel], field: str) -> str:
    """The default of ``model.field``, for help texts: help shows what the code uses, from the same object."""
    info = model.model_fields[field]
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    return show(value)


def command(sub: argparse._SubParsersAction, name: str, summary: str, *,
            handler: Callable[[argparse.Namespace], int] | None = None, **kwargs: object) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with the same line the command list shows.

    ``handler`` runs the command: the entry point's ``main`` calls ``args.handler(args)``.
    """
    parser = sub.add_parser(name, help=summary, description=summary, **kwargs)  # type: ignore[arg-type]
    if handler is not None:
        parser.set_defaults(handler=handler)
    return parser


def number(text: str) -> float:
    """An ``argparse`` type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_log_level(parser: argparse.ArgumentParser, default: str = "WARNING") -> None:
    parser.add_argument("--log-level", default=default, help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")


def description(doc: str | None) -> str:
    """A module docstring as an argparse description: reST literals (double backticks) read as plain text."""
    return (doc or "").replace("``", "")


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,  # some libraries call basicConfig at import time (opacus does); the entry point decides
    )
    # httpx logs every request URL at INFO; our own modules say what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_cli(main: Callable[[], int | None]) -> None:
    """Run ``main``; a Cutlayer error becomes one line on stderr and exit status 2, not a traceback."""
    try:
        code = main()
    except CutlayerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValidationError as exc:  # a model built outside the settings loaders: still one line, not a traceback
        from parties.settings import describe_problems

        print(f"error: {describe_problems(exc, lambda loc: '.'.join(map(str, loc)))}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (``... | head``): what is left to print has nowhere to go. Point stdout at
        # devnull so the interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(code or 0)


def add_service_arguments(parser: argparse.ArgumentParser, *, data: bool = True) -> None:
    """The flags every ``serve`` command takes; unset flags fall back to the environment, then defaults.

    ``data=False``: a service without a table of its own (a compute party)."""

    parser.add_argument("--name", required=True, help="this party's name (its certificate's CN)")
    if data:
        parser.add_argument("--data", type=Path, required=True, help="this party's own CSV file")
        _add_table_arguments(parser)
    else:
        parser.set_defaults(data=None, id_column=None, id_type=None, schema_file=None, categorical=None, numeric=None)
    _add_transport_arguments(parser)


def _add_table_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id-column", default=None,
                        help="customer ID column (default: the schema file's, else customer_id)")
    parser.add_argument("--id-type", choices=["integer", "text"], default=None,
                        help="integer: 12, 12.0 and 0012 are one customer; text: IDs as written (default: the "
                             "schema file's, else integer if every ID is a whole number)")
    parser.add_argument("--schema", dest="schema_file", type=Path, default=None,
                        help="the table's schema file (default: <data>.schema.json if present, else inferred; "
                             "python -m data schema FILE writes one to edit)")
    parser.add_argument("--categorical", type=_columns, default=None, metavar="COL,COL",
                        help="treat these columns as categorical (e.g. integer codes), whatever the schema says")
    parser.add_argument("--numeric", type=_columns, default=None, metavar="COL,COL",
                        help="treat these columns as numeric, whatever the schema says")


def _add_transport_arguments(parser: argparse.ArgumentParser) -> None:
    from parties.settings import ServiceSettings as S

    parser.add_argument("--host", default=None, help=f"address to listen on (default {default_of(S, 'host')})")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port to listen on (default {default_of(S, 'port')}: any free port)")
    parser.add_argument("--tls-dir", type=Path, default=None, help="folder with ca.pem, NAME.pem, NAME.key "
                        "(as python -m parties certs writes them); or give the three files one by one:")
    parser.add_argument("--tls-ca", type=Path, default=None, help="the partnership's CA certificate (PEM)")
    parser.add_argument("--tls-cert", type=Path, default=None, help="this party's certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, default=None, help="this party's private key (PEM)")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="plain HTTP, no certificates, on a loopback address only: development on one machine "
                             "(the command line only; the environment cannot turn TLS off)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where this party keeps caches, checkpoints and models (default ./cutlayer-state/NAME)")
    parser.add_argument("--workers", type=int, default=None, help="PSI worker processes (default: every core)")
    parser.add_argument("--min-intersection", type=int, default=None,
                        help=f"commit policy: refuse to keep fewer aligned rows (default {default_of(S, 'min_intersection')}); "
                             "not a privacy control: the PSI budgets are (see docs/explanation/security.md)")
    parser.add_argument("--ready-file", type=Path, default=None, help='write {"url": ...} here once listening')
    parser.add_argument("--torch-threads", type=int, default=None,
                        help=f"intra-op threads for the model (default {default_of(S, 'torch_threads')})")
    parser.add_argument("--cpus", type=_cpu_list, default=None,
                        help="CPUs to run on, e.g. 0 or 2,3 (Linux; default: any). Parties sharing one machine "
                             "run best on CPUs of their own")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")


def add_psi_limit_arguments(parser: argparse.ArgumentParser, peers: str) -> None:
    """What a peer's PSI sessions may cost (``parties.settings.PsiLimits``); ``peers``: "bank" or "partner"."""
    from parties.limits import PsiLimits as L

    g = parser.add_argument_group(f"what each {peers}'s PSI sessions may bring (docs/explanation/security.md)")
    g.add_argument("--peer-max-ids", action="append", default=None, metavar=f"[{peers.upper()}=]N",
                   help=f"the most IDs a {peers} may bring to one PSI session: the set size the partnership agreed; "
                        f"NAME=N for one {peers}, N for every other; repeat (default: twice this party's own set)")
    g.add_argument("--peer-ids-per-day", type=int, default=None, metavar="N",
                   help=f"IDs one {peers} may bring over 24 hours, every session it opened counted, aborted ones too "
                        "(default: four times this party's own set)")
    g.add_argument("--psi-sessions-per-hour", type=int, default=None, metavar="N",
                   help=f"PSI sessions one {peers} may open per hour (default {default_of(L, 'sessions_per_hour')})")


def psi_limit_values(args: argparse.Namespace) -> dict[str, object] | None:
    """The ``psi_limits`` setting from the flags of ``add_psi_limit_arguments`` (``None``: none given)."""
    values: dict[str, object] = {}
    if args.peer_max_ids:
        agreed: dict[str, int] = {}
        for item in args.peer_max_ids:
            name, sep, count = item.rpartition("=")
            try:
                agreed[name if sep else "*"] = int(count)
            except ValueError:
                raise ConfigError(f"--peer-max-ids takes NAME=N or N (a whole number of IDs), not {item!r}") from None
        values["peer_max_ids"] = agreed
    if args.peer_ids_per_day is not None:
        values["peer_ids_per_day"] = args.peer_ids_per_day
    if args.psi_sessions_per_hour is not None:
        values["sessions_per_hour"] = args.psi_sessions_per_hour
    return values or None


def add_quota_arguments(parser: argparse.ArgumentParser) -> None:
    """What one bank may keep at a party that serves several (``parties.limits.BankQuotas``)."""
    from parties.limits import BankQuotas as Q

    g = parser.add_argument_group("what each bank may keep here")
    g.add_argument("--disk-quota-per-bank", type=_size, default=None, metavar="SIZE",
                   help="disk one bank's checkpoints, models and alignments may take, e.g. 500M or 2G, or none "
                        f"(default {_show_size(Q.model_fields['disk_per_bank'].default)}); past it, writes are refused "
                        "with HTTP 507")
    g.add_argument("--checkpoint-ttl", type=float, default=None, metavar="SECONDS",
                   help="seconds a session's checkpoints stay after it was last used; then they are removed "
                        f"(default {default_of(Q, 'checkpoint_ttl')})")


_UNSET = object()


def quota_values(args: argparse.Namespace) -> dict[str, object] | None:
    values = {k: v for k, v in (("disk_per_bank", args.disk_quota_per_bank), ("checkpoint_ttl", args.checkpoint_ttl))
              if v is not None}
    if values.get("disk_per_bank") is _UNSET:
        values["disk_per_bank"] = None
    return values or None


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> object:
    if text.strip().lower() == "none":
        return _UNSET  # no quota: told apart from "not given"
    number, unit = text.strip().upper().rstrip("B").rstrip("I"), ""
    if number and number[-1] in _UNITS:
        number, unit = number[:-1], number[-1]
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is bytes, or a number with K, M, G or T (e.g. 500M), or none; "
                                         f"not {text!r}") from None


def _show_size(n: int | None) -> str:
    return "none" if n is None else f"{n / (1 << 30):g}G" if n % (1 << 30) == 0 else f"{n / (1 << 20):g}M"


SERVICE_FIELDS = (
    "name", "data", "id_column", "id_type", "schema_file", "categorical", "numeric", "host", "port", "tls_dir", "tls_ca", "tls_cert", "tls_key",
    "insecure", "state_dir", "workers", "min_intersection", "ready_file", "torch_threads", "cpus",
)


def _columns(text: str) -> tuple[str, ...]:
    columns = tuple(c.strip() for c in text.split(",") if c.strip())
    if not columns:
        raise argparse.ArgumentTypeError("give column names separated by commas")
    return columns


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        cpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus takes CPU numbers separated by commas, not {text!r}") from None
    if any(c < 0 for c in cpus):
        raise argparse.ArgumentTypeError(f"--cpus takes CPU numbers from 0, not {text!r}")
    return cpus


def apply_process_settings(threads: int, cpus: tuple[int, ...] | None) -> None:
    """Torch's intra-op threads and, if asked, the CPUs this process may run on."""
    import torch

    torch.set_num_threads(threads)
    if cpus is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cpus needs Linux (this system cannot pin a process to CPUs)")
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as exc:
        raise ConfigError(f"--cpus {','.join(map(str, cpus))}: this machine cannot run on those CPUs ({exc})") from exc


def service_values(args: argparse.Namespace) -> dict[str, object]:
    return {f: getattr(args, f) for f in SERVICE_FIELDS}
