"""The epoch book every training loop of the bank keeps: the per-epoch history, the best epoch by the task's
objective, what to restore from it, and early stopping.

One book for the vertical coordinator, the other configurations, the bank's own heads and the lab's references,
so that "the best epoch" and "patience" mean the same thing in every run folder.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EpochBook", "train_epochs"]

Objective = tuple[str, Literal["max", "min"]]


@dataclass
class EpochBook:
    """Epochs as they end, each with its validation score on the objective (``Task.objective``).

    ``best_epoch`` numbers epochs from 1, as the history does (0: no epoch yet); ``stale`` counts the epochs
    since the best; the loop stops when ``stale`` reaches ``patience``. An epoch whose score is NaN is never
    better than one with a score.
    """

    patience: int
    objective: Objective = ("roc_auc", "max")
    history: list[dict[str, Any]] = field(default_factory=list)
    best_score: float | None = None
    best_epoch: int = 0
    stale: int = 0
    best_state: Any = None  # what ``record``'s ``state`` gave at the best epoch (a deep copy)

    @property
    def metric(self) -> str:
        return self.objective[0]

    def better(self, score: float, than: float | None) -> bool:
        if than is None or (math.isnan(than) and not math.isnan(score)):
            return True
        return score > than if self.objective[1] == "max" else score < than

    def record(self, score: float, row: dict[str, Any] | None = None,
               state: Callable[[], Any] | None = None) -> bool:
        """The next epoch ends with validation ``score``: whether it is the best so far.

        ``row`` is its line of the history (``epoch`` is added unless it has one); ``state`` is called only for a
        new best, and a deep copy of what it returns is kept as ``best_state``.
        """
        row = dict(row or {})
        self.history.append(row if "epoch" in row else {"epoch": len(self.history) + 1, **row})
        if not self.better(score, self.best_score):
            self.stale += 1
            return False
        self.best_score, self.best_epoch, self.stale = score, len(self.history), 0
        if state is not None:
            self.best_state = copy.deepcopy(state())
        return True

    def record_validation(self, metrics: dict[str, float], row: dict[str, Any] | None = None,
                          state: Callable[[], Any] | None = None) -> bool:
        """``record`` an epoch from its validation metrics (``Task.metrics``): the objective's is its score, and
        every one goes in its history row as ``val_<metric>``."""
        return self.record(metrics[self.metric], {**(row or {}), **{f"val_{m}": v for m, v in metrics.items()}},
                           state)

    @property
    def stop(self) -> bool:
        """Early stopping: ``patience`` epochs in a row without a better score."""
        return self.stale >= self.patience

    @property
    def epochs(self) -> int:
        return len(self.history)

    def meta(self) -> dict[str, Any]:
        """What a checkpoint keeps of the book, as plain JSON (``best_state`` is the caller's to save)."""
        return {"history": self.history, "best_score": self.best_score, "best_epoch": self.best_epoch,
                "stale": self.stale}

    def restore(self, meta: dict[str, Any], best_state: Any = None) -> EpochBook:
        """The book as ``meta`` (from ``meta()``) left it; ``best_state`` as saved beside it."""
        self.history = list(meta["history"])
        self.best_score, self.best_epoch, self.stale = meta["best_score"], meta["best_epoch"], meta["stale"]
        self.best_state = best_state
        return self


def train_epochs(book: EpochBook, epochs: int, steps: Callable[[int], Iterable[Callable[[], object]]],
                 validate: Callable[[], dict[str, float]], *, state: Callable[[], Any],
                 restore: Callable[[Any], object] | None = None, max_steps: int | None = None) -> list[float]:
    """The epoch loop of a model trained in one process (the lab's unsplit references and twins).

    Each epoch runs ``steps(epoch)`` (one callable per training step; ``max_steps`` in all, if given), then
    records ``validate()`` (the task's metrics) in ``book`` with ``state()`` kept at a new best, and stops
    when the book says so. Then ``restore`` (if given) gets the best epoch's state. Returns the seconds each
    epoch's steps took.
    """
    seconds: list[float] = []
    done = 0
    for epoch in range(epochs):
        began = time.perf_counter()
        for step in steps(epoch):
            if max_steps is not None and done >= max_steps:
                break
            step()
            done += 1
        seconds.append(time.perf_counter() - began)
        book.record_validation(validate(), state=state)
        if book.stop or (max_steps is not None and done >= max_steps):
            break
    if restore is not None and book.best_state is not None:
        restore(book.best_state)
    return seconds
