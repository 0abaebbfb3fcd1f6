"""Single-process twins of the U-shaped, vanilla and horizontal configurations, and centralised training.

Each twin trains the same model, from the same seeds, on the same rows in the same order as its split run,
with every layer in one process and one backward pass per step: what the split run must equal, bit for bit
(``tests/test_configurations.py``). ``centralised`` trains the horizontal model on all the bank's rows at
once, shuffled together: the reference the horizontal bars are measured against, which no split run equals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bank.configurations.horizontal import BranchLabels, fedavg, horizontal_top
from bank.configurations.u_shaped import OwnerData, owner_head
from bank.vertical.schedule import epoch_batches
from bank.configurations.split_run import ConfigurationSettings
from bank.epochs import EpochBook, train_epochs
from bank.task import Task
from parties.learning.model import build_bottom, build_optimizer, mlp
from parties.tables.encoding import TabularEncoder
from parties.tables.table import PartyTable

__all__ = ["TwinOutcome", "centralised", "encode_branches", "horizontal_twin", "owner_twin", "reference_for_run"]


@dataclass
class TwinOutcome:
    test_scores: np.ndarray
    test: dict[str, float]
    history: list[dict[str, Any]]
    best_epoch: int
    models: dict[str, nn.Module]
    epoch_seconds: list[float] = field(default_factory=list)


def _update(optimizers: list[torch.optim.Optimizer], loss: torch.Tensor) -> None:
    """One step of every part: gradients from one backward pass, then each part's optimizer."""
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    for o in optimizers:
        o.step()


