"""``python -m partner serve``: run a partner's service on its own data."""

from __future__ import annotations

import argparse
import logging
import sys

from parties.cli import add_service_arguments, configure_logging, run_cli, service_values
from parties.dataset import load_party_table
from parties.server import serve
from parties.settings import PartnerSettings, load_settings
from partner.service import create_app

logger = logging.getLogger("partner")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the partner's endpoints")
    add_service_arguments(s)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    settings = load_settings(PartnerSettings, **service_values(args))
    assert isinstance(settings, PartnerSettings)
    if settings.insecure:
        logger.warning("--insecure: plain HTTP, no certificates; callers are not authenticated. Never use across organisations.")
    table = load_party_table(settings.data, settings.id_column, schema_path=settings.schema_file)
    serve(create_app(settings, table), settings.tls_files(), settings.host, settings.port, settings.ready_file)
    return 0


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
