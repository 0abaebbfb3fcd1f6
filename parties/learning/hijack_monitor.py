"""The hijack monitor of a partner that holds no labels: the rank test, and the older copy probes.

Feature-space hijacking (FSHA; Pasquini, Ateniese and Bernaschi, CCS 2021) has the bank return, instead of
the task's gradient, the gradient of an adversarial loss on each embedding row.

**The rank test** (``watch``) reads what arrives and changes nothing. The task's gradient with respect to a
row's embedding is Jᵢᵀ δᵢ: δᵢ, the loss's derivative with respect to the model's outputs for that row (one
number for a binary or regression task, one per class for a multiclass one), carried back through the top's
Jacobian Jᵢ. So a batch's task gradients lie close to ``task_rank`` directions, however the labels fall; an
adversarial loss on the embedding itself moves all of the embedding's directions. Every training step the
monitor takes the share of the gradient's energy outside its top ``task_rank`` singular directions, and
when the median share over ``window`` steps exceeds ``limit`` it stops applying gradients and says why
(``on_alarm="warn"``: it logs and goes on). It sends nothing and adds no byte; with no alarm, training is
bit for bit what it is without it. Noise a bank adds to hide a hijack only adds off-task energy. What it
cannot see: a hijack mixed into a large enough share of honest gradient, or one confined to ``task_rank``
directions per step; a bank gradient defense that adds noise in every direction (isotropic, Marvell) looks
like a hijack to it. The study measures where those limits lie (``bank.lab.hijack_study``).

**The copy probes** (``probe_every``): on a probe step the partner copies a few rows' embeddings over other
rows of the batch; an adversarial loss on the embedding alone returns identical gradients for the copies,
an honest task loss cannot. The copies are fakes whose gradients are never applied, so training changes,
and a bank that knows the test defeats it: it can spot exact duplicates and answer them honestly, or add
noise keyed on the row's position.

Published detectors (SplitGuard, Gradients Scrutinizer) need the client to hold labels; these need none.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from parties.learning.config import MonitorConfig

__all__ = ["HijackMonitor", "MonitorConfig"]

logger = logging.getLogger(__name__)


class HijackMonitor:
    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.differences: list[float] = []  # copy probes: each copied pair's relative difference
        self.shares: deque[float] = deque(maxlen=config.window)  # rank test: the last window's off-task shares
        self.observed = 0  # gradients the rank test has read
        self.alarm: str | None = None
        self.alarm_step: int | None = None

    def _raise(self, step: int, message: str) -> None:
        self.alarm, self.alarm_step = message, step
        logger.error("step %d: %s", step, message)

    @staticmethod
    def off_task_share(grad: torch.Tensor, rank: int) -> float:
        """The share of ``grad``'s energy outside its top ``rank`` singular directions (0 for a zero gradient)."""
        energy = torch.linalg.svdvals(grad).square()
        total = float(energy.sum())
        return 1.0 - float(energy[:rank].sum()) / total if total > 0 else 0.0

    def observe(self, step: int, grad: torch.Tensor) -> None:
        """The rank test: read the gradient the bank returned for ``step``'s embedding."""
        if not self.config.watch or self.alarm is not None:
            return
        self.shares.append(self.off_task_share(grad, self.config.task_rank))
        self.observed += 1
        if len(self.shares) == self.config.window:
            median = float(np.median(self.shares))
            if median > self.config.limit:
                self._raise(step, (
                    f"hijack suspected: over the last {len(self.shares)} steps the bank's gradients put a median "
                    f"{median:.1%} of their energy outside the {self.config.task_rank} direction(s) a task's "
                    f"gradient can take (limit {self.config.limit:.0%}); an honest task loss cannot do that. "
                    + ("No further gradient is applied." if self.config.on_alarm == "stop" else
                       "Training goes on (on_alarm=warn).")))

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

    def inspect(self, step: int, grad: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """Record how alike the copied pairs' gradients are; return the gradient with the fakes zeroed."""
        for source, copy in pairs:
            a, b = grad[source], grad[copy]
            scale = float(a.norm() + b.norm())
            self.differences.append(float((a - b).norm()) / scale if scale > 0 else 0.0)
        if len(self.differences) >= self.config.min_pairs:
            median = float(np.median(self.differences))
            if median < self.config.threshold:
                self._raise(step, (
                    f"hijack suspected: the bank returned identical gradients for identical embeddings at "
                    f"different rows (median relative difference {median:.2e} over {len(self.differences)} "
                    "probes); an honest task loss cannot do that. No further gradient is applied."
                ))
        cleaned = grad.clone()
        cleaned[[copy for _, copy in pairs]] = 0.0
        return cleaned
