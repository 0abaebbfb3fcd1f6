"""The notebook's section 8: runs of the other configurations (U-shaped, vanilla, relay, SplitFed) beside a
vertical run, found in the same ``runs/`` folder; their results side by side, their learning curves, and their
audits (``bank.lab.report.config_audit``) where they were run with ``--audit``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from bank.vertical.results import Run, is_configuration_run
from bank.lab.report.config_audit import CONFIGURATIONS, audit_headlines, configuration_audit

__all__ = ["CONFIGURATION_COMMANDS", "configuration_curves", "configuration_runs", "configuration_table",
           "other_configurations"]

#: What makes the runs section 8 shows, from the project folder.
CONFIGURATION_COMMANDS = [f"python -m bank walkthrough --configuration {c} --audit" for c in CONFIGURATIONS]


def configuration_runs(root: Path) -> list[Path]:
    """Run folders of the other configurations in ``root`` or one folder below, by configuration then age."""
    found = {p.parent for pattern in ("*/metrics.json", "*/*/metrics.json") for p in Path(root).glob(pattern)
             if is_configuration_run(p.parent)}

    def key(folder: Path) -> tuple[int, float]:
        configuration = json.loads((folder / "metrics.json").read_text())["configuration"]
        order = CONFIGURATIONS.index(configuration) if configuration in CONFIGURATIONS else len(CONFIGURATIONS)
        return order, (folder / "metrics.json").stat().st_mtime

    return sorted(found, key=key)


def _label(folder: Path, root: Path) -> str:
    return folder.relative_to(root).as_posix() if folder.is_relative_to(root) else str(folder)


def configuration_table(runs: list[Path], root: Path) -> pd.DataFrame:
    """Per run: its configuration, its test figure on the task's objective (ROC-AUC for a binary task), best epoch,
    mean epoch seconds, and what crossed the wire."""
    rows = []
    for folder in runs:
        m = json.loads((folder / "metrics.json").read_text())
        traffic = m.get("communication", {}).values()
        objective = _objective(m)
        rows.append({
            "configuration": m["configuration"], "run": _label(folder, root),
            f"test_{objective}": m.get("test", {}).get(objective), "best_epoch": m.get("best_epoch"),
            "epochs_run": m.get("epochs_run"), "mean_epoch_seconds": m.get("mean_epoch_seconds"),
            "round_trips": sum(c.get("round_trips", 0) for c in traffic),
            "bytes": sum(c.get("bytes_sent", 0) + c.get("bytes_received", 0) for c in traffic),
            "audited": (folder / "audit").is_dir(),
        })
    return pd.DataFrame(rows)


def _objective(metrics: dict) -> str:
    """The metric a run chose its best epoch on (a run written before it was recorded: its task's, as its test
    metrics show it: ROC-AUC, log-loss or MSE)."""
    test = metrics.get("test", {})
    return str(metrics.get("objective") or next((m for m in ("roc_auc", "log_loss", "mse") if m in test), "roc_auc"))


def configuration_curves(runs: list[Path], root: Path) -> Figure:
    """Training loss and the validation objective (ROC-AUC for a binary task) per epoch, one line per run (its ``history.csv``)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for folder in runs:
        history = pd.read_csv(folder / "history.csv")
        metrics = json.loads((folder / "metrics.json").read_text())
        configuration = metrics["configuration"]
        name = _label(folder, root)
        label = configuration if name == configuration else f"{configuration} ({name})"
        ax1.plot(history["epoch"], history["train_loss"], marker="o", label=label)
        metric = f"val_{_objective(metrics)}"
        ax2.plot(history["epoch"], history[metric], marker="o", label=label)
    ax1.set(title="training loss", xlabel="epoch", ylabel="loss")
    ax2.set(title=f"validation {metric.removeprefix('val_')}", xlabel="epoch")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _audit(folder: Path, seed: int) -> pd.DataFrame:
    saved = folder / "audit" / "leakage.csv"
    if saved.exists():  # written by the command line's --audit, or by an earlier report
        return pd.read_csv(saved, dtype={"epoch": "string"})
    return configuration_audit(folder, seed=seed)


def other_configurations(run: Run, *, seed: int = 0) -> dict[str, Any] | None:
    """The runs of the other configurations beside ``run`` (in its parent folder), or None if there are none.

    Their table, their learning curves and their audits (the long table and one headline per observer and
    target), saved under ``<run>/analysis/`` as ``configurations.csv``, ``configuration_curves.png``,
    ``configuration_audit.csv`` and ``configuration_audit_headlines.csv``.
    """
    root = run.path.resolve().parent
    runs = configuration_runs(root)
    if not runs:
        return None
    out = run.path / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    table = configuration_table(runs, root)
    table.to_csv(out / "configurations.csv", index=False)
    fig = configuration_curves(runs, root)
    fig.savefig(out / "configuration_curves.png", dpi=110)
    plt.close(fig)
    audited = [folder for folder in runs if (folder / "audit").is_dir()]
    audits = [_audit(folder, seed).assign(run=_label(folder, root)) for folder in audited]
    audit = pd.concat(audits, ignore_index=True) if audits else pd.DataFrame()
    headlines = (pd.concat([audit_headlines(a).assign(run=a["run"].iloc[0]) for a in audits if len(a)],
                           ignore_index=True) if audits else pd.DataFrame())
    audit.to_csv(out / "configuration_audit.csv", index=False)
    headlines.to_csv(out / "configuration_audit_headlines.csv", index=False)
    return {"table": table, "curves": out / "configuration_curves.png", "audit": audit, "headlines": headlines}
