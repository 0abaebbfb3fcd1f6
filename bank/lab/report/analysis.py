"""Analyse a training run from its files: curves, communication, time per party, and the report.

Everything here reads the run folder the walkthrough (or ``python -m bank
train``) wrote, so a notebook or a script can use it without the services.
``write_report`` computes every table and figure, saves them under
``<run>/analysis/`` (CSV and PNG) and returns them for display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files, not windows: the report runs headless too

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from sklearn import metrics as skm

from parties.errors import DataError
from bank.vertical.results import Run, is_configuration_run, latest_run, load_run, resolve_run

__all__ = [
    "Run",
    "communication_table",
    "cut_study",
    "latest_run",
    "leakage_figure",
    "learning_curves",
    "load_run",
    "party_times",
    "privacy_frontiers",
    "privacy_study",
    "hijack_study",
    "is_configuration_run",
    "reliability_figure",
    "resolve_run",
    "roc_pr_curves",
    "subset_table",
    "write_report",
]


def learning_curves(run: Run) -> Figure:
    """Training loss and validation ROC-AUC per epoch, the best epoch marked."""
    h = run.history
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(h["epoch"], h["train_loss"], marker="o")
    ax1.set(title="training loss", xlabel="epoch", ylabel="loss")
    metric = "val_roc_auc" if "val_roc_auc" in h else [c for c in h if c.startswith("val_")][0]
    ax2.plot(h["epoch"], h[metric], marker="o", color="tab:green")
    ax2.axvline(run.metrics["best_epoch"], color="grey", linestyle="--", label="best epoch")
    ax2.set(title=f"validation {metric[4:]}", xlabel="epoch")
    ax2.legend()
    fig.tight_layout()
    return fig


def test_rows_figure(run: Run) -> Figure:
    """The test rows at a glance, as the task reads them: ROC and precision-recall curves (binary), predicted
    against observed (regression), the confusion matrix (multiclass)."""
    task = run.metrics.get("task", "binary")
    if task == "binary":
        return roc_pr_curves(run)
    if task == "regression":
        y, s = run.predictions["target"].to_numpy(), run.predictions["score"].to_numpy()
        fig, ax = plt.subplots(figsize=(5, 4.5))
        ax.scatter(y, s, s=8, alpha=0.5)
        low, high = float(min(y.min(), s.min())), float(max(y.max(), s.max()))
        ax.plot([low, high], [low, high], color="grey", linestyle=":")
        ax.set(title=f"test rows: R² {run.metrics['test']['r2']:.3f}", xlabel="observed", ylabel="predicted")
        fig.tight_layout()
        return fig
    scores = run.predictions[[c for c in run.predictions if c.startswith("score_")]]
    classes = [c.removeprefix("score_") for c in scores.columns]
    matrix = skm.confusion_matrix(run.predictions["target"].to_numpy(), scores.to_numpy().argmax(axis=1),
                                  labels=list(range(len(classes))))
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.imshow(matrix, cmap="Blues")
    for (i, j), count in np.ndenumerate(matrix):
        ax.text(j, i, str(count), ha="center", va="center")
    ax.set(title=f"test rows: accuracy {run.metrics['test']['accuracy']:.3f}", xlabel="predicted", ylabel="observed",
           xticks=range(len(classes)), yticks=range(len(classes)), xticklabels=classes, yticklabels=classes)
    fig.tight_layout()
    return fig


def roc_pr_curves(run: Run) -> Figure:
    """ROC and precision-recall curves on the held-out test rows."""
    y, s = run.predictions["target"].to_numpy(), run.predictions["score"].to_numpy()
    fpr, tpr, _ = skm.roc_curve(y, s)
    precision, recall, _ = skm.precision_recall_curve(y, s)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(fpr, tpr, label=f"split model (AUC {skm.roc_auc_score(y, s):.3f})")
    ax1.plot([0, 1], [0, 1], color="grey", linestyle=":")
    ax1.set(title="ROC, test rows", xlabel="false positive rate", ylabel="true positive rate")
    ax1.legend(loc="lower right")
    ax2.plot(recall, precision, label=f"split model (AP {skm.average_precision_score(y, s):.3f})")
    ax2.axhline(y.mean(), color="grey", linestyle=":", label=f"base rate {y.mean():.3f}")
    ax2.set(title="precision-recall, test rows", xlabel="recall", ylabel="precision")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    return fig


def subset_table(run: Run) -> pd.DataFrame:
    """Per subset of parties scoring can meet and group of held-out customers: its model and how it did."""
    rows = []
    for subset, info in run.metrics.get("subsets", {}).items():
        for group, figures in info["held_out"].items():
            shown = ("roc_auc", "pr_auc", "brier", "mean_score", "observed_rate", "accuracy", "log_loss", "r2", "rmse")
            rows.append({"parties": subset, "model": info["model"], "held_out": group, "rows": figures["rows"],
                         **{k: figures.get(k, np.nan) for k in shown}, "note": figures.get("note", "")})
    return pd.DataFrame(rows)


def reliability_figure(run: Run) -> Figure | None:
    """Mean score against observed rate in bins of held-out customers, per scoring path (binary tasks)."""
    path = run.path / "calibration.csv"
    if not path.exists():
        return None
    bins = pd.read_csv(path)
    fig, ax = plt.subplots(figsize=(6.4, 5))
    for (subset, group), table in bins.groupby(["subset", "held_out"], sort=False):
        ax.plot(table["mean_score"], table["observed_rate"], marker="o", label=f"{subset}: {group}")
    top = float(max(bins["mean_score"].max(), bins["observed_rate"].max()))
    ax.plot([0, top], [0, top], color="grey", linestyle=":", label="perfectly calibrated")
    ax.set(title="reliability: held-out customers in 10 bins by score", xlabel="mean score",
           ylabel="observed rate")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def communication_table(run: Run) -> pd.DataFrame:
    """Per partner and epoch: bytes and round trips, next to the theoretical minimum."""
    epochs = max(len(run.history), 1)
    rows = []
    for name, c in run.metrics["communication"].items():
        rows.append({
            "partner": name,
            "round_trips_per_epoch": c["round_trips"] / epochs,
            "MB_per_epoch": c["bytes_total"] / epochs / 1e6,
            "minimum_MB_per_epoch": c["minimum_bytes_total"] / epochs / 1e6,
            "overhead_ratio": c["overhead_ratio"],
        })
    return pd.DataFrame(rows)


def party_times(run: Run) -> pd.DataFrame:
    """Seconds the bank spent waiting on each party (its own bottom included), and per epoch."""
    timings = run.metrics["timings"]
    epochs = max(len(run.history), 1)
    rows = [
        {"party": key.removeprefix("wait_seconds_"), "seconds": value, "seconds_per_epoch": value / epochs}
        for key, value in timings.items()
        if key.startswith("wait_seconds_")
    ]
    rows.append({"party": "whole run", "seconds": timings["total_seconds"],
                 "seconds_per_epoch": timings["total_seconds"] / epochs})
    return pd.DataFrame(rows)


def _bar(table: pd.DataFrame, x: str, y: str, title: str) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.barh(table[x], table[y], color=["tab:blue" if str(v).startswith("split") else "tab:grey" for v in table[x]])
    for i, v in enumerate(table[y]):
        ax.text(v, i, f" {v:.3f}", va="center")
    ax.set(title=title, xlabel=y, xlim=(min(0.5, float(np.nanmin(table[y])) - 0.05), 1.0))
    fig.tight_layout()
    return fig


def leakage_figure(leakage: pd.DataFrame) -> Figure:
    """Leak AUC per epoch for each attack (dashed: the cross-epoch attack on row-averaged gradients)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for partner, table in leakage.groupby("partner"):
        per_epoch = table[table["epoch"].map(lambda e: isinstance(e, (int, np.integer)))]
        pooled = table[~table.index.isin(per_epoch.index)]
        for column, color in (("norm_leak_auc", "tab:red"), ("direction_leak_auc", "tab:purple")):
            label = f"{partner}: {column.removesuffix('_leak_auc')} attack"
            ax.plot(per_epoch["epoch"].astype(int), per_epoch[column], marker="o", color=color, label=label)
            if len(pooled):
                ax.axhline(float(pooled[column].iloc[0]), color=color, linestyle="--", alpha=0.6)
    ax.axhline(0.5, color="grey", linestyle=":", label="no leak")
    ax.set(title="label leakage to the partner (leak AUC)", xlabel="epoch", ylim=(0.4, 1.02))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def privacy_study(run: Run) -> dict[str, Any] | None:
    """The privacy study saved under ``<run>/privacy`` (``python -m bank.lab privacy-study --out``), if any:
    its table, its per-defense tables and the trade-off figure."""
    folder = run.path / "privacy"
    if not (folder / "privacy_study.csv").exists():
        return None
    table = pd.read_csv(folder / "privacy_study.csv")
    return {"table": table, "by_defense": privacy_frontiers(table),
            "figure": folder / "privacy_tradeoff.png"}


