"""The unsplit model: every party's bottom, the aggregation and the top in one process.

It is what split training must equal, step for step: the exactness tests and
the speed benchmark train it side by side with the split services. It reads
every party's features, which only a simulation can do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from bank.vertical.aggregation import get_aggregation
from bank.config import TopConfig
from bank.task import Task
from parties.learning.model import BottomConfig, InputLayout, build_bottom, build_optimizer, build_top

__all__ = ["UnsplitModel"]


class UnsplitModel(nn.Module):
    """Bottoms (in the coordinator's party order), aggregation and top, with the same seeds as split training."""

    def __init__(
        self,
        features: Mapping[str, np.ndarray],
        bottoms: Mapping[str, BottomConfig],
        top: TopConfig,
        aggregation: str,
        task: Task,
        layouts: Mapping[str, InputLayout] | None = None,
    ) -> None:
        """``layouts``: what each party's encoded columns are (``TabularEncoder.layout``), which a bottom with
        column embeddings is built from; default: plain numbers."""
        super().__init__()
        self.names = list(features)
        self.x = {n: torch.from_numpy(np.ascontiguousarray(features[n], dtype=np.float32)) for n in self.names}
        layouts = layouts or {}
        self.bottoms = nn.ModuleDict({n: build_bottom(layouts.get(n, self.x[n].shape[1]), bottoms[n])
                                      for n in self.names})
        self.aggregation = get_aggregation(aggregation)
        width = self.aggregation.width([bottoms[n].cut_width for n in self.names])
        self.top = build_top(width, top, task.output_dim)
        self.task = task
        self.optimizers = [build_optimizer(self.bottoms[n].parameters(), bottoms[n]) for n in self.names]
        self.optimizers.append(build_optimizer(self.top.parameters(), top))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.top(self.aggregation.combine([self.bottoms[n](self.x[n].index_select(0, rows)) for n in self.names]))

    def train_step(self, rows: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimiser step of every part on one batch; returns the loss."""
        loss = self.task.loss(self(rows), targets.index_select(0, rows))
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return loss.item()

    def train_batches(self, batches: Sequence[torch.Tensor], targets: torch.Tensor) -> list[float]:
        return [self.train_step(rows, targets) for rows in batches]
