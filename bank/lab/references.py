"""Reference models for a run. SIMULATION ONLY: they read every party's file.

No bank can compute these in real life: they join all parties' columns in
one place. In a simulation (the walkthrough keeps every party's file under
``<run>/data/``) they show what the partnership is worth: the split model
next to a bank-only model and centralised references, all on exactly the
run's own train/validation/test rows.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn import metrics as skm
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression

from bank.config import TopConfig
from bank.lab.analysis import Run
from bank.lab.unsplit import UnsplitModel
from bank.task import Task
from bank.trainer import epoch_batches
from parties.errors import DataError
from parties.learning.model import BottomConfig
from parties.tables.encoding import TabularEncoder
from parties.tables.table import load_party_table

__all__ = ["NoPartition", "fit_unsplit", "joined_features", "reference_models"]


class NoPartition(DataError):
    """No partition folder with every party's file: references (a simulation's privilege) cannot be computed."""


def _party_files(run: Run, partition: Path | None) -> tuple[str, dict[str, Path]]:
    """The label party's name and every party's file, from a partition folder's ``partition.json``."""
    folder = Path(partition) if partition is not None else run.path / "data"
    manifest = folder / "partition.json"
    if not manifest.exists():
        raise NoPartition(f"{manifest}: missing. Reference models need every party's file, which only a simulation "
                        "has: point --partition at the folder python -m data partition wrote")
    described = json.loads(manifest.read_text())
    label_party = described.get("spec", {}).get("label_party", "bank")
    files = {name: folder / info["file"] for name, info in described["parties"].items()}
    for name, path in files.items():
        if not path.is_file():
            raise DataError(f"{path}: {name}'s file, named in {manifest}, is missing")
    return label_party, files


def joined_features(run: Run, partition: Path | None = None
                    ) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
    """Each party's encoded columns for the run's aligned rows (in the run's order), the targets, the splits.

    Encoders are fitted on the run's training rows only, as each party does. Each file is read through its
    own schema file (ID column, label, column kinds), as its party reads it.
    """
    label_party, files = _party_files(run, partition)
    bank = load_party_table(files.pop(label_party), labelled=True)
    split = run.split.sort_values("position")
    bank_rows = split["bank_row"].to_numpy()
    ids = [bank.normalized_ids[r] for r in bank_rows]
    train = np.flatnonzero(split["split"].to_numpy() == "train")
    tables = {"bank": (bank, bank_rows)}
    for name, path in files.items():
        table = load_party_table(path)
        where = {i: k for k, i in enumerate(table.normalized_ids)}
        missing = sum(i not in where for i in ids)
        if missing:
            raise DataError(f"{path}: {missing} of the run's aligned customers are not in {name}'s file; "
                            "is this the partition the run was trained on?")
        tables[name] = (table, np.array([where[i] for i in ids]))
    features = {}
    for name, (table, rows) in tables.items():
        frame = table.features.iloc[rows]
        features[name] = TabularEncoder(table.schema).fit(frame.iloc[train]).transform(frame)
    task = Task(run.metrics["task"], run.config.get("positive_label")).fit(bank.labels.iloc[bank_rows])
    targets = task.targets(bank.labels.iloc[bank_rows]).numpy()
    splits = {k: np.flatnonzero(split["split"].to_numpy() == k) for k in ("train", "val", "test")}
    return features, targets, splits


def _scores(name: str, features: str, y: np.ndarray, s: np.ndarray) -> dict[str, object]:
    return {"model": name, "features": features, "test_roc_auc": skm.roc_auc_score(y, s),
            "test_pr_auc": skm.average_precision_score(y, s)}


def _partner_bottom(run: Run, name: str) -> BottomConfig:
    return BottomConfig.model_validate_json((run.model_dir(name) / "bottom-config.json").read_text())


