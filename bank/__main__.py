"""``python -m bank``: serve the bank, align, train, score, run the configurations, or the whole walkthrough.

The lab (reports, studies, benchmarks) has its own entry point: ``python -m bank.lab``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from bank import commands
from bank.config import TopConfig, TrainingConfig
from bank.configurations.commands import add_configuration_commands
from bank.configurations.split_run import ConfigurationSettings
from bank.settings import BankSettings, share
from data.uci import CACHE_HELP
from parties.cli import add_log_level, add_service_arguments, command, configure_logging, description, run_cli
from parties.flags import add_flags
from parties.learning.config import BottomConfig, PartnerDefenses


def _add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    """How the bank's operator reaches its own service: its URL and the bank's certificate."""
    parser.add_argument("--url", help="the bank service, e.g. https://127.0.0.1:8443 (required)")
    parser.add_argument("--name", default="bank", help="the bank's party name, its certificate's CN (default %(default)s)")
    parser.add_argument("--tls-dir", type=Path, default=None,
                        help="folder with ca.pem, NAME.pem and NAME.key: the bank's certificate")
    parser.add_argument("--insecure", action="store_true",
                        help="plain HTTP, for a bank service started with --insecure (development only)")



def _config_epilog() -> str:
    """The training settings, listed from the models the bank builds them with."""
    wrap = lambda label, names: textwrap.fill(", ".join(names), width=100, initial_indent=f"  {label}: ",
                                               subsequent_indent=" " * (len(label) + 4))
    nested = {"bank_bottom": BottomConfig, "top": TopConfig}
    return "\n".join([
        "training settings (--config FILE: a JSON object; TrainingConfig in bank/config.py):",
        wrap("top level", [f for f in TrainingConfig.model_fields if f not in nested]),
        wrap("bank_bottom (the bank's own bottom model)", list(BottomConfig.model_fields)),
        wrap("top (the top model)", list(TopConfig.model_fields)),
        "",
        "example:",
        '  {"epochs": 20, "batch_size": 512, "bank_bottom": {"learning_rate": 0.002}, "top": {"hidden": [64, 32]}}',
        "",
        "--print-config prints every setting with its default.",
    ])


#: The walkthrough's training settings, and the defenses it sets at the bank and hands to its partners.
WALKTHROUGH_TRAINING = ("epochs", "max_steps", "audit", "wire_precision", "local_steps", "reuse_steps")
WALKTHROUGH_DEFENSES = ("label_dp_epsilon", "gradient_defense", "gradient_noise", "marvell_power", "marvell_persistence")


def build_parser(prog: str = "python -m bank") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    s = command(sub, "serve", "serve the bank's coordinator endpoints", handler=commands.serve)
    add_service_arguments(s, BankSettings)

    a = command(sub, "align", "align customers with every partner, through the running bank service",
                handler=commands.align)
    _add_operator_arguments(a)
    a.add_argument("--partners", default=None, help="comma-separated subset of partners (default: every one)")
    a.add_argument("--min-intersection", type=int, default=None,
                   help="refuse an intersection smaller than this (default: the service's --min-intersection)")
    a.add_argument("--expect-overlap", type=share, default=None, metavar="SHARE",
                   help="the share (0 to 1) of the bank's customers you expect each partner to hold: a partner "
                        "matching under three quarters of it is warned about (IDs written differently, the wrong "
                        "file), one matching over it + 0.05 refused (a partner claiming IDs it does not hold); "
                        "default: no expectation")
    a.add_argument("--max-overlap", type=share, default=None, metavar="SHARE",
                   help="refuse, before anything is committed, a partner matching more than this share of the bank's "
                        "customers: a partner that claims IDs it does not hold learns which are the bank's at the "
                        "commit (default: --expect-overlap + 0.05 if given, else the service's --max-overlap, 0.95)")
    a.add_argument("--sequential", action="store_true",
                   help="align with one partner after another (default: with every partner at once; same result)")
    add_log_level(a)

    t = command(sub, "train", "train across every partner, through the running bank service", handler=commands.train,
                epilog=_config_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_operator_arguments(t)
    t.add_argument("--config", type=Path, default=None,
                   help="a JSON file of training settings (see below; --print-config shows them all); "
                        "flags given here override it")
    t.add_argument("--print-config", action="store_true",
                   help="print the training settings this command would use (defaults, --config, flags) as "
                        "JSON to edit for --config, and exit")
    add_flags(t, TrainingConfig, skip=("bank_bottom", "top"))
    t.add_argument("--resume", metavar="SESSION", default=None,
                   help="continue a session from the latest step every party checkpointed (after the bank stopped)")
    add_log_level(t)

    se = command(sub, "sessions", "list the training sessions (running, stopped, finished, ended); end one",
                 handler=commands.sessions)
    _add_operator_arguments(se)
    se.add_argument("--end", metavar="SESSION", default=None,
                    help="end a stopped session for good, here and at every partner (it can no longer resume)")
    add_log_level(se)

    sc = command(sub, "score", "score new customers with a trained model, through the running bank service",
                 handler=commands.score)
    _add_operator_arguments(sc)
    sc.add_argument("--model", required=True, help="the model id (its training session)")
    sc.add_argument("--data", type=Path, required=True, help="CSV of customer IDs and the bank's own columns")
    sc.add_argument("--out", type=Path, required=True, help="where to write the scores (CSV)")
    sc.add_argument("--accept-drift", action="store_true",
                    help="score even when a column's population stability index against the training rows is above "
                         "0.25 (default: refuse, naming the columns; above 0.1 is a warning)")
    sc.add_argument("--max-overlap", type=share, default=None, metavar="SHARE",
                    help="leave out, before anything is committed, a partner matching more than this share of the "
                         "customers to score (default: what the last alignment accepted of that partner, else "
                         "the service's --max-overlap)")
    sc.add_argument("--allow-missing", action="store_true",
                    help="score customers some partners lack with the model of the parties that hold them "
                         "(trained with the joint model; e.g. the bank-only model); default: report them unscorable")
    add_log_level(sc)

    co = command(sub, "console", "the operator's console in a browser: align, train, follow, inspect runs, score",
                 handler=commands.console)
    _add_operator_arguments(co)
    co.add_argument("--port", type=int, default=8600,
                    help="the console's port on this machine (default %(default)s; 0: any free one)")
    co.add_argument("--host", default="127.0.0.1",
                    help="a loopback address to serve on (default %(default)s): the console acts as the bank's "
                         "operator, so it serves this machine only; reach it from elsewhere through ssh -L")
    add_log_level(co)

    add_configuration_commands(sub)

    w = command(sub, "walkthrough", "run the bank-marketing walkthrough end to end", handler=commands.walkthrough)
    w.add_argument("--configuration", choices=["vertical", "u-shaped", "vanilla", "relay", "splitfed"],
                   default="vertical",
                   help="vertical: the bank and partners hold different columns; u-shaped/vanilla: the bank owns "
                        "every column and rents a compute party; relay/splitfed: the bank's customers at 3 branches "
                        "(docs/how-to/configurations.md) (default vertical)")
    w.add_argument("--branches", type=int, default=None, help="relay, splitfed: how many branches (default 3)")
    add_flags(w, ConfigurationSettings, only=("fedavg_every",))
    w.add_argument("--no-reference", action="store_true",
                   help="u-shaped, vanilla, relay, splitfed: skip training the single-process twin (and, "
                        "horizontal, the centralised model) to compare with")
    w.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<timestamp>)")
    w.add_argument("--console", action="store_true",
                   help="start the parties' services and the operator's console, then align, train, inspect and "
                        "score in the browser (docs/how-to/console.md); Ctrl-C stops them all")
    w.add_argument("--console-port", type=int, default=8600,
                   help="with --console: the console's port on 127.0.0.1 (default %(default)s; 0: any free one)")
    w.add_argument("--partners", type=int, default=1,
                   help="spread the partner columns over N partners, each its own service (default %(default)s)")
    w.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers (default: all)")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of the partition and of training's split and batch order (default %(default)s)")
    w.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    w.add_argument("--no-download", action="store_true", help="fail instead of downloading bank-full.csv")
    w.add_argument("--workers", type=int, default=None, help="PSI worker processes per party (default: every core)")
    add_flags(w, TrainingConfig, only=WALKTHROUGH_TRAINING)
    d = w.add_argument_group("the bank's defenses (all off by default: see docs/explanation/privacy.md)")
    add_flags(w, TrainingConfig, only=WALKTHROUGH_DEFENSES, group=d)
    add_flags(w, PartnerDefenses)  # each partner's own, handed to its service
    add_log_level(w)
    return parser


#: The lab's commands, which ``python -m bank`` once offered too: a user who types one is told where it went.
LAB_COMMANDS = frozenset({"report", "subset-study", "privacy-study", "hijack-study", "cut-study", "bench", "psi-bench",
                          "scale-bench", "config-bench"})


def main(argv: list[str] | None = None, prog: str = "python -m bank") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LAB_COMMANDS:
        print(f"error: {argv[0]} is a lab command: python -m bank.lab {argv[0]} ...", file=sys.stderr)
        return 2
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    return args.handler(args)


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
