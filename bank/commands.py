"""What each ``python -m bank`` subcommand does, given its parsed flags (``bank/__main__.py`` declares them).

A handler imports what it needs (torch, pandas, the service, the lab) when it runs, so that
``--help`` and a mistyped flag cost what argparse costs, not what training costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from bank.config import TopConfig, TrainingConfig, json_settings
from parties.errors import ConfigError
from parties.flags import as_flags, flag_for, flag_values
from parties.learning.config import BottomConfig, PartnerDefenses

if TYPE_CHECKING:
    from bank.service.operator import BankOperator
    from parties.protocol.control import JobStatus
    from parties.transport.tls import TLSFiles

__all__ = [
    "align", "console", "print_scoring", "print_summary", "score", "serve", "sessions", "train", "training_config",
    "walkthrough",
]


def serve(args: argparse.Namespace) -> int:
    from bank.settings import BankSettings
    from parties.cli import pin_cpus, service_settings, set_torch_threads
    from parties.memory import use_system_allocator

    # Settings and the table are checked before torch and FastAPI are imported (seconds): a refusal is quick.
    settings = service_settings(args, BankSettings)
    assert isinstance(settings, BankSettings)
    pin_cpus(settings.cpus)
    use_system_allocator()
    table = settings.load_table()
    set_torch_threads(settings.torch_threads)
    from alignment.parallel import start_fork_server
    from bank.service.app import create_app
    from parties.transport.server import serve_party

    start_fork_server(settings.workers)  # worker processes, or the Ray driver process
    serve_party(create_app(settings, table), settings)
    return 0


# --- the operator's commands: through the running bank service ---------------------------------------------


def align(args: argparse.Namespace) -> int:
    from bank.service.operator import BankOperator
    from parties.protocol.control import AlignmentRequest

    tls = _operator_tls(args)
    request = AlignmentRequest(
        partners=args.partners.split(",") if args.partners else None, min_intersection=args.min_intersection,
        mode="sequential" if args.sequential else "concurrent", expect_overlap=args.expect_overlap,
        max_overlap=args.max_overlap,
    )
    with BankOperator(args.url, tls, args.name) as operator:
        result = operator.wait(operator.start_alignment(request), on_progress=lambda j: print(f"... {j.progress}", file=sys.stderr))
    print(json.dumps(result, indent=2))
    customers = result.get("bank_customers")
    for name, count in result.get("pairwise", {}).items():
        share = result.get("shares", {}).get(name)
        print(f"{name}: {count:,} of the bank's {customers:,} customers matched ({share:.1%})", file=sys.stderr)
    print(f"aligned with every partner: {result['rows']:,} customers", file=sys.stderr)
    for warning in result.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def train(args: argparse.Namespace) -> int:
    if args.print_config:
        print(_train_config(args).model_dump_json(indent=2))
        return 0
    from bank.service.operator import BankOperator

    tls = _operator_tls(args)
    config = _train_config(args)
    with BankOperator(args.url, tls, args.name) as operator:
        job = operator.resume_training(args.resume) if args.resume else operator.start_training(config)
        result = _follow(operator, job, "training")
    shown = ("session", "run_dir", "test", "best_epoch", "epochs_run", "mlflow")
    print(json.dumps({k: result[k] for k in shown if k in result}, indent=2))
    if "test_note" in result:
        print(f"warning: {result['test_note']}", file=sys.stderr)
    if result.get("positive_label"):
        print(f"scores are the probability that the label is {result['positive_label']!r}", file=sys.stderr)
    for setting, why in result.get("defaults_chosen", {}).items():
        print(f"{setting}: {why}", file=sys.stderr)
    rollbacks = result.get("timings", {}).get("rollbacks", 0)
    if rollbacks:
        print(f"a party restarted during training: every party was rolled back to a common checkpoint {rollbacks} "
              "time(s), and training went on from there (the model is the one an uninterrupted run gives)",
              file=sys.stderr)
    print_score_command(args, result)
    return 0


def print_score_command(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The ``score`` command for the model just trained, as it runs: on the bank's own file, which scores every
    customer it holds; a file of new customers takes the same columns."""
    import shlex

    connection = ["--url", args.url, "--name", args.name]
    connection += ["--insecure"] if args.insecure else ["--tls-dir", str(args.tls_dir)]
    scoring = result["scoring"]
    command = ["python", "-m", "bank", "score", *connection, "--model", result["session"], "--data", scoring["data"],
               "--out", "scores.csv"]
    print(f"\nmodel id: {result['session']}\n"
          f"score customers with it: a CSV, Parquet or Feather file with the columns {', '.join(scoring['columns'])}; the "
          f"bank's own file is one, and scores every customer it holds:\n  {shlex.join(command)}")


