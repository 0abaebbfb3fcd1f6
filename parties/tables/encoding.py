"""Encode a party's own columns into numbers: one-hot categoricals, standardised numerics.

Fitted on the party's own training rows only. The learned state is plain
data (categories, means, scales, quantile bin edges) so it can be saved as JSON beside the model.
A training session keeps its rows as ``EncodedRows`` (numbers, and each category's position) and expands
each batch into the one-hot when it is used: memory grows with the table's columns, not the encoded width.

With ``bins`` (the built-in bottom's ``numeric_embedding="ple"``) each numeric column is encoded piecewise
linearly over quantile bins of its training values (Gorishniy et al., "On Embeddings for Numerical Features in
Tabular Deep Learning", NeurIPS 2022): component t is 0 below bin t, 1 above it and linear inside it (the first
bin extends below the lowest edge, the last above the highest), one component per bin.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from parties.errors import DataError
from parties.tables.drift import Drift, fit_profile, stability
from parties.tables.schema import POLICIES, FeatureSchema

__all__ = ["EncodedRows", "Fallbacks", "InputLayout", "TabularEncoder", "category_text", "merge_fallbacks",
           "parse_fallbacks"]

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


def _category_codes(values: pd.Series, categories: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each value's position in ``categories`` (-1: none) and whether its ``category_text`` is empty.

    Worked out on the column's distinct values and spread over the rows, as ``category_text`` does, without
    a Python string per row."""
    index = pd.Index(list(categories), dtype=object)
    codes, uniques = pd.factorize(values)
    numeric = pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)
    if not numeric and not all(type(u) is str for u in uniques):
        text = category_text(values).to_numpy(dtype=object)
        return index.get_indexer(text), text == ""
    each = _category_text_each(pd.Series(uniques, dtype=values.dtype)).to_numpy(dtype=object)
    # One more slot for position -1, a missing value's code (replaced below), so that a column of nothing but
    # missing values (no distinct value) has one to read.
    found = np.append(index.get_indexer(each), -1)[codes]
    empty = np.append(each == "", True)[codes]
    missing = codes < 0
    if missing.any():  # replaced by the missing values' own text
        text = _category_text_each(values[missing]).to_numpy(dtype=object)
        found[missing], empty[missing] = index.get_indexer(text), text == ""
    return found, empty


@dataclass(frozen=True)
class InputLayout:
    """What the columns of an encoded matrix are, in order: each numeric column's components (1: its z-score;
    more: its piecewise-linear bins), then each categorical column's one-hot block (its category count)."""

    numeric: tuple[int, ...]
    categories: tuple[int, ...] = ()

    @classmethod
    def dense(cls, width: int) -> InputLayout:
        """A matrix of plain numbers."""
        return cls((1,) * width)

    @property
    def width(self) -> int:
        return sum(self.numeric) + sum(self.categories)


def _edges_on_z(edges: Sequence[float], mean: float, scale: float) -> np.ndarray | None:
    """A column's bin edges on its z-score's scale, as float32 and strictly increasing (None: fewer than two)."""
    z = np.unique(((np.asarray(edges, dtype=np.float64) - mean) / scale).astype(np.float32))
    return z if len(z) >= 2 else None


