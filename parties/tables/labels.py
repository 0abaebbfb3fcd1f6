"""The bank's label column: one spelling per value, and what kind of label it is, checked when the table loads.

A label is read as text and normalised like a category: ``1.0``, `` 1 `` and ``1`` are one label.
Its kind (the task: binary, multiclass or regression) is the operator's declaration (``bank serve
--task``, or ``task`` in the schema file) or, without one, inferred from the values; either way the
column is checked against it before anything is aligned, and a value that does not fit (a stray
``2`` in a 0/1 label, a ``?``, a word in a numeric target) is refused naming the value, how many
rows hold it and where the first one is. These messages go to the bank's own operator: label values
never leave the bank.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from parties.errors import DataError
from parties.learning.config import TaskKind
from parties.tables.schema import file_row

__all__ = ["MAX_CLASSES", "MIN_CLASS_ROWS", "MISSING_MARKERS", "infer_task", "label_text", "check_labels"]

#: More distinct values than this, nearly all numbers: a regression target, unless declared otherwise.
MAX_CLASSES = 20
#: A class needs rows to train on, one to validate and one to test.
MIN_CLASS_ROWS = 5
#: Values that say "no label": refused in any task.
MISSING_MARKERS = frozenset({"?", "na", "n/a", "nan", "null", "none", "-", "missing"})
#: Share of values that must be numbers for an undeclared label to read as a (faulty) regression target.
_MOSTLY_NUMBERS = 0.95

_INTEGRAL = re.compile(r"^([+-]?\d+)\.0*$")


def label_text(labels: pd.Series) -> pd.Series:
    """Labels read as text, one spelling per value: stripped, and ``1.0`` written ``1`` (as categories are)."""
    # One distinct value at a time: a label column has few, and the rule then costs nothing per row.
    codes, uniques = pd.factorize(labels.astype(str), use_na_sentinel=False)
    text = [_INTEGRAL.sub(r"\1", str(u).strip()) for u in uniques]
    return pd.Series(np.asarray(text, dtype=object)[codes], index=labels.index, dtype="str", name=labels.name)


def _numbers(labels: pd.Series) -> pd.Series:
    values = pd.to_numeric(labels, errors="coerce")
    return values.where(np.isfinite(values.to_numpy(dtype=np.float64, na_value=np.nan)))


def _describe(labels: pd.Series, values: list[str], limit: int = 5) -> str:
    """``'2' (1 row, row 57)``, per value: how many rows hold it and where the first is."""
    parts = []
    for value in values[:limit]:
        where = np.flatnonzero((labels == value).to_numpy())
        rows = "row" if len(where) == 1 else "rows"
        first = f"row {file_row(int(where[0]))}" if len(where) == 1 else f"first at row {file_row(int(where[0]))}"
        parts.append(f"{value!r} ({len(where)} {rows}, {first})")
    more = f" and {len(values) - limit} more" if len(values) > limit else ""
    return ", ".join(parts) + more


def infer_task(labels: pd.Series) -> TaskKind:
    """The task a label column reads as without a declaration: two values are binary; more than
    ``MAX_CLASSES`` values that are (nearly all) numbers, regression; anything else multiclass."""
    distinct = labels.nunique()
    if distinct <= 2:
        return "binary"
    numbers = _numbers(labels)
    if numbers.notna().mean() >= _MOSTLY_NUMBERS and numbers.nunique() > MAX_CLASSES:
        return "regression"
    return "multiclass"


def check_labels(labels: pd.Series, declared: TaskKind | None, column: str, path: Path) -> TaskKind:
    """The label column's task, once its values are checked against it; ``DataError`` naming what does not fit.

    ``labels``: normalised by ``label_text``. ``declared``: the operator's task, or ``None`` to infer it.
    """
    where = f"{path}: label column {column!r}"
    how = "declared" if declared else "inferred from its values; declare another with --task on serve or 'task' " \
                                      "in the schema file"
    task = declared or infer_task(labels)
    missing = sorted(v for v in labels.unique() if v.lower() in MISSING_MARKERS)
    if missing:
        raise DataError(f"{where} holds values that mean 'no label': {_describe(labels, missing)}. Remove those "
                        "rows, or give them their label")
    if task == "regression":
        numbers = _numbers(labels)
        bad = sorted(labels[numbers.isna()].unique())
        if bad:
            raise DataError(f"{where} is a regression target ({how}), but holds values that are not finite "
                            f"numbers: {_describe(labels, bad)}")
        return task
    counts = labels.value_counts()
    if len(counts) < 2:
        raise DataError(f"{where} has a single value, {counts.index[0]!r}: there is nothing to learn")
    if task == "binary" and len(counts) > 2:
        raise DataError(f"{where} is binary ({how}), but holds {len(counts)} values: "
                        f"{_describe(labels, sorted(counts.index, key=lambda v: -counts[v]), limit=len(counts))}")
    # A class of a few rows among several is what a stray value looks like (a 2 in a 0/1 label); two
    # classes are a binary label however unbalanced, and training says if it cannot split them.
    rare = sorted(counts.index[counts < MIN_CLASS_ROWS]) if len(counts) > 2 else []
    if rare:
        hint = (" If the label is binary, these rows are likely errors: fix or remove them"
                if len(counts) - len(rare) == 2 else "")
        raise DataError(f"{where} is {task} ({how}), and some classes have fewer than {MIN_CLASS_ROWS} rows, "
                        f"too few to train, validate and test on: {_describe(labels, rare)}.{hint}")
    return task
