"""What every command-line entry point shares: logging set-up and clean error exits."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ValidationError

from parties.errors import ConfigError, CutlayerError
from parties.flags import add_flags, flag_values, number, show

if TYPE_CHECKING:
    from parties.settings import ServiceSettings

__all__ = [
    "add_log_level",
    "add_service_arguments",
    "command",
    "configure_logging",
    "description",
    "number",
    "pin_cpus",
    "run_cli",
    "service_settings",
    "set_torch_threads",
    "show",
]


def command(sub: argparse._SubParsersAction, name: str, summary: str, *,
            handler: Callable[[argparse.Namespace], int] | None = None, **kwargs: object) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with the same line the command list shows.

    ``handler`` runs the command: the entry point's ``main`` calls ``args.handler(args)``.
    """
    parser = sub.add_parser(name, help=summary, description=summary, **kwargs)  # type: ignore[arg-type]
    if handler is not None:
        parser.set_defaults(handler=handler)
    return parser


def add_log_level(parser: argparse.ArgumentParser, default: str = "WARNING") -> None:
    parser.add_argument("--log-level", default=default, help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text lines, or JSON lines with the party, session and step (default %(default)s)")


def description(doc: str | None) -> str:
    """A module docstring as an argparse description: reST literals (double backticks) read as plain text."""
    return (doc or "").replace("``", "")


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,  # some libraries call basicConfig at import time (opacus does); the entry point decides
    )
    if log_format == "json":
        from parties.observability import JsonLines

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
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


def add_service_arguments(parser: argparse.ArgumentParser, settings: type[BaseModel], *,
                          skip: tuple[str, ...] = ()) -> None:
    """A ``serve`` command's flags: one per setting of ``settings`` (``parties.flags``), and the log level.

    A flag not given leaves the setting to the environment (``CUTLAYER_<ROLE>_...``), then to its default."""
    add_flags(parser, settings, skip=skip)
    add_log_level(parser, "INFO")
    files = parser.add_argument_group("a settings file")
    files.add_argument("--config", type=Path, default=None, metavar="FILE",
                       help="read settings from this TOML file; flags and the environment override it")
    files.add_argument("--print-config", action="store_true",
                       help="print every setting as a commented TOML file (the values given, else the defaults), "
                            "and exit")


def service_settings(args: argparse.Namespace, settings: type[ServiceSettings]) -> ServiceSettings:
    """The service's settings from its flags, the environment, its ``--config`` file and the defaults; a problem
    names its flag or its file. With ``--print-config``, prints them as a TOML file and exits instead."""
    from parties.settings import load_settings

    values = flag_values(args, settings)
    if args.print_config:
        from parties.config_file import print_config, read_config_file

        given = read_config_file(args.config) if args.config is not None else {}
        _merge(given, values)
        print(print_config(settings, given, f"{settings.role} {args.command}"), end="")
        raise SystemExit(0)
    loaded = load_settings(settings, args.config, **values)
    from parties.observability import set_log_party

    set_log_party(loaded.name)
    return loaded


def _merge(into: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def pin_cpus(cpus: tuple[int, ...] | None) -> None:
    """If asked, the CPUs this process may run on. Called before anything starts a thread (a Parquet table's
    reader does): Linux pins the calling thread, and only threads started after it inherit the pinning."""
    if cpus is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("--cpus needs Linux (this system cannot pin a process to CPUs)")
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as exc:
        raise ConfigError(f"--cpus {','.join(map(str, cpus))}: this machine cannot run on those CPUs ({exc})") from exc


def set_torch_threads(threads: int) -> None:
    """Torch's intra-op threads (importing torch: seconds, so after every setting is checked)."""
    import torch

    torch.set_num_threads(threads)