class EncodedRows:
    """Encoded rows kept compactly: the numbers (float32), and each categorical column's category position
    (-1: the all-zero "unknown"). ``take`` gives a batch of rows exactly as ``TabularEncoder.encode`` would.
    ``edges``: each numeric column's quantile bin edges on its z-score's scale (None: the z-score as it is).
    """

    def __init__(self, numbers: np.ndarray, codes: np.ndarray, sizes: Sequence[int],
                 edges: Sequence[np.ndarray | None] | None = None) -> None:
        if codes.shape != (len(numbers), len(sizes)) or any(size < 1 for size in sizes):
            raise ValueError(f"codes of shape {codes.shape} for {len(numbers)} rows of {len(sizes)} columns of "
                             f"{list(sizes)} categories")
        self.numbers = torch.from_numpy(np.ascontiguousarray(numbers, dtype=np.float32))
        self.codes = torch.from_numpy(codes)
        self._bins = None if edges is None or all(e is None for e in edges) else _bins(edges)
        components = (tuple(int(n) for n in torch.bincount(self._bins[0], minlength=self.numbers.shape[1]))
                      if self._bins is not None else (1,) * self.numbers.shape[1])
        self.layout = InputLayout(components, tuple(int(s) for s in sizes))
        self.width = self.layout.width
        self._offsets = torch.from_numpy(sum(components) + np.cumsum([0, *sizes[:-1]], dtype=np.int64))

    @classmethod
    def dense(cls, matrix: np.ndarray) -> EncodedRows:
        """Rows already encoded: kept as they are."""
        return cls(np.asarray(matrix, dtype=np.float32), np.zeros((len(matrix), 0), dtype=np.int16), [])

    def __len__(self) -> int:
        return self.numbers.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.width

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """The encoded rows at positions ``rows``: a float32 matrix, one row per position."""
        numbers = self.numbers.index_select(0, rows)
        if self._bins is not None:
            column, left, width, low, high = self._bins
            numbers = ((numbers.index_select(1, column) - left) / width).clamp_(low, high)
        if not self.codes.shape[1]:
            return numbers
        codes = self.codes.index_select(0, rows).long()
        known = codes >= 0
        out = torch.zeros(len(rows), self.width, dtype=torch.float32)
        out[:, : numbers.shape[1]] = numbers
        # An unknown category writes 0 on its own column's first slot, which is 0 already.
        return out.scatter_(1, torch.where(known, codes + self._offsets, self._offsets), known.to(out.dtype))

    def all(self) -> torch.Tensor:
        """Every row, encoded."""
        return self.take(torch.arange(len(self)))


def _bins(edges: Sequence[np.ndarray | None]) -> tuple[torch.Tensor, ...]:
    """Per output component of a piecewise-linear encoding: its numeric column, bin start, bin width, and the
    bounds it is clamped to (the first bin open below, the last open above). A column without edges: one
    component, its z-score as it is."""
    column, left, width, low, high = [], [], [], [], []
    for j, e in enumerate(edges):
        spans = [(0.0, 1.0)] if e is None else [(float(a), float(b) - float(a)) for a, b in itertools.pairwise(e)]
        for t, (start, span) in enumerate(spans):
            column.append(j)
            left.append(start)
            width.append(span)
            low.append(-np.inf if t == 0 else 0.0)
            high.append(np.inf if t == len(spans) - 1 else 1.0)
    return (torch.tensor(column, dtype=torch.int64),
            *(torch.tensor(np.asarray(v, dtype=np.float32)) for v in (left, width, low, high)))


