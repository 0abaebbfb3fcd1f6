"""Reading a party's file: CSV, Parquet or Feather, every cell as the text it stands for.

Text first, types second: the party's schema decides what a column is (``parties.tables.table``), not the
reader's guess, so a table means the same whichever format it came in.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from parties.errors import DataError

__all__ = ["ARROW_SUFFIXES", "COLUMNAR_SUFFIXES", "PARQUET_SUFFIXES", "read_table_text", "sniff_separator"]


def sniff_separator(path: Path) -> str:
    """``;`` or ``,``, whichever the header line uses more."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        header = f.readline()
    return ";" if header.count(";") > header.count(",") else ","


PARQUET_SUFFIXES = (".parquet", ".pq")
#: Arrow's own file format (Feather V2, or V1). Read whole, not memory-mapped: a mapped file rewritten in place
#: (as pandas and pyarrow write one) while the service holds it would kill the process with a bus error.
ARROW_SUFFIXES = (".feather", ".arrow", ".ipc")
COLUMNAR_SUFFIXES = PARQUET_SUFFIXES + ARROW_SUFFIXES


def read_table_text(path: Path) -> pd.DataFrame:
    """A CSV (``;`` or ``,``; any line ending), Parquet or Feather/Arrow file, every cell as text, missing cells as ``""``.

    Text first, types second: the party's schema decides what a column is, not
    the reader's guess, so a table means the same whichever format it came in.
    """
    path = Path(path)
    separator = ","
    try:
        with path.open("rb") as f:
            magic = f.read(6)
        if path.suffix.lower() in PARQUET_SUFFIXES or magic[:4] == b"PAR1":
            import pyarrow.parquet as pq

            return _arrow_as_text(path, pq.read_table(path))
        if path.suffix.lower() in ARROW_SUFFIXES or magic == b"ARROW1":
            from pyarrow import feather

            return _arrow_as_text(path, feather.read_table(path, memory_map=False))
        separator = sniff_separator(path)
        # Arrow's reader: text columns without a Python object per cell, and in a tenth of the time.
        return pd.read_csv(path, dtype=str, keep_default_na=False, sep=separator, engine="pyarrow")
    except pd.errors.EmptyDataError as exc:
        raise DataError(f"{path}: the file is empty") from exc
    except pd.errors.ParserError as exc:
        if "CSV parse error" in str(exc):  # Arrow quotes the row, which may hold an ID: say where it is instead
            raise DataError(f"{path}: not a readable CSV file ({_ragged_row(path, separator)})") from None
        raise DataError(f"{path}: not a readable CSV or Parquet file ({exc})") from exc
    except (UnicodeDecodeError, ValueError, OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable CSV, Parquet or Feather file ({exc})") from exc


def _ragged_row(path: Path, separator: str) -> str:
    """Where a CSV file first has a row of another width than its header, without quoting the row."""
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.reader(f, delimiter=separator)
        width = len(next(rows, []))
        for number, row in enumerate(rows, start=2):
            if row and len(row) != width:
                return f"row {number} has {len(row)} field{'' if len(row) == 1 else 's'}; the header has {width}"
    return "a row's fields do not match the header"


def _arrow_as_text(path: Path, table: pa.Table) -> pd.DataFrame:
    """A typed Arrow table as text columns: text stays Arrow's own, numbers and booleans are written out once per
    distinct value, any other type (dates, durations, nested values...) cell by cell as pandas holds it."""
    index = (table.schema.pandas_metadata or {}).get("index_columns", [])  # a pandas index is not a column
    if isinstance(index, list):
        table = table.drop_columns([c for c in index if isinstance(c, str) and c in table.column_names])
    names = [str(c) for c in table.column_names]
    repeated = sorted({c for c in names if names.count(c) > 1})
    if repeated:
        raise DataError(f"{path}: columns named more than once: {repeated}")
    columns = {}
    for i, name in enumerate(names):
        try:
            columns[name] = _column_text(table.column(i))
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
            raise DataError(f"{path}: column {name!r} cannot be read as text ({exc})") from exc
    return pa.table(columns).to_pandas()


def _column_text(values: pa.ChunkedArray) -> pa.ChunkedArray:
    kind = values.type
    if pa.types.is_dictionary(kind):
        values, kind = values.cast(kind.value_type), kind.value_type
    if pa.types.is_string_view(kind):
        values, kind = values.cast(pa.large_string()), pa.large_string()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pc.fill_null(values, "")
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind) or kind in (pa.float32(), pa.float64()):
        uniques = pc.unique(values).drop_null()
        written = pa.array([_cell_text(v) for v in uniques.to_pylist()], pa.string())
        return pc.fill_null(pc.take(written, pc.index_in(values, uniques)), "")
    # Rare types, as pandas holds them (a date past year 9999 included): a Python object per cell, as before.
    return pa.chunked_array([pa.array(values.to_pandas().map(_cell_text).astype(object), pa.string())])


def _cell_text(value: object) -> str:
    """A cell as text: a float as Python writes it (shortest round trip), a missing value as "", else ``str``."""
    if value is None or value is pd.NA or value is pd.NaT:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)