def sessions(args: argparse.Namespace) -> int:
    from bank.service.operator import BankOperator

    tls = _operator_tls(args)
    with BankOperator(args.url, tls, args.name) as operator:
        if args.end:
            operator.end_session(args.end)
            print(f"session {args.end} ended")
        for s in operator.sessions().sessions:
            print(f"{s.session}  {s.state}")
    return 0


def score(args: argparse.Namespace) -> int:
    from bank.service.operator import BankOperator

    tls = _operator_tls(args)
    try:
        csv = args.data.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{args.data}: cannot read ({exc.strerror})") from exc
    with BankOperator(args.url, tls, args.name) as operator:
        job = operator.start_scoring(args.model, csv, args.allow_missing, args.accept_drift, args.max_overlap)
        result = _follow(operator, job, "scoring")
        args.out.write_bytes(operator.scores(job.job_id))
    print_scoring(result, args.out)
    return 0


def console(args: argparse.Namespace) -> int:
    from bank.console.app import check_host, serve_console
    from bank.service.operator import BankOperator

    check_host(args.host)  # before anything is asked of the bank service
    tls = _operator_tls(args)
    with BankOperator(args.url, tls, args.name) as operator:
        operator.sessions()  # the bank service answers, to this certificate: else a clear refusal now
        serve_console(operator, args.host, args.port, about=f" for the bank service at {args.url}")
    return 0


def _operator_tls(args: argparse.Namespace) -> TLSFiles | None:
    """The bank's certificate for calling its own service, or ``None`` with ``--insecure``."""
    from parties.transport.tls import TLSFiles

    if args.url is None:
        raise ConfigError("give --url: the bank service, e.g. https://127.0.0.1:8443")
    if args.tls_dir is None and not args.insecure:
        raise ConfigError("give --tls-dir (the bank's certificate) or --insecure")
    return None if args.insecure else TLSFiles.from_dir(args.tls_dir, args.name)


def _follow(operator: BankOperator, job: JobStatus, desc: str) -> dict[str, Any]:
    """Wait for a job with a progress bar on stderr."""
    from tqdm import tqdm

    with tqdm(total=1000, desc=desc, bar_format="{l_bar}{bar}| {postfix}") as bar:
        shown = 0  # events already printed

        def show(status: JobStatus) -> None:
            nonlocal shown
            for event in status.events[shown:]:  # a retry, a rollback: a line of its own, not just the bar's
                bar.write(f"{desc}: {event}", file=sys.stderr)
            shown = len(status.events)
            bar.n = int(1000 * (status.fraction or 0))
            bar.set_postfix_str(status.progress[:110])

        result = operator.wait(job, on_progress=show)
        bar.n = bar.total  # the job is done: whatever its last progress report said
        bar.refresh()
        return result


def _train_config(args: argparse.Namespace) -> TrainingConfig:
    """The training settings of ``train``: --config's file, then the flags over it, then the defaults."""
    given = flag_values(args, TrainingConfig)
    return _training_config(args.config, flags=given)


def _knob_applies(given: dict[str, object], config: TrainingConfig) -> TrainingConfig:
    """Refuse a defense's knob given for another defense: it would change nothing, silently."""
    knobs = (("marvell_power", "power", ("matched", "marvell")),
             ("marvell_persistence", "persistence", ("matched", "marvell")),
             ("gradient_noise", "noise scale", ("isotropic",)))
    for field, knob, defenses in knobs:
        if field in given and config.gradient_defense not in defenses:
            named = " or ".join(defenses)
            raise ConfigError(f"{flag_for(TrainingConfig, (field,))} sets the {knob} of --gradient-defense {named}, "
                              f"not of {config.gradient_defense}: give --gradient-defense {defenses[0]} too, or drop it")
    return config


