"""What a training run keeps as it goes: where the loop stands, and (audit mode) what crossed the cut."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bank.epochs import EpochBook

__all__ = ["AuditRecord", "LoopState"]


@dataclass
class AuditRecord:
    """What crossed the cut, kept for analysis only (``TrainingConfig.audit``).

    ``gradients[name]`` holds, per training row and epoch, the gradient that
    partner received; ``embeddings[name]`` the final model's embeddings of the
    validation and test rows, as the bank received them.
    """

    gradients: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    embeddings: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def add_gradients(self, name: str, epoch: int, step: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        record = self.gradients.setdefault(name, {"epoch": [], "step": [], "rows": [], "grads": []})
        record["epoch"].append(torch.full((len(rows),), epoch, dtype=torch.int64))
        record["step"].append(torch.full((len(rows),), step, dtype=torch.int64))
        record["rows"].append(rows.clone())
        record["grads"].append(grad.detach().clone())

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """One flat tensor dict per file: ``gradients-<name>`` and ``embeddings-<name>``."""
        out = {f"gradients-{n}": {k: torch.cat(v) for k, v in r.items()} for n, r in self.gradients.items()}
        out |= {f"embeddings-{n}": r for n, r in self.embeddings.items()}
        return out


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
