"""Encode a party's own columns into numbers: one-hot categoricals, standardised numerics.

Fitted on the party's own training rows only. The learned state is plain
data (categories, means, scales) so it can be saved as JSON beside the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from parties.dataset import FeatureSchema
from parties.errors import DataError

__all__ = ["TabularEncoder"]


@dataclass
class TabularEncoder:
    """One-hot for categoricals (unseen values encode as all zeros), z-scores for numerics."""

    schema: FeatureSchema
    categories_: dict[str, list[str]] = field(default_factory=dict)
    means_: dict[str, float] = field(default_factory=dict)
    scales_: dict[str, float] = field(default_factory=dict)

    def fit(self, frame: pd.DataFrame) -> TabularEncoder:
        if frame.empty:
            raise DataError("cannot fit the feature encoder on zero rows")
        for col in self.schema.numeric:
            values = frame[col].to_numpy(dtype=np.float64)
            self.means_[col] = float(values.mean())
            std = float(values.std())
            self.scales_[col] = std if std > 0 else 1.0
        for col in self.schema.categorical:
            self.categories_[col] = sorted(frame[col].astype(str).str.strip().unique().tolist())
        return self

    @property
    def width(self) -> int:
        return len(self.schema.numeric) + sum(len(c) for c in self.categories_.values())

    def feature_names(self) -> list[str]:
        names = list(self.schema.numeric)
        for col, cats in self.categories_.items():
            names += [f"{col}={c}" for c in cats]
        return names

    def transform(self, frame: pd.DataFrame) -> np.ndarray:
        if not self.categories_ and self.schema.categorical:
            raise DataError("the encoder is not fitted")
        blocks = []
        for col in self.schema.numeric:
            values = frame[col].to_numpy(dtype=np.float64)
            blocks.append(((values - self.means_[col]) / self.scales_[col])[:, None])
        for col in self.schema.categorical:
            cats = self.categories_[col]
            codes = pd.Categorical(frame[col].astype(str).str.strip(), categories=cats).codes
            onehot = np.zeros((len(frame), len(cats)))
            known = codes >= 0
            onehot[np.flatnonzero(known), codes[known]] = 1.0
            blocks.append(onehot)
        if not blocks:
            return np.zeros((len(frame), 0), dtype=np.float32)
        return np.hstack(blocks).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {
            "numeric": list(self.schema.numeric),
            "categorical": list(self.schema.categorical),
            "categories": self.categories_,
            "means": self.means_,
            "scales": self.scales_,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TabularEncoder:
        schema = FeatureSchema(tuple(state["numeric"]), tuple(state["categorical"]))
        return cls(schema, dict(state["categories"]), dict(state["means"]), dict(state["scales"]))
