"""What the ``python -m bank`` commands of the configurations beside vertical do: ``train-owner``,
``train-branches`` and ``walkthrough --configuration``, and what they print (``bank/__main__.py`` declares
their flags, with ``add_configuration_commands``).

Like ``bank/commands.py``, a handler imports torch, pandas, the services and the lab only when it runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from bank.config import TrainingConfig, json_settings
from parties.errors import ConfigError

if TYPE_CHECKING:
    from parties.transport.tls import TLSFiles

__all__ = ["add_configuration_commands", "configuration_settings", "configuration_walkthrough",
           "print_configuration_summary", "train_branches", "train_owner"]


#: Walkthrough flags that only the vertical configuration has (PSI, partners and their defenses, the wire).
#: The walkthrough's training settings the configurations take too; the rest of its flags are the vertical flow's.
SHARED_TRAINING = ("epochs", "audit")


def configuration_settings(configuration: str, path: Path | None, **overrides: object) -> Any:
    """``ConfigurationSettings`` from an optional JSON file and flags (``None``: not given): ``fedavg_every`` and
    ``audit`` are the configuration's, every other flag a training setting (``TrainingConfig``)."""
    from bank.configurations.split_run import ConfigurationSettings
    from parties.settings import describe_problems

    values = json_settings(path, '{"training": {"epochs": 20}}')
    named = values.pop("configuration", configuration)  # a run's own config.json names it
    if named != configuration:
        raise ConfigError(f"{path} is a {named} configuration's settings; this command runs {configuration}")
    training = dict(values.pop("training", {}) or {})
    if (every := overrides.pop("fedavg_every", None)) is not None:
        values["fedavg_every"] = every
    if overrides.pop("audit", None):
        values["audit"] = True
    training |= {key: value for key, value in overrides.items() if value is not None}  # every training flag given
    try:
        return ConfigurationSettings(configuration=configuration, training=TrainingConfig(**training), **values)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        problems = describe_problems(exc, lambda loc: ".".join(str(p) for p in loc))
        raise ConfigError(f"invalid settings{where}: {problems}") from exc


def _training_flags(args: argparse.Namespace) -> dict[str, Any]:
    from parties.flags import flag_values

    return flag_values(args, TrainingConfig)


def _configuration_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration's own settings given as flags: ``--fedavg-every``, ``--audit``."""
    from bank.configurations.split_run import ConfigurationSettings
    from parties.flags import flag_values

    return flag_values(args, ConfigurationSettings)


def fedavg_every(args: argparse.Namespace) -> int | None:
    """``--fedavg-every`` if given (``None``: not given)."""
    return _configuration_flags(args).get("fedavg_every")


def _tls_or_insecure(args: argparse.Namespace) -> TLSFiles | None:
    from parties.transport.tls import TLSFiles

    if args.insecure:
        if args.tls_dir is not None:
            raise ConfigError("--insecure turns TLS off and --tls-dir turns it on: give one or the other")
        return None
    if args.tls_dir is None:
        raise ConfigError("TLS is required: give --tls-dir (or --insecure for services on this machine)")
    files = TLSFiles.from_dir(args.tls_dir, args.name)
    files.check()
    return files


def _one_url(item: str, flag: str) -> tuple[str, str]:
    name, sep, url = item.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{flag} takes NAME=URL (an http(s) URL), got {item!r}")
    return name, url


def train_owner(args: argparse.Namespace) -> int:
    from bank.configurations.runs import owner_run

    settings = configuration_settings(args.configuration, args.config, **_training_flags(args),
                                       **_configuration_flags(args))
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    metrics = owner_run(settings, args.data, label=args.label, compute=_one_url(args.compute, "--compute"),
                        tls=_tls_or_insecure(args), bank_name=args.name, out=out)
    print_configuration_summary(out, metrics)
    _audit_if_asked(settings, out)
    return 0


def train_branches(args: argparse.Namespace) -> int:
    from bank.configurations.runs import horizontal_run

    if not args.branch:
        raise ConfigError("give every branch: --branch NAME=URL, once per branch")
    branches = dict(_one_url(b, "--branch") for b in args.branch)
    settings = configuration_settings(args.configuration, args.config, **_training_flags(args),
                                       **_configuration_flags(args))
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    metrics = horizontal_run(settings, args.labels, branches=branches, tls=_tls_or_insecure(args),
                             bank_name=args.name, out=out)
    print_configuration_summary(out, metrics)
    _audit_if_asked(settings, out)
    return 0


def _audit_if_asked(settings: Any, out: Path) -> None:
    if settings.audit:
        from bank.lab.report.config_audit import configuration_audit, print_configuration_audit

        print_configuration_audit(configuration_audit(out))


def configuration_walkthrough(args: argparse.Namespace) -> int:
    from bank.configurations.runs import configuration_walkthrough as run_walkthrough

    from parties.flags import as_flags, flag_for, flag_values
    from parties.learning.config import PartnerDefenses

    training = flag_values(args, TrainingConfig)
    given = [flag_for(TrainingConfig, (k,)) for k in training if k not in SHARED_TRAINING]
    given += [flag.partition("=")[0] for flag in as_flags(PartnerDefenses, flag_values(args, PartnerDefenses))]
    if args.workers is not None:
        given.insert(0, "--workers")
    if args.partners != 1:
        given.insert(0, "--partners")
    if given:
        raise ConfigError(f"{', '.join(given)}: vertical only, not in the {args.configuration} configuration "
                          "(docs/how-to/configurations.md)")
    every = fedavg_every(args)
    if args.configuration not in ("relay", "splitfed") and (args.branches is not None or every is not None):
        raise ConfigError(f"--branches and --fedavg-every are for relay and splitfed, not {args.configuration}")
    if args.configuration == "relay" and every is not None:
        raise ConfigError("--fedavg-every is for splitfed: the relay hands one model on, it averages nothing")
    settings = configuration_settings(args.configuration, None, epochs=training.get("epochs"), seed=args.seed,
                                       audit=training.get("audit"), fedavg_every=every)
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    summary = run_walkthrough(settings, out, rows=args.rows, seed=args.seed, cache_dir=args.cache_dir,
                                        download=not args.no_download,
                                        branches=args.branches if args.branches is not None else 3)
    if not args.no_reference:
        from bank.lab.references.twins import reference_for_run

        summary = reference_for_run(out, settings)
    print_configuration_summary(out, summary)
    _audit_if_asked(settings, out)
    return 0


