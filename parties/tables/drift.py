"""Drift: how far rows to score are from the rows a model trained on, column by column.

Each party keeps, with its encoder, a profile of every column of its own training rows (deciles of a
number and its missing share; each category's share and the share of values training never saw).
The profile stays with the party, like the encoder. At scoring, each party measures its own columns'
population stability index (PSI), the figure credit-risk teams already monitor::

    PSI = sum over bins of (a - e) * ln(a / e)      e, a: the bin's share in training, in the new rows

Below 0.1 a column is stable; 0.1 to 0.25 it has moved (a warning); above 0.25 the rows are not the
population the model learned (scoring refuses, unless the operator accepts the drift). A file of the
wrong party's columns under the same generic names (``x0, x1, ...``) reads as drift of every column.

The index of a small sample is mostly its noise (about (bins − 1) / rows even without drift). So on fewer
than ``FULL_DRIFT_ROWS`` rows only gross drift is judged (above ``GROSS_PSI``: not the same population,
such as another party's columns), and under ``MIN_DRIFT_ROWS`` there is no figure; either is said.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from parties.errors import DataError

__all__ = ["FULL_DRIFT_ROWS", "GROSS_PSI", "MIN_DRIFT_ROWS", "REFUSE_PSI", "WARN_PSI", "Drift", "fit_profile",
           "judge_drift", "limits", "parse_drift", "stability"]

#: Drift a scoring answer warns about, and drift it refuses unless the operator accepts it.
WARN_PSI, REFUSE_PSI = 0.1, 0.25
#: Rows from which every threshold applies; from which only gross drift is judged; and under which none is.
FULL_DRIFT_ROWS, MIN_DRIFT_ROWS = 200, 30
GROSS_PSI = 1.0
#: Deciles of a numeric column's training values.
BINS = 10
#: Shares of zero would make the index infinite; an empty bin counts as this share instead.
_FLOOR = 1e-4
MISSING, OTHER = "(missing)", "(unseen)"

#: Per column, its population stability index.
Drift = dict[str, float]


def fit_profile(frame: pd.DataFrame, numeric: tuple[str, ...], categorical: dict[str, pd.Series]) -> dict[str, Any]:
    """Each column's training distribution: ``numeric`` columns of ``frame`` by deciles, ``categorical``
    columns (already as the text categories are matched on) by category."""
    profile: dict[str, Any] = {}
    for col in numeric:
        values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
        present = values[~np.isnan(values)]
        edges = np.unique(np.quantile(present, np.linspace(0, 1, BINS + 1)[1:-1])) if len(present) else np.zeros(0)
        profile[col] = {"edges": edges.tolist(), "shares": _numeric_shares(values, edges).tolist()}
    for col, text in categorical.items():
        shares = text.value_counts(normalize=True)
        profile[col] = {"categories": {str(k): float(v) for k, v in shares.items()}}
    return profile


def _numeric_shares(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Shares of ``values`` in each bin between ``edges`` (right-closed), then the missing share."""
    missing = np.isnan(values)
    bins = np.searchsorted(edges, values[~missing], side="left")
    counts = np.bincount(bins, minlength=len(edges) + 1).astype(np.float64)
    counts = np.append(counts, missing.sum())
    return counts / max(len(values), 1)


def _index(expected: np.ndarray, actual: np.ndarray) -> float:
    e, a = np.maximum(expected, _FLOOR), np.maximum(actual, _FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


def stability(profile: dict[str, Any], frame: pd.DataFrame, categorical: dict[str, pd.Series]) -> Drift:
    """Every profiled column's PSI on ``frame``'s rows (``categorical``: those columns as category text);
    empty below ``MIN_DRIFT_ROWS`` rows. Rounded to two decimals: a figure to act on, not a fingerprint."""
    if len(frame) < MIN_DRIFT_ROWS:
        return {}
    drift: Drift = {}
    for col, entry in profile.items():
        if "edges" in entry:
            values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
            actual = _numeric_shares(values, np.asarray(entry["edges"], dtype=np.float64))
            drift[col] = round(_index(np.asarray(entry["shares"]), actual), 2)
        else:
            expected = entry["categories"]
            shares = categorical[col].value_counts(normalize=True)
            known = [float(shares.get(c, 0.0)) for c in expected]
            unseen = float(shares[~shares.index.isin(list(expected))].sum())
            drift[col] = round(_index(np.array([*expected.values(), 0.0]), np.array([*known, unseen])), 2)
    return drift


def parse_drift(text: str, columns: int = 4096) -> Drift:
    """Drift figures a peer sent as JSON, checked strictly: column -> a finite index of at least 0."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"drift figures are not JSON ({exc.msg})") from exc
    if not isinstance(value, dict) or len(value) > columns:
        raise ValueError("drift figures are an object of columns")
    for col, psi in value.items():
        if not isinstance(col, str) or type(psi) not in (int, float) or not math.isfinite(psi) or psi < 0:
            raise ValueError(f"the drift figure of {col!r} is not an index of at least 0")
    return {k: float(v) for k, v in value.items()}


def limits(rows: int) -> tuple[float, float] | None:
    """(warn, refuse) for a drift figure on ``rows`` rows; ``None``: too few rows to judge any."""
    if rows < MIN_DRIFT_ROWS:
        return None
    return (WARN_PSI, REFUSE_PSI) if rows >= FULL_DRIFT_ROWS else (GROSS_PSI, GROSS_PSI)


def judge_drift(drift: dict[str, Drift], accept: bool, rows: dict[str, int]) -> list[str]:
    """Warnings for columns above the warning threshold (per party), and a note for each party with too few
    rows to judge; ``DataError`` for columns above the refusal threshold, naming them, unless ``accept``.
    ``rows``: per party, how many customers its figures are of (the thresholds depend on it: ``limits``)."""
    notes = []
    moved, refused = {}, {}
    for party, cols in drift.items():
        bounds = limits(rows.get(party, 0))
        if bounds is None:
            notes.append(f"{party}: drift not measured on {rows.get(party, 0)} customers (fewer than "
                         f"{MIN_DRIFT_ROWS}); a file of another party's columns under the same names would not be "
                         "noticed")
            continue
        if rows[party] < FULL_DRIFT_ROWS:
            notes.append(f"{party}: drift judged on {rows[party]} customers (fewer than {FULL_DRIFT_ROWS}): only "
                         f"gross drift, a column's population stability index above {GROSS_PSI}, is refused")
        moved[party] = {c: v for c, v in cols.items() if v > bounds[0]}
        refused[party] = {c: v for c, v in cols.items() if v > bounds[1]}
    refused = {p: cols for p, cols in refused.items() if cols}
    if refused and not accept:
        named = "; ".join(f"{party}: " + ", ".join(f"{c!r} {v:.2f}" for c, v in cols.items())
                          for party, cols in refused.items())
        raise DataError(f"the customers to score are not the population the model trained on: population "
                        f"stability index above {REFUSE_PSI} for {named}. Check that the file holds the bank's own "
                        "columns for these customers (not another party's under the same names); --accept-drift "
                        "scores them anyway")
    return notes + [f"{party} column {c!r}: population stability index {v:.2f} (above "
                    f"{limits(rows[party])[0]}: it has moved since training"  # type: ignore[index]
                    + ("; accepted" if c in refused.get(party, {}) else "") + ")"
                    for party, cols in moved.items() for c, v in cols.items()]
