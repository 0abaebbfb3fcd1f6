"""A bottom trainer's saved state says exactly what is pending: a restore continues from any step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parties.learning.bottom import BottomTrainer
from parties.learning.model import BottomConfig
from parties.storage.checkpoint import Checkpoint

CONFIG = BottomConfig(hidden=(8,), cut_width=4, seed=3)


def _trainer() -> BottomTrainer:
    return BottomTrainer(np.random.default_rng(0).normal(size=(40, 5)).astype(np.float32), CONFIG)


def _restored(trainer: BottomTrainer) -> BottomTrainer:
    tensors, meta = trainer.state()
    fresh = _trainer()
    fresh.load_state(Checkpoint(meta["next_step"] - 1, tensors, meta), meta)
    return fresh


def _epoch(trainer: BottomTrainer, first: int, flush: bool = True) -> None:
    """Two batches, then (``flush``) the step that only carries the last gradient."""
    grad = None
    for k, rows in enumerate((torch.arange(0, 8), torch.arange(8, 16))):
        trainer.step(first + k, grad, rows)
        grad = torch.full((8, 4), 0.1 * (k + 1))
    if flush:
        trainer.step(first + 2, grad, None)


@pytest.mark.parametrize("where", ["after the flush", "mid-epoch"])
def test_a_restored_trainer_continues_exactly_like_the_original(where: str) -> None:
    original = _trainer()
    _epoch(original, 0, flush=where == "after the flush")
    restored = _restored(original)
    if where == "after the flush":
        original.mark_best()  # nothing is pending after a flush, in the original and in the restored one
        restored.mark_best()
        next_step = (3, None, torch.arange(16, 24))
    else:
        next_step = (2, torch.full((8, 4), 0.2), None)
    for trainer in (original, restored):
        trainer.step(*next_step)
    assert all(torch.equal(a, b) for a, b in zip(original.model.parameters(), restored.model.parameters()))


def test_the_state_after_a_flush_holds_no_pending_rows() -> None:
    trainer = _trainer()
    _epoch(trainer, 0)
    tensors, _ = trainer.state()
    assert "pending.rows" not in tensors
