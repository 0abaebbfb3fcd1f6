"""``python -m bank``: serve the bank, drive alignment, or run the whole walkthrough."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from alignment.parallel import start_fork_server
from bank.cli import print_scoring, print_summary
from bank.config import TopConfig, TrainingConfig
from bank.operator import BankOperator
from bank.service import create_app
from bank.walkthrough import WalkthroughConfig, run_walkthrough
from parties.cli import (
    add_service_arguments,
    apply_process_settings,
    command,
    configure_logging,
    default_of,
    description,
    run_cli,
    service_values,
)
from parties.errors import ConfigError
from parties.learning.model import BottomConfig
from parties.protocol.control import AlignmentRequest, JobStatus
from parties.settings import BankSettings, describe_problems, load_settings
from parties.storage.files import atomic_write_text
from parties.transport.server import serve
from parties.transport.tls import TLSFiles

logger = logging.getLogger("bank")


def _partners(items: list[str]) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise ConfigError(f"--partner takes NAME=URL, got {item!r}")
        out[name] = url
    return out


def _add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    """How the bank's operator reaches its own service: its URL and the bank's certificate."""
    parser.add_argument("--url", help="the bank service, e.g. https://127.0.0.1:8443 (required)")
    parser.add_argument("--name", default="bank", help="the bank's party name, its certificate's CN (default %(default)s)")
    parser.add_argument("--tls-dir", type=Path, default=None,
                        help="folder with ca.pem, NAME.pem and NAME.key: the bank's certificate")
    parser.add_argument("--insecure", action="store_true",
                        help="plain HTTP, for a bank service started with --insecure (development only)")


CACHE_HELP = "where bank-full.csv is cached (default: $CUTLAYER_DATA_DIR, else ~/.cache/cutlayer/data)"

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


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bank", description=description(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    s = command(sub, "serve", "serve the bank's coordinator endpoints")
    add_service_arguments(s)
    s.add_argument("--label", default=None, help="label column (default: the schema file's, else y)")
    s.add_argument("--partner", action="append", default=[], metavar="NAME=URL", help="repeat per partner")
    s.add_argument("--peer-retry-deadline", type=float, default=None,
                   help=f"seconds a silent partner is retried (it may be restarting) before training stops "
                        f"(default {default_of(BankSettings, 'peer_retry_deadline')})")

    a = command(sub, "align", "align customers with every partner, through the running bank service")
    _add_operator_arguments(a)
    a.add_argument("--partners", default=None, help="comma-separated subset of partners (default: every one)")
    a.add_argument("--min-intersection", type=int, default=None,
                   help="refuse an intersection smaller than this (default: the service's --min-intersection)")
    _add_log_level(a)

    t = command(sub, "train", "train across every partner, through the running bank service",
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
    t.add_argument("--resume", metavar="SESSION", default=None,
                   help="continue a session from the latest step every party checkpointed (after the bank stopped)")
    _add_log_level(t)

    se = command(sub, "sessions", "list the training sessions (running, stopped, finished, ended); end one")
    _add_operator_arguments(se)
    se.add_argument("--end", metavar="SESSION", default=None,
                    help="end a stopped session for good, here and at every partner (it can no longer resume)")
    _add_log_level(se)

    sc = command(sub, "score", "score new customers with a trained model, through the running bank service")
    _add_operator_arguments(sc)
    sc.add_argument("--model", required=True, help="the model id (its training session)")
    sc.add_argument("--data", type=Path, required=True, help="CSV of customer IDs and the bank's own columns")
    sc.add_argument("--out", type=Path, required=True, help="where to write the scores (CSV)")
    sc.add_argument("--allow-missing", action="store_true",
                    help="score customers some partners lack with the model of the parties that hold them "
                         "(trained with the joint model; e.g. the bank-only model); default: report them unscorable")
    _add_log_level(sc)

    r = command(sub, "report", "write a run's analysis (tables as CSV, figures as PNG) without the notebook")
    r.add_argument("run", type=Path, nargs="?", default=None,
                   help="run folder, relative to here or a folder above (default: the latest under runs/, here or above)")
    r.add_argument("--no-references", action="store_true", help="skip the centralised references (simulation)")
    r.add_argument("--partition", type=Path, default=None,
                   help="the folder python -m data partition wrote, for the references (default: RUN/data, "
                        "as the walkthrough keeps it)")
    _add_log_level(r)

    ss = command(sub, "subset-study", "customers no partner holds: the bank-only model's choice, and whether "
                                      "unaligned customers help the joint model (simulation only)")
    ss.add_argument("run", type=Path, nargs="?", default=None,
                    help="run folder (default: the latest under runs/, here or above)")
    ss.add_argument("--seeds", type=int, default=3, help="how many batch seeds (0 to N-1) to train the joint model with (default %(default)s)")
    ss.add_argument("--partition", type=Path, default=None, help="every party's files (default: RUN/data)")
    _add_log_level(ss)

    ps = command(sub, "privacy-study", "measure every defense's price and effect (simulation only)")
    ps.add_argument("--out", type=Path, required=True, help="folder for privacy_study.csv, hijack_monitor.csv, PNG")
    ps.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers (default: all)")
    ps.add_argument("--epochs", type=int, default=10, help="epochs per setting (default %(default)s)")
    ps.add_argument("--hijack-runs", type=int, default=5,
                    help="honest and hijacking runs each, for the monitor's rates (default %(default)s)")
    ps.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    _add_log_level(ps)

    b = command(sub, "bench", "time split training against the unsplit model, side by side")
    b.add_argument("--epochs", type=int, default=4, help="epochs per round (default %(default)s)")
    b.add_argument("--rounds", type=int, default=3, help="alternating split/unsplit rounds (default %(default)s)")
    b.add_argument("--rows", type=int, default=None, help="use a seeded slice of N customers")
    b.add_argument("--batch-size", type=int, default=None, help="training batch size (default: training's default)")
    b.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    b.add_argument("--json", type=Path, default=None, help="also write the figures here")
    _add_log_level(b)

    pb = command(sub, "psi-bench", "run both PSI roles here over mutual TLS and report time, bytes and rates")
    pb.add_argument("--size", type=int, default=1 << 16,
                    help="IDs per party (default %(default)s; the target is 1048576)")
    pb.add_argument("--overlap", type=float, default=0.5,
                    help="share of each party's IDs the other also holds (default %(default)s)")
    pb.add_argument("--seed", type=int, default=0, help="seed of the generated IDs (default %(default)s)")
    pb.add_argument("--workers", type=int, default=None, help="worker processes per party (default: every core)")
    pb.add_argument("--json", type=Path, default=None, help="also write the figures here")
    _add_log_level(pb)

    w = command(sub, "walkthrough", "run the bank-marketing walkthrough end to end")
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
    d = w.add_argument_group("defenses (all off by default: see the README's privacy section)")
    d.add_argument("--dp-clip", type=float, default=None, help="partners: embedding DP clip norm")
    d.add_argument("--dp-noise", type=float, default=None, help="partners: embedding DP noise std")
    d.add_argument("--dp-budget", type=float, default=None, help="partners: refuse releases past this ε")
    d.add_argument("--hijack-probe-every", type=int, default=None, help="partners: hijack monitor probe interval")
    d.add_argument("--label-dp-epsilon", type=float, default=None, help="bank: randomized-response label DP ε")
    d.add_argument("--gradient-defense", choices=["none", "max_norm", "isotropic"], default=None,
                   help="bank: perturb the gradients partners receive")
    d.add_argument("--gradient-noise", type=float, default=None, help="bank: isotropic noise scale")
    _add_log_level(w)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "serve":
        settings = load_settings(
            BankSettings, **service_values(args), label=args.label, partners=_partners(args.partner),
            peer_retry_deadline=args.peer_retry_deadline,
        )
        assert isinstance(settings, BankSettings)
        apply_process_settings(settings.torch_threads, settings.cpus)
        table = settings.load_table()
        start_fork_server(settings.workers)
        serve(create_app(settings, table), settings.tls_files(), settings.host, settings.port, settings.ready_file)
        return 0
    if args.command == "report":
        from bank.lab.analysis import load_run, write_report

        run = load_run(args.run)
        report = write_report(run, references=not args.no_references, partition=args.partition)
        for name, table in report["tables"].items():
            print(f"\n== {name}\n{table.to_string(index=False)}")
        for note in report["notes"]:
            print(f"\n{note}")
        print(f"\nwritten to {run.path / 'analysis'}")
        return 0
    if args.command == "subset-study":
        from bank.lab.analysis import load_run
        from bank.lab.subset_study import run_subset_study

        run = load_run(args.run)
        tables = run_subset_study(run, seeds=args.seeds, partition=args.partition)
        (run.path / "analysis").mkdir(exist_ok=True)
        for name, table in tables.items():
            table.to_csv(run.path / "analysis" / f"subset_study_{name}.csv", index=False)
            print(f"\n== {name}\n{table.to_string(index=False, float_format=lambda v: f'{v:.4f}')}")
        print(f"\nwritten to {run.path / 'analysis'}")
        return 0
    if args.command == "privacy-study":
        from bank.lab.privacy_study import hijack_rates, run_study

        table = run_study(args.out, rows=args.rows, epochs=args.epochs, cache=args.cache_dir,
                          progress=lambda name: print(f"... {name}", file=sys.stderr))
        rates = hijack_rates(args.out, runs=args.hijack_runs, cache=args.cache_dir)
        print(table.to_string(index=False))
        print()
        print(rates.to_string(index=False))
        print(f"\nwritten to {args.out}")
        return 0
    if args.command == "bench":
        from bank.lab.bench import bench_json, format_bench, run_training_bench

        figures = run_training_bench(args.epochs, args.rows, args.cache_dir, rounds=args.rounds,
                                     progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                                     batch_size=args.batch_size)
        print(format_bench(figures))
        if args.json:
            args.json.write_text(bench_json(figures) + "\n")
        return 0
    if args.command == "psi-bench":
        from bank.lab.psi_bench import format_result, run_bench, to_json

        result = run_bench(args.size, args.overlap, args.seed, args.workers)
        print(format_result(result))
        if args.json:
            atomic_write_text(args.json, to_json(result) + "\n")
        return 0
    if args.command == "train" and args.print_config:
        print(_train_config(args).model_dump_json(indent=2))
        return 0
    if args.command in ("align", "train", "score", "sessions"):
        if args.url is None:
            raise ConfigError("give --url: the bank service, e.g. https://127.0.0.1:8443")
        if args.tls_dir is None and not args.insecure:
            raise ConfigError("give --tls-dir (the bank's certificate) or --insecure")
        tls = None if args.insecure else TLSFiles.from_dir(args.tls_dir, args.name)
    if args.command == "train":
        config = _train_config(args)
        with BankOperator(args.url, tls, args.name) as operator:
            job = operator.resume_training(args.resume) if args.resume else operator.start_training(config)
            result = _follow(operator, job, "training")
        print(json.dumps({k: result[k] for k in ("session", "run_dir", "test", "best_epoch", "epochs_run")}, indent=2))
        connection = f"--url {args.url} " + ("--insecure" if args.insecure else f"--tls-dir {args.tls_dir}")
        print(f"\nmodel id: {result['session']}\n"
              f"next, score new customers (a CSV of IDs and the bank's own columns):\n"
              f"  python -m bank score {connection} --model {result['session']} "
              f"--data new_customers.csv --out scores.csv")
        return 0
    if args.command == "sessions":
        with BankOperator(args.url, tls, args.name) as operator:
            if args.end:
                operator.end_session(args.end)
                print(f"session {args.end} ended")
            for s in operator.sessions().sessions:
                print(f"{s.session}  {s.state}")
        return 0
    if args.command == "score":
        try:
            csv = args.data.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{args.data}: cannot read ({exc.strerror})") from exc
        with BankOperator(args.url, tls, args.name) as operator:
            job = operator.start_scoring(args.model, csv, args.allow_missing)
            result = _follow(operator, job, "scoring")
            args.out.write_bytes(operator.scores(job.job_id))
        print_scoring(result, args.out)
        return 0
    if args.command == "align":
        request = AlignmentRequest(
            partners=args.partners.split(",") if args.partners else None, min_intersection=args.min_intersection
        )
        with BankOperator(args.url, tls, args.name) as operator:
            result = operator.wait(operator.start_alignment(request), on_progress=lambda j: print(f"... {j.progress}", file=sys.stderr))
        print(json.dumps(result, indent=2))
        return 0
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    training = _training_config(None, epochs=args.epochs, max_steps=args.max_steps, seed=args.seed, audit=args.audit,
                                label_dp_epsilon=args.label_dp_epsilon, gradient_defense=args.gradient_defense,
                                gradient_noise=args.gradient_noise)
    partner_args = [f"--{flag.replace('_', '-')}={value}" for flag, value in (
        ("dp_clip", args.dp_clip), ("dp_noise", args.dp_noise), ("dp_budget", args.dp_budget),
        ("hijack_probe_every", args.hijack_probe_every)) if value is not None]
    summary = run_walkthrough(
        WalkthroughConfig(out=out, partners=args.partners, rows=args.rows, seed=args.seed,
                          cache_dir=args.cache_dir, download=not args.no_download, workers=args.workers,
                          training=training, partner_args=tuple(partner_args))
    )
    print_summary(out, summary)
    return 0


def _train_config(args: argparse.Namespace) -> TrainingConfig:
    """The training settings of ``train``: --config's file, then the flags over it, then the defaults."""
    return _training_config(args.config, task=args.task, positive_label=args.positive_label, epochs=args.epochs,
                            batch_size=args.batch_size, aggregation=args.aggregation, seed=args.seed, audit=args.audit)