def _unsplit_mlp(run: Run, features: dict[str, np.ndarray], targets: np.ndarray, splits: dict[str, np.ndarray]) -> np.ndarray:
    """The run's own architecture and schedule, trained in one process with the same early stopping.

    On one intra-op thread, as every party computes by default (``--torch-threads 1``): with more,
    torch splits some reductions differently, the last bits differ, and after a few hundred steps
    so does the model; with one, it is the split model bit for bit.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_unsplit(run, features, targets, splits)
    finally:
        torch.set_num_threads(previous)


def _train_unsplit(run: Run, features: dict[str, np.ndarray], targets: np.ndarray, splits: dict[str, np.ndarray]) -> np.ndarray:
    config = run.config
    bottoms = {"bank": BottomConfig.model_validate(config["bank_bottom"])}
    bottoms |= {n: _partner_bottom(run, n) for n in features if n != "bank"}
    model = UnsplitModel(features, bottoms, TopConfig.model_validate(config["top"]), config["aggregation"], Task("binary"))
    return fit_unsplit(model, targets, splits, config, config["seed"])


def fit_unsplit(model: UnsplitModel, targets: np.ndarray, splits: dict[str, np.ndarray], config: dict[str, Any],
                seed: int) -> np.ndarray:
    """Train ``model`` with the run's schedule (batches from ``seed``) and early stopping; its test scores."""
    task = model.task
    y = torch.from_numpy(targets.astype(np.float32))
    val, test = (torch.from_numpy(splits[k]) for k in ("val", "test"))
    best, best_state, stale = -1.0, None, 0
    for epoch in range(config["epochs"]):
        model.train_batches(epoch_batches(splits["train"], config["batch_size"], seed, epoch), y)
        with torch.no_grad():
            auc = skm.roc_auc_score(targets[splits["val"]], task.scores(model.eval()(val)))
        model.train()
        if auc > best:
            best, best_state, stale = auc, copy.deepcopy(model.state_dict()), 0
        else:
            stale += 1
            if stale >= config["patience"]:
                break
    model.load_state_dict(best_state)
    with torch.no_grad():
        return task.scores(model.eval()(test))


def reference_models(run: Run, seed: int = 0, partition: Path | None = None) -> pd.DataFrame:
    """Test ROC-AUC and PR-AUC of the split model and its references, on the run's own test rows.

    ``partition``: the folder ``python -m data partition`` wrote (default: the walkthrough's ``<run>/data``).
    The unsplit MLP needs every partner's bottom configuration: it is left out when the run folder lacks
    a partner's model files (a run trained by separate services keeps them with each partner).
    """
    if run.metrics["task"] != "binary":
        raise NoPartition(f"reference models are implemented for binary tasks, not {run.metrics['task']}")
    features, y, splits = joined_features(run, partition)
    train, test = splits["train"], splits["test"]
    everything = np.hstack(list(features.values()))
    rows = [{"model": "split model (this run)", "features": "all parties",
             "test_roc_auc": run.metrics["test"]["roc_auc"], "test_pr_auc": run.metrics["test"]["pr_auc"]}]
    bank_only = run.metrics.get("subsets", {}).get("bank", {}).get("held_out", {}).get("aligned test, partners withheld")
    if bank_only is not None:  # what scores customers no partner holds, trained on unaligned customers as well
        rows.append({"model": "bank-only model (this run)", "features": "bank",
                     "test_roc_auc": bank_only["roc_auc"], "test_pr_auc": bank_only["pr_auc"]})
    hgb = HistGradientBoostingClassifier(random_state=seed)
    rows.append(_scores("bank only: HistGradientBoosting", "bank", y[test],
                        hgb.fit(features["bank"][train], y[train]).predict_proba(features["bank"][test])[:, 1]))
    lr = LogisticRegression(max_iter=2000)
    rows.append(_scores("centralised: logistic regression", "all parties", y[test],
                        lr.fit(everything[train], y[train]).predict_proba(everything[test])[:, 1]))
    hgb = HistGradientBoostingClassifier(random_state=seed)
    rows.append(_scores("centralised: HistGradientBoosting", "all parties", y[test],
                        hgb.fit(everything[train], y[train]).predict_proba(everything[test])[:, 1]))
    if all((run.model_dir(name) / "bottom-config.json").exists() for name in features if name != "bank"):
        rows.append(_scores("centralised: unsplit MLP (same architecture)", "all parties", y[test],
                            _unsplit_mlp(run, features, y, splits)))
    return pd.DataFrame(rows)
