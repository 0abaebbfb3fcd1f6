"""What a training run keeps as it goes: where the loop stands (what crossed the cut: ``bank.audit_record``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bank.epochs import EpochBook

__all__ = ["LoopState"]


@dataclass
class LoopState:
    """Where training stands: enough, with the parties' checkpoints, to continue exactly."""

    grads: list[torch.Tensor | None]
    book: EpochBook
    epoch: int = 0
    batch: int = 0  # the next batch of this epoch
    step: int = 0  # the next step number
    flushed: bool = False
    losses: list[float] = field(default_factory=list)
    done: bool = False

    def next_epoch(self) -> None:
        self.epoch, self.batch, self.flushed, self.losses = self.epoch + 1, 0, False, []

    def meta(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step, "flushed": self.flushed,
                "losses": self.losses, "done": self.done, **self.book.meta()}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], grads: list[torch.Tensor | None], book: EpochBook,
                  best_state: Any = None) -> LoopState:
        """The loop as ``meta`` left it; ``book`` (empty, with the run's patience and objective) takes its epochs."""
        return cls(grads=grads, book=book.restore(meta, best_state),
                   **{k: meta[k] for k in ("epoch", "batch", "step", "flushed", "losses", "done")})
