"""How well scores match outcomes on a group of held-out customers.

Every scoring path (the joint model, and each model for customers some partners lack) is judged the
same way: the task's metrics, and for a binary task the Brier score, the mean score against the
observed rate, and reliability bins (customers grouped by score, each bin's mean score against its
observed rate) for a reliability plot.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bank.task import Task

__all__ = ["MIN_METRIC_ROWS", "RELIABILITY_BINS", "held_out_metrics", "reliability"]

#: Bins of a reliability plot: equal counts of customers (most scores of a rare class are small, so
#: equal-width bins would put almost every customer in the first one).
RELIABILITY_BINS = 10

#: Fewer held-out customers than this get no metric, only their count and the reason: an ROC-AUC or an R²
#: of two customers is a number nobody should act on.
MIN_METRIC_ROWS = 30


def held_out_metrics(task: Task, targets: torch.Tensor, scores: np.ndarray) -> dict[str, float | str]:
    """The task's metrics on these customers, with ``rows``; binary: also Brier, mean score and observed rate.

    Metrics a group cannot define (ROC-AUC with one class present) are left out, not faked; a group of
    fewer than ``MIN_METRIC_ROWS`` customers gets its count and a ``note`` saying why there is no metric.
    """
    out: dict[str, float | str] = {"rows": len(targets)}
    if len(targets) < MIN_METRIC_ROWS:
        out["note"] = f"too few customers for a metric ({len(targets)} < {MIN_METRIC_ROWS})"
        return out
    y = targets.numpy()
    if task.kind == "binary":
        from sklearn import metrics as skm  # here, not at the top: scikit-learn takes 1.4 s of a bank's start-up

        out |= {"brier": float(skm.brier_score_loss(y, scores)), "mean_score": float(scores.mean()),
                "observed_rate": float(y.mean())}
        if len(np.unique(y)) < 2:
            return out
    elif task.kind == "multiclass" and len(np.unique(y)) < 2:
        return out
    return task.metrics(targets, scores) | out


def reliability(targets: torch.Tensor, scores: np.ndarray, bins: int = RELIABILITY_BINS) -> pd.DataFrame:
    """Customers grouped by score into (at most) ``bins`` bins of equal counts: rows, mean score, observed rate."""
    frame = pd.DataFrame({"score": scores, "target": targets.numpy().astype(float)})
    if frame.empty:
        return pd.DataFrame(columns=["bin", "rows", "mean_score", "observed_rate"])
    frame["bin"] = pd.qcut(frame["score"].rank(method="first"), min(bins, len(frame)), labels=False)
    grouped = frame.groupby("bin")
    return pd.DataFrame({"rows": grouped.size(), "mean_score": grouped["score"].mean(),
                         "observed_rate": grouped["target"].mean()}).reset_index()
