"""What is learned: labels to targets, the loss, and the metrics. Binary is one case, not an assumption."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import torch

from bank.config import TaskKind
from parties.errors import ConfigError, DataError
from parties.learning.model import task_loss
from parties.tables.labels import infer_task, label_text

__all__ = ["Task", "TaskKind"]


@dataclass
class Task:
    kind: TaskKind | None = "binary"  # None: what the labels show (``fit``; parties.tables.labels)
    positive_label: str | None = None  # binary: the label value that counts as 1
    classes_: list[str] = field(default_factory=list)
    # Regression learns a standardised target (fitted on the training rows): a target in the millions
    # would otherwise put the loss near 1e10 and the default learning rates nowhere near convergence.
    # Scores and metrics are in the target's own units.
    target_mean_: float = 0.0
    target_scale_: float = 1.0

    def fit(self, labels: pd.Series) -> Task:
        """Learn the label vocabulary (classification) from the bank's own labels (and, without a kind, the kind)."""
        labels = label_text(labels)
        if self.kind is None:
            self.kind = infer_task(labels)
        if self.kind == "regression":
            return self
        values = sorted(labels.unique().tolist())
        if self.kind == "binary":
            if len(values) != 2:
                raise DataError(f"binary task: the label column has {len(values)} distinct values, expected 2")
            positive = self.positive_label or ("yes" if "yes" in values else values[1])
            if positive not in values:
                raise ConfigError(f"positive label {positive!r} is not one of the label values {values}")
            self.positive_label = positive
            self.classes_ = [v for v in values if v != positive] + [positive]
        else:
            if len(values) < 2:
                raise DataError("multiclass task: the label column has fewer than 2 values")
            self.classes_ = values
        return self

    def fit_target_scale(self, train_targets: torch.Tensor) -> Task:
        """Regression: the mean and scale of the target on the training rows (other tasks: nothing to fit)."""
        if self.kind == "regression" and len(train_targets):
            values = train_targets.double()
            self.target_mean_ = float(values.mean())
            scale = float(values.std(unbiased=False))
            self.target_scale_ = scale if scale > 0 else 1.0
        return self

    def to_dict(self) -> dict[str, object]:
        """What scoring needs to turn the top model's outputs into scores (``task.json``, the manifest)."""
        return {"kind": self.kind, "classes": self.classes_, "positive_label": self.positive_label,
                "target_mean": self.target_mean_, "target_scale": self.target_scale_}

    @classmethod
    def from_dict(cls, state: dict[str, object]) -> Task:
        return cls(state["kind"], state.get("positive_label"), list(state.get("classes") or []),  # type: ignore[arg-type]
                   float(state.get("target_mean", 0.0)), float(state.get("target_scale", 1.0)))  # type: ignore[arg-type]

    @property
    def output_dim(self) -> int:
        return len(self.classes_) if self.kind == "multiclass" else 1

    def targets(self, labels: pd.Series) -> torch.Tensor:
        if self.kind == "regression":
            values = pd.to_numeric(labels, errors="coerce")
            if values.isna().any():
                raise DataError("regression task: a label is not a number")
            return torch.tensor(values.to_numpy(dtype=np.float32))
        index = {c: i for i, c in enumerate(self.classes_)}
        codes = [index.get(v) for v in label_text(labels)]
        if any(c is None for c in codes):
            raise DataError("a label value was not seen when the task was fitted")
        if self.kind == "binary":
            return torch.tensor(codes, dtype=torch.float32)
        return torch.tensor(codes, dtype=torch.int64)

    def loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """What the loss compares the outputs with: the targets, standardised for regression."""
        if self.kind == "regression":
            return (targets - self.target_mean_) / self.target_scale_
        return targets

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.kind is not None, "fit the task first"
        return task_loss(self.kind, outputs, self.loss_targets(targets))

    def scores(self, outputs: torch.Tensor) -> np.ndarray:
        """Probabilities of the positive class / of each class; predictions for regression."""
        if self.kind == "binary":
            return torch.sigmoid(outputs.squeeze(1)).numpy()
        if self.kind == "multiclass":
            return torch.softmax(outputs, dim=1).numpy()
        return (outputs.squeeze(1).double() * self.target_scale_ + self.target_mean_).numpy()

    def score_columns(self, scores: np.ndarray) -> dict[str, np.ndarray]:
        """Scores as the columns of a predictions file: ``score``, or ``score_<class>`` for each class."""
        if scores.ndim == 1:
            return {"score": scores}
        return {f"score_{c}": scores[:, i] for i, c in enumerate(self.classes_)}

    def metrics(self, targets: torch.Tensor, scores: np.ndarray) -> dict[str, float]:
        from sklearn import metrics as skm  # here, not at the top: scikit-learn takes 1.4 s of a bank's start-up

        y = targets.numpy()
        if self.kind == "binary":
            predicted = (scores >= 0.5).astype(int)
            clipped = np.clip(scores, 1e-7, 1 - 1e-7)
            return {
                "roc_auc": float(skm.roc_auc_score(y, scores)),
                "pr_auc": float(skm.average_precision_score(y, scores)),
                "accuracy": float(skm.accuracy_score(y, predicted)),
                "log_loss": float(skm.log_loss(y, clipped, labels=[0, 1])),
                "f1": float(skm.f1_score(y, predicted, zero_division=0)),
            }
        if self.kind == "multiclass":
            predicted = scores.argmax(axis=1)
            return {
                "accuracy": float(skm.accuracy_score(y, predicted)),
                "log_loss": float(skm.log_loss(y, scores, labels=list(range(len(self.classes_))))),
                "f1_macro": float(skm.f1_score(y, predicted, average="macro", zero_division=0)),
            }
        mse = float(skm.mean_squared_error(y, scores))
        return {
            "mse": mse,
            "rmse": float(np.sqrt(mse)),
            "mae": float(skm.mean_absolute_error(y, scores)),
            "r2": float(skm.r2_score(y, scores)),
        }

    @property
    def objective(self) -> tuple[str, Literal["max", "min"]]:
        """The validation metric early stopping follows, and which way is better."""
        return {"binary": ("roc_auc", "max"), "multiclass": ("log_loss", "min"), "regression": ("mse", "min")}[
            self.kind
        ]

    @property
    def stratify(self) -> bool:
        return self.kind != "regression"
