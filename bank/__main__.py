"""``python -m bank``: serve the bank, align, train, score, run the configurations, or the whole walkthrough.

The lab (reports, studies, benchmarks) has its own entry point: ``python -m bank.lab``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import get_args

from bank import commands
from bank.config import GradientDefenseName, TopConfig, TrainingConfig
from bank.configurations.commands import add_configuration_commands
from data.uci import CACHE_HELP
from parties.cli import (
    add_log_level,
    add_psi_limit_arguments,
    add_service_arguments,
    command,
    configure_logging,
    default_of,
    description,
    number,
    run_cli,
)
from parties.learning.config import BottomConfig
from bank.settings import BankSettings


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


LOCAL_STEPS_HELP = (f"batches per round trip, one update each at every party (default "
                    f"{default_of(TrainingConfig, 'local_steps')}: exact; K > 1 makes K times fewer round trips, "
                    "one round trip stale: see docs/how-to/wan.md)")
REUSE_STEPS_HELP = (f"with --local-steps: R more updates per round trip at every party from the last two round "
                    f"trips' batches (default {default_of(TrainingConfig, 'reuse_steps')}; the WAN setting of docs/how-to/wan.md: "
                    "--local-steps 4 --reuse-steps 8 --wire-precision int8)")


def _add_gradient_defense_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--gradient-defense", choices=get_args(GradientDefenseName), default=None,
                        help=f"bank: perturb the gradients partners receive (default "
                             f"{default_of(TrainingConfig, 'gradient_defense')}; matched: each class gets the other's "
                             "covariance, both the same noise along their mean difference; marvell: the paper's "
                             "noise model, Li et al. 2022, which label-free attacks read)")
    parser.add_argument("--gradient-noise", type=float, default=None, help="bank: isotropic noise scale")
    parser.add_argument("--marvell-power", type=float, default=None, metavar="S",
                        help=f"bank, with --gradient-defense matched or marvell: the noise power, in units of the squared "
                             f"distance between the classes' mean gradients (default "
                             f"{default_of(TrainingConfig, 'marvell_power')}; more: less leakage, slower learning)")
    parser.add_argument("--marvell-persistence", type=float, default=None, metavar="RHO",
                        help=f"bank, with --gradient-defense matched or marvell: the share (0 to 1) of each row's noise drawn once "
                             f"for the run, so that averaging a row's gradients over epochs does not remove it "
                             f"(default {default_of(TrainingConfig, 'marvell_persistence')}; the per-batch bound is the same)")


def _share(text: str) -> float:
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share is above 0 and at most 1, e.g. 0.9")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bank", description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    s = command(sub, "serve", "serve the bank's coordinator endpoints", handler=commands.serve)
    add_service_arguments(s)
    s.add_argument("--label", default=None, help="label column (default: the schema file's, else y)")
    s.add_argument("--task", choices=["binary", "multiclass", "regression"], default=None,
                   help="what the label is; its values are checked against it before anything is aligned, and "
                        "training learns it unless told otherwise (default: the schema file's 'task', else inferred: "
                        "two values binary, many numbers regression, else multiclass)")
    s.add_argument("--partner", action="append", default=[], metavar="NAME=URL", help="repeat per partner")
    s.add_argument("--peer-retry-deadline", type=float, default=None,
                   help=f"seconds a silent partner is retried (it may be restarting) before training stops "
                        f"(default {default_of(BankSettings, 'peer_retry_deadline')})")
    s.add_argument("--max-overlap", type=_share, default=None, metavar="SHARE",
                   help="refuse, before anything is committed, a partner matching more than this share of the bank's "
                        "customers (a partner that claims IDs it does not hold learns them at the commit; default "
                        f"{default_of(BankSettings, 'max_overlap')}); align and score may ask for their own")
    add_psi_limit_arguments(s, "partner")

    a = command(sub, "align", "align customers with every partner, through the running bank service",
                handler=commands.align)
    _add_operator_arguments(a)
    a.add_argument("--partners", default=None, help="comma-separated subset of partners (default: every one)")
    a.add_argument("--min-intersection", type=int, default=None,
                   help="refuse an intersection smaller than this (default: the service's --min-intersection)")
    a.add_argument("--expect-overlap", type=_share, default=None, metavar="SHARE",
                   help="the share (0 to 1) of the bank's customers you expect each partner to hold: a partner "
                        "matching under three quarters of it is warned about (IDs written differently, the wrong "
                        "file), one matching over it + 0.05 refused (a partner claiming IDs it does not hold); "
                        "default: no expectation")
    a.add_argument("--max-overlap", type=_share, default=None, metavar="SHARE",
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
    t.add_argument("--task", choices=["binary", "multiclass", "regression"], default=None,
                   help=f"what the label is (default {default_of(TrainingConfig, 'task')}); regression learns "
                        "a standardised target and reports metrics in the label's own units")
    t.add_argument("--positive-label", default=None,
                   help="binary: the label value that counts as positive (default: 'yes' if present, else the "
                        "second in sorted order)")
    t.add_argument("--epochs", type=int, default=None,
                   help=f"at most this many epochs (default {default_of(TrainingConfig, 'epochs')}; "
                        f"early stopping after {default_of(TrainingConfig, 'patience')} without improvement)")
    t.add_argument("--batch-size", type=int, default=None,
                   help=f"training rows per step (default {default_of(TrainingConfig, 'batch_size')})")
    t.add_argument("--aggregation", choices=["concat", "sum", "mean"], default=None,
                   help=f"how the top model combines the embeddings (default {default_of(TrainingConfig, 'aggregation')})")
    t.add_argument("--seed", type=int, default=None,
                   help=f"seed of the split and the batch order (default {default_of(TrainingConfig, 'seed')})")
    t.add_argument("--audit", action="store_true", default=None, help="record what crossed the cut, for analysis")
    t.add_argument("--wire-precision", choices=["fp32", "fp16", "bf16", "int8"], default=None,
                   help=f"how step embeddings and gradients travel (default {default_of(TrainingConfig, 'wire_precision')}: "
                        "exact; fp16/bf16 halve the bytes, int8 quarters them)")
    t.add_argument("--local-steps", type=int, default=None, metavar="K", help=LOCAL_STEPS_HELP)
    t.add_argument("--reuse-steps", type=int, default=None, metavar="R", help=REUSE_STEPS_HELP)
    _add_gradient_defense_arguments(t)
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
    sc.add_argument("--max-overlap", type=_share, default=None, metavar="SHARE",
                    help="leave out, before anything is committed, a partner matching more than this share of the "
                         "customers to score (default: what the last alignment accepted of that partner, else "
                         "the service's --max-overlap)")
    sc.add_argument("--allow-missing", action="store_true",
                    help="score customers some partners lack with the model of the parties that hold them "
                         "(trained with the joint model; e.g. the bank-only model); default: report them unscorable")
    add_log_level(sc)

    add_configuration_commands(sub)

    w = command(sub, "walkthrough", "run the bank-marketing walkthrough end to end", handler=commands.walkthrough)
    w.add_argument("--configuration", choices=["vertical", "u-shaped", "vanilla", "relay", "splitfed"],
                   default="vertical",
                   help="vertical: the bank and partners hold different columns; u-shaped/vanilla: the bank owns "
                        "every column and rents a compute party; relay/splitfed: the bank's customers at 3 branches "
                        "(docs/how-to/configurations.md) (default vertical)")
    w.add_argument("--branches", type=int, default=None, help="relay, splitfed: how many branches (default 3)")
    w.add_argument("--fedavg-every", type=int, default=None, metavar="N",
                   help="splitfed: average the branches' bottoms every N steps, and at epoch ends (default 10; 0: "
                        "at epoch ends only)")
    w.add_argument("--no-reference", action="store_true",
                   help="u-shaped, vanilla, relay, splitfed: skip training the single-process twin (and, "
                        "horizontal, the centralised model) to compare with")
    w.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<timestamp>)")
    w.add_argument("--partners", type=int, default=1,
                   help="spread the partner columns over N partners, each its own service (default %(default)s)")
    w.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers (default: all)")
    w.add_argument("--seed", type=int, default=0,
                   help="seed of the partition and of training's split and batch order (default %(default)s)")
    w.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    w.add_argument("--no-download", action="store_true", help="fail instead of downloading bank-full.csv")
    w.add_argument("--workers", type=int, default=None, help="PSI worker processes per party (default: every core)")
    w.add_argument("--epochs", type=int, default=None,
                   help=f"at most this many training epochs (default {default_of(TrainingConfig, 'epochs')}, "
                        f"with early stopping after {default_of(TrainingConfig, 'patience')} without improvement)")
    w.add_argument("--max-steps", type=int, default=None, help="stop training after N steps (smoke runs)")
    w.add_argument("--audit", action="store_true", default=None,
                   help="record what crossed the cut, for the notebook's leakage audit")
    w.add_argument("--wire-precision", choices=["fp32", "fp16", "bf16", "int8"], default=None,
                   help=f"how step embeddings and gradients travel (default {default_of(TrainingConfig, 'wire_precision')}: "
                        "exact; fp16/bf16 halve the bytes, int8 quarters them)")
    w.add_argument("--local-steps", type=int, default=None, metavar="K", help=LOCAL_STEPS_HELP)
    w.add_argument("--reuse-steps", type=int, default=None, metavar="R", help=REUSE_STEPS_HELP)
    d = w.add_argument_group("defenses (all off by default: see docs/explanation/privacy.md)")
    d.add_argument("--dp-clip", type=float, default=None, help="partners: embedding noise's clip norm")
    d.add_argument("--dp-noise", type=float, default=None, help="partners: embedding noise's std (obfuscation, no ε)")
    d.add_argument("--nopeek", type=float, default=None, metavar="ALPHA",
                   help="partners: NoPeek, ALPHA x dCor(features, embedding) added to their own loss")
    d.add_argument("--hijack-monitor", action="store_true", default=None, help="partners: the hijack monitor's rank test")
    d.add_argument("--hijack-probe-every", type=int, default=None, help="partners: hijack monitor copy-probe interval")
    d.add_argument("--label-dp-epsilon", type=float, default=None, help="bank: randomized-response label DP ε")
    _add_gradient_defense_arguments(d)
    add_log_level(w)
    return parser


#: The lab's commands, which ``python -m bank`` once offered too: a user who types one is told where it went.
LAB_COMMANDS = frozenset({"report", "subset-study", "privacy-study", "hijack-study", "cut-study", "bench", "psi-bench",
                          "scale-bench", "config-bench"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LAB_COMMANDS:
        print(f"error: {argv[0]} is a lab command: python -m bank.lab {argv[0]} ...", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return args.handler(args)


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
