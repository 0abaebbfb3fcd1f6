"""Models for customers some partners do not hold: one per subset of the parties scoring can meet.

The joint model needs every partner's embedding of a customer. A customer only some partners hold is
scored by the model of exactly the parties that hold them, trained in the same job, after the joint
model and from it, so the joint model (and its exact equivalence with the unsplit twin) is unchanged:

* **the bank alone**: ``BankOnlyModel`` on the bank's own columns, trained on every labelled customer
  of the bank's training share, aligned or not;
* **the bank with some of its partners** (two or more partners): a head of the top model's shape over
  those parties' embeddings from the trained joint bottoms, trained on the aligned training rows.

Each is judged on customers held out from all training: the bank's customers no partner holds (a
seeded, stratified share of them, split like the aligned rows), and the aligned test rows with the
absent partners' embeddings withheld.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from bank.epochs import EpochBook
from bank.vertical.aggregation import get_aggregation
from bank.scoring.bank_only import BankOnlyModel
from bank.scoring.calibration import held_out_metrics, reliability
from bank.config import TrainingConfig
from bank.scoring.manifest import SubsetEntry
from bank.vertical.schedule import Split, epoch_batches, split_rows
from bank.task import Task
from parties.errors import ConfigError, DataError
from parties.learning.model import build_optimizer, mlp
from parties.storage.files import atomic_write_bytes
from parties.tables.table import PartyTable

__all__ = ["BankRows", "SubsetModels", "head_from_blob", "partial_subsets", "subset_name", "train_subset_models",
           "unaligned_rows"]

logger = logging.getLogger(__name__)

#: Heads for every partial subset of up to this many partners (2^4 - 2 = 14 heads). With more partners,
#: customers some partners lack are scored by the bank-only model or reported as unscorable.
MAX_HEAD_PARTNERS = 4


def subset_name(parties: Sequence[str]) -> str:
    """A subset's name: its parties in the model's order, joined by ``+`` (``bank+telco``)."""
    return "+".join(parties)


def partial_subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Every subset with the bank (``names[0]``) and at least one partner, but not all: largest first."""
    bank, partners = names[0], list(names[1:])
    if len(partners) > MAX_HEAD_PARTNERS:
        return []
    return [(bank, *combo) for k in range(len(partners) - 1, 0, -1) for combo in itertools.combinations(partners, k)]


@dataclass(frozen=True)
class BankRows:
    """Rows of the bank's table with their targets; ``split`` holds positions into ``rows``."""

    rows: np.ndarray
    targets: torch.Tensor
    split: Split

    def part(self, name: str) -> tuple[np.ndarray, torch.Tensor]:
        positions = getattr(self.split, name)
        return self.rows[positions], self.targets[torch.from_numpy(positions.astype(np.int64))]


def unaligned_rows(table: PartyTable, aligned: np.ndarray, task: Task, config: TrainingConfig) -> BankRows:
    """The bank's labelled customers outside the alignment, split like the aligned rows (same fractions, seed).

    A label the task does not know (a class only unaligned customers have) cannot be learned: such rows
    are left out. Too few rows to split: all of them train, none is held out.
    """
    assert table.labels is not None
    rows = np.setdiff1d(np.arange(len(table)), aligned)
    labels = table.labels.iloc[rows]
    if task.kind == "regression":
        known = pd.to_numeric(labels, errors="coerce").notna().to_numpy()
    else:
        known = labels.astype(str).str.strip().isin(task.classes_).to_numpy()
    if not known.all():
        logger.warning("%d unaligned customers have a label the aligned rows lack: left out", int((~known).sum()))
    rows = rows[known]
    targets = task.targets(table.labels.iloc[rows]) if len(rows) else torch.zeros(0)
    empty = np.zeros(0, dtype=np.int64)
    try:
        split = split_rows(len(rows), targets, task, config, shared=False)  # no partner sees these rows
    except ConfigError:
        split = Split(np.arange(len(rows)), empty, empty)
    return BankRows(rows, targets, split)


