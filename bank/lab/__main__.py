"""``python -m bank.lab``: the lab's commands: a run's report, the studies and the benchmarks.

They play every party on one machine (SIMULATION ONLY where they say so) or time the product; the product's
commands are ``python -m bank``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bank.config import TrainingConfig
from bank.lab import commands as lab_commands
from data.uci import CACHE_HELP
from parties.cli import add_log_level, command, configure_logging, description, number, run_cli
from parties.flags import add_flags


def _non_negative_ms(text: str) -> float:
    value = number(text)
    if not 0 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"{text} ms: a round-trip time is between 0 and 10000 ms")
    return value


def _positive_rate(text: str) -> float:
    value = number(text)
    if not 0 < value <= 100_000:
        raise argparse.ArgumentTypeError(f"{text} Mbit/s: a rate is above 0 and at most 100000 Mbit/s")
    return value


def _auc(text: str) -> float:
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a ROC AUC target is above 0 and at most 1")
    return value


def _known_labels(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if count < 2:
        raise argparse.ArgumentTypeError(f"{count}: model completion needs at least 2 known labels, one of each class")
    return count


def _congestion(text: str) -> str:
    if not text.isascii() or not text.replace("_", "").isalnum() or len(text) > 15:
        raise argparse.ArgumentTypeError(f"{text!r} is not a congestion control name (e.g. cubic, reno, bbr)")
    return text


def build_parser(prog: str = "python -m bank.lab") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    r = command(sub, "report", "write a run's analysis (tables as CSV, figures as PNG) without the notebook",
                handler=lab_commands.report)
    r.add_argument("run", type=Path, nargs="?", default=None,
                   help="run folder, relative to here or a folder above (default: the latest under runs/, here or above)")
    r.add_argument("--no-references", action="store_true", help="skip the centralised references (simulation)")
    r.add_argument("--partition", type=Path, default=None,
                   help="the folder python -m data partition wrote, for the references (default: RUN/data, "
                        "as the walkthrough keeps it)")
    r.add_argument("--party-file", action="append", default=[], metavar="NAME=FILE",
                   help="instead of --partition: each party's own file, once per party (pre-split files; the "
                        "references join them, as only a simulation can)")
    add_log_level(r)

    ss = command(sub, "subset-study", "customers no partner holds: the bank-only model's choice, and whether "
                                      "unaligned customers help the joint model (simulation only)",
                 handler=lab_commands.subset_study)
    ss.add_argument("run", type=Path, nargs="?", default=None,
                    help="run folder (default: the latest under runs/, here or above)")
    ss.add_argument("--seeds", type=int, default=3, help="how many batch seeds (0 to N-1) to train the joint model with (default %(default)s)")
    ss.add_argument("--partition", type=Path, default=None, help="every party's files (default: RUN/data)")
    add_log_level(ss)

    ps = command(sub, "privacy-study", "measure every defense's price and effect (simulation only)",
                 handler=lab_commands.privacy_study)
    ps.add_argument("--out", type=Path, required=True, help="folder for privacy_study.csv and its PNG")
    ps.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers (default: all)")
    ps.add_argument("--epochs", type=int, default=10, help="epochs per setting (default %(default)s)")
    ps.add_argument("--known-labels", type=_known_labels, default=50, metavar="N",
                    help="model completion: training rows whose labels the partner has learned (default %(default)s)")
    ps.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    add_log_level(ps)

    hs = command(sub, "hijack-study", "the partner's hijack monitor against banks that know it: detection, false "
                                      "alarms and how well each attack still works (simulation only)",
                 handler=lab_commands.hijack_study)
    hs.add_argument("--out", type=Path, required=True,
                    help="folder for hijack_runs.csv, hijack_study.csv and .txt (the table the notebook shows), "
                         "hijack_monitor_cost.csv, and the slice's party files")
    hs.add_argument("--runs", type=int, default=20, help="seeded runs per bank, seeds 0 to N-1 (default %(default)s)")
    hs.add_argument("--rows", type=int, default=5000, help="customers in the seeded slice (default %(default)s)")
    hs.add_argument("--epochs", type=int, default=17, help="epochs per run (default %(default)s)")
    hs.add_argument("--project", action="store_true",
                    help="the partners apply only each gradient's task part (--hijack-project)")
    hs.add_argument("--secret-init", action="store_true",
                    help="the partners draw their initial weights from their secret, as a partner with the monitor "
                         "on does by default (without it: from a seed the bank knows, the bank's best case)")
    hs.add_argument("--banks", default=None,
                    help="only the banks whose name holds one of these comma-separated words (the honest bank and "
                         "plain FSHA always run: they set the line an attack must cross), e.g. 'freeze'")
    hs.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    add_log_level(hs)

    cs = command(sub, "cut-study", "sweep the cut layer (width, partner depth, where the partner stops): test AUC, "
                                   "bytes, compute and every leak per point (simulation only)",
                 handler=lab_commands.cut_study)
    cs.add_argument("--out", type=Path, required=True, help="folder for cut_study.csv and cut_frontier.png")
    cs.add_argument("--rows", type=int, default=0,
                    help="a seeded slice of N customers; 0: all of bank-full (default %(default)s)")
    cs.add_argument("--epochs", type=int, default=8, help="epochs per point (default %(default)s)")
    cs.add_argument("--known-labels", type=int, default=50,
                    help="labels the model-completion attacker knows (default %(default)s)")
    cs.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    add_log_level(cs)

    b = command(sub, "bench", "time split training against the unsplit model, side by side",
                handler=lab_commands.bench)
    b.add_argument("--epochs", type=int, default=4, help="epochs per round (default %(default)s)")
    b.add_argument("--rounds", type=int, default=3, help="alternating split/unsplit rounds (default %(default)s)")
    b.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers")
    add_flags(b, TrainingConfig, only=("batch_size", "wire_precision"))
    b.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    b.add_argument("--json", type=Path, default=None, help="also write the figures here")
    wan = b.add_argument_group("across an emulated WAN (root only: the parties run in network namespaces of their own)")
    wan.add_argument("--rtt-ms", type=_non_negative_ms, default=None,
                     help="round-trip time of the link between bank and partner (default: loopback, no link)")
    wan.add_argument("--rate-mbit", type=_positive_rate, default=None,
                     help="the link's rate each way, Mbit/s (default: unlimited)")
    wan.add_argument("--congestion", type=_congestion, default=None,
                     help="the namespaces' default TCP congestion control, e.g. cubic, reno, bbr (default: the host's)")
    wan.add_argument("--target-auc", type=_auc, default=None,
                     help="report each mode's training seconds to this ROC AUC (default 0.930)")
    wan.add_argument("--modes", default=None, metavar="M1,M2",
                     help="the training settings to compare, of exact, int8, efficient (default: all three)")
    add_log_level(b)

    pb = command(sub, "psi-bench", "run both PSI roles here over mutual TLS and report time, bytes and rates",
                 handler=lab_commands.psi_bench)
    pb.add_argument("--size", type=int, default=1 << 16,
                    help="IDs per party (default %(default)s; the target is 1048576)")
    pb.add_argument("--overlap", type=float, default=0.5,
                    help="share of each party's IDs the other also holds (default %(default)s)")
    pb.add_argument("--seed", type=int, default=0, help="seed of the generated IDs (default %(default)s)")
    pb.add_argument("--workers", type=int, default=None, help="worker processes per party (default: every core)")
    pb.add_argument("--ray", default=None, metavar="ADDRESS",
                    help="also run both parties' PSI on this Ray cluster (HOST:PORT or auto), side by side with the "
                         "worker processes: throughput ratio and whether the aligned rows are identical")
    pb.add_argument("--json", type=Path, default=None, help="also write the figures here")
    add_log_level(pb)

    tb = command(sub, "tables", "SIMULATION ONLY: the split model's built-in settings against centralised "
                 "HistGradientBoosting, a linear model and the bank-only model, on bank-full, a generated credit "
                 "table, a regression and a multiclass table", handler=lab_commands.tables)
    tb.add_argument("--out", type=Path, default=Path("runs/tables"),
                    help="folder for tables.json and tables.csv (default %(default)s)")
    tb.add_argument("--tables", default=None, metavar="NAME,NAME",
                    help="the tables to compare (default: bank-full,credit,diabetes,wine)")
    tb.add_argument("--settings", default=None, metavar="NAME,NAME",
                    help="the built-in bottom settings to compare (default: default,ple,periodic,categories,"
                         "ple+categories; the first is the baseline of the step costs)")
    tb.add_argument("--epochs", type=int, default=None, help="at most this many epochs (default: the training "
                    "default, with its early stopping)")
    tb.add_argument("--seed", type=int, default=0, help="seed of the splits and the batch order (default %(default)s)")
    tb.add_argument("--no-step-costs", action="store_true", help="skip timing the bottoms' training steps")
    tb.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    tb.add_argument("--no-download", action="store_true", help="use the cached bank-full.csv only")
    add_log_level(tb)

    sb = command(sub, "scale-bench", "generate a synthetic bank and N partners, run them end to end as services, "
                                     "and time every stage", handler=lab_commands.scale_bench)
    sb.add_argument("--customers", type=int, default=1_000_000, help="the bank's customers (default %(default)s)")
    sb.add_argument("--partners", type=int, default=3, help="partner services (default %(default)s)")
    sb.add_argument("--epochs", type=int, default=2, help="training epochs (default %(default)s)")
    sb.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default %(default)s)")
    sb.add_argument("--sequential", action="store_true",
                    help="also align one partner after another and all at once again (hashes cached), side by side")
    sb.add_argument("--ray", default=None, metavar="ADDRESS",
                    help="every service runs its PSI on this Ray cluster (HOST:PORT of its head, or auto): "
                         "--ray-address on each (default: each service's worker processes)")
    sb.add_argument("--out", type=Path, default=None, help="keep the data, logs and runs here (default: a temporary folder)")
    sb.add_argument("--json", type=Path, default=None, help="also write the figures here")
    add_log_level(sb)

    cb = command(sub, "config-bench", "horizontal relay and SplitFed against centralised training on bank-full, "
                 "side by side: test AUC and epoch time", handler=lab_commands.config_bench)
    cb.add_argument("--rows", type=int, default=None, help="a seeded slice of N customers (default: all)")
    cb.add_argument("--epochs", type=int, default=None, help="at most this many epochs (default 40, early stopping)")
    cb.add_argument("--fedavg-every", type=int, default=None, metavar="N",
                    help="splitfed: average every N steps, and at epoch ends (default 10; 0: at epoch ends only)")
    cb.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    cb.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    add_log_level(cb)

    return parser


def main(argv: list[str] | None = None, prog: str = "python -m bank.lab") -> int:
    args = build_parser(prog).parse_args(argv)
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    return args.handler(args)


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