def _follow(operator: BankOperator, job: JobStatus, desc: str) -> dict[str, Any]:
    """Wait for a job with a progress bar on stderr."""
    with tqdm(total=1000, desc=desc, bar_format="{l_bar}{bar}| {postfix}") as bar:

        def show(status: JobStatus) -> None:
            bar.n = int(1000 * (status.fraction or 0))
            bar.set_postfix_str(status.progress[:60])

        result = operator.wait(job, on_progress=show)
        bar.n = bar.total  # the job is done: whatever its last progress report said
        bar.refresh()
        return result


def _training_config(path: Path | None, **overrides: object) -> TrainingConfig:
    values: dict[str, object] = {}
    if path is not None:
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: training settings are a JSON object, e.g. {{\"epochs\": 20}}")
    values |= {k: v for k, v in overrides.items() if v is not None}
    where = f" in {path}" if path else ""
    misplaced = [_misplaced(key) for key in values if key not in TrainingConfig.model_fields]
    if misplaced:
        raise ConfigError(f"invalid training settings{where}: {'; '.join(misplaced)}")
    try:
        return TrainingConfig(**values)
    except ValidationError as exc:
        problems = describe_problems(exc, lambda loc: ".".join(str(p) for p in loc))
        raise ConfigError(f"invalid training settings{where}: {problems}") from exc


def _misplaced(key: str) -> str:
    """Say where an unknown top-level key belongs, if it is a setting of a nested model."""
    homes = [name for name, model in (("bank_bottom", BottomConfig), ("top", TopConfig)) if key in model.model_fields]
    if not homes:
        return f"{key!r} is not a training setting (python -m bank train --print-config lists them)"
    example = f'{{"{homes[0]}": {{"{key}": ...}}}}'
    return f"{key!r} is not a top-level setting: it belongs under {' or '.join(map(repr, homes))}, e.g. {example}"


if __name__ == "__main__":
    run_cli(lambda: main(sys.argv[1:]))
