"""Reference models for a run. SIMULATION ONLY: they read every party's file.

No bank can compute these in real life: they join all parties' columns in
one place. In a simulation (the walkthrough keeps every party's file under
``<run>/data/``) they show what the partnership is worth: the split model
next to a bank-only model and centralised references, all on exactly the
run's own train/validation/test rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
from sklearn.linear_model import LogisticRegression, Ridge

from bank.config import TopConfig
from bank.epochs import EpochBook, train_epochs
from bank.vertical.results import Run
from bank.lab.references.unsplit import UnsplitModel
from bank.task import Task
from bank.vertical.coordinator import epoch_batches
from parties.errors import ConfigError, DataError
from parties.learning.model import BottomConfig
from parties.learning.trained_bottom import read_bottom_config
from parties.tables.encoding import InputLayout, TabularEncoder
from parties.tables.table import PartyTable, load_party_table

__all__ = ["NoPartition", "PartyFiles", "fit_unsplit", "joined_features", "reference_models"]


class NoPartition(DataError):
    """No partition folder with every party's file: references (a simulation's privilege) cannot be computed."""


#: Where every party's file is: a folder ``python -m data partition`` wrote (its ``partition.json`` names them),
#: each party's own file by name (pre-split files), or ``None`` for the walkthrough's ``<run>/data``.
PartyFiles = Path | dict[str, Path] | None


def _party_files(run: Run, partition: PartyFiles) -> tuple[str, dict[str, Path]]:
    """The label party's name and every party's file: named one by one, or from a partition folder."""
    if isinstance(partition, dict):
        return _named_files(run, partition)
    folder = Path(partition) if partition is not None else run.path / "data"
    manifest = folder / "partition.json"
    if not manifest.exists():
        raise NoPartition(f"{manifest}: missing. Reference models need every party's file, which only a simulation "
                        "has: name each party's own file with --party-file NAME=FILE, or point --partition at the "
                        "folder python -m data partition wrote")
    described = json.loads(manifest.read_text())
    label_party = described.get("spec", {}).get("label_party", "bank")
    files = {name: folder / info["file"] for name, info in described["parties"].items()}
    for name, path in files.items():
        if not path.is_file():
            raise DataError(f"{path}: {name}'s file, named in {manifest}, is missing")
    return label_party, files


def _named_files(run: Run, files: dict[str, Path]) -> tuple[str, dict[str, Path]]:
    """The files named per party (``--party-file NAME=FILE``): one for each of the run's parties, no other."""
    bank, *partners = run.metrics["embedding_widths"]
    missing = [n for n in (bank, *partners) if n not in files]
    unknown = sorted(set(files) - {bank, *partners})
    if missing or unknown:
        raise ConfigError(f"--party-file: the run's parties are the bank {bank!r} and the partners {partners}; "
                          + (f"give a file for {missing}" if missing else f"{unknown} took no part in it"))
    for name, path in files.items():
        if not Path(path).is_file():
            raise DataError(f"{path}: {name}'s file (--party-file) does not exist")
    return bank, {name: Path(path) for name, path in files.items()}


