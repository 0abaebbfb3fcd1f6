"""A hijack monitor for a partner that holds no labels.

Feature-space hijacking (Pasquini et al., CCS 2021) has the bank return the
gradient of an adversarial loss on each embedding row instead of the task
loss. Such a gradient depends only on the embedding it is the gradient of:
give the bank the same embedding at two positions and it returns the same
gradient twice. An honest bank cannot: the task gradient at a position also
depends on that row's label and on the bank's own (and other partners')
embedding of that row, which differ between the two positions.

So, on a probe step (every ``probe_every`` steps), the partner copies a few
rows' embeddings over other rows of the batch, and when the gradients come
back it measures, for each copied pair, how different the two gradients are
(0: identical). The copies are fakes: their gradients are never applied. If
the median difference over the probes so far stays under ``threshold``, the
partner stops applying gradients and says why. Published detectors
(SplitGuard, Gradients Scrutinizer) need labels; this needs none.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from parties.learning.config import MonitorConfig

__all__ = ["HijackMonitor", "MonitorConfig"]

logger = logging.getLogger(__name__)


class HijackMonitor:
    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.differences: list[float] = []
        self.alarm: str | None = None

    def plan(self, step: int, batch: int) -> list[tuple[int, int]]:
        """The (source, copy) positions for this step; empty unless it is a probe step."""
        every = self.config.probe_every
        if not every or step % every != every - 1 or batch < 2 * self.config.pairs:
            return []
        order = np.random.default_rng([self.config.seed, step]).permutation(batch)[: 2 * self.config.pairs]
        return [(int(order[2 * k]), int(order[2 * k + 1])) for k in range(self.config.pairs)]

    @staticmethod
    def disguise(z: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
        out = z.clone()
        for source, copy in pairs:
            out[copy] = out[source]
        return out

    def inspect(self, grad: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """Record how alike the copied pairs' gradients are; return the gradient with the fakes zeroed."""
        for source, copy in pairs:
            a, b = grad[source], grad[copy]
            scale = float(a.norm() + b.norm())
            self.differences.append(float((a - b).norm()) / scale if scale > 0 else 0.0)
        if len(self.differences) >= self.config.min_pairs:
            median = float(np.median(self.differences))
            if median < self.config.threshold:
                self.alarm = (
                    f"hijack suspected: the bank returned identical gradients for identical embeddings at "
                    f"different rows (median relative difference {median:.2e} over {len(self.differences)} "
                    "probes); an honest task loss cannot do that. No further gradient is applied."
                )
                logger.error(self.alarm)
        cleaned = grad.clone()
        cleaned[[copy for _, copy in pairs]] = 0.0
        return cleaned