def fit_head(inputs: torch.Tensor, targets: torch.Tensor, split: Split, task: Task,
             config: TrainingConfig) -> torch.nn.Module:
    """A head of the top model's shape on fixed inputs, with the joint training's schedule and early stopping."""
    head = mlp(inputs.shape[1], config.top.hidden, task.output_dim, activate_output=False, seed=config.top.seed)
    optimizer = build_optimizer(head.parameters(), config.top)
    val = torch.from_numpy(split.val.astype(np.int64))
    book = EpochBook(config.patience, task.objective)
    for epoch in range(config.epochs):
        for rows in epoch_batches(split.train, config.batch, config.seed, epoch):
            loss = task.loss(head(inputs[rows]), targets[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if not len(val):  # nothing to choose an epoch on: the last one
            continue
        with torch.no_grad():
            book.record(task.metrics(targets[val], task.scores(head(inputs[val])))[book.metric], state=head.state_dict)
        if book.stop:
            break
    if book.best_state is not None:
        head.load_state_dict(book.best_state)
    return head.eval()


def head_from_blob(blob: bytes, width: int, task: Task) -> torch.nn.Module:
    """A head (or the top model) from its safetensors bytes: the hidden widths are read off the weights."""
    weights = load_tensors(blob)
    layers = sorted({int(k.split(".")[0]) for k in weights})
    hidden = tuple(weights[f"{i}.weight"].shape[0] for i in layers)[:-1]
    head = mlp(width, hidden, task.output_dim, activate_output=False, seed=0)
    try:
        head.load_state_dict(weights)
    except RuntimeError as exc:
        raise DataError(f"the weights do not fit a head of width {width} ({exc})") from exc
    return head.eval()


@dataclass
class SubsetModels:
    """The trained models for partial subsets, and how every scoring path did on held-out customers."""

    names: list[str]
    unaligned: BankRows | None = None  # the bank's customers outside the alignment, and their split
    bank_only: BankOnlyModel | None = None
    heads: dict[str, torch.nn.Module] = field(default_factory=dict)
    held_out: dict[str, dict[str, Any]] = field(default_factory=dict)  # metrics.json's "subsets"
    calibration: pd.DataFrame = field(default_factory=pd.DataFrame)

    def save(self, model_dir: Path) -> dict[str, SubsetEntry]:
        """Each model under ``model_dir/subsets/<subset>/``; the manifest's entries."""
        entries = {}
        if self.bank_only is not None:
            name = subset_name(self.names[:1])
            files = self.bank_only.save(model_dir / "subsets" / name)
            entries[name] = SubsetEntry(parties=self.names[:1], kind="bank-only", files=files)
        for name, head in self.heads.items():
            blob = save_tensors({k: v.contiguous() for k, v in head.state_dict().items()})
            atomic_write_bytes(model_dir / "subsets" / name / "head.safetensors", blob)
            entries[name] = SubsetEntry(parties=name.split("+"), kind="head",
                                        files={"head.safetensors": hashlib.sha256(blob).hexdigest()})
        return entries


def _evaluate(models: SubsetModels, subset: str, group: str, task: Task, targets: torch.Tensor,
              scores: np.ndarray) -> None:
    models.held_out[subset]["held_out"][group] = figures = held_out_metrics(task, targets, scores)
    if task.kind == "binary" and "note" not in figures:
        bins = reliability(targets, scores).assign(subset=subset, held_out=group)
        models.calibration = pd.concat([models.calibration, bins], ignore_index=True)


def train_subset_models(
    *,
    table: PartyTable,
    aligned: np.ndarray,
    task: Task,
    targets: torch.Tensor,
    split: Split,
    config: TrainingConfig,
    names: list[str],
    joint_test_scores: np.ndarray,
    embeddings: dict[str, torch.Tensor] | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> SubsetModels:
    """Train the bank-only model and the heads; evaluate every scoring path on held-out customers.

    ``aligned``: the bank-table row of each aligned position; ``targets`` and ``split`` are the joint
    training's. ``embeddings``: every party's embedding of every aligned position from the trained joint
    bottoms (needed for heads only, so only with two or more partners).
    """
    models = SubsetModels(names=list(names))
    test = torch.from_numpy(split.test.astype(np.int64))
    full = subset_name(names)
    models.held_out[full] = {"model": "joint", "parties": list(names), "held_out": {}}
    _evaluate(models, full, "aligned test", task, targets[test], joint_test_scores)

    progress("the bank-only model, for customers no partner holds")
    models.unaligned = unaligned = unaligned_rows(table, aligned, task, config)
    train_rows, train_targets = unaligned.part("train")
    train_rows = np.concatenate([aligned[split.train], train_rows])
    train_targets = torch.cat([targets[torch.from_numpy(split.train.astype(np.int64))], train_targets])
    features = table.features[list(table.schema.columns)]
    bank = names[0]
    try:
        models.bank_only = BankOnlyModel(task, seed=config.seed).fit(
            features, table.schema, train_targets, rows=train_rows)
    except DataError as exc:
        logger.warning("no bank-only model: %s", exc)
    if models.bank_only is not None:
        models.held_out[bank] = {
            "model": "bank-only", "parties": [bank],
            "trained_on": {"aligned": len(split.train), "unaligned": len(unaligned.split.train)},
            "held_out": {},
        }
        if models.bank_only.trained_rows_ < len(train_rows):
            models.held_out[bank]["trained_on"]["sample"] = models.bank_only.trained_rows_
        test_rows, test_targets = unaligned.part("test")
        _evaluate(models, bank, "unaligned test", task, test_targets, models.bank_only.predict(features.iloc[test_rows])[0])
        _evaluate(models, bank, "aligned test, partners withheld", task, targets[test],
                  models.bank_only.predict(features.iloc[aligned[split.test]])[0])

    subsets = partial_subsets(names)
    if subsets and embeddings is not None:
        aggregation = get_aggregation(config.aggregation)
        for parties in subsets:
            name = subset_name(parties)
            progress(f"a head for customers only {name} hold")
            inputs = aggregation.combine([embeddings[p] for p in parties])
            models.heads[name] = head = fit_head(inputs, targets, split, task, config)
            models.held_out[name] = {"model": "head", "parties": list(parties), "trained_on": {"aligned": len(split.train)},
                                     "held_out": {}}
            absent = "+".join(p for p in names if p not in parties)
            with torch.no_grad():
                scores = task.scores(head(inputs[test]))
            _evaluate(models, name, f"aligned test, {absent} withheld", task, targets[test], scores)
    return models