def joined_features(run: Run, partition: PartyFiles = None, layouts: dict[str, InputLayout] | None = None,
                    ) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray]]:
    """Each party's encoded columns for the run's aligned rows (in the run's order), the targets, the splits.

    Encoders are fitted on the run's training rows only, as each party does, with the quantile bins its saved
    encoder has (a bottom with piecewise-linear embeddings); ``layouts``, if given, gets each party's
    ``TabularEncoder.layout``. Each file is read through its own schema file (ID column, label, column
    kinds), as its party reads it.
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
        _check_party_file(run, name, path, table, bank)
        where = {i: k for k, i in enumerate(table.normalized_ids)}
        missing = sum(i not in where for i in ids)
        if missing:
            raise DataError(f"{path}: {missing} of the run's aligned customers are not in {name}'s file; "
                            "is this the partition the run was trained on?")
        tables[name] = (table, np.array([where[i] for i in ids]))
    features = {}
    for name, (table, rows) in tables.items():
        frame = table.features.iloc[rows]
        encoder = TabularEncoder(table.schema, bins=_saved_bins(run, name)).fit(frame.iloc[train])
        features[name] = encoder.transform(frame)
        if layouts is not None:
            layouts[name] = encoder.layout
    task = Task(run.metrics["task"], run.config.get("positive_label")).fit(bank.labels.iloc[bank_rows])
    targets = task.targets(bank.labels.iloc[bank_rows]).numpy()
    splits = {k: np.flatnonzero(split["split"].to_numpy() == k) for k in ("train", "val", "test")}
    return features, targets, splits


def _saved_bins(run: Run, name: str) -> int:
    """The quantile bins of the encoder a party saved with its model (0: none saved, or z-scores)."""
    saved = run.model_dir(name) / ("bank/encoder.json" if name == "bank" else "encoder.json")
    return int(json.loads(saved.read_text()).get("bins", 0)) if saved.is_file() else 0


#: The test metrics a comparison shows, per task.
COMPARED = {"binary": ("roc_auc", "pr_auc"), "multiclass": ("accuracy", "log_loss"), "regression": ("r2", "rmse")}


def _check_party_file(run: Run, name: str, path: Path, table: PartyTable, bank: PartyTable) -> None:
    """A partner's file must be that partner's: not one holding the bank's label, and, where the run keeps the
    partner's model files, one with the columns its model was trained on."""
    label = bank.labels.name if bank.labels is not None else None
    if label is not None and label in table.schema.columns:
        raise DataError(f"{path}: given as {name}'s file, it holds the bank's label column {label!r}: is it the "
                        "bank's file?")
    encoder = run.model_dir(name) / "encoder.json"
    if encoder.exists():
        trained = TabularEncoder.from_dict(json.loads(encoder.read_text())).schema
        if set(trained.columns) != set(table.schema.columns):
            raise DataError(f"{path}: given as {name}'s file, its columns {list(table.schema.columns)} are not the "
                            f"ones {name}'s model trained on {list(trained.columns)}")


def _scores(task: Task, name: str, features: str, y: np.ndarray, s: np.ndarray) -> dict[str, object]:
    figures = task.metrics(torch.from_numpy(y), s)
    return {"model": name, "features": features, **{f"test_{m}": figures[m] for m in COMPARED[task.kind]}}


def _partner_bottom(run: Run, name: str) -> BottomConfig:
    return read_bottom_config((run.model_dir(name) / "bottom-config.json").read_text())


