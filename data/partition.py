"""Split one table vertically into per-party files, as separate organisations would hold it.

Each party gets its own columns plus the customer ID, for its own seeded,
shuffled subset of customers, so the overlap between parties is partial. The
label stays with one party (the bank). This is a simulation helper: in real
life each party already has its own file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from parties.errors import ConfigError, DataError
from parties.storage.files import atomic_write_text
from parties.tables.reading import COLUMNAR_SUFFIXES, read_table_text, sniff_separator
from parties.tables.schema import PartySchema, infer_kinds, sidecar_path

__all__ = [
    "BANK_COLUMNS",
    "PARTNER_COLUMNS",
    "PartitionSpec",
    "PartySpec",
    "bank_marketing_spec",
    "partition",
    "read_source_csv",
    "write_partition",
]

BANK_COLUMNS = ("age", "job", "marital", "education", "default", "balance", "housing", "loan")
PARTNER_COLUMNS = ("contact", "day", "month", "duration", "campaign", "pdays", "previous", "poutcome")
SYNTHETIC_ID = "customer_id"


@dataclass(frozen=True)
class PartySpec:
    name: str
    columns: tuple[str, ...]
    coverage: float = 1.0  # share of all customers this party holds


@dataclass(frozen=True)
class PartitionSpec:
    parties: tuple[PartySpec, ...]
    label_column: str
    label_party: str
    id_column: str | None = None  # None: synthesise stable IDs from the row number
    seed: int = 0
    categorical: tuple[str, ...] = ()  # columns to treat as categorical whatever they look like (integer codes)
    numeric: tuple[str, ...] = ()

    @property
    def output_id_column(self) -> str:
        """The ID column of the files written: the input's, or ``customer_id`` for synthesised IDs."""
        return self.id_column or SYNTHETIC_ID

    def validate(self, columns: Sequence[str], source: str) -> None:
        names = [p.name for p in self.parties]
        if len(set(names)) != len(names):
            raise ConfigError(f"party names repeat: {names}")
        if self.label_party not in names:
            raise ConfigError(f"the label party {self.label_party!r} is not one of the parties {names}")
        wanted = [c for p in self.parties for c in p.columns] + [self.label_column]
        if self.id_column:
            wanted.append(self.id_column)
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise ConfigError(f"{source}: no column {missing[0]!r} (columns: {', '.join(columns)})")
        owned = [c for p in self.parties for c in p.columns]
        twice = sorted({c for c in owned if owned.count(c) > 1})
        if twice:
            raise ConfigError(f"columns assigned to more than one party: {twice}")
        if self.label_column in owned:
            raise ConfigError(f"the label column {self.label_column!r} cannot also be a feature")
        unknown = sorted((set(self.categorical) | set(self.numeric)) - set(owned))
        if unknown:
            raise ConfigError(f"--categorical/--numeric name columns no party holds: {unknown}")
        both = sorted(set(self.categorical) & set(self.numeric))
        if both:
            raise ConfigError(f"columns declared both categorical and numeric: {both}")
        for p in self.parties:
            if not 0 < p.coverage <= 1:
                raise ConfigError(f"coverage of {p.name!r} must be in (0, 1], got {p.coverage}")


def bank_marketing_spec(
    n_partners: int = 1,
    *,
    partner_names: Sequence[str] | None = None,
    bank_coverage: float = 0.95,
    partner_coverage: float = 0.90,
    seed: int = 0,
) -> PartitionSpec:
    """The walkthrough's split: the bank keeps demographics and ``y``; partners keep the campaign columns."""
    if n_partners < 1:
        raise ConfigError("--partners must be at least 1")
    if n_partners > len(PARTNER_COLUMNS):
        raise ConfigError(f"--partners can be at most {len(PARTNER_COLUMNS)} (one column each)")
    if partner_names is None:
        partner_names = ["partner"] if n_partners == 1 else [f"partner{i + 1}" for i in range(n_partners)]
    if len(partner_names) != n_partners:
        raise ConfigError(f"{len(partner_names)} partner names given for {n_partners} partners")
    groups = np.array_split(np.array(PARTNER_COLUMNS), n_partners)
    partners = tuple(
        PartySpec(name, tuple(str(c) for c in cols), partner_coverage) for name, cols in zip(partner_names, groups)
    )
    return PartitionSpec(
        parties=(PartySpec("bank", BANK_COLUMNS, bank_coverage), *partners),
        label_column="y",
        label_party="bank",
        seed=seed,
    )


def read_source_csv(path: Path, sep: str | None = None) -> pd.DataFrame:
    """Read a CSV (or Parquet or Feather) file as text (IDs keep leading zeros); ``sep=None`` picks ``;`` or ``,``."""
    path = Path(path)
    if path.suffix.lower() in COLUMNAR_SUFFIXES:
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        return read_table_text(path)
    try:
        frame = pd.read_csv(path, sep=sep or sniff_separator(path), dtype=str, keep_default_na=False)
    except FileNotFoundError as exc:
        raise DataError(f"{path}: no such file") from exc
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a readable CSV ({exc})") from exc
    if frame.empty:
        raise DataError(f"{path}: the file has no rows")
    return frame


def partition(frame: pd.DataFrame, spec: PartitionSpec, source: str = "input") -> dict[str, pd.DataFrame]:
    """One frame per party: its ID column, its own columns (the label party also the label), its rows."""
    spec.validate(list(frame.columns), source)
    if spec.id_column:
        ids = frame[spec.id_column]
        id_name = spec.id_column
        if ids.duplicated().any():
            raise DataError(f"{source}: column {spec.id_column!r} has duplicate IDs")
    else:
        # The source row number is stable across runs and slices of the same file.
        width = max(6, len(str(int(frame.index.max()))))
        ids = pd.Series([f"C{i:0{width}d}" for i in frame.index], index=frame.index)
        id_name = spec.output_id_column
    rng = np.random.default_rng(spec.seed)
    out: dict[str, pd.DataFrame] = {}
    for party in spec.parties:
        n = round(party.coverage * len(frame))
        rows = rng.permutation(len(frame))[:n]
        cols = list(party.columns) + ([spec.label_column] if party.name == spec.label_party else [])
        part = frame.iloc[rows][cols].copy()
        part.insert(0, id_name, ids.iloc[rows].to_numpy())
        out[party.name] = part.reset_index(drop=True)
    return out


def write_partition(frames: dict[str, pd.DataFrame], spec: PartitionSpec, out_dir: Path) -> dict[str, Path]:
    """Write ``OUT/<party>/<party>.csv`` and its schema; ``OUT/partition.json`` describes the split."""
    out_dir = Path(out_dir)
    id_column = spec.output_id_column
    paths: dict[str, Path] = {}
    for name, frame in frames.items():
        path = out_dir / name / f"{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(path, index=False)
        features = [c for c in frame.columns if c not in (id_column, spec.label_column)]
        numeric, categorical = infer_kinds(frame, features, categorical=[c for c in spec.categorical if c in features],
                                           numeric=[c for c in spec.numeric if c in features])
        label = spec.label_column if name == spec.label_party else None
        PartySchema(id_column=id_column, label_column=label, numeric=numeric, categorical=categorical).write(
            sidecar_path(path))
        paths[name] = path
    manifest = {
        "spec": asdict(spec) | {"output_id_column": id_column},
        "id_column": id_column,
        "parties": {n: {"file": str(p.relative_to(out_dir)), "rows": len(frames[n])} for n, p in paths.items()},
    }
    atomic_write_text(out_dir / "partition.json", json.dumps(manifest, indent=2) + "\n")
    return paths