@dataclass
class TabularEncoder:
    """One-hot for categoricals (unseen values encode as all zeros), z-scores for numerics, or with ``bins`` each
    numeric column piecewise linear over quantile bins of its training values."""

    schema: FeatureSchema
    categories_: dict[str, list[str]] = field(default_factory=dict)
    means_: dict[str, float] = field(default_factory=dict)
    scales_: dict[str, float] = field(default_factory=dict)
    #: each column's distribution on the training rows, for drift at scoring (``parties.tables.drift``);
    #: empty for an encoder saved before profiles existed
    profile_: dict[str, Any] = field(default_factory=dict)
    #: quantile bins per numeric column (0: z-scores only), and each column's bin edges in its own units
    bins: int = 0
    edges_: dict[str, list[float]] = field(default_factory=dict)

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
            if self.bins:
                seen = values[~np.isnan(values)]
                self.edges_[col] = np.unique(np.quantile(seen, np.linspace(0, 1, self.bins + 1))).tolist()
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

    def _z_edges(self) -> list[np.ndarray | None] | None:
        if not self.bins:
            return None
        return [_edges_on_z(self.edges_[c], self.means_[c], self.scales_[c]) for c in self.schema.numeric]

    @property
    def layout(self) -> InputLayout:
        """The encoded matrix's columns (``InputLayout``)."""
        edges = self._z_edges() or [None] * len(self.schema.numeric)
        return InputLayout(tuple(1 if e is None else len(e) - 1 for e in edges),
                           tuple(len(self.categories_[c]) for c in self.schema.categorical))

    @property
    def width(self) -> int:
        return self.layout.width

    def feature_names(self) -> list[str]:
        names = []
        for col, edges in zip(self.schema.numeric, self._z_edges() or [None] * len(self.schema.numeric)):
            names += [col] if edges is None else [f"{col}[bin {t}]" for t in range(len(edges) - 1)]
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
        rows, fallbacks = self.encode_rows(frame)
        return rows.all().numpy(), fallbacks

    def encode_rows(self, frame: pd.DataFrame, rows: np.ndarray | None = None,
                    chunk: int = 1 << 18) -> tuple[EncodedRows, Fallbacks]:
        """``encode(frame.iloc[rows])``'s rows kept compactly (``EncodedRows``), and its fallbacks; ``frame``
        is read ``chunk`` rows at a time, so no column of it is copied whole. ``rows``: default, all."""
        if not self.categories_ and self.schema.categorical:
            raise DataError("the encoder is not fitted")
        sizes = [len(self.categories_[col]) for col in self.schema.categorical]
        n = len(frame) if rows is None else len(rows)
        numbers = np.empty((n, len(self.schema.numeric)), dtype=np.float32)
        codes = np.empty((n, len(sizes)), dtype=np.int16 if max(sizes, default=0) < 1 << 15 else np.int32)
        fallbacks: Fallbacks = {}
        for start in range(0, n, chunk):
            part = frame.iloc[start : start + chunk] if rows is None else frame.iloc[rows[start : start + chunk]]
            merge_fallbacks(fallbacks, self._encode_into(part, numbers[start : start + chunk], codes[start : start + chunk]))
        return EncodedRows(numbers, codes, sizes, self._z_edges()), fallbacks

    def _encode_into(self, frame: pd.DataFrame, numbers: np.ndarray, codes: np.ndarray) -> Fallbacks:
        fallbacks: Fallbacks = {}
        for j, col in enumerate(self.schema.numeric):
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
            missing = np.isnan(values)
            if missing.any():
                fallbacks[col] = {MISSING_NUMBER: int(missing.sum())}
                values = np.where(missing, self.means_[col], values)
            numbers[:, j] = (values - self.means_[col]) / self.scales_[col]  # computed in float64, rounded once
        for j, col in enumerate(self.schema.categorical):
            found, empty_text = _category_codes(frame[col], self.categories_[col])
            codes[:, j] = found
            known = found >= 0
            empty = int((empty_text & ~known).sum())
            unseen = int((~known).sum()) - empty
            counts = {k: v for k, v in ((UNSEEN, unseen), (MISSING_CATEGORY, empty)) if v}
            if counts:
                fallbacks[col] = counts
        return fallbacks

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
        } | ({"bins": self.bins, "edges": self.edges_} if self.bins else {})

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> TabularEncoder:
        schema = FeatureSchema(tuple(state["numeric"]), tuple(state["categorical"]))
        encoder = cls(schema, dict(state["categories"]), dict(state["means"]), dict(state["scales"]),
                      dict(state.get("profile") or {}), state.get("bins", 0), dict(state.get("edges") or {}))
        _check_bins(encoder)
        return encoder


#: The most quantile bins an encoder may have per numeric column (``BottomConfig.bins``' bound).
MAX_BINS = 256


def _check_bins(encoder: TabularEncoder) -> None:
    """Bins read from a file or a peer: a count in [0, MAX_BINS], and per numeric column at most bins + 1 finite,
    strictly increasing edges (none without bins)."""
    bins = encoder.bins
    if type(bins) is not int or not 0 <= bins <= MAX_BINS:
        raise ValueError(f"the encoder's bins must be a whole number from 0 to {MAX_BINS}")
    if set(encoder.edges_) != (set(encoder.schema.numeric) if bins else set()):
        raise ValueError("the encoder's bin edges do not name its numeric columns")
    for col, edges in encoder.edges_.items():
        try:
            values = np.asarray(edges, dtype=np.float64) if isinstance(edges, list) and all(
                type(e) in (int, float) for e in edges) else None
        except OverflowError:  # an integer past float64
            values = None
        if values is None or not 1 <= len(values) <= bins + 1 or not np.isfinite(values).all() or (
                np.diff(values) <= 0).any():
            raise ValueError(f"the encoder's bin edges for {col!r} are not at most {bins + 1} finite, increasing numbers")


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
