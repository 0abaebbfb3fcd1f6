"""The bank-marketing files for the configurations beside vertical.

- ``prepare_owner``: U-shaped and vanilla. The bank owns every column and the label of its customers
  (``OUT/bank/bank.csv``); the compute party has no file.
- ``prepare_branches``: horizontal. The bank's customers are split across branches by a seeded, non-IID
  rule: each ``job`` value goes to one branch (the values shuffled by the seed, then dealt in turn), so the
  branches differ in who their customers are and in their subscription rates. Each branch holds every
  column of its own customers (``OUT/<branch>/<branch>.csv``); the bank's head office holds the labels and
  which branch each customer banks with (``OUT/bank/labels.csv``).

Every file gets the same schema sidecar (``<file>.schema.json``), so the branches encode alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from data.partition import BANK_COLUMNS, PARTNER_COLUMNS, SYNTHETIC_ID, read_source_csv
from data.uci import locate_bank_full
from parties.errors import ConfigError
from parties.storage.files import atomic_write_text
from parties.tables.schema import PartySchema, infer_kinds, sidecar_path

__all__ = ["BRANCH_COLUMN", "FEATURES", "LABEL", "prepare_branches", "prepare_owner"]

FEATURES = BANK_COLUMNS + PARTNER_COLUMNS
LABEL = "y"
BRANCH_COLUMN = "branch"


def _customers(rows: int | None, seed: int, cache: Path | None, download: bool) -> pd.DataFrame:
    if rows is not None and rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {rows}")
    frame = read_source_csv(locate_bank_full(cache, download=download))
    width = max(6, len(str(len(frame) - 1)))
    frame.insert(0, SYNTHETIC_ID, [f"C{i:0{width}d}" for i in range(len(frame))])  # as data.partition names them
    if rows is not None and rows < len(frame):
        keep = np.sort(np.random.default_rng(seed).permutation(len(frame))[:rows])
        frame = frame.iloc[keep].reset_index(drop=True)
    return frame


def _write(frame: pd.DataFrame, path: Path, label: str | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    numeric, categorical = infer_kinds(frame, list(FEATURES))
    PartySchema(id_column=SYNTHETIC_ID, label_column=label, numeric=numeric, categorical=categorical).write(
        sidecar_path(path))
    return path


def prepare_owner(out: Path, *, rows: int | None = None, seed: int = 0, cache: Path | None = None,
                  download: bool = True) -> dict[str, Path]:
    """``OUT/bank/bank.csv``: every column and the label of the bank's customers (the whole file, or a slice)."""
    frame = _customers(rows, seed, cache, download)
    return {"bank": _write(frame[[SYNTHETIC_ID, *FEATURES, LABEL]], Path(out) / "bank" / "bank.csv", LABEL)}


def branch_of_job(jobs: pd.Series, branches: list[str], seed: int) -> dict[str, str]:
    """Which branch each job value goes to: the sorted values shuffled by ``seed``, then dealt in turn."""
    values = sorted(jobs.unique().tolist())
    order = np.random.default_rng(seed).permutation(len(values))
    return {values[i]: branches[k % len(branches)] for k, i in enumerate(order)}


def prepare_branches(out: Path, *, branches: int = 3, rows: int | None = None, seed: int = 0,
                     cache: Path | None = None, download: bool = True) -> dict[str, Path]:
    """One file per branch (every column, its own customers) and the head office's ``labels.csv``."""
    if not 2 <= branches <= 12:
        raise ConfigError(f"--branches must be 2 to 12 (one job value at least per branch), got {branches}")
    frame = _customers(rows, seed, cache, download)
    names = [f"branch-{i + 1}" for i in range(branches)]
    assignment = branch_of_job(frame["job"], names, seed)
    frame[BRANCH_COLUMN] = frame["job"].map(assignment)
    out = Path(out)
    paths = {}
    for name in names:
        mine = frame[frame[BRANCH_COLUMN] == name]
        paths[name] = _write(mine[[SYNTHETIC_ID, *FEATURES]], out / name / f"{name}.csv", None)
    labels = out / "bank" / "labels.csv"
    labels.parent.mkdir(parents=True, exist_ok=True)
    # In each branch's row order: the bank checks it against a hash of the branch's IDs before training.
    frame[[SYNTHETIC_ID, BRANCH_COLUMN, LABEL]].to_csv(labels, index=False)
    paths["bank"] = labels
    summary = {name: {"rows": int((frame[BRANCH_COLUMN] == name).sum()),
                      "positive_rate": round(float((frame.loc[frame[BRANCH_COLUMN] == name, LABEL] == "yes").mean()), 4),
                      "jobs": sorted(j for j, b in assignment.items() if b == name)} for name in names}
    atomic_write_text(out / "branches.json", json.dumps({"rule": "job", "seed": seed, "branches": summary}, indent=2)
                      + "\n")
    return paths
