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
from parties.learning.secret import Secret

__all__ = ["Split", "epoch_batches", "split_rows"]


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def split_rows(n: int, targets: torch.Tensor, task: Task, config: TrainingConfig, *,
               secret: Secret | None = None, shared: bool = True) -> Split:
    """A train/validation/test split of the aligned positions.

    ``shared``: the partners see it (which rows they train on, which they embed for validation and test).
    Then it must not depend on the labels in a way they can replay: by default it is seeded by the public seed
    and not stratified, so it says nothing of the labels. Stratified (``config.stratify``), its shuffles come
    from the bank's ``secret``: a split stratified with a public seed let a partner replay it and read each
    row's label at 0.90 AUC, whatever the defenses. A split the partners never see (the bank's own
    customers outside the alignment) is stratified with the public seed.
    """
    from sklearn.model_selection import train_test_split  # here, not at the top: scikit-learn takes 1.4 s of a bank's start-up

    positions = np.arange(n)
    stratify = task.stratify and (config.stratify or not shared)
    labels = targets.numpy() if stratify else None
    if stratify and shared:
        if secret is None:
            raise ConfigError("a stratified split the partners see needs the bank's secret")
        seed = int(secret.numpy("split").integers(1 << 31))
    else:
        seed = config.seed
    try:
        rest, test = train_test_split(positions, test_size=config.test_fraction, random_state=seed, stratify=labels)
        train, val = train_test_split(
            rest,
            test_size=config.val_fraction / (1 - config.test_fraction),
            random_state=seed,
            stratify=None if labels is None else labels[rest],
        )
    except ValueError as exc:
        raise ConfigError(f"cannot split {n} aligned rows as configured: {exc}") from exc
    if task.kind == "binary":
        for name, part in (("validation", val), ("test", test)):
            if len(np.unique(targets.numpy()[part])) < 2:
                raise ConfigError(f"the {name} rows ({len(part)} of {n}) hold one class only: give a larger "
                                  f"{name}_fraction, or stratify (the split then comes from the bank's secret)")
    return Split(np.sort(train), np.sort(val), np.sort(test))


def epoch_batches(train: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The batches of one epoch: a permutation seeded by (seed, epoch), cut into batches."""
    order = np.random.default_rng([seed, epoch]).permutation(train)
    return [torch.from_numpy(order[i : i + batch_size].astype(np.int64)) for i in range(0, len(order), batch_size)]
