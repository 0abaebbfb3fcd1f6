"""Bottom models: a configurable MLP from a party's encoded columns to its cut-layer embedding."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

__all__ = ["BottomConfig", "OptimizerConfig", "build_bottom", "build_optimizer", "mlp", "seeded"]


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    optimizer: Literal["adam", "sgd"] = "adam"
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class BottomConfig(OptimizerConfig):
    """A party's own bottom model: its architecture, optimizer and seed are its own business."""

    hidden: tuple[int, ...] = (64,)
    cut_width: int = Field(16, ge=1, le=4096)
    seed: int = 0


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, *, activate_output: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = in_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_dim))
    if activate_output:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class seeded:
    """Build modules under a fixed seed without touching the caller's global RNG."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._ctx = torch.random.fork_rng(devices=[])

    def __enter__(self) -> None:
        self._ctx.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def build_bottom(in_dim: int, config: BottomConfig) -> nn.Sequential:
    """The bottom MLP; the same (in_dim, config) always gives the same initial weights."""
    with seeded(config.seed):
        return mlp(in_dim, config.hidden, config.cut_width, activate_output=True)


def build_optimizer(params: Iterable[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.learning_rate, weight_decay=config.weight_decay)
