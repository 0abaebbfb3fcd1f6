"""The parties the bank's coordinators see: the calls they make, whatever carries them.

``TrainingParty`` is what the training coordinator (``bank.vertical.coordinator``) needs,
``ScoringParty`` what scoring (``bank.scoring.scorer``) needs.
``bank.vertical.http_partner.HttpPartner`` carries both to a partner's service over
mutual TLS; ``bank.vertical.in_process_party.InProcessParty`` runs the bank's own bottom
model in its process. The coordinators know only these protocols: retries,
connections and byte counts are the carrier's business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from alignment.psi import Committed, PsiPeer
from parties.learning.config import LocalSteps
from parties.protocol.training import ModelFiles, PrivacyReport
from parties.tables.drift import Drift
from parties.tables.encoding import Fallbacks

__all__ = ["ScoringParty", "TrainingParty"]


class TrainingParty(Protocol):
    """What the training coordinator needs from a party that holds a bottom model."""

    name: str

    def start_training(self, session_id: str, alignment_id: str, train_positions: torch.Tensor,
                       precision: str = "fp32", local: LocalSteps | None = None) -> int:
        """Fit the party's encoder on its training rows and build its bottom; returns the embedding width.

        ``precision``: how the session's step tensors travel (``parties.protocol.codec``); ``local``: the
        communication-efficient mode, if any (``parties.learning.config.LocalSteps``; default exact)."""
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

    def attach(self, session_id: str, width: int, precision: str = "fp32") -> None:
        """Rejoin a session this party already has (after the bank restarted), at the session's precision."""
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


class ScoringParty(PsiPeer, Protocol):
    """What scoring needs from a partner: a PSI peer for the customers to score, and its trained bottom."""

    name: str

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, purpose: str = "training",
               log_head: str | None = None) -> Committed:
        """Fix the intersection's order at the partner; ``purpose``: ``training`` or ``scoring``; ``log_head``:
        the bank's session-log chain head, for the partner to keep."""
        ...

    def load_model(self, model_id: str, files: dict[str, str], width: int) -> None:
        """Have the partner load its files of ``model_id``, checked against the manifest's digests."""
        ...

    def embed_for_scoring(self, model_id: str, alignment_id: str,
                          positions: torch.Tensor) -> tuple[torch.Tensor, Fallbacks, Drift]:
        """Its embeddings of the committed rows at ``positions``, its count of values that took a policy, and
        its columns' drift on every customer it holds of the alignment (``parties.tables.drift``)."""
        ...
