"""A party's own table: loaded once, validated strictly, never sent anywhere.

Errors name the file, the column and a row number (1-based, counting the
header as row 1), never a customer ID or a value.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from safetensors.numpy import save as save_tensors

from parties.errors import DataError
from parties.learning.config import TaskKind
from parties.memory import release
from parties.storage.files import atomic_write_bytes
from parties.tables.ids import IdColumn, IdError, IdType, canonical_ids, id_formats, infer_id_type
from parties.tables.labels import check_labels, label_text
from parties.tables.schema import (
    DEFAULT_ID_COLUMN,
    DEFAULT_LABEL,
    FeatureSchema,
    PartySchema,
    file_row,
    infer_kinds,
    parse_numbers,
    read_schema,
    sidecar_path,
)

__all__ = [
    "AlignedRows",
    "FeatureSchema",
    "PartyTable",
    "load_alignment",
    "load_party_table",
    "read_table_text",
    "save_alignment",
    "sniff_separator",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartyTable:
    """A party's rows. ``normalized_ids``: each ID's canonical bytes under ``id_type`` (what PSI hashes);
    ``labels`` (the bank's): normalised text, checked against ``task``; ``id_formats``: how many IDs are
    written in each way (``parties.tables.ids``). ``ids`` as written, and ``normalized_ids``, are columns
    (Arrow-backed text, an ``IdColumn``), not a Python object per customer."""

    path: Path
    id_column: str
    ids: Sequence[str]
    features: pd.DataFrame
    schema: FeatureSchema
    labels: pd.Series | None = None
    normalized_ids: Sequence[bytes] = field(default=(), repr=False)
    id_type: IdType = "text"
    task: TaskKind | None = None
    id_formats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)


def sniff_separator(path: Path) -> str:
    """``;`` or ``,``, whichever the header line uses more."""
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        header = f.readline()
    return ";" if header.count(";") > header.count(",") else ","


_row = file_row


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


def load_party_table(
    path: Path,
    id_column: str | None = None,
    label_column: str | None = None,
    schema_path: Path | None = None,
    *,
    labelled: bool = False,
    categorical: Sequence[str] = (),
    numeric: Sequence[str] = (),
    schema: FeatureSchema | None = None,
    missing_numbers: bool = True,
    id_type: IdType | None = None,
    task: TaskKind | None = None,
) -> PartyTable:
    """Load and validate a party's table (CSV, Parquet or Feather).

    The ID column is ``id_column``, else the schema file's, else ``customer_id``;
    its type ``id_type``, else the schema file's, else inferred. With ``labelled``
    (the bank) the label is ``label_column``, else the schema file's, else ``y``,
    checked against ``task``, else the schema file's, else the inferred task. The
    feature kinds are ``schema`` (a trained model's, at scoring), else the schema
    file (``schema_path``, else ``<file>.schema.json`` beside the data), else
    inferred; ``categorical``/``numeric`` override either. ``missing_numbers``: an
    empty numeric cell is kept as missing (the encoder imputes the training
    mean, and counts it); ``False`` refuses it.
    """
    try:
        return _load(Path(path), id_column, label_column, schema_path, labelled, categorical, numeric, schema,
                     missing_numbers, id_type, task)
    finally:
        release()  # the file's text and every step's temporaries: several times the table at 10^6 rows


def _load(path: Path, id_column: str | None, label_column: str | None, schema_path: Path | None, labelled: bool,
          categorical: Sequence[str], numeric: Sequence[str], schema: FeatureSchema | None, missing_numbers: bool,
          id_type: IdType | None, task: TaskKind | None) -> PartyTable:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    sidecar_file = Path(schema_path) if schema_path is not None else sidecar_path(path)
    if schema_path is not None and not sidecar_file.exists():
        raise DataError(f"{sidecar_file}: no such schema file")
    declared = read_schema(sidecar_file) if schema is None else None
    id_column = id_column or (declared.id_column if declared else DEFAULT_ID_COLUMN)
    if labelled and label_column is None:
        label_column = declared.label_column if declared and declared.label_column else DEFAULT_LABEL
    frame = read_table_text(path)
    if frame.empty:
        raise DataError(f"{path}: the file has a header but no rows")
    columns = list(frame.columns)
    for role, col in (("ID", id_column), ("label", label_column)):
        if col is not None and col not in frame.columns:
            raise DataError(f"{path}: no {role} column {col!r} (columns: {', '.join(columns)})")

    raw_ids = frame[id_column]
    blank = raw_ids.str.strip() == ""
    if blank.any():
        raise DataError(f"{path}: column {id_column!r} is empty at row {_row(int(blank.to_numpy().argmax()))}")
    declared_by = "--id-type" if id_type else f"id_type in {sidecar_file.name}"
    id_type = id_type or (declared.id_type if declared else None)
    inferred = id_type is None
    id_type = id_type or infer_id_type(raw_ids)
    try:
        normalized = canonical_ids(raw_ids, id_type)
    except IdError as exc:
        raise DataError(f"{path}: column {id_column!r} holds {exc.count} {exc.what}, "
                        f"first at row {_row(exc.first)}; its IDs are declared integer ({declared_by}): declare them "
                        "text, or fix those rows") from exc
    formats = id_formats(raw_ids)
    _check_unique(path, id_column, id_type, normalized)
    if len(formats) > 1:
        logger.warning("%s: column %r writes its IDs in %d ways (%s); they are read as %s IDs (%s)%s", path.name,
                       id_column, len(formats), ", ".join(f"{n} {f}" for f, n in formats.items()), id_type,
                       "12, 12.0 and 0012 are one customer" if id_type == "integer" else "each as written",
                       ", inferred: declare id_type in the schema file to choose" if inferred else "")

    labels = None
    if label_column is not None:
        labels = label_text(frame[label_column])
        missing = labels == ""
        if missing.any():
            raise DataError(
                f"{path}: column {label_column!r} has no label at row {_row(int(missing.to_numpy().argmax()))}"
            )
        declared_task = task or (declared.task if declared else None)
        task = check_labels(labels, declared_task, label_column, path)
        logger.info("%s: label %r is %s (%s), %d distinct values", path.name, label_column, task,
                    "declared" if declared_task else "inferred; --task on serve or 'task' in the schema file to "
                    "choose", labels.nunique())

    feature_cols = [c for c in columns if c not in (id_column, label_column)]
    parsed: dict[str, pd.Series] = {}

    def numbers(col: str) -> pd.Series:  # each column parsed once, whether to infer its kind or to read it
        if col not in parsed:
            parsed[col] = parse_numbers(frame[col])
        return parsed[col]

    if schema is None:
        schema = _feature_schema(path, sidecar_file, declared, frame, feature_cols, categorical, numeric, numbers)
    else:
        absent = [c for c in schema.columns if c not in frame.columns]
        if absent:
            raise DataError(f"{path}: the model needs the columns {absent} (columns: {', '.join(columns)})")
    features = frame[list(schema.columns)].copy()
    for col in schema.numeric:
        values = numbers(col)
        missing = values.isna().to_numpy()
        empty = np.zeros(len(missing), dtype=bool)  # only a value that is no number can be empty
        empty[missing] = (features[col][missing].str.strip() == "").to_numpy()
        kinds = {"empty": empty & ~missing_numbers, "text": missing & ~empty,
                 "infinite": np.isinf(values.to_numpy(dtype=np.float64, na_value=np.nan))}
        bad = {kind: mask for kind, mask in kinds.items() if mask.any()}
        if bad:
            problems = ", ".join(f"{int(mask.sum())} {kind} (first at row {_row(int(mask.argmax()))})"
                                 for kind, mask in bad.items())
            raise DataError(f"{path}: column {col!r} is numeric, but holds values that are not finite numbers: "
                            f"{problems}")
        features[col] = values.astype("float64")
    for col in schema.categorical:
        features[col] = _compact(features[col])
    logger.info("loaded %s: %d rows, %d feature columns, %s IDs (%s)", path.name, len(frame), len(schema.columns),
                id_type, "inferred" if inferred else "declared")
    for col in schema.numeric:
        missing = int(features[col].isna().sum())
        if missing:
            logger.info("%s: column %r has %d missing values (the encoder imputes the training mean)",
                        path.name, col, missing)
    return PartyTable(
        path=path,
        id_column=id_column,
        ids=raw_ids.reset_index(drop=True),
        features=features,
        schema=schema,
        labels=labels,
        normalized_ids=normalized,
        id_type=id_type,
        task=task if labels is not None else None,
        id_formats=formats,
    )


def _compact(text: pd.Series) -> pd.Series:
    """A text column of few distinct values (a category) as pandas categorical: a small code per row, not its text.

    The values are the same strings, so every later step (encoding, drift, scoring) reads the same column."""
    values = pa.array(text, from_pandas=True)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)) or values.null_count:
        return text
    uniques = pc.unique(values)
    if len(uniques) > max(1, len(values) // 4) or len(uniques) >= 1 << 15:
        return text
    codes = pc.index_in(values, value_set=uniques).to_numpy(zero_copy_only=False).astype(np.int16)
    return pd.Series(pd.Categorical.from_codes(codes, categories=uniques.to_pylist()), index=text.index, name=text.name)


def _check_unique(path: Path, column: str, id_type: IdType, normalized: IdColumn) -> None:
    # Sorted (stably), a repeated ID sits right after an equal one: the earliest such row is the first repeat.
    ids = normalized.arrow
    order = pc.array_sort_indices(ids)
    ordered = ids.take(order)
    same = pc.equal(ordered[1:], ordered[:-1]).to_numpy(zero_copy_only=False)
    if same.any():
        later = int(order.to_numpy()[1:][same].min())
        first = int(pc.equal(ids, ids[later]).to_numpy(zero_copy_only=False).argmax())
        rule = ("as integers: 12, 12.0 and 0012 are one ID" if id_type == "integer" else
                "after stripping white space and Unicode NFC")
        raise DataError(f"{path}: column {column!r} has duplicate IDs (rows {_row(first)} and {_row(later)}, {rule})")


def _feature_schema(path: Path, sidecar: Path, declared: PartySchema | None, frame: pd.DataFrame,
                    feature_cols: list[str], categorical: Sequence[str], numeric: Sequence[str],
                    numbers: Callable[[str], pd.Series]) -> FeatureSchema:
    if declared is None:
        return FeatureSchema(*infer_kinds(frame, feature_cols, categorical=categorical, numeric=numeric,
                                          numbers=numbers))
    for col in declared.numeric + declared.categorical:
        if col not in frame.columns:
            raise DataError(f"{path}: column {col!r} named in {sidecar.name} is missing from the file")
    listed = [c for c in feature_cols if c in declared.numeric + declared.categorical]
    overrides_unknown = sorted((set(categorical) | set(numeric)) - set(listed))
    if overrides_unknown:
        raise DataError(f"{path}: --categorical/--numeric name columns {sidecar.name} does not list: {overrides_unknown}")
    kinds = {c: "numeric" for c in declared.numeric} | {c: "categorical" for c in declared.categorical}
    kinds |= {c: "categorical" for c in categorical} | {c: "numeric" for c in numeric}
    return FeatureSchema(tuple(c for c in listed if kinds[c] == "numeric"),
                         tuple(c for c in listed if kinds[c] == "categorical"))


@dataclass(frozen=True)
class AlignedRows:
    """The outcome of alignment at one party: its own row indices, in the order every party shares."""

    alignment_id: str
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def _table_digest(table: PartyTable) -> str:
    h = hashlib.sha256()
    for i in table.normalized_ids:
        h.update(len(i).to_bytes(4, "little"))
        h.update(i)
    return h.hexdigest()


def save_alignment(folder: Path, table: PartyTable, alignment: AlignedRows) -> None:
    """Keep the committed alignment on this party's disk, so a restarted service still has it."""
    blob = save_tensors(
        {"rows": np.ascontiguousarray(alignment.rows, dtype=np.int64)},
        metadata={"alignment_id": alignment.alignment_id, "table": _table_digest(table)},
    )
    atomic_write_bytes(Path(folder) / "alignment.safetensors", blob)


def load_alignment(folder: Path, table: PartyTable) -> AlignedRows | None:
    """The alignment saved by ``save_alignment``, if it was made on this very table."""
    path = Path(folder) / "alignment.safetensors"
    if not path.exists():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:  # numpy, not torch: reading a table needs no torch
        meta = f.metadata() or {}
        rows = f.get_tensor("rows")
    if meta.get("table") != _table_digest(table):
        logger.warning("ignoring the saved alignment: it was made on another version of %s", table.path.name)
        return None
    return AlignedRows(meta["alignment_id"], rows)