def print_configuration_summary(out: Path, summary: dict[str, Any]) -> None:
    """What a U-shaped, vanilla or horizontal run did: who held what, test figures, traffic, the references."""
    print(f"\nRun folder: {out}")
    print(f"Configuration: {summary['configuration']}")
    for name, holds in summary.get("parties", {}).items():
        print(f"  {name:<10}{holds}")
    if "rows_per_party" in summary:
        print(f"{'party':<12}{'customers':>10}")
        for name, n in summary["rows_per_party"].items():
            print(f"{name:<12}{n:>10}")
    print(f"\nTest metrics (best epoch {summary['best_epoch']} of {summary['epochs_run']}):")
    for metric, value in summary["test"].items():
        print(f"  {metric:<10}{value:8.4f}")
    metric = next(iter(summary["test"]))  # the task's first metric: roc_auc, accuracy or mse
    for branch, figures in summary.get("per_branch", {}).items():
        if figures:
            print(f"  {branch:<10}{metric} {figures[metric]:.4f} on its own test customers")
    for name, comm in summary["communication"].items():
        print(f"\n{name}: {comm['round_trips']} round trips for {comm['training_steps']} training steps, "
              f"{comm['bytes_sent'] / 2**20:.1f} MiB sent, {comm['bytes_received'] / 2**20:.1f} MiB received"
              + (f", {comm['retries']} retried" if comm["retries"] else ""))
    if summary.get("resumes"):
        print(f"the compute party restarted: resumed {summary['resumes']} time(s) from its last checkpoint")
    print(f"mean epoch time: {summary['mean_epoch_seconds']:.2f} s")
    if summary.get("model_files"):
        print("the bank's model files: " + ", ".join(str(out / f) for f in summary["model_files"].values()))
    reference = summary.get("reference")
    if reference:
        twin = reference["twin"]
        same = "yes, bit for bit" if twin["equal"] else f"NO (largest score difference {twin['max_difference']:.3g})"
        print(f"\nsingle-process twin: test {metric} {twin['test'][metric]:.4f}; the split run equals it: {same}")
        if "centralised" in reference:
            c = reference["centralised"]["test"]
            print(f"centralised training on all the bank's rows: test {metric} {c[metric]:.4f} "
                  f"(split - centralised: {summary['test'][metric] - c[metric]:+.4f})")
    if "wall_seconds" in summary:
        print(f"\nwall time: {summary['wall_seconds']} s")


def add_configuration_commands(sub: argparse._SubParsersAction) -> None:
    """``train-owner`` and ``train-branches``: the bank's side of the by-hand flows (docs/how-to/configurations.md)."""
    from bank.configurations.split_run import ConfigurationSettings
    from parties.cli import command
    from parties.flags import add_flags

    for name, summary, handler in (
        ("train-owner", "U-shaped or vanilla: train on the bank's own file with a running compute party "
         "(python -m partner compute)", train_owner),
        ("train-branches", "horizontal relay or SplitFed: train on the bank's labels with its running branches "
         "(python -m partner branch)", train_branches),
    ):
        o = command(sub, name, summary, handler=handler)
        owner = name == "train-owner"
        o.add_argument("--configuration", required=True,
                       choices=["u-shaped", "vanilla"] if owner else ["relay", "splitfed"],
                       help="u-shaped: the compute party holds a trunk, the bank its head and labels; vanilla: the "
                            "compute party holds the rest of the model and receives the labels" if owner else
                            "relay: branches train in turn, each from the state the previous left; splitfed: all at "
                            "once, their bottoms averaged (FedAvg, weighted by rows)")
        if owner:
            o.add_argument("--data", type=Path, required=True, help="the bank's file: IDs, columns, the label")
            o.add_argument("--label", default=None, help="the label column (default: the schema file's, else y)")
            o.add_argument("--compute", required=True, metavar="NAME=URL", help="the compute party")
        else:
            o.add_argument("--labels", type=Path, required=True,
                           help="the bank's labels: customer_id, branch, y, each branch's rows in its file's order")
            o.add_argument("--branch", action="append", default=[], metavar="NAME=URL", help="repeat per branch")
            add_flags(o, ConfigurationSettings, only=("fedavg_every",))
        o.add_argument("--name", default="bank", help="this bank's name, its certificate's CN (default %(default)s)")
        o.add_argument("--tls-dir", type=Path, default=None, help="folder with ca.pem, NAME.pem, NAME.key")
        o.add_argument("--insecure", action="store_true", help="plain HTTP to services on this machine (development)")
        o.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<timestamp>)")
        o.add_argument("--config", type=Path, default=None,
                       help="a JSON file of settings (bank/configurations/split_run.py: ConfigurationSettings, without "
                            "'configuration'); flags given here override it")
        add_flags(o, TrainingConfig, only=("task", "positive_label", "epochs", "patience", "seed"))
        add_flags(o, ConfigurationSettings, only=("audit",))
        o.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
