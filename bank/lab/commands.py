"""The command line's handlers for the lab: the report, the studies and the benchmarks.

SIMULATION ONLY, like ``bank.lab`` itself: each plays every party on this machine. Apart from
``bank.commands`` (the product's handlers) so that neither file holds two concepts; each handler imports
the lab when it runs, so ``--help`` stays light.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parties.errors import ConfigError

__all__ = ["bench", "cut_study", "hijack_study", "privacy_study", "psi_bench", "report", "scale_bench", "subset_study"]


def report(args: argparse.Namespace) -> int:
    from bank.lab.report.analysis import load_run, write_report

    run = load_run(args.run)
    if args.party_file and args.partition:
        raise ConfigError("give --partition (a folder python -m data partition wrote) or --party-file per party, "
                          "not both")
    files = {}
    for item in args.party_file:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--party-file takes NAME=FILE, got {item!r}")
        files[name] = Path(path)
    written = write_report(run, references=not args.no_references, partition=files or args.partition)
    for name, table in written["tables"].items():
        print(f"\n== {name}\n{table.to_string(index=False)}")
    for note in written["notes"]:
        print(f"\n{note}")
    print(f"\nwritten to {run.path / 'analysis'}")
    return 0


def subset_study(args: argparse.Namespace) -> int:
    from bank.vertical.results import load_run
    from bank.lab.studies.subsets import run_subset_study

    run = load_run(args.run)
    tables = run_subset_study(run, seeds=args.seeds, partition=args.partition)
    (run.path / "analysis").mkdir(exist_ok=True)
    for name, table in tables.items():
        table.to_csv(run.path / "analysis" / f"subset_study_{name}.csv", index=False)
        print(f"\n== {name}\n{table.to_string(index=False, float_format=lambda v: f'{v:.4f}')}")
    print(f"\nwritten to {run.path / 'analysis'}")
    return 0


def cut_study(args: argparse.Namespace) -> int:
    from bank.lab.studies.cut import default_grid, run_cut_study

    for flag, value in (("--rows", args.rows), ("--epochs", args.epochs), ("--known-labels", args.known_labels)):
        if value < (0 if flag == "--rows" else 1):
            raise ConfigError(f"{flag} must be {'0 or more' if flag == '--rows' else 'at least 1'}, got {value}")
    grid = default_grid()
    print(f"cut study: {len(grid)} points, {args.epochs} epochs each, "
          f"{'all customers' if not args.rows else f'{args.rows:,} customers'}", file=sys.stderr)
    table = run_cut_study(args.out, rows=args.rows or None, epochs=args.epochs, grid=grid,
                          known_labels=args.known_labels, cache=args.cache_dir,
                          progress=lambda line: print(f"... {line}", file=sys.stderr))
    shown = ["point", "test_roc_auc", "bytes_per_step", "partner_ms_per_step", "bank_ms_per_step",
             "strongest_label_leak_auc", "inversion_r2_advantage"]
    print(table[[c for c in shown if c in table]].to_string(index=False))
    print(f"\nwritten to {args.out}")
    return 0


def privacy_study(args: argparse.Namespace) -> int:
    from bank.lab.studies.privacy import default_settings, run_study

    _at_least_one(("--rows", args.rows), ("--epochs", args.epochs))
    settings = default_settings()
    counter = iter(range(1, len(settings) + 1))
    table = run_study(args.out, rows=args.rows, epochs=args.epochs, settings=settings, cache=args.cache_dir,
                      known_labels=args.known_labels,
                      progress=lambda name: print(f"... {next(counter)}/{len(settings)} {name}", file=sys.stderr))
    print(table.to_string(index=False))
    print(f"\nwritten to {args.out}")
    return 0


def hijack_study(args: argparse.Namespace) -> int:
    from bank.lab.studies.hijack import StudyConfig, default_attackers, format_study, monitor_cost, run_hijack_study
    from parties.learning.config import MonitorConfig

    _at_least_one(("--runs", args.runs), ("--rows", args.rows), ("--epochs", args.epochs))
    config = StudyConfig(rows=args.rows, epochs=args.epochs, secret_init=args.secret_init,
                         monitor=MonitorConfig(watch=True, on_alarm="warn", project=args.project))
    attackers = default_attackers()
    if args.banks is not None:
        words = [w.strip() for w in args.banks.split(",") if w.strip()]
        if not any(w in a.name for a in attackers for w in words):
            raise ConfigError(f"--banks {args.banks!r} names none of the study's banks: "
                              + "; ".join(a.name for a in attackers))
        # Plain FSHA stays: with the honest bank it sets the line an attack must cross to succeed.
        attackers = [a for a in attackers if a.kind == "fsha" or any(w in a.name for w in words)]
    banks = len(attackers) + 1
    counter = iter(range(1, banks + 1))
    result = run_hijack_study(args.out, runs=args.runs, attackers=attackers, config=config, cache=args.cache_dir,
                              progress=lambda name: print(f"... {next(counter)}/{banks} {name}: {args.runs} runs",
                                                          file=sys.stderr))
    cost = monitor_cost()
    cost.to_csv(args.out / "hijack_monitor_cost.csv", index=False)
    print(format_study(result["study"], config, args.runs))
    print("\nthe partner's cost of the rank test, next to an unmonitored partner (same steps, interleaved):")
    print(cost.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"\nwritten to {args.out}")
    return 0


def _at_least_one(*flags: tuple[str, int | None]) -> None:
    for flag, value in flags:
        if value is not None and value < 1:  # before any training: a study is minutes of work
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def _training(args: argparse.Namespace) -> dict[str, object]:
    """The training settings given as flags (``--batch-size``, ``--wire-precision``)."""
    from bank.config import TrainingConfig
    from parties.flags import flag_values

    return flag_values(args, TrainingConfig)


def bench(args: argparse.Namespace) -> int:
    from bank.lab.bench.training import bench_json, format_bench, run_training_bench

    if args.rtt_ms is not None or args.rate_mbit is not None:
        return _wan_bench(args)
    if args.congestion is not None or args.target_auc is not None or args.modes is not None:
        raise ConfigError("--congestion, --target-auc and --modes belong to the WAN bench: give --rtt-ms "
                          "(and --rate-mbit)")
    training = _training(args)
    figures = run_training_bench(args.epochs, args.rows, args.cache_dir, rounds=args.rounds,
                                 progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                                 batch_size=training.get("batch_size"), wire_precision=training.get("wire_precision"))
    print(format_bench(figures))
    if args.json:
        args.json.write_text(bench_json(figures) + "\n")
    return 0


def _wan_bench(args: argparse.Namespace) -> int:
    from bank.lab.bench.wan import DEFAULT_TARGET_AUC, WAN_MODES, format_wan_bench, run_wan_bench, wan_bench_json

    training = _training(args)
    if training.get("wire_precision") is not None:
        raise ConfigError("the WAN bench compares its modes (exact, int8, efficient) side by side: leave out "
                          "--wire-precision and choose them with --modes")
    names = list(WAN_MODES) if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in WAN_MODES]
    if unknown or not names:
        raise ConfigError(f"--modes: {', '.join(unknown) or 'none given'}; choose from {', '.join(WAN_MODES)}")
    figures = run_wan_bench(args.rtt_ms or 0.0, args.rate_mbit, args.congestion,
                            args.target_auc if args.target_auc is not None else DEFAULT_TARGET_AUC,
                            args.epochs, args.rows, args.cache_dir, rounds=args.rounds,
                            batch_size=training.get("batch_size"), modes={m: WAN_MODES[m] for m in names},
                            progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_wan_bench(figures))
    if args.json:
        args.json.write_text(wan_bench_json(figures) + "\n")
    return 0


def psi_bench(args: argparse.Namespace) -> int:
    from bank.lab.bench.psi import format_result, run_bench, to_json
    from parties.storage.files import atomic_write_text

    result = run_bench(args.size, args.overlap, args.seed, args.workers, args.ray)
    print(format_result(result))
    if args.json:
        atomic_write_text(args.json, to_json(result) + "\n")
    return 0


def scale_bench(args: argparse.Namespace) -> int:
    from bank.lab.bench.scale import format_scale_bench, run_scale_bench, scale_bench_json

    figures = run_scale_bench(args.customers, args.partners, args.epochs, sequential=args.sequential, seed=args.seed,
                              out=args.out, progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                              ray=args.ray)
    print(format_scale_bench(figures))
    if args.json is not None:
        args.json.write_text(scale_bench_json(figures) + "\n")
    return 0


def tables(args: argparse.Namespace) -> int:
    from bank.config import TrainingConfig
    from bank.lab.bench.tables import SETTINGS, TABLES, report, run

    def names(given: str | None, known: dict[str, object], flag: str) -> list[str]:
        chosen = list(known) if given is None else [n.strip() for n in given.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in known]
        if unknown or not chosen:
            raise ConfigError(f"{flag}: {', '.join(unknown) or 'none given'}; choose from {', '.join(known)}")
        return chosen

    config = TrainingConfig(seed=args.seed, **({"epochs": args.epochs} if args.epochs is not None else {}))
    results = run(args.out, names(args.tables, TABLES, "--tables"), names(args.settings, SETTINGS, "--settings"),
                  config, cache=args.cache_dir, download=not args.no_download, costs=not args.no_step_costs,
                  progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(report(results))
    print(f"\nwritten: {args.out / 'tables.json'}, {args.out / 'tables.csv'}")
    return 0


def config_bench(args: argparse.Namespace) -> int:
    from bank.configurations.commands import configuration_settings
    from bank.lab.bench.configurations import format_config_bench, run_config_bench

    settings = {name: configuration_settings(name, None, epochs=args.epochs, seed=None, audit=None,
                                              fedavg_every=args.fedavg_every if name == "splitfed" else None)
                for name in ("relay", "splitfed")}
    frame = run_config_bench(settings, args.out, rows=args.rows, cache_dir=args.cache_dir)
    print(format_config_bench(frame))
    if args.out is not None:
        print(f"\nwritten: {args.out / 'config_bench.csv'}")
    return 0
