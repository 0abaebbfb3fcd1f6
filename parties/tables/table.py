"""A party's own table: loaded once, validated strictly, never sent anywhere.

Errors name the file, the column and a row number (1-based, counting the
header as row 1), never a customer ID or a value.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
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
from parties.memory import MappedColumns, release
from parties.storage.files import atomic_write_bytes
from parties.tables.ids import IdColumn, IdError, IdType, canonical_ids, id_formats, infer_id_type
from parties.tables.labels import check_labels, label_text
from parties.tables.reading import TextColumns, read_table_text, sniff_separator
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
]  # read_table_text and sniff_separator: parties.tables.reading's, here for the callers that import them here

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


_row = file_row


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
    spill_dir: Path | None = None,
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

    The feature columns are kept in a private unnamed file in ``spill_dir`` (None: the system's temporary
    folder), mapped read-only: numbers and category codes are the page cache's, not the process's memory.
    """
    try:
        return _load(Path(path), id_column, label_column, schema_path, labelled, categorical, numeric, schema,
                     missing_numbers, id_type, task, spill_dir)
    finally:
        release()  # the file's text and every step's temporaries: several times the table at 10^6 rows


def _load(path: Path, id_column: str | None, label_column: str | None, schema_path: Path | None, labelled: bool,
          categorical: Sequence[str], numeric: Sequence[str], schema: FeatureSchema | None, missing_numbers: bool,
          id_type: IdType | None, task: TaskKind | None, spill_dir: Path | None) -> PartyTable:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    sidecar_file = Path(schema_path) if schema_path is not None else sidecar_path(path)
    if schema_path is not None and not sidecar_file.exists():
        raise DataError(f"{sidecar_file}: no such schema file")
    declared = read_schema(sidecar_file) if schema is None else None
    id_column = id_column or (declared.id_column if declared else DEFAULT_ID_COLUMN)
    if labelled and label_column is None:
        label_column = declared.label_column if declared and declared.label_column else DEFAULT_LABEL
    frame = TextColumns(path)  # a Parquet or Feather file column by column: one column's text at a time
    if not frame.columns or len(frame) == 0:
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
    def numbers_once(col: str) -> pd.Series:  # for the build: a parse kept from inference is let go of once used
        return parsed.pop(col) if col in parsed else parse_numbers(frame[col])

    features = _build_features(path, frame, schema, numbers_once, missing_numbers, spill_dir)
    frame.check_unchanged()
    logger.info("loaded %s: %d rows, %d feature columns, %s IDs (%s)", path.name, len(frame), len(schema.columns),
                id_type, "inferred" if inferred else "declared")
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


def _build_features(path: Path, frame: TextColumns, schema: FeatureSchema, numbers: Callable[[str], pd.Series],
                    missing_numbers: bool, folder: Path | None) -> pd.DataFrame:
    """The feature columns, checked, one at a time: numbers as float64 and categories as codes written to a private
    file and mapped read-only (``parties.memory.MappedColumns``: the page cache holds them, not the service); a
    text column of many distinct values stays in memory."""
    try:
        return _features_kept(path, frame, schema, numbers, missing_numbers, folder)
    except OSError as exc:  # the folder missing or full
        where = folder if folder is not None else tempfile.gettempdir()
        raise DataError(f"{path}: its columns could not be kept in {where} ({exc.strerror or exc}); free space "
                        "there, or give the service another state folder") from exc


def _features_kept(path: Path, frame: TextColumns, schema: FeatureSchema, numbers: Callable[[str], pd.Series],
                   missing_numbers: bool, folder: Path | None) -> pd.DataFrame:
    store, kept = MappedColumns(folder), {}
    for col in schema.columns:
        if col in schema.numeric:
            values = _checked_numbers(path, col, lambda col=col: frame[col], numbers(col), missing_numbers)
            missing = int(np.isnan(values).sum())
            if missing:
                logger.info("%s: column %r has %d missing values (the encoder imputes the training mean)",
                            path.name, col, missing)
            kept[col] = (store.append(values), None)
            continue
        compact = _compact(frame[col])
        if isinstance(compact.dtype, pd.CategoricalDtype):
            kept[col] = (store.append(compact.cat.codes.to_numpy()), compact.dtype)
        else:
            kept[col] = compact
    arrays, columns = store.open(), {}
    for col, held in kept.items():
        if isinstance(held, pd.Series):
            columns[col] = held
            continue
        number, dtype = held
        values = arrays[number] if dtype is None else pd.Categorical.from_codes(arrays[number], dtype=dtype)
        columns[col] = pd.Series(values, name=col, copy=False)
    return pd.DataFrame(columns, index=pd.RangeIndex(len(frame)), columns=list(schema.columns), copy=False)


def _checked_numbers(path: Path, col: str, text: Callable[[], pd.Series], values: pd.Series,
                     missing_numbers: bool) -> np.ndarray:
    """A numeric column's values (float64, NaN where missing), or a ``DataError`` naming what is not a finite
    number. ``text()``: the column as written, read only where a value is missing (empty, or no number)."""
    missing = values.isna().to_numpy()
    empty = np.zeros(len(missing), dtype=bool)  # only a value that is no number can be empty
    if missing.any():
        empty[missing] = (text()[missing].str.strip() == "").to_numpy()
    numbers = values.to_numpy(dtype=np.float64, na_value=np.nan)
    kinds = {"empty": empty & ~missing_numbers, "text": missing & ~empty, "infinite": np.isinf(numbers)}
    bad = {kind: mask for kind, mask in kinds.items() if mask.any()}
    if bad:
        problems = ", ".join(f"{int(mask.sum())} {kind} (first at row {_row(int(mask.argmax()))})"
                             for kind, mask in bad.items())
        raise DataError(f"{path}: column {col!r} is numeric, but holds values that are not finite numbers: "
                        f"{problems}")
    return numbers


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
