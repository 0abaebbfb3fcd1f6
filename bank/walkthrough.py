"""The bank-marketing walkthrough: data, certificates, separate services, PSI, training, results on disk."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from data.uci import locate_bank_full
from parties.protocol.control import JobStatus
from parties.storage.files import atomic_write_text
from parties.storage.layout import model_folder
from parties.transport.pki import write_dev_pki
from parties.transport.process import ServiceProcess
from parties.transport.tls import TLSFiles

__all__ = ["WalkthroughConfig", "run_walkthrough"]

logger = logging.getLogger(__name__)

#: The bank's run files the walkthrough also puts at the top of its run folder.
RUN_FILES = ("config.json", "metrics.json", "history.csv", "test_predictions.csv", "split.csv", "calibration.csv",
             "unaligned_split.csv")


@dataclass(frozen=True)
class WalkthroughConfig:
    out: Path
    partners: int = 1
    rows: int | None = None
    seed: int = 0
    cache_dir: Path | None = None
    download: bool = True
    workers: int | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    partner_args: tuple[str, ...] = ()  # extra flags for every partner (its own defenses)


def _start_services(config: WalkthroughConfig, paths: dict[str, Path]) -> tuple[list[ServiceProcess], str]:
    out = config.out
    common = ["--tls-dir", str(out / "certs")]
    if config.workers:
        common += ["--workers", str(config.workers)]
    partners = [n for n in paths if n != "bank"]
    # The partnership agreement: each side brings at most its own set to a PSI session (docs/explanation/security.md).
    sizes = {name: _rows(path) for name, path in paths.items()}
    services = []
    for i, name in enumerate(partners):
        # Partner i's bottom model starts from seed i: the first partner's is `partner serve`'s default, so
        # the by-hand flow (docs/how-to/by-hand.md) trains the walkthrough's model bit for bit.
        args = ["--name", name, "--data", str(paths[name]), "--state-dir", str(out / name), "--seed", str(i),
                "--peer-max-ids", f"bank={sizes['bank']}", *config.partner_args]
        services.append(ServiceProcess("partner", args + common, out / name / "ready.json", out / "logs" / f"{name}.log"))
    try:
        urls = {name: svc.wait_ready() for name, svc in zip(partners, services)}
        bank_args = ["--name", "bank", "--data", str(paths["bank"]), "--label", "y", "--state-dir", str(out / "bank"),
                     *[f"--partner={n}={u}" for n, u in urls.items()],
                     *[f"--peer-max-ids={n}={sizes[n]}" for n in partners], *common]
        bank = ServiceProcess("bank", bank_args, out / "bank" / "ready.json", out / "logs" / "bank.log")
        services.append(bank)
        return services, bank.wait_ready()
    except BaseException:
        for svc in services:
            svc.stop()
        raise


def _rows(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f) - 1  # the header aside


def _inside(out: Path, path: Path) -> str:
    """``path`` relative to the run folder ``out`` (absolute if it lies elsewhere)."""
    try:
        return path.resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


def _prepare(config: WalkthroughConfig) -> dict[str, Path]:
    """The per-party files and the certificates, under the run folder; the parties' files by name."""
    out = config.out
    paths = prepare_bank_marketing(
        out / "data", n_partners=config.partners, seed=config.seed, rows=config.rows,
        cache=config.cache_dir, download=config.download,
    )
    write_dev_pki(out / "certs", {"bank": "bank", **{n: "partner" for n in paths if n != "bank"}})
    return paths


def walkthrough_console(config: WalkthroughConfig, port: int) -> None:
    """The walkthrough's parties, each its own service, and the operator's console over the bank's: the
    operator aligns, trains, inspects and scores in the browser. Until Ctrl-C, which stops them all."""
    from bank.console.app import serve_console

    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    locate_bank_full(config.cache_dir, download=config.download)
    print("preparing the parties' files and certificates; starting their services", flush=True)
    paths = _prepare(config)
    services, bank_url = _start_services(config, paths)
    try:
        with BankOperator(bank_url, TLSFiles.from_dir(out / "certs", "bank")) as operator:
            print(f"the bank service is at {bank_url}; its state, runs and models are under {out / 'bank'}; "
                  f"a file to score: {paths['bank']} (the bank's own, every customer it holds)", flush=True)
            serve_console(operator, "127.0.0.1", port, about=" for the walkthrough's bank")
    finally:
        for svc in reversed(services):
            svc.stop()


def run_walkthrough(config: WalkthroughConfig) -> dict[str, Any]:
    """Run every step; return (and write to ``OUT/summary.json``) what happened."""
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    locate_bank_full(config.cache_dir, download=config.download)  # a missing file is one line, before any bar
    with tqdm(total=4, desc="walkthrough", unit="step", position=0) as steps:
        steps.set_postfix_str("preparing per-party files and certificates")
        paths = _prepare(config)
        steps.update(2)
        steps.set_postfix_str("starting the services")
        services, bank_url = _start_services(config, paths)
        steps.update()
        try:
            with BankOperator(bank_url, TLSFiles.from_dir(out / "certs", "bank")) as operator:
                steps.set_postfix_str("aligning customers (PSI)")
                alignment = operator.wait(
                    operator.start_alignment(),
                    on_progress=lambda job: steps.set_postfix_str(f"PSI: {job.progress}"[:60]),
                )
                steps.set_postfix_str("training")
                with tqdm(total=1000, desc="training", position=1, leave=False, bar_format="{l_bar}{bar}| {postfix}") as bar:

                    def show(job: JobStatus) -> None:
                        bar.n = int(1000 * (job.fraction or 0))
                        bar.set_postfix_str(job.progress[:60])

                    result = operator.wait(operator.start_training(config.training), on_progress=show)
                steps.update()
        finally:
            for svc in reversed(services):
                svc.stop()

    run_dir = Path(result["run_dir"])
    for name in RUN_FILES:
        if (run_dir / name).exists():  # calibration.csv: binary tasks only
            shutil.copy(run_dir / name, out / name)
    summary = {
        "rows_per_party": {n: _rows(p) for n, p in paths.items()},
        "alignment": alignment,
        "test": result["test"],
        **({"test_note": result["test_note"]} if "test_note" in result else {}),
        "subsets": result["subsets"],
        "best_epoch": result["best_epoch"],
        "epochs_run": result["epochs_run"],
        "communication": result["communication"],
        # Paths inside the run folder are stored relative to it, so the folder can move.
        "bank_run_dir": _inside(out, run_dir),
        "model_files": {
            "bank": _inside(out, run_dir / "model"),
            **{n: _inside(out, model_folder(out / n, "bank", result["session"])) for n in paths if n != "bank"},
        },
        "wall_seconds": round(time.perf_counter() - started, 2),
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
