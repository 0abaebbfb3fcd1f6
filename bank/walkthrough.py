"""The bank-marketing walkthrough: data, certificates, separate services, alignment, results on disk."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from bank.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.files import atomic_write_text
from parties.process import ServiceProcess
from parties.tls import TLSFiles, write_dev_pki

__all__ = ["WalkthroughConfig", "run_walkthrough"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WalkthroughConfig:
    out: Path
    partners: int = 1
    rows: int | None = None
    seed: int = 0
    cache_dir: Path | None = None
    download: bool = True
    workers: int | None = None


def run_walkthrough(config: WalkthroughConfig) -> dict[str, object]:
    """Run every step; return (and write to ``OUT/summary.json``) what happened."""
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=5, desc="walkthrough", unit="step")
    started = time.perf_counter()

    steps.set_postfix_str("preparing per-party files")
    paths = prepare_bank_marketing(
        out / "data", n_partners=config.partners, seed=config.seed, rows=config.rows,
        cache=config.cache_dir, download=config.download,
    )
    partners = [n for n in paths if n != "bank"]
    steps.update()

    steps.set_postfix_str("creating certificates")
    write_dev_pki(out / "certs", {"bank": "bank", **{n: "partner" for n in partners}})
    steps.update()

    services: list[ServiceProcess] = []
    try:
        steps.set_postfix_str("starting services")
        common = ["--tls-dir", str(out / "certs")]
        if config.workers:
            common += ["--workers", str(config.workers)]
        urls = {}
        for name in partners:
            svc = ServiceProcess(
                "partner",
                ["--name", name, "--data", str(paths[name]), "--state-dir", str(out / "state" / name), *common],
                out / "state" / f"{name}.ready", out / "logs" / f"{name}.log",
            )
            services.append(svc)
        for svc, name in zip(services, partners):
            urls[name] = svc.wait_ready()
        bank = ServiceProcess(
            "bank",
            ["--name", "bank", "--data", str(paths["bank"]), "--label", "y", "--state-dir", str(out / "state" / "bank"),
             *[f"--partner={n}={u}" for n, u in urls.items()], *common],
            out / "state" / "bank.ready", out / "logs" / "bank.log",
        )
        services.append(bank)
        bank_url = bank.wait_ready()
        steps.update()

        steps.set_postfix_str("aligning customers (PSI)")
        with BankOperator(bank_url, TLSFiles.from_dir(out / "certs", "bank")) as operator:
            job = operator.start_alignment()
            alignment = operator.wait(job, on_progress=lambda msg: steps.set_postfix_str(f"PSI: {msg}"[:60]))
        steps.update()
    finally:
        for svc in reversed(services):
            svc.stop()

    rows = {n: sum(1 for _ in open(p)) - 1 for n, p in paths.items()}
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(config).items()},
        "rows_per_party": rows,
        "alignment": alignment,
        "wall_seconds": round(time.perf_counter() - started, 2),
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    steps.update()
    steps.close()
    return summary