def hijack_study(run: Run) -> str | None:
    """The hijack study saved under ``<run>/privacy`` (``python -m bank.lab hijack-study --out``), if any: its table
    as the command printed it."""
    path = run.path / "privacy" / "hijack_study.txt"
    return path.read_text() if path.exists() else None


#: What the per-defense tables show: the knob, the price, and what still leaks.
FRONTIER_COLUMNS = ["setting", "knob", "test_roc_auc", "auc_cost", "strongest_label_leak_auc", "strongest_label_attack",
                    "strongest_gradient_leak_auc", "model_completion_advantage", "inversion_r2_advantage", "inversion_r2_max"]


def privacy_frontiers(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """One table per defense, its settings in order of its knob, each with its test-AUC cost against no defense."""
    base = table.loc[table["defense"] == "no defense", "test_roc_auc"]
    table = table.assign(auc_cost=(float(base.iloc[0]) if len(base) else float("nan")) - table["test_roc_auc"])
    return {defense: part.sort_values("knob")[[c for c in FRONTIER_COLUMNS if c in part]].reset_index(drop=True)
            for defense, part in table.groupby("defense", sort=False)}


def cut_study(run: Run) -> dict[str, Any] | None:
    """The cut-layer study saved under ``<run>/cut-study`` (``python -m bank.lab cut-study --out``), if any: its
    table (one row per cut point, the walkthrough's default marked) and its frontier figure."""
    folder = run.path / "cut-study"
    if not (folder / "cut_study.csv").exists():
        return None
    return {"table": pd.read_csv(folder / "cut_study.csv"), "figure": folder / "cut_frontier.png"}


def write_report(run: Run, *, references: bool = True, audit: bool = True, seed: int = 0,
                 partition: Path | dict[str, Path] | None = None) -> dict[str, Any]:
    """Compute every table and figure, save them under ``<run>/analysis/``, return them by name.

    ``partition``: where every party's file is, for the references and the audit's targets: the folder
    ``python -m data partition`` wrote, or each party's own file by name (default: the walkthrough's
    ``<run>/data``). Without them the references are left out, and ``notes`` says so.
    """
    from bank.lab.report.audit import inversion_probe, label_leakage
    from bank.lab.references.models import NoPartition, reference_models

    out = run.path / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    tables: dict[str, pd.DataFrame] = {
        "communication": communication_table(run),
        "party_times": party_times(run),
        "subsets": subset_table(run),
    }
    figures: dict[str, Figure] = {"learning_curves": learning_curves(run),
                                  ("roc_pr" if run.metrics.get("task", "binary") == "binary" else "test_rows"):
                                  test_rows_figure(run)}
    reliability = reliability_figure(run)
    if reliability is not None:
        figures["reliability"] = reliability
    notes: list[str] = []
    if references:
        try:
            tables["comparison"] = reference_models(run, seed=seed, partition=partition)
        except NoPartition as exc:
            notes.append(f"references left out: {exc}")
        else:
            headline = tables["comparison"].columns[2]  # the task's first metric: test_roc_auc, test_accuracy, test_r2
            figures["comparison"] = _bar(tables["comparison"], "model", headline,
                                         f"{headline.removeprefix('test_')}, test rows of the run")
    if audit and run.config.get("audit") and not run.audit_dir.exists():
        raise DataError(f"{run.audit_dir}: missing, though the run was trained with --audit")
    if audit and run.audit_dir.exists():
        try:
            tables["label_leakage"] = label_leakage(run, partition)
            tables["inversion"] = inversion_probe(run, seed=seed, partition=partition)
        except NoPartition as exc:
            notes.append(f"audit left out: {exc}")
        else:
            figures["label_leakage"] = leakage_figure(tables["label_leakage"])
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
    for name, fig in figures.items():
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    return {"tables": tables, "figures": {n: out / f"{n}.png" for n in figures}, "notes": notes}
