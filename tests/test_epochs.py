"""The epoch book every training loop keeps: best epoch by the task's objective, patience, what is restored."""

from __future__ import annotations

import json
import math

import pytest

from bank.epochs import EpochBook
from bank.task import Task


def _run(book: EpochBook, scores: list[float]) -> list[int]:
    """Record ``scores`` until the book stops; the epochs that were the best when they ended."""
    bests = []
    for score in scores:
        epoch = book.epochs + 1
        if book.record(score, {"val": score}, state=lambda: {"weights": [epoch]}):
            bests.append(epoch)
        if book.stop:
            break
    return bests


def test_higher_is_better_for_roc_auc_and_the_book_stops_after_patience() -> None:
    book = EpochBook(patience=2)
    assert _run(book, [0.6, 0.7, 0.65, 0.69, 0.9]) == [1, 2]
    assert book.stop and book.epochs == 4  # epoch 5 never ran: two epochs without a better score
    assert (book.best_epoch, book.best_score, book.best_state) == (2, 0.7, {"weights": [2]})
    assert [row["epoch"] for row in book.history] == [1, 2, 3, 4]


@pytest.mark.parametrize(("kind", "scores", "best"), [
    ("binary", [0.6, 0.8, 0.7], 2),  # roc_auc: higher is better
    ("multiclass", [0.9, 0.5, 0.7], 2),  # log_loss: lower is better
    ("regression", [3.0, 2.0, 2.5], 2),  # mse: lower is better
])
def test_the_task_says_which_way_is_better(kind: str, scores: list[float], best: int) -> None:
    book = EpochBook(patience=10, objective=Task(kind).objective)
    _run(book, scores)
    assert book.best_epoch == best and book.best_score == scores[best - 1]


def test_a_nan_score_is_not_kept_over_a_real_one() -> None:
    book = EpochBook(patience=5)
    assert _run(book, [math.nan, 0.55, 0.5]) == [1, 2]
    assert book.best_epoch == 2


def test_the_state_is_taken_only_at_a_new_best_and_as_a_copy() -> None:
    calls: list[int] = []
    weights = {"w": [1.0]}
    book = EpochBook(patience=3)

    def state() -> dict[str, list[float]]:
        calls.append(len(book.history))
        return weights

    book.record(0.5, state=state)
    book.record(0.4, state=state)
    weights["w"][0] = 2.0  # training goes on, in place
    assert calls == [1] and book.best_state == {"w": [1.0]}


def test_a_checkpointed_book_continues_as_if_never_stopped() -> None:
    scores = [0.6, 0.7, 0.65, 0.66, 0.72, 0.71, 0.70, 0.69]
    whole = EpochBook(patience=3)
    _run(whole, scores)
    half = EpochBook(patience=3)
    _run(half, scores[:4])
    saved = json.loads(json.dumps(half.meta()))  # what a checkpoint keeps, through JSON
    resumed = EpochBook(patience=3).restore(saved, half.best_state)
    _run(resumed, scores[4:])
    assert resumed.meta() == whole.meta() and resumed.best_state == whole.best_state
    assert (resumed.best_epoch, resumed.epochs) == (5, 8)
