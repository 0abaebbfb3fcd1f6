"""python -m partner: a partner's service, on its own data (serve); a compute party's (compute) and a
branch's (branch), which hold layers for a bank in the U-shaped, vanilla and horizontal configurations."""

from __future__ import annotations

import argparse
import sys

from parties.cli import (
    add_psi_limit_arguments,
    add_quota_arguments,
    add_service_arguments,
    command,
    configure_logging,
    default_of,
    description,
    run_cli,
)
from parties.learning.config import BottomConfig, MonitorConfig, PrivacyConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m partner", description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    s = command(sub, "serve", "serve the partner's endpoints", handler=serve)
    add_service_arguments(s)
    b = s.add_argument_group("this partner's own bottom model")
    b.add_argument("--hidden", default=None,
                   help=f"hidden layer widths, comma-separated (default {default_of(BottomConfig, 'hidden')})")
    b.add_argument("--cut-width", type=int, default=None,
                   help=f"embedding width sent to the bank (default {default_of(BottomConfig, 'cut_width')})")
    b.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default {default_of(BottomConfig, 'learning_rate')})")
    b.add_argument("--optimizer", choices=["adam", "sgd"], default=None,
                   help=f"optimizer of the bottom model (default {default_of(BottomConfig, 'optimizer')})")
    b.add_argument("--seed", type=_seed, default=None,
                   help=f"the initial weights' seed, or 'secret' to draw them from this partner's secret (default "
                        f"{default_of(BottomConfig, 'seed')}; secret with the hijack monitor on, so a bank cannot "
                        "rebuild them)")
    d = s.add_argument_group("embedding noise (off unless --dp-clip is given): obfuscation against inversion, "
                             "not differential privacy, and no ε is claimed (docs/explanation/privacy.md)")
    d.add_argument("--dp-clip", type=float, default=None, help="L2 bound on each released embedding row")
    d.add_argument("--dp-noise", type=float, default=None,
                   help=f"Gaussian noise std per coordinate, drawn from this partner's own secret "
                        f"(default {default_of(PrivacyConfig, 'noise')})")
    n = s.add_argument_group("NoPeek: embeddings that reveal less of this partner's features (needs no DP)")
    n.add_argument("--nopeek", type=float, default=None, metavar="ALPHA",
                   help="add ALPHA x the distance correlation between this partner's features and its embedding "
                        "of each training batch to its own loss, so the bank decodes less of the features; "
                        "costs some accuracy (more at larger ALPHA) and O(batch size squared) compute per update "
                        f"(default {default_of(PrivacyConfig, 'nopeek')}: off)")
    s.add_argument("--hijack-monitor", action="store_true", default=None,
                   help="watch for a hijacking bank with the rank test: read every gradient the bank returns and "
                        "stop when they move more directions than the task can, or wander further than the "
                        "bank's model learns (no extra bytes; training unchanged unless it alarms; not with a bank "
                        "that adds gradient noise)")
    s.add_argument("--hijack-project", action="store_true", default=None,
                   help="with --hijack-monitor, apply only each gradient's task part (the rank test's fit): what a "
                        "bank hides under the monitor's limits never reaches the weights (training then differs "
                        "slightly from an unmonitored partner's)")
    s.add_argument("--hijack-task-rank", type=int, default=None, metavar="K",
                   help="the rank test's task output width: 1 for a binary or regression task, the number of "
                        f"classes for a multiclass one (default {default_of(MonitorConfig, 'task_rank')})")
    s.add_argument("--hijack-probe-every", type=int, default=None,
                   help=f"watch for a hijacking bank with copy probes every N steps (a bank that knows them evades them) "
                        f"(default {default_of(MonitorConfig, 'probe_every')}: off)")
    add_psi_limit_arguments(s, "bank")
    add_quota_arguments(s)
    c = command(sub, "compute", "serve a compute party: a trunk (U-shaped) or the rest of the model and the loss "
                "(vanilla) for a bank that owns the data; no data of its own (certificate role compute)",
                handler=serve_layers)
    add_service_arguments(c, data=False)
    _add_layer_limits(c)
    b = command(sub, "branch", "serve a branch of horizontal split learning: the bank's schema, customers of its "
                "own, the client-side bottom model the bank relays or averages (certificate role partner)",
                handler=serve_layers)
    add_service_arguments(b)
    _add_layer_limits(b)
    return parser