def _unsplit_mlp(run: Run, features: dict[str, np.ndarray], targets: np.ndarray, splits: dict[str, np.ndarray],
                 layouts: dict[str, InputLayout]) -> np.ndarray:
    """The run's own architecture and schedule, trained in one process with the same early stopping.

    On one intra-op thread, as every party computes by default (``--torch-threads 1``): with more,
    torch splits some reductions differently, the last bits differ, and after a few hundred steps
    so does the model; with one, it is the split model bit for bit.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_unsplit(run, features, targets, splits, layouts)
    finally:
        torch.set_num_threads(previous)


def _train_unsplit(run: Run, features: dict[str, np.ndarray], targets: np.ndarray, splits: dict[str, np.ndarray],
                   layouts: dict[str, InputLayout]) -> np.ndarray:
    config = run.config
    bottoms = {"bank": BottomConfig.model_validate(config["bank_bottom"])}
    bottoms |= {n: _partner_bottom(run, n) for n in features if n != "bank"}
    task = Task.from_dict(json.loads((run.bank_run_dir / "model" / "task.json").read_text()))
    model = UnsplitModel(features, bottoms, TopConfig.model_validate(config["top"]), config["aggregation"], task,
                         layouts)
    return fit_unsplit(model, targets, splits, config, config["seed"])


def fit_unsplit(model: UnsplitModel, targets: np.ndarray, splits: dict[str, np.ndarray], config: dict[str, Any],
                seed: int, book: EpochBook | None = None) -> np.ndarray:
    """Train ``model`` with the run's schedule (batches from ``seed``), early stopping on the task's objective and
    the run's ``restore_best``; its test scores. ``book``, if given, keeps the epochs' validation scores."""
    task = model.task
    y = torch.from_numpy(targets.astype(np.int64 if task.kind == "multiclass" else np.float32))
    val, test = (torch.from_numpy(splits[k]) for k in ("val", "test"))

    def steps(epoch: int) -> Iterator[Callable[[], float]]:
        for rows in epoch_batches(splits["train"], config["batch_size"], seed, epoch):
            yield lambda rows=rows: model.train_step(rows, y)

    def validate() -> dict[str, float]:
        with torch.no_grad():
            return task.metrics(y[val], task.scores(model(val)))

    train_epochs(book or EpochBook(config["patience"], task.objective), config["epochs"], steps, validate,
                 state=model.state_dict, restore=model.load_state_dict if config.get("restore_best", True) else None)
    with torch.no_grad():
        return task.scores(model(test))


def reference_models(run: Run, seed: int = 0, partition: PartyFiles = None) -> pd.DataFrame:
    """The split model and its references on the run's own test rows: the task's headline test metrics.

    ``partition``: where every party's file is (``PartyFiles``). The unsplit MLP needs every
    partner's bottom configuration: it is left out when the run folder lacks a partner's model files (a run
    trained by separate services keeps them with each partner).
    """
    task = Task.from_dict(json.loads((run.bank_run_dir / "model" / "task.json").read_text()))
    layouts: dict[str, InputLayout] = {}
    features, y, splits = joined_features(run, partition, layouts)
    train, test = splits["train"], splits["test"]
    everything = np.hstack(list(features.values()))
    metrics = COMPARED[task.kind]
    rows = [{"model": "split model (this run)", "features": "all parties",
             **{f"test_{m}": run.metrics["test"][m] for m in metrics}}]
    bank_name = next(iter(run.metrics.get("embedding_widths", {"bank": 0})))
    bank_only = run.metrics.get("subsets", {}).get(bank_name, {}).get("held_out", {}).get("aligned test, partners withheld")
    if bank_only is not None and "note" not in bank_only:  # trained on unaligned customers as well
        rows.append({"model": "bank-only model (this run)", "features": "bank",
                     **{f"test_{m}": bank_only[m] for m in metrics}})
    if task.kind == "regression":
        gbm, linear, named = HistGradientBoostingRegressor, Ridge, "linear regression"
        predict = lambda model, x: model.predict(x)  # noqa: E731
    else:
        gbm, linear, named = HistGradientBoostingClassifier, lambda: LogisticRegression(max_iter=2000), "logistic regression"
        classes = np.arange(task.output_dim if task.kind == "multiclass" else 2)

        def predict(model, x):  # every class's probability, in the task's order, also for classes absent in training
            proba = np.zeros((len(x), len(classes)))
            proba[:, model.classes_.astype(int)] = model.predict_proba(x)
            return proba[:, 1] if task.kind == "binary" else proba
    for name, cols, model in (("bank only: HistGradientBoosting", "bank", gbm(random_state=seed)),
                              (f"centralised: {named}", "all parties", linear()),
                              ("centralised: HistGradientBoosting", "all parties", gbm(random_state=seed))):
        x = features["bank"] if cols == "bank" else everything
        rows.append(_scores(task, name, cols, y[test], predict(model.fit(x[train], y[train]), x[test])))
    partners_saved = all((run.model_dir(name) / "bottom-config.json").exists() for name in features if name != "bank")
    if partners_saved:
        rows.append(_scores(task, "centralised: unsplit MLP (same architecture)", "all parties", y[test],
                            _unsplit_mlp(run, features, y, splits, layouts)))
    return pd.DataFrame(rows)
