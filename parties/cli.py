"""What every command-line entry point shares: logging set-up and clean error exits."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from parties.errors import CutlayerError

__all__ = ["add_service_arguments", "configure_logging", "run_cli", "service_values"]


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
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code or 0)


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every ``serve`` command takes; unset flags fall back to the environment, then defaults."""
    parser.add_argument("--name", required=True, help="this party's name (its certificate's CN)")
    parser.add_argument("--data", type=Path, required=True, help="this party's own CSV file")
    parser.add_argument("--id-column", default=None, help="customer ID column (default: customer_id)")
    parser.add_argument("--schema", dest="schema_file", type=Path, default=None,
                        help="numeric/categorical columns (default: <data>.schema.json if present, else inferred)")
    parser.add_argument("--host", default=None, help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: 0, any free port)")
    parser.add_argument("--tls-dir", type=Path, default=None, help="folder with ca.pem, NAME.pem, NAME.key")
    parser.add_argument("--tls-ca", type=Path, default=None)
    parser.add_argument("--tls-cert", type=Path, default=None)
    parser.add_argument("--tls-key", type=Path, default=None)
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="plain HTTP, no certificates: development only")
    parser.add_argument("--state-dir", type=Path, default=None, help="where this party keeps caches and state")
    parser.add_argument("--workers", type=int, default=None, help="PSI worker processes (default: every core)")
    parser.add_argument("--min-intersection", type=int, default=None, help="refuse smaller intersections")
    parser.add_argument("--ready-file", type=Path, default=None, help='write {"url": ...} here once listening')
    parser.add_argument("--torch-threads", type=int, default=None, help="intra-op threads for the model (default 1)")
    parser.add_argument("--log-level", default="INFO")


SERVICE_FIELDS = (
    "name", "data", "id_column", "schema_file", "host", "port", "tls_dir", "tls_ca", "tls_cert", "tls_key",
    "insecure", "state_dir", "workers", "min_intersection", "ready_file", "torch_threads",
)


def service_values(args: argparse.Namespace) -> dict[str, object]:
    return {f: getattr(args, f) for f in SERVICE_FIELDS}
