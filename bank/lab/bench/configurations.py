"""Horizontal split learning against centralised training on bank-full, side by side in one run.

One branch partition (3 branches by job, seeded), then: the relay and SplitFed as walkthroughs (every branch
a separate service over mutual TLS on 127.0.0.1), and centralised training of the same model on all the
bank's rows in this process. Printed: test ROC-AUC, its gap to centralised (the issue's bar: within 0.005),
and the mean epoch time (training steps only, evaluation aside) as a ratio to centralised's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bank.configurations.runs import configuration_walkthrough
from bank.lab.references.twins import reference_for_run
from bank.configurations.split_run import ConfigurationSettings
from parties.storage.files import atomic_write_text

__all__ = ["format_config_bench", "run_config_bench"]

#: The bar of issue 20: SplitFed and the relay within this much test ROC-AUC of centralised training.
AUC_BAR = 0.005


def run_config_bench(settings: dict[str, ConfigurationSettings], out: Path | None = None, *, rows: int | None = None,
                     cache_dir: Path | None = None) -> pd.DataFrame:
    """``settings``: per horizontal configuration (relay, splitfed), its settings. One row per model."""
    with tempfile.TemporaryDirectory(prefix="config-bench-") as scratch:
        base = Path(out) if out is not None else Path(scratch)
        rows_out: list[dict[str, Any]] = []
        central: dict[str, Any] | None = None
        for name, s in settings.items():
            run = base / name
            configuration_walkthrough(s, run, rows=rows, cache_dir=cache_dir, download=True)
            summary = reference_for_run(run, s)
            ref = summary["reference"]
            central = central or ref["centralised"]
            rows_out.append({"model": name, "roc_auc": summary["test"]["roc_auc"], "best_epoch": summary["best_epoch"],
                             "epochs_run": summary["epochs_run"], "epoch_seconds": summary["mean_epoch_seconds"],
                             "equals_its_twin": ref["twin"]["equal"],
                             "fedavg_every": s.fedavg_every if name == "splitfed" else None})
        assert central is not None
        rows_out.insert(0, {"model": "centralised", "roc_auc": central["test"]["roc_auc"], "best_epoch": central["best_epoch"],
                            "epochs_run": None, "epoch_seconds": central["mean_epoch_seconds"],
                            "equals_its_twin": None, "fedavg_every": None})
        frame = pd.DataFrame(rows_out)
        frame["auc_gap"] = frame["roc_auc"] - central["test"]["roc_auc"]
        frame["within_bar"] = np.abs(frame["auc_gap"]) <= AUC_BAR
        frame["epoch_time_ratio"] = frame["epoch_seconds"] / central["mean_epoch_seconds"]
        if out is not None:
            atomic_write_text(Path(out) / "config_bench.csv", frame.to_csv(index=False))
            atomic_write_text(Path(out) / "config_bench.json",
                              json.dumps(frame.to_dict(orient="records"), indent=2, default=str) + "\n")
        return frame


def format_config_bench(frame: pd.DataFrame) -> str:
    lines = [f"{'model':<12}{'test AUC':>9}{'- central':>10}{'bar':>5}{'epochs':>7}{'epoch s':>9}{'x central':>10}"
             f"{'= twin':>7}"]
    for r in frame.itertuples():
        bar = "ok" if r.within_bar else "MISS"
        epochs = "" if pd.isna(r.epochs_run) else f"{int(r.epochs_run)}"
        twin = "" if r.equals_its_twin is None or pd.isna(r.equals_its_twin) else ("yes" if r.equals_its_twin else "NO")
        lines.append(f"{r.model:<12}{r.roc_auc:>9.4f}{r.auc_gap:>+10.4f}{bar:>5}{epochs:>7}{r.epoch_seconds:>9.3f}"
                     f"{r.epoch_time_ratio:>9.1f}x{twin:>7}")
    lines.append(f"bar: within {AUC_BAR} of centralised test ROC-AUC; epoch time = training steps only "
                 "(the relay and SplitFed over mutual TLS to separate branch services on this machine)")
    return "\n".join(lines)