#: What a file of training settings looks like, for a refusal.
SETTINGS_EXAMPLE = '{"epochs": 20}'


def _training_config(path: Path | None, flags: dict[str, object], **values: object) -> TrainingConfig:
    """--config's file, then ``values`` the command sets, then the flags; a problem names the flag it came from."""
    return training_config(json_settings(path, SETTINGS_EXAMPLE) | values, f" in {path}" if path else "", flags)


def training_config(values: dict[str, object], where: str, flags: dict[str, object],
                    flag_name: Callable[[tuple[Any, ...]], str] | None = None) -> TrainingConfig:
    """Training settings from ``values`` (a settings file's, or the console's box), then the flags over them,
    checked as ``train`` checks them: a problem names the flag it came from (``flag_name``, default the
    command line's), or ``where`` for the rest."""
    name_flag = flag_name or (lambda loc: flag_for(TrainingConfig, loc))
    from parties.settings import describe_problems

    values = values | flags
    misplaced = [_misplaced(key) for key in values if key not in TrainingConfig.model_fields]
    if misplaced:
        raise ConfigError(f"invalid training settings{where}: {'; '.join(misplaced)}")
    try:
        config = TrainingConfig(**values)
    except ValidationError as exc:
        problems = describe_problems(exc, lambda loc: name_flag(loc) if loc and loc[0] in flags
                                     else ".".join(str(p) for p in loc))
        raise ConfigError(f"invalid training settings{where}: {problems}") from exc
    return _knob_applies(flags, config)


def _misplaced(key: str) -> str:
    """Say where an unknown top-level key belongs, if it is a setting of a nested model."""
    homes = [name for name, model in (("bank_bottom", BottomConfig), ("top", TopConfig)) if key in model.model_fields]
    if not homes:
        return f"{key!r} is not a training setting (python -m bank train --print-config lists them)"
    example = f'{{"{homes[0]}": {{"{key}": ...}}}}'
    return f"{key!r} is not a top-level setting: it belongs under {' or '.join(map(repr, homes))}, e.g. {example}"


# --- the lab's commands: simulation and study tooling -------------------------------------------------------


# --- the walkthrough: every party on this machine, end to end -----------------------------------------------


def _partner_defenses(given: dict[str, Any]) -> list[str]:
    """The partners' defenses given to the walkthrough, checked here (a bad value is one line naming the flag,
    not a partner that fails to start) and as the flags each partner's service is started with."""
    from parties.settings import describe_problems

    try:
        PartnerDefenses(**given)
    except ValidationError as exc:
        raise ConfigError(describe_problems(exc, lambda loc: flag_for(PartnerDefenses, loc))) from exc
    return as_flags(PartnerDefenses, given)


def walkthrough(args: argparse.Namespace) -> int:
    from bank.walkthrough import WalkthroughConfig, run_walkthrough

    if args.configuration != "vertical":
        if args.console:
            raise ConfigError(f"--console runs the vertical walkthrough's parties, not --configuration "
                              f"{args.configuration}'s")
        from bank.configurations.commands import configuration_walkthrough

        return configuration_walkthrough(args)
    from bank.configurations.commands import fedavg_every

    for flag, value in (("--branches", args.branches), ("--fedavg-every", fedavg_every(args))):
        if value is not None:
            raise ConfigError(f"{flag} is for the relay and splitfed configurations (--configuration)")

    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    given = flag_values(args, TrainingConfig)
    if args.console and given:
        flags = ", ".join(sorted(flag_for(TrainingConfig, (k,)) for k in given))
        raise ConfigError(f"{flags}: with --console you align and train in the console, whose training form "
                          "takes every setting; drop the flag or the --console")
    training = _training_config(None, given, seed=args.seed)
    partner = flag_values(args, PartnerDefenses)
    partner_args = _partner_defenses(partner)
    if partner.get("monitor", {}).get("watch") and training.gradient_defense != "none":
        # Both are this operator's choice here: refuse what would stop the run with a false alarm.
        raise ConfigError(f"--hijack-monitor cannot watch a bank that adds gradient noise (--gradient-defense "
                          f"{training.gradient_defense}): the rank test reads that noise as a hijack. Protect "
                          "labels with --label-dp-epsilon alongside it (see docs/explanation/privacy.md)")
    config = WalkthroughConfig(out=out, partners=args.partners, rows=args.rows, seed=args.seed,
                               cache_dir=args.cache_dir, download=not args.no_download, workers=args.workers,
                               training=training, partner_args=tuple(partner_args))
    if args.console:
        from bank.walkthrough import walkthrough_console

        walkthrough_console(config, args.console_port)
        return 0
    summary = run_walkthrough(config)
    print_summary(out, summary)
    return 0