def owner_twin(settings: ConfigurationSettings, data: OwnerData) -> TwinOutcome:
    """U-shaped (bottom -> trunk -> head) or vanilla (bottom -> server layers), every layer here."""
    t = settings.training
    bottom = build_bottom(data.features.shape[1], settings.bottom)
    if settings.configuration == "u-shaped":
        tr = settings.trunk
        rest = [mlp(settings.bottom.cut_width, tr.hidden, tr.width, activate_output=True, seed=tr.seed)]
        head = owner_head(settings, data.task)
        assert head is not None
        rest.append(head)
        configs = [settings.bottom, tr, settings.top]
    else:
        rest = [mlp(settings.bottom.cut_width, settings.top.hidden, data.task.output_dim, activate_output=False,
                    seed=settings.top.seed)]
        configs = [settings.bottom, settings.top]
    modules = [bottom, *rest]
    optimizers = [build_optimizer(m.parameters(), c) for m, c in zip(modules, configs)]
    model = nn.Sequential(*modules)
    split, task = data.split, data.task

    def scores(positions: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return task.scores(model(data.features[torch.from_numpy(positions)]))

    def steps(epoch: int) -> Iterator[Callable[[], None]]:
        for rows in epoch_batches(split.train, t.batch, t.seed, epoch):
            yield lambda rows=rows: _update(optimizers, task.loss(model(data.features[rows]), data.targets[rows]))

    book = EpochBook(t.patience, task.objective)
    seconds = train_epochs(book, t.epochs, steps,
                           lambda: task.metrics(data.targets[torch.from_numpy(split.val)], scores(split.val)),
                           state=model.state_dict, restore=model.load_state_dict if t.restore_best else None,
                           max_steps=t.max_steps)
    test_scores = scores(split.test)
    test = task.metrics(data.targets[torch.from_numpy(split.test)], test_scores)
    names = ["bottom", "trunk", "head"] if len(modules) == 3 else ["bottom", "server"]
    return TwinOutcome(test_scores, test, book.history, book.best_epoch, dict(zip(names, modules)), seconds)


def encode_branches(tables: dict[str, PartyTable], encoder: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each branch's rows through the shared encoder, as the branch encodes them."""
    enc = TabularEncoder.from_dict(encoder)
    return {b: torch.from_numpy(enc.transform(tables[b].features)) for b in tables}


def horizontal_twin(settings: ConfigurationSettings, task: Task, labels: dict[str, BranchLabels],
                    features: dict[str, torch.Tensor]) -> TwinOutcome:
    """Relay: one bottom trained branch after branch. SplitFed: one bottom per branch, one top, FedAvg."""
    t = settings.training
    order = sorted(labels)
    relay = settings.configuration == "relay"
    bottoms = {b: build_bottom(features[b].shape[1], settings.bottom) for b in (order[:1] if relay else order)}
    if relay:
        bottoms = {b: bottoms[order[0]] for b in order}
    bottom_opts = {b: build_optimizer(bottoms[b].parameters(), settings.bottom) for b in (order[:1] if relay else order)}
    if relay:
        bottom_opts = {b: bottom_opts[order[0]] for b in order}
    top = horizontal_top(settings, task)
    top_opt = build_optimizer(top.parameters(), settings.top)
    rows_of = {b: len(labels[b].split.train) for b in order}

    def step(branches: list[str], batches: list[torch.Tensor]) -> None:
        zs = [bottoms[b](features[b][r]) for b, r in zip(branches, batches)]
        targets = torch.cat([labels[b].targets[r] for b, r in zip(branches, batches)])
        loss = task.loss(top(torch.cat(zs) if len(zs) > 1 else zs[0]), targets)
        # The relay's branches share one optimizer: each once.
        _update([top_opt, *{id(bottom_opts[b]): bottom_opts[b] for b in branches}.values()], loss)

    def average() -> None:
        mean = fedavg([bottoms[b].state_dict() for b in order], [rows_of[b] for b in order])
        for b in order:
            bottoms[b].load_state_dict(mean)

    def scores(part: str) -> tuple[np.ndarray, torch.Tensor]:
        with torch.no_grad():
            s = [task.scores(top(bottoms[b](features[b][torch.from_numpy(getattr(labels[b].split, part))])))
                 for b in order]
        y = torch.cat([labels[b].targets[torch.from_numpy(getattr(labels[b].split, part))] for b in order])
        return np.concatenate(s), y

    def steps(epoch: int) -> Iterator[Callable[[], None]]:
        if relay:
            for b in order:
                for r in epoch_batches(labels[b].split.train, t.batch, t.seed, epoch):
                    yield lambda b=b, r=r: step([b], [r])
            return
        batches = {b: epoch_batches(labels[b].split.train, t.batch, t.seed, epoch) for b in order}
        longest = max(len(v) for v in batches.values())
        for j in range(longest):
            def one(j: int = j) -> None:
                active = [b for b in order if j < len(batches[b])]
                step(active, [batches[b][j] for b in active])
                if (settings.fedavg_every and (j + 1) % settings.fedavg_every == 0) or j == longest - 1:
                    average()
            yield one

    def restore(best: dict[str, Any]) -> None:
        for b in (order[:1] if relay else order):
            bottoms[b].load_state_dict(best["bottom"])
        top.load_state_dict(best["top"])

    book = EpochBook(t.patience, task.objective)
    seconds = train_epochs(book, t.epochs, steps, lambda: task.metrics(*reversed(scores("val"))),
                           state=lambda: {"bottom": bottoms[order[0]].state_dict(), "top": top.state_dict()},
                           restore=restore if t.restore_best else None)
    test_scores, y = scores("test")
    return TwinOutcome(test_scores, task.metrics(y, test_scores), book.history, book.best_epoch,
                       {"bottom": bottoms[order[0]], "top": top}, seconds)


def centralised(settings: ConfigurationSettings, task: Task, labels: dict[str, BranchLabels],
                features: dict[str, torch.Tensor]) -> TwinOutcome:
    """The horizontal model (bottom -> top) trained on every branch's training rows at once, shuffled together,
    with the same validation rows, early stopping and test rows."""
    t = settings.training
    order = sorted(labels)
    x = torch.cat([features[b] for b in order])
    offsets = np.cumsum([0] + [len(features[b]) for b in order])
    y = torch.cat([labels[b].targets for b in order])

    def pooled(part: str) -> np.ndarray:
        return np.concatenate([getattr(labels[b].split, part) + offsets[i] for i, b in enumerate(order)])

    train, val, test = pooled("train"), pooled("val"), pooled("test")
    bottom = build_bottom(x.shape[1], settings.bottom)
    top = horizontal_top(settings, task)
    model = nn.Sequential(bottom, top)
    optimizers = [build_optimizer(bottom.parameters(), settings.bottom), build_optimizer(top.parameters(), settings.top)]

    def scores(positions: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return task.scores(model(x[torch.from_numpy(positions)]))

    def steps(epoch: int) -> Iterator[Callable[[], None]]:
        for rows in epoch_batches(train, t.batch, t.seed, epoch):
            yield lambda rows=rows: _update(optimizers, task.loss(model(x[rows]), y[rows]))

    book = EpochBook(t.patience, task.objective)
    seconds = train_epochs(book, t.epochs, steps, lambda: task.metrics(y[torch.from_numpy(val)], scores(val)),
                           state=model.state_dict, restore=model.load_state_dict if t.restore_best else None)
    test_scores = scores(test)
    return TwinOutcome(test_scores, task.metrics(y[torch.from_numpy(test)], test_scores), book.history,
                       book.best_epoch, {"bottom": bottom, "top": top}, seconds)


def reference_for_run(out: Path, settings: ConfigurationSettings) -> dict[str, Any]:
    """Train a walkthrough run's twin (and, horizontal, the centralised model) from the run's own files; add
    ``reference`` to its ``summary.json`` (whether the run equals its twin, and the centralised figure)."""
    import json

    import pandas as pd

    from bank.configurations.runs import read_labels
    from bank.configurations.horizontal import branch_labels
    from bank.configurations.u_shaped import owner_data
    from data.configurations import BRANCH_COLUMN, LABEL
    from parties.storage.files import atomic_write_text
    from parties.tables.table import load_party_table

    torch.set_num_threads(1)
    summary = json.loads((out / "summary.json").read_text())
    predictions = pd.read_csv(out / "test_predictions.csv")
    split_scores = predictions[[c for c in predictions.columns if c.startswith("score")]].to_numpy(np.float32)
    reference: dict[str, Any] = {}
    if settings.configuration in ("u-shaped", "vanilla"):
        table = load_party_table(out / "data" / "bank" / "bank.csv", None, LABEL, labelled=True)
        twin = owner_twin(settings, owner_data(table, settings.training))
    else:
        frame = read_labels(out / "data" / "bank" / "labels.csv")
        task = Task(settings.training.task, settings.training.positive_label).fit(frame[LABEL])
        labels = branch_labels(frame, "customer_id", BRANCH_COLUMN, LABEL, task, settings)
        tables = {b: load_party_table(out / "data" / b / f"{b}.csv") for b in labels}
        features = encode_branches(tables, json.loads((out / "encoder.json").read_text()))
        twin = horizontal_twin(settings, task, labels, features)
        c = centralised(settings, task, labels, features)
        reference["centralised"] = {"test": c.test, "best_epoch": c.best_epoch,
                                    "mean_epoch_seconds": float(np.mean(c.epoch_seconds))}
    twin_scores = twin.test_scores.astype(np.float32).reshape(split_scores.shape)
    reference["twin"] = {
        "test": twin.test, "best_epoch": twin.best_epoch,
        "equal": bool(np.array_equal(split_scores, twin_scores)),
        "max_difference": float(np.abs(split_scores - twin_scores).max()) if len(twin_scores) else 0.0,
        "mean_epoch_seconds": float(np.mean(twin.epoch_seconds)),
    }
    summary["reference"] = reference
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    return summary
