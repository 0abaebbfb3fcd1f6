"""The bank's model of its own columns alone: what scores a customer no partner holds.

HistGradientBoosting over the bank's columns, encoded as its bottom model sees them (one-hot
categoricals, standardised numbers, fitted on this model's own training rows). It is trained on
every labelled customer of the bank's training share, aligned or not: the customers no partner
holds teach it too. On bank-full's bank columns it scored 0.025–0.036 ROC-AUC above an MLP of the
bank bottom's shape with a head, trained on the same rows (``python -m bank.lab subset-study``), so it
is the better model for the bank alone.

Past ``MAX_ROWS`` training customers it is fitted on a seeded sample of that many: gradient boosting on a
few columns gains nothing measurable from more rows (scale bench's bank, 3.4M training rows against a
2^20 sample: 0.61444 against 0.61430 test ROC-AUC), while scikit-learn holds about 200 bytes per row
while fitting (float64 input, its validation split's copies), which was the bank's peak memory.

Saved as ``encoder.json`` and ``model.skops``: skops stores the trees as data and loads only the
types named in ``TRUSTED``, so a model file cannot run code when it is read, as a pickle could.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bank.task import Task
from parties.errors import DataError
from parties.learning.trained_bottom import verify_files
from parties.storage.files import atomic_write_bytes
from parties.tables.encoding import Fallbacks, TabularEncoder
from parties.tables.table import FeatureSchema

__all__ = ["BANK_ONLY_FILES", "MAX_ROWS", "BankOnlyModel"]

BANK_ONLY_FILES = ("encoder.json", "model.skops")

#: The most training customers the model is fitted on; past this, a sample seeded by the run's seed.
MAX_ROWS = 1 << 20

#: The only types a stored model may hold beyond what skops trusts by default (checked before loading).
TRUSTED = frozenset({"sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor"})


class BankOnlyModel:
    """HistGradientBoosting on the bank's encoded columns; ``predict`` gives scores in the task's form."""

    def __init__(self, task: Task, seed: int = 0, max_rows: int | None = None) -> None:
        self.task, self.seed, self.max_rows = task, seed, MAX_ROWS if max_rows is None else max_rows

    def fit(self, features: pd.DataFrame, schema: FeatureSchema, targets: torch.Tensor,
            rows: np.ndarray | None = None) -> BankOnlyModel:
        """Fit the encoder and the trees on ``features``' ``rows`` (default: all), ``targets`` being theirs.

        Past ``max_rows`` rows the trees are fitted on a sample of that many (seeded, in the rows' order; the
        encoder on every row): ``trained_rows_`` says how many they saw.

        scikit-learn's defaults, seeded: over 10,000 rows it stops adding trees when the loss on a seeded
        tenth of the training rows stalls. Stopping on the run's validation rows instead scored 0.004–0.016
        ROC-AUC lower on bank-full's held-out customers, within noise, so the defaults stay.
        """
        rows = np.arange(len(features)) if rows is None else np.asarray(rows)
        if len(rows) != len(targets):
            raise ValueError(f"{len(rows)} rows but {len(targets)} targets")
        # The encoder sees every training row (a category only a few customers have is known to it, not an
        # "unseen" fallback at scoring); the trees see the sample.
        self.encoder_ = TabularEncoder(schema).fit(features.iloc[rows])
        if len(rows) > self.max_rows:
            keep = np.sort(np.random.default_rng(self.seed).choice(len(rows), self.max_rows, replace=False))
            rows, targets = rows[keep], targets[torch.from_numpy(keep)]
        self.trained_rows_ = len(rows)
        y = targets.numpy()
        if self.task.kind != "regression" and len(np.unique(y)) < 2:
            raise DataError("the bank-only model needs training customers of at least two classes")
        from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor  # here, not at the top: scikit-learn takes 1.4 s of a bank's start-up

        kind = HistGradientBoostingRegressor if self.task.kind == "regression" else HistGradientBoostingClassifier
        encoded, _ = self.encoder_.encode_rows(features, rows)
        self.estimator_ = kind(random_state=self.seed).fit(encoded.all().numpy(), y)
        return self

    def predict(self, features: pd.DataFrame) -> tuple[np.ndarray, Fallbacks]:
        """Scores for ``features``' rows (as ``Task.scores`` gives them), and the values that took a policy."""
        x, fallbacks = self.encoder_.encode(features)
        if self.task.kind == "regression":
            # scikit-learn refuses zero rows; a group of no customers has no scores (every partner holds them).
            return (self.estimator_.predict(x) if len(x) else np.zeros(0)).astype(np.float64), fallbacks
        proba = np.zeros((len(x), len(self.task.classes_)))
        if len(x):
            # Classes absent from the training rows get probability 0, in the task's class order.
            proba[:, self.estimator_.classes_.astype(int)] = self.estimator_.predict_proba(x)
        return (proba[:, 1] if self.task.kind == "binary" else proba), fallbacks

    def save(self, folder: Path) -> dict[str, str]:
        """Write the model's files; return their SHA-256 (for the manifest)."""
        import skops.io as sio  # here, not at the top: importing it takes two seconds of every bank's start-up

        blobs = {"encoder.json": json.dumps(self.encoder_.to_dict(), indent=2).encode(),
                 "model.skops": sio.dumps(self.estimator_)}
        for name, blob in blobs.items():
            atomic_write_bytes(Path(folder) / name, blob)
        return {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}

    @classmethod
    def load(cls, folder: Path, expected: dict[str, str], task: Task) -> BankOnlyModel:
        """The model saved in ``folder``, each file checked against the manifest's digest first."""
        import skops.io as sio  # here, not at the top: importing it takes two seconds of every bank's start-up

        blobs = verify_files(folder, expected, BANK_ONLY_FILES)
        untrusted = set(sio.get_untrusted_types(data=blobs["model.skops"]))
        if untrusted - TRUSTED:
            raise DataError(f"{Path(folder) / 'model.skops'}: holds types this version does not load: "
                            f"{sorted(untrusted - TRUSTED)}")
        model = cls(task)
        try:
            model.encoder_ = TabularEncoder.from_dict(json.loads(blobs["encoder.json"]))
            model.estimator_ = sio.loads(blobs["model.skops"], trusted=sorted(untrusted))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{folder}: unreadable bank-only model ({exc})") from exc
        return model
