"""Encode a party's own columns into numbers: one-hot categoricals, standardised numerics.

Fitted on the party's own training rows only. The learned state is plain
data (categories, means, scales) so it can be saved as JSON beside the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from parties.errors import DataError
from parties.tables.drift import Drift, fit_profile, stability
from parties.tables.schema import POLICIES, FeatureSchema

__all__ = ["Fallbacks", "TabularEncoder", "category_text", "merge_fallbacks", "parse_fallbacks"]

#: Per column, how many values took a declared policy instead of being encoded as seen in training:
#: ``{"job": {"unseen category": 3}, "balance": {"missing: training mean": 1}}``.
Fallbacks = dict[str, dict[str, int]]

SCHEMA_VERSION = 1
UNSEEN = "unseen category"
MISSING_CATEGORY = "missing category"
MISSING_NUMBER = "missing: training mean"

_INTEGRAL = re.compile(r"^([+-]?\d+)\.0*$")


def category_text(values: pd.Series) -> pd.Series:
    """A categorical column as the text its categories are matched on, whatever dtype pandas read it as.

    An integer-coded category is the same category as ``3``, ``3.0`` or the float 3.0: a CSV read as
    text at training and as numbers at scoring (or a column a later schema calls numeric) must encode
    the same. Text is stripped; leading zeros are kept (``"01"`` is a code, not a number). Missing
    values come back as ``""``.
    """
    # A column has few distinct categories and many rows: the text of each distinct value is worked out
    # once (by the reference, value by value) and spread over the rows. Exact only where equal values
    # give equal text: plain strings, numbers (0.0 and -0.0 both read "0"); anything else (bools mixed
    # with numbers in an object column, say) goes value by value.
    codes, uniques = pd.factorize(values)
    numeric = pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)
    if not numeric and not all(type(u) is str for u in uniques):
        return _category_text_each(values)
    each = _category_text_each(pd.Series(uniques, dtype=values.dtype))
    text = each.to_numpy(dtype=object)[codes]
    missing = codes < 0
    if missing.any():
        text[missing] = _category_text_each(values[missing]).to_numpy(dtype=object)
    return pd.Series(text, index=values.index, dtype=each.dtype, name=values.name)


def _category_text_each(values: pd.Series) -> pd.Series:
    """``category_text`` value by value: the reference the fast path is tested against."""
    if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        numbers = values.astype("float64")
        integral = numbers.notna() & np.isfinite(numbers) & (numbers == np.round(numbers))
        text = numbers.map(lambda v: "" if pd.isna(v) else repr(float(v)))
        text[integral] = numbers[integral].map(lambda v: str(int(v)))
        return text.astype(object)
    text = values.astype(object).map(lambda v: "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v))
    return text.str.strip().str.replace(_INTEGRAL, r"\1", regex=True)


@dataclass
class TabularEncoder:
    """One-hot for categoricals (unseen values encode as all zeros), z-scores for numerics."""

    schema: FeatureSchema
    categories_: dict[str, list[str]] = field(default_factory=dict)
    means_: dict[str, float] = field(default_factory=dict)
    scales_: dict[str, float] = field(default_factory=dict)
    #: each column's distribution on the training rows, for drift at scoring (``parties.tables.drift``);
    #: empty for an encoder saved before profiles existed
    profile_: dict[str, Any] = field(default_factory=dict)

    def fit(self, frame: pd.DataFrame) -> TabularEncoder:
        if frame.empty:
            raise DataError("cannot fit the feature encoder on zero rows")
        for col in self.schema.numeric:
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
            if np.isnan(values).all():
                raise DataError(f"column {col!r} has no value in the training rows to fit its mean and scale on")
            self.means_[col] = float(np.nanmean(values))
            std = float(np.nanstd(values))
            self.scales_[col] = std if std > 0 else 1.0
        texts = {col: category_text(frame[col]) for col in self.schema.categorical}
        for col, text in texts.items():
            self.categories_[col] = sorted(text.unique().tolist())
        self.profile_ = fit_profile(frame, self.schema.numeric, texts)
        return self

    def drift(self, frame: pd.DataFrame) -> Drift:
        """Each column's population stability index on ``frame`` against the training rows (``{}``: too few
        rows, or an encoder without a profile)."""
        if not self.profile_:
            return {}
        return stability(self.profile_, frame, {col: category_text(frame[col]) for col in self.schema.categorical})

    @property
    def width(self) -> int:
        return len(self.schema.numeric) + sum(len(c) for c in self.categories_.values())

    def feature_names(self) -> list[str]:
        names = list(self.schema.numeric)
        for col, cats in self.categories_.items():
            names += [f"{col}={c}" for c in cats]
        return names

    def transform(self, frame: pd.DataFrame) -> np.ndarray:
        return self.encode(frame)[0]

    def encode(self, frame: pd.DataFrame) -> tuple[np.ndarray, Fallbacks]:
        """The encoded rows, and per column the values that took a policy.

        Policies: an unseen (or missing) category encodes as all zeros, the one-hot's "unknown"
        slot; a missing number as the training mean (z-score 0). A training row's category was
        seen (the encoder is fitted on them); its missing numbers take the mean as well.
        """
        if not self.categories_ and self.schema.categorical:
            raise DataError("the encoder is not fitted")
        # One float32 matrix, filled column by column: never a float64 block per column and their join.
        out = np.zeros((len(frame), self.width), dtype=np.float32)
        fallbacks: Fallbacks = {}
        for j, col in enumerate(self.schema.numeric):
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
            missing = np.isnan(values)
            if missing.any():
                fallbacks[col] = {MISSING_NUMBER: int(missing.sum())}
                values = np.where(missing, self.means_[col], values)
            out[:, j] = (values - self.means_[col]) / self.scales_[col]  # computed in float64, rounded once
        at = len(self.schema.numeric)
        for col in self.schema.categorical:
            cats = self.categories_[col]
            text = category_text(frame[col])
            codes = pd.Index(cats).get_indexer(text)
            known = codes >= 0
            out[np.flatnonzero(known), at + codes[known]] = 1.0
            at += len(cats)
            empty = int(((text == "") & ~known).sum())
            unseen = int((~known).sum()) - empty
            counts = {k: v for k, v in ((UNSEEN, unseen), (MISSING_CATEGORY, empty)) if v}
            if counts:
                fallbacks[col] = counts
        return out, fallbacks

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "policies": POLICIES,
            "numeric": list(self.schema.numeric),
            "categorical": list(self.schema.categorical),
            "categories": self.categories_,
            "means": self.means_,
            "scales": self.scales_,
            "profile": self.profile_,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TabularEncoder:
        schema = FeatureSchema(tuple(state["numeric"]), tuple(state["categorical"]))
        return cls(schema, dict(state["categories"]), dict(state["means"]), dict(state["scales"]),
                   dict(state.get("profile") or {}))


def merge_fallbacks(total: Fallbacks, more: Fallbacks) -> Fallbacks:
    """``total`` with ``more``'s counts added, column by column and policy by policy."""
    for col, counts in more.items():
        into = total.setdefault(col, {})
        for policy, n in counts.items():
            into[policy] = into.get(policy, 0) + n
    return total


def parse_fallbacks(text: str, *, max_columns: int = 4096) -> Fallbacks:
    """Fallback counts a peer sent as JSON, checked strictly: column -> policy -> count (a count of rows)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"fallback counts are not JSON ({exc.msg})") from exc
    policies = {UNSEEN, MISSING_CATEGORY, MISSING_NUMBER}
    if not isinstance(value, dict) or len(value) > max_columns:
        raise ValueError("fallback counts are an object of columns")
    for col, counts in value.items():
        if not isinstance(counts, dict) or not set(counts) <= policies:
            raise ValueError(f"fallback counts for {col!r} name unknown policies")
        if not all(type(n) is int and 0 <= n < 1 << 40 for n in counts.values()):
            raise ValueError(f"fallback counts for {col!r} are not counts")
    return value
