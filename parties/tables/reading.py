"""Reading a party's file: CSV, Parquet or Feather, every cell as the text it stands for.

Text first, types second: the party's schema decides what a column is (``parties.tables.table``), not the
reader's guess, so a table means the same whichever format it came in.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from parties.errors import DataError

__all__ = ["ARROW_SUFFIXES", "COLUMNAR_SUFFIXES", "PARQUET_SUFFIXES", "TextColumns", "read_table_text",
           "sniff_separator"]


def sniff_separator(path: Path) -> str:
    """``;`` or ``,``, whichever the header line uses more."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        header = f.readline()
    return ";" if header.count(";") > header.count(",") else ","


PARQUET_SUFFIXES = (".parquet", ".pq")
#: Arrow's own file format (Feather V2, or V1). Read, not memory-mapped: a mapped file rewritten in place (as
#: pandas and pyarrow write one) while the service holds it would kill the process with a bus error.
ARROW_SUFFIXES = (".feather", ".arrow", ".ipc")
COLUMNAR_SUFFIXES = PARQUET_SUFFIXES + ARROW_SUFFIXES


def read_table_text(path: Path) -> pd.DataFrame:
    """A CSV (``;`` or ``,``; any line ending), Parquet or Feather/Arrow file, every cell as text, missing cells as ``""``.

    Text first, types second: the party's schema decides what a column is, not
    the reader's guess, so a table means the same whichever format it came in.
    """
    return TextColumns(path).frame()


class TextColumns:
    """A file's columns as ``read_table_text`` reads them, one column at a time where the format allows it.

    A Parquet or Feather (Arrow IPC) file is read column by column, so loading a table holds one column's text,
    not the table's; a CSV file (and an old Feather V1 file) is read whole, once. ``columns``: the names, in the
    file's order; ``source[name]``: that column as text; ``len(source)``: the rows.
    """

    def __init__(self, path: Path) -> None:
        self.path = path = Path(path)
        self._whole: pd.DataFrame | None = None
        self._read: Callable[[str], pa.ChunkedArray] | None = None
        self._rows: int | None = None
        self._last: pd.Series | None = None  # the column read last: one column's text, not the table's
        self._seen = _identity(path) if path.exists() else None
        with _readable(path):
            with path.open("rb") as f:
                magic = f.read(6)
            if path.suffix.lower() in PARQUET_SUFFIXES or magic[:4] == b"PAR1":
                import pyarrow.parquet as pq

                # One handle for every column: a file renamed over this one meanwhile is not read half and half.
                parquet = pq.ParquetFile(pa.OSFile(str(path)))
                if any("." in name for name in parquet.schema_arrow.names):
                    # Parquet names a nested field by its dotted path: "a.c" could read a's field c. Read whole.
                    table = parquet.read(use_threads=False)
                    self._open(table.schema, table.column)
                else:
                    self._open(parquet.schema_arrow,
                               lambda name: parquet.read(columns=[name], use_threads=False).column(0))
                self._rows = parquet.metadata.num_rows
            elif path.suffix.lower() in ARROW_SUFFIXES or magic == b"ARROW1":
                from pyarrow import feather

                handle = pa.OSFile(str(path))
                try:
                    schema = pa.ipc.open_file(handle).schema
                except pa.ArrowInvalid:  # Feather V1: read whole, then made text column by column
                    table = feather.read_table(path, memory_map=False)
                    self._open(table.schema, table.column)
                    self._rows = table.num_rows
                else:
                    def column(name: str) -> pa.ChunkedArray:
                        only = pa.ipc.IpcReadOptions(included_fields=[schema.get_field_index(name)], use_threads=False)
                        return pa.ipc.open_file(handle, options=only).read_all().column(0)

                    self._open(schema, column)
            else:
                separator = sniff_separator(path)
                try:
                    # Arrow's reader: text columns without a Python object per cell, and in a tenth of the time.
                    self._whole = pd.read_csv(path, dtype=str, keep_default_na=False, sep=separator, engine="pyarrow")
                except pd.errors.ParserError as exc:
                    if "CSV parse error" in str(exc):  # Arrow quotes the row, which may hold an ID: say where it is
                        raise DataError(f"{path}: not a readable CSV file ({_ragged_row(path, separator)})") from None
                    raise DataError(f"{path}: not a readable CSV or Parquet file ({exc})") from exc
        self.columns: list[str] = [str(c) for c in self._whole.columns] if self._whole is not None else self._names

    def _open(self, schema: pa.Schema, read: Callable[[str], pa.ChunkedArray]) -> None:
        index = (schema.pandas_metadata or {}).get("index_columns", [])  # a pandas index is not a column
        hidden = {c for c in index if isinstance(c, str)} if isinstance(index, list) else set()
        names = [str(c) for c in schema.names if c not in hidden]
        repeated = sorted({c for c in names if names.count(c) > 1})
        if repeated:
            raise DataError(f"{self.path}: columns named more than once: {repeated}")
        self._names, self._read = names, read

    def check_unchanged(self) -> None:
        """Refuse a file that was replaced or rewritten while it was read a column at a time (``DataError``):
        its columns could come from two versions of it."""
        if self._whole is None and self._seen is not None and _identity(self.path) != self._seen:
            raise DataError(f"{self.path}: the file changed while it was read; load it again once it is written")

    def __len__(self) -> int:
        if self._whole is not None:
            return len(self._whole)
        if self._rows is None:
            self._rows = len(self[self.columns[0]]) if self.columns else 0
        return self._rows

    def __getitem__(self, name: str) -> pd.Series:
        if self._whole is not None:
            return self._whole[name]
        if name not in self.columns or self._read is None:
            raise KeyError(name)
        if self._last is not None and self._last.name == name:  # asked again in a row (inferring a kind, then parsing)
            return self._last
        self._last = None
        with _readable(self.path):
            values = self._read(name)
        if self._rows is None:
            self._rows = len(values)
        if len(values) != self._rows:
            raise DataError(f"{self.path}: column {name!r} has {len(values)} rows; the file has {self._rows}")
        try:
            text = _column_text(values)
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
            raise DataError(f"{self.path}: column {name!r} cannot be read as text ({exc})") from exc
        with _readable(self.path):
            self._last = pa.table({name: text}).to_pandas()[name]
        return self._last

    def frame(self) -> pd.DataFrame:
        """Every column at once."""
        if self._whole is not None:
            return self._whole
        return pd.DataFrame({name: self[name] for name in self.columns}, columns=self.columns)


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is replaced (its inode) or rewritten in place (its size, its modification time)."""
    seen = path.stat()
    return seen.st_dev, seen.st_ino, seen.st_size, seen.st_mtime_ns


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """What a reader raises about the file, as a ``DataError`` naming it."""
    try:
        yield
    except pd.errors.EmptyDataError as exc:
        raise DataError(f"{path}: the file is empty") from exc
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
