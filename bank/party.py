"""The party the training coordinator sees: the calls it makes, whatever carries them.

``bank.http_partner.HttpPartner`` carries them to a partner's service over mutual TLS;
``bank.in_process.InProcessParty`` runs the bank's own bottom model in its process.
The coordinator knows only this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from parties.protocol.messages import ModelFiles, PrivacyReport

__all__ = ["TrainingParty"]


class TrainingParty(Protocol):
    """What the training coordinator needs from a party that holds a bottom model."""

    name: str

    def start_training(self, session_id: str, alignment_id: str, train_positions: torch.Tensor) -> int:
        """Fit the party's encoder on its training rows and build its bottom; returns the embedding width."""
        ...

    def step(self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Apply ``grad`` to the previous step's embedding, then embed ``rows`` (``None``: the final flush)."""
        ...

    def submit_step(
        self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None, checkpoint: bool = False,
        keep_from: int | None = None,
    ) -> Callable[[], torch.Tensor | None]:
        """Start ``step``; the returned function finishes it. The bank computes in between.

        ``checkpoint``: save this party's state once the step is applied; ``keep_from``: the newest
        step every party has on disk (older checkpoints may be deleted).
        """
        ...

    @property
    def durable(self) -> int | None:
        """The newest step this party has reported on disk (``None``: not known yet)."""
        ...

    def checkpoints(self) -> list[int]:
        """The steps this party holds a checkpoint for."""
        ...

    def attach(self, session_id: str, width: int) -> None:
        """Rejoin a session this party already has (after the bank restarted)."""
        ...

    def privacy(self) -> PrivacyReport:
        """The party's embedding-DP spend so far."""
        ...

    def restore(self, step: int) -> None:
        """Roll back to this party's checkpoint at ``step``."""
        ...

    def embed(self, rows: torch.Tensor) -> torch.Tensor: ...

    def mark_best(self) -> None: ...

    def finish(self, restore_best: bool) -> ModelFiles:
        """Restore the best weights if asked and write the party's model files; the session stays open."""
        ...

    def end(self, finished: bool = True) -> None:
        """Close the session: ``finished``, for good (retried); otherwise (the run stopped) unload it,
        resumable from its checkpoints, in one attempt."""
        ...