def _seed(text: str) -> int | str:
    if text == "secret":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'secret', got {text!r}") from None


def _add_layer_limits(parser: argparse.ArgumentParser) -> None:
    from partner.settings import LayerHostSettings as L

    g = parser.add_argument_group("what a bank may ask this service to hold")
    g.add_argument("--max-sessions", type=int, default=None,
                   help=f"live sessions at once, per bank (default {default_of(L, 'max_sessions')})")
    g.add_argument("--max-parameters", type=int, default=None,
                   help=f"parameters of one session's layers (default {default_of(L, 'max_parameters')})")
    g.add_argument("--max-width", type=int, default=None,
                   help=f"widest layer (default {default_of(L, 'max_width')})")
    g.add_argument("--session-ttl", type=float, default=None,
                   help=f"seconds an idle session stays live, then dropped with its checkpoints kept for the bank "
                        f"to resume (default {default_of(L, 'session_ttl')})")
    g.add_argument("--min-stats-rows", type=int, default=None,
                   help=f"branch: the fewest distinct rows column statistics are given on "
                        f"(default {default_of(L, 'min_stats_rows')})")
    g.add_argument("--bank", dest="banks", action="append", default=None, metavar="NAME",
                   help="required: the bank this service holds layers for (its certificate name); repeat for "
                        "several. Each has its own sessions and disk; a branch names its own bank, since whoever "
                        "starts a bottom sets its weights and can read the branch's rows through it")
    add_quota_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return args.handler(args)


def serve(args: argparse.Namespace) -> int:
    # Imported here, not at the top: --help and a mistyped flag need none of torch, pandas or FastAPI.
    from alignment.parallel import start_fork_server
    from parties.cli import apply_process_settings, psi_limit_values, quota_values, service_values
    from parties.settings import load_settings
    from partner.settings import PartnerSettings
    from parties.transport.server import serve as serve_app
    from partner.service import create_app

    bottom = {
        "hidden": tuple(int(h) for h in args.hidden.split(",") if h) if args.hidden is not None else None,
        "cut_width": args.cut_width, "learning_rate": args.lr, "optimizer": args.optimizer, "seed": args.seed,
    }
    bottom = {k: v for k, v in bottom.items() if v is not None}
    if bottom.get("seed") == "secret":
        bottom["seed"] = None  # said, not left out: None draws the initial weights from this partner's secret
    privacy = {"clip": args.dp_clip, "noise": args.dp_noise,
               "nopeek": args.nopeek}
    privacy = {k: v for k, v in privacy.items() if v is not None}
    settings = load_settings(
        PartnerSettings, **service_values(args), bottom=bottom or None, privacy=privacy or None,
        psi_limits=psi_limit_values(args), quotas=quota_values(args),
        monitor={k: v for k, v in (("watch", args.hijack_monitor), ("task_rank", args.hijack_task_rank),
                                   ("project", args.hijack_project), ("probe_every", args.hijack_probe_every)) if v is not None} or None,
    )
    assert isinstance(settings, PartnerSettings)
    apply_process_settings(settings.torch_threads, settings.cpus)
    table = settings.load_table()
    start_fork_server(settings.workers)
    serve_app(create_app(settings, table), settings.tls_files(), settings.host, settings.port, settings.ready_file)
    return 0


def serve_layers(args: argparse.Namespace) -> int:
    from parties.cli import apply_process_settings, quota_values, service_values
    from parties.settings import load_settings
    from partner.settings import BranchSettings, ComputeSettings
    from parties.transport.server import serve as serve_app
    from partner.layer_service import create_layer_app

    cls = ComputeSettings if args.command == "compute" else BranchSettings
    limits = {"max_sessions": args.max_sessions, "max_parameters": args.max_parameters, "max_width": args.max_width,
              "session_ttl": args.session_ttl, "min_stats_rows": args.min_stats_rows,
              "banks": tuple(args.banks) if args.banks else None, "quotas": quota_values(args)}
    values = {k: v for k, v in service_values(args).items() if not (cls is ComputeSettings and k == "data")}
    settings = load_settings(cls, **values, **limits)
    assert isinstance(settings, (ComputeSettings, BranchSettings))
    apply_process_settings(settings.torch_threads, settings.cpus)
    table = settings.load_table() if settings.data is not None else None
    serve_app(create_layer_app(settings, table), settings.tls_files(), settings.host, settings.port,
              settings.ready_file)
    return 0


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
