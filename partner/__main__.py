"""python -m partner: a partner's service, on its own data (serve); a compute party's (compute) and a
branch's (branch), which hold layers for a bank in the U-shaped, vanilla and horizontal configurations."""

from __future__ import annotations

import argparse
import sys

from parties.cli import add_service_arguments, command, configure_logging, description, run_cli

#: A compute party holds no table: none of a table's settings.
_TABLE = ("data", "id_column", "id_type", "schema_file", "categorical", "numeric")


def build_parser(prog: str = "python -m partner") -> argparse.ArgumentParser:
    # The settings classes state every flag (parties.flags); they import neither torch nor pandas.
    from partner.settings import BranchSettings, ComputeSettings, PartnerSettings

    parser = argparse.ArgumentParser(prog=prog, description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    s = command(sub, "serve", "serve the partner's endpoints", handler=serve)
    add_service_arguments(s, PartnerSettings)
    c = command(sub, "compute", "serve a compute party: a trunk (U-shaped) or the rest of the model and the loss "
                "(vanilla) for a bank that owns the data; no data of its own (certificate role compute)",
                handler=serve_layers)
    add_service_arguments(c, ComputeSettings, skip=_TABLE)
    b = command(sub, "branch", "serve a branch of horizontal split learning: the bank's schema, customers of its "
                "own, the client-side bottom model the bank relays or averages (certificate role partner)",
                handler=serve_layers)
    add_service_arguments(b, BranchSettings)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m partner") -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    return args.handler(args)


def serve(args: argparse.Namespace) -> int:
    from parties.cli import pin_cpus, service_settings, set_torch_threads
    from parties.memory import use_system_allocator
    from partner.settings import PartnerSettings

    # Settings and the table are checked before torch and FastAPI are imported (seconds): a refusal is quick.
    settings = service_settings(args, PartnerSettings)
    assert isinstance(settings, PartnerSettings)
    pin_cpus(settings.cpus)
    use_system_allocator()
    table = settings.load_table()
    set_torch_threads(settings.torch_threads)
    if settings.bottom.factory is not None:  # its own model's module is importable now, not at the first session
        from parties.learning.model import load_factory

        load_factory(settings.bottom.factory)
    from alignment.parallel import start_fork_server
    from parties.transport.server import serve_party
    from partner.service import create_app

    start_fork_server(settings.workers)  # worker processes, or the Ray driver process
    serve_party(create_app(settings, table), settings)
    return 0


def serve_layers(args: argparse.Namespace) -> int:
    from parties.cli import pin_cpus, service_settings, set_torch_threads
    from parties.memory import use_system_allocator
    from partner.settings import BranchSettings, ComputeSettings

    settings = service_settings(args, ComputeSettings if args.command == "compute" else BranchSettings)
    assert isinstance(settings, (ComputeSettings, BranchSettings))
    pin_cpus(settings.cpus)
    use_system_allocator()
    table = settings.load_table() if settings.data is not None else None  # before torch: a refusal is quick
    set_torch_threads(settings.torch_threads)
    from parties.transport.server import serve_party
    from partner.layer_service import create_layer_app

    serve_party(create_layer_app(settings, table), settings)
    return 0


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
