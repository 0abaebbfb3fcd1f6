"""A party's table schema: its ID column, its label (the bank's), and the kind of every feature column.

Inferred once from the data with explicit overrides, written beside the data as
``<file>.schema.json`` for a person to read and edit, and read back by every
step that loads the table. The kinds and the categories fitted on the training
rows then travel with the model (``encoder.json``, hashed into the manifest), so
scoring reads new rows the way training did.

Policies for values training never saw are part of the schema's meaning:
an unseen or missing category encodes as the one-hot's all-zero "unknown" slot,
a missing number as the training mean; scoring counts every value that took one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, ValidationError

from parties.errors import DataError
from parties.learning.config import TaskKind
from parties.storage.files import atomic_write_text
from parties.tables.ids import IdType

__all__ = ["DEFAULT_ID_COLUMN", "DEFAULT_LABEL", "POLICIES", "FeatureSchema", "PartySchema", "file_row", "infer_kinds", "parse_numbers",
           "read_schema", "sidecar_path"]

DEFAULT_ID_COLUMN = "customer_id"
DEFAULT_LABEL = "y"

#: What a value training never saw becomes; recorded in every schema file so the reader knows.
POLICIES = {
    "unseen_category": "all-zero one-hot (the 'unknown' slot), counted",
    "missing_category": "all-zero one-hot (the 'unknown' slot), counted",
    "missing_number": "the mean of the training rows' values, counted",
}


@dataclass(frozen=True)
class FeatureSchema:
    """Which of a party's columns are numeric and which categorical."""

    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        return self.numeric + self.categorical


def file_row(position: int) -> int:
    """A row's number as a person finds it in the file: 1-based, the header being row 1."""
    return position + 2


class PartySchema(BaseModel):
    """The schema file's content; older files without a version or policies read as version 1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    id_column: str = DEFAULT_ID_COLUMN
    #: integer: 12, 12.0 and 0012 are one customer; text: IDs as written (parties.tables.ids). None: inferred.
    id_type: IdType | None = None
    label_column: str | None = None
    #: the bank's label: binary, multiclass or regression (parties.tables.labels). None: inferred.
    task: TaskKind | None = None
    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    policies: dict[str, str] = POLICIES

    def write(self, path: Path) -> None:
        atomic_write_text(path, self.model_dump_json(indent=2) + "\n")


def sidecar_path(data: Path) -> Path:
    """``<file>.schema.json`` beside a party's data file."""
    return Path(data).with_suffix(".schema.json")


def read_schema(path: Path) -> PartySchema | None:
    """The schema in ``path``, or ``None`` if there is no such file; an unreadable one is a clear error."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return PartySchema.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'schema'}: {e['msg']}" for e in exc.errors())
        raise DataError(f"{path}: not a valid schema file ({problems})") from exc


def parse_numbers(text: pd.Series) -> pd.Series:
    """A column of text as float64, NaN where a value is empty or not a number (as ``pd.to_numeric`` reads it).

    Fast where it can be: a column of plain numbers is cast by Arrow (correctly rounded, as pandas parses them,
    in a tenth of the time); any other column (its first values tell) is parsed one distinct value at a time,
    and a column of categories has few. Neither keeps a copy of the column's text.
    """
    try:
        values = pa.array(text, from_pandas=True)  # no copy of an Arrow-backed column
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # an object column of mixed types: as text
        values = pa.array(text.astype(str), from_pandas=True)
    try:
        _cast_numbers(values.slice(0, 1024))
        return pd.Series(_cast_numbers(values), index=text.index)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        uniques = pc.unique(values)
        stripped = [None if u is None else str(u).strip() for u in uniques.to_pylist()]
        parsed = pd.to_numeric(pd.Series(stripped, dtype=object), errors="coerce").to_numpy(dtype=np.float64)
        where = pc.index_in(values, value_set=uniques).to_numpy(zero_copy_only=False)  # float: NaN where null
        out = np.full(len(where), np.nan)
        known = ~np.isnan(where)
        out[known] = parsed[where[known].astype(np.int64)]
        return pd.Series(out, index=text.index)


def _cast_numbers(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    trimmed = pc.utf8_trim_whitespace(values)
    trimmed = pc.if_else(pc.equal(trimmed, ""), pa.scalar(None, trimmed.type), trimmed)
    return pc.cast(trimmed, pa.float64()).to_numpy(zero_copy_only=False)


def infer_kinds(frame: pd.DataFrame, columns: Sequence[str], *, categorical: Sequence[str] = (),
                numeric: Sequence[str] = (), numbers: Callable[[str], pd.Series] | None = None,
                ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(numeric, categorical): a column is numeric when every value present parses as a number, unless overridden.

    Integer codes (a sex, a status, a region code) parse as numbers; name them with ``categorical``.
    ``numbers``: a column's values parsed as numbers (NaN where they are not), if the caller keeps them.
    """
    unknown = sorted((set(categorical) | set(numeric)) - set(columns))
    if unknown:
        raise DataError(f"column overrides name columns the table does not have: {unknown} (columns: {', '.join(columns)})")
    both = sorted(set(categorical) & set(numeric))
    if both:
        raise DataError(f"columns declared both categorical and numeric: {both}")
    kinds = {}
    for col in columns:
        if col in categorical:
            kinds[col] = "categorical"
        elif col in numeric:
            kinds[col] = "numeric"
        else:
            present = (frame[col].astype(str).str.strip() != "").to_numpy()  # a missing value says nothing
            parsed = numbers(col) if numbers is not None else parse_numbers(frame[col])
            kinds[col] = "numeric" if present.any() and parsed[present].notna().all() else "categorical"
    return (tuple(c for c in columns if kinds[c] == "numeric"), tuple(c for c in columns if kinds[c] == "categorical"))