# --- what the commands print ------------------------------------------------------------------


def print_summary(out: Path, summary: dict[str, Any]) -> None:
    alignment, test = summary["alignment"], summary["test"]
    print(f"\nRun folder: {out}")
    print(f"{'party':<12}{'customers':>10}")
    for name, n in summary["rows_per_party"].items():
        print(f"{name:<12}{n:>10}")
    print(f"{'aligned':<12}{alignment['rows']:>10}   (alignment {alignment['alignment_id']})")
    print(f"\nTest metrics (best epoch {summary['best_epoch']} of {summary['epochs_run']}):")
    for metric, value in test.items():
        print(f"  {metric:<10}{value:8.4f}")
    if "test_note" in summary:
        print(f"  ({summary['test_note']})")
    for subset, info in summary.get("subsets", {}).items():
        if info["model"] == "joint":
            continue
        print(f"\nCustomers only {subset} hold{'s' if '+' not in subset else ''} ({info['model']} model), held out:")
        for group, figures in info["held_out"].items():
            print(f"  {group:<34}{figures['rows']:>6} customers  {held_out_line(figures)}")
    for name, comm in summary["communication"].items():
        print(f"\n{name}: {comm['round_trips']} round trips, {comm['bytes_per_step'] / 1024:.1f} KiB per training "
              f"round trip (its embeddings and gradients at float32: {comm['minimum_bytes_per_step'] / 1024:.1f} KiB)")
    print("\nModel files (each party wrote its own):")
    for name, path in summary["model_files"].items():
        print(f"  {name:<10}{out / path}")
    print(f"\nwall time: {summary['wall_seconds']} s")


#: The figures a held-out group's line shows, whichever the task has.
_HEADLINE = ("roc_auc", "accuracy", "r2", "rmse")


def held_out_line(figures: dict[str, Any]) -> str:
    """A held-out group's figures in one line: its headline metrics, or why it has none."""
    if "note" in figures:
        return figures["note"]
    parts = [f"{m} {figures[m]:.4f}" for m in _HEADLINE if m in figures]
    if "mean_score" in figures:
        parts.append(f"mean score {figures['mean_score']:.3f} vs observed {figures['observed_rate']:.3f}")
    return "  ".join(parts)


def print_scoring(result: dict[str, Any], out: Path) -> None:
    """A scoring job's result: how many customers were scored, by which model, and what took a fallback."""
    print(f"{result['scored']} of {result['rows']} customers scored; {result['unscorable']} unscorable -> {out}")
    for partner, reason in result.get("refused", {}).items():
        print(f"  {reason}; {partner} counts as holding none of them")
    for partner, share in result.get("max_overlap", {}).items():
        print(f"  {partner} may match at most {share:.0%} of the bank's customers sent to it over the partnership "
              "(its alignment's --expect-overlap or --max-overlap; score --max-overlap sets another)")
    for model, count in result.get("models", {}).items():
        if model != "joint":
            print(f"  {count} scored by the {model} model: customers some partners do not hold (or refused)")
    if len(result.get("scored_without", {})) > 1:
        for partner, count in result["scored_without"].items():
            print(f"    of which {count} without {partner}")
    if result["unscorable"]:
        print(f"  {result['unscorable']} not scored: some partners do not hold them (their status says which); "
              "--allow-missing scores them with the model of the parties that do")
    for warning in result.get("drift_warnings", []):
        print(f"  drift: {warning}")
    for party, columns in result.get("fallbacks", {}).items():
        for column, counts in columns.items():
            took = ", ".join(f"{n} {policy}" for policy, n in counts.items())
            print(f"  {party} column {column!r}: {took} (encoded by the model's declared policy)")
