"""The bank's schedule: which aligned rows train, validate and test, and in which order they come.

Only row positions are ever shared with the partners, never labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bank.config import TrainingConfig
from bank.task import Task
from parties.errors import ConfigError

__all__ = ["Split", "epoch_batches", "split_rows"]


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def split_rows(n: int, targets: torch.Tensor, task: Task, config: TrainingConfig) -> Split:
    """A seeded train/validation/test split of the aligned positions, stratified by label."""
    from sklearn.model_selection import train_test_split  # here, not at the top: scikit-learn takes 1.4 s of a bank's start-up

    positions = np.arange(n)
    labels = targets.numpy() if task.stratify else None
    try:
        rest, test = train_test_split(
            positions, test_size=config.test_fraction, random_state=config.seed, stratify=labels
        )
        train, val = train_test_split(
            rest,
            test_size=config.val_fraction / (1 - config.test_fraction),
            random_state=config.seed,
            stratify=None if labels is None else labels[rest],
        )
    except ValueError as exc:
        raise ConfigError(f"cannot split {n} aligned rows as configured: {exc}") from exc
    return Split(np.sort(train), np.sort(val), np.sort(test))


def epoch_batches(train: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The batches of one epoch: a permutation seeded by (seed, epoch), cut into batches."""
    order = np.random.default_rng([seed, epoch]).permutation(train)
    return [torch.from_numpy(order[i : i + batch_size].astype(np.int64)) for i in range(0, len(order), batch_size)]
