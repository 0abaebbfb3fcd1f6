"""The scoring exchange: the bank has a partner load a trained model and embed customers to score.

The flow (after a PSI session with purpose ``scoring``, ``parties.protocol.psi``)::

    POST LOAD   LoadModelRequest            the manifest's digests; the partner checks its files
    POST EMBED  ScoringRequest -> ScoringReply
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from pydantic import Field

from parties.errors import BadMessage
from parties.protocol.common import Message
from parties.protocol.training import checked
from parties.protocol.wire import decode, encode
from parties.tables.drift import Drift, parse_drift
from parties.tables.encoding import Fallbacks, parse_fallbacks

__all__ = ["EMBED", "LOAD", "LoadModelRequest", "ScoringReply", "ScoringRequest"]

LOAD = "/models/{model_id}/load"
EMBED = "/models/{model_id}/embed"


class LoadModelRequest(Message):
    """The bank's manifest entry for this party: the digests its files must have."""

    files: dict[str, str]
    embedding_width: int = Field(ge=1)


@dataclass(frozen=True)
class ScoringRequest:
    """Embed the rows at these positions of the committed scoring alignment."""

    TENSORS: ClassVar[dict[str, torch.dtype]] = {"rows": torch.int64}
    alignment: str
    rows: torch.Tensor

    def encode(self) -> bytes:
        return encode({"rows": self.rows}, alignment=self.alignment)

    @classmethod
    def decode(cls, body: bytes) -> ScoringRequest:
        message = checked(body, cls.TENSORS, None)
        rows = message.get("rows")
        if rows is None:
            raise BadMessage("the message carries no rows")
        return cls(message.meta.get("alignment", ""), rows)


@dataclass(frozen=True)
class ScoringReply:
    """The embeddings, per column the count of values that took a policy (unseen, missing), and per column
    the drift of every customer of the scoring alignment from the training rows (``parties.tables.drift``;
    empty under its minimum of rows)."""

    TENSORS: ClassVar[dict[str, torch.dtype]] = {"embedding": torch.float32}
    model: str
    embedding: torch.Tensor | None
    fallbacks: Fallbacks = field(default_factory=dict)
    drift: Drift = field(default_factory=dict)

    def encode(self) -> bytes:
        tensors = {} if self.embedding is None else {"embedding": self.embedding}
        return encode(tensors, model=self.model, fallbacks=json.dumps(self.fallbacks), drift=json.dumps(self.drift))

    @classmethod
    def decode(cls, body: bytes) -> ScoringReply:
        """Raises ``BadMessage`` for unusable fallback counts or drift figures too."""
        message = decode(body, cls.TENSORS)
        try:
            fallbacks = parse_fallbacks(message.meta.get("fallbacks", ""))
            drift = parse_drift(message.meta.get("drift", ""))
        except ValueError as exc:
            raise BadMessage(f"unusable scoring figures: {exc}") from exc
        return cls(message.meta.get("model", ""), message.get("embedding"), fallbacks, drift)
