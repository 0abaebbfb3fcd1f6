"""The training exchange between the bank (coordinator) and a partner: routes and messages.

The flow (``bank.vertical.coordinator`` drives it through ``bank.vertical.party.TrainingParty``)::

    GET    SESSIONS                  the calling bank's live sessions -> SessionList
    POST   SESSIONS                  StartRequest -> TrainSessionInfo
    POST   STEP                      StepRequest -> StepReply            (the hot route)
    POST   EMBED                     EmbedRequest -> EmbedReply          (evaluation)
    POST   BEST                      mark the current weights the best
    GET    CHECKPOINTS               -> CheckpointList
    POST   RESTORE                   RestoreRequest
    GET    PRIVACY                   -> PrivacyReport
    POST   FINISH                    FinishRequest -> ModelFiles
    DELETE SESSION (?finished=...)   end it, or only unload it

Tensor messages are safetensors bodies (``parties.protocol.wire``); each
names its tensors and their dtypes here, once, for both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import Field, ValidationError

from parties.errors import BadMessage
from parties.learning.config import LocalSteps
from parties.protocol import codec
from parties.protocol.codec import Precision
from parties.protocol.common import Message
from parties.protocol.wire import WireMessage, decode, encode

__all__ = [
    "BEST",
    "CHECKPOINTS",
    "EMBED",
    "FINISH",
    "PRIVACY",
    "RESTORE",
    "SESSION",
    "SESSIONS",
    "STEP",
    "CheckpointList",
    "EmbedReply",
    "EmbedRequest",
    "FinishRequest",
    "ModelFiles",
    "PrivacyReport",
    "RestoreRequest",
    "StartRequest",
    "StepReply",
    "StepRequest",
    "TrainSessionInfo",
    "checked",
]

SESSIONS = "/train/sessions"
SESSION = "/train/sessions/{session_id}"
STEP = "/train/sessions/{session_id}/step"
EMBED = "/train/sessions/{session_id}/embed"
BEST = "/train/sessions/{session_id}/best"
FINISH = "/train/sessions/{session_id}/finish"
CHECKPOINTS = "/train/sessions/{session_id}/checkpoints"
RESTORE = "/train/sessions/{session_id}/restore"
PRIVACY = "/train/sessions/{session_id}/privacy"


# --- JSON messages -----------------------------------------------------------------------------


class TrainSessionInfo(Message):
    session: str
    embedding_width: int = Field(ge=1)
    precision: Precision = Field("fp32", description="how step tensors travel, as the partner accepted it")
    local: LocalSteps = Field(default_factory=LocalSteps, description="the communication-efficient mode, as the "
                              "partner accepted it (default: exact)")


class FinishRequest(Message):
    restore_best: bool = True


class ModelFiles(Message):
    """What a party wrote when training finished: file names and their SHA-256, in its own folder."""

    session: str
    files: dict[str, str] = Field(default_factory=dict)


class CheckpointList(Message):
    session: str
    steps: list[int]


class RestoreRequest(Message):
    step: int = Field(ge=0)


class PrivacyReport(Message):
    """What a partner's own privacy settings did so far: embedding noise (``enabled``; how often its most-released
    row was released: no ε is claimed, ``parties.learning.embedding_noise``), and NoPeek's weight and the dCor it
    measured (both None when NoPeek is off)."""

    session: str
    enabled: bool
    max_releases: int | None = None
    nopeek: float | None = Field(None, description="NoPeek's weight α")
    dcor: float | None = Field(None, description="NoPeek: mean dCor(features, embedding) over the training batches "
                               "of the last finished epoch")


# --- tensor messages ---------------------------------------------------------------------------


def checked(
    body: bytes, allowed: Mapping[str, torch.dtype | tuple[torch.dtype, ...]], session: str | None, *,
    check_finite: bool = True,
) -> WireMessage:
    """``body`` decoded with only ``allowed`` tensors, and (when given) naming ``session``, as the URL does."""
    message = decode(body, allowed, check_finite=check_finite)
    if session is not None and message.meta.get("session") != session:
        raise BadMessage("the message names another session than the URL")
    return message


def _required(message: WireMessage, name: str) -> torch.Tensor:
    tensor = message.get(name)
    if tensor is None:
        raise BadMessage(f"the message carries no {name}")
    return tensor


# Row positions travel as int32 (an alignment holds far fewer than 2**31 rows): 4 bytes a row, not 8.
_POSITIONS = (torch.int32, torch.int64)  # int64: what earlier versions sent


def _positions_out(rows: torch.Tensor) -> torch.Tensor:
    return rows.to(torch.int32) if rows.numel() == 0 or int(rows.max()) < 1 << 31 else rows


def _positions_in(rows: torch.Tensor | None) -> torch.Tensor | None:
    return None if rows is None else rows.to(torch.int64)


def _optional_int(message: WireMessage, key: str) -> int | None:
    return message.int_meta(key) if key in message.meta else None


@dataclass(frozen=True)
class StartRequest:
    """Open a training session on an alignment: the positions of the training rows."""

    TENSORS: ClassVar[dict[str, torch.dtype]] = {"train_rows": torch.int64}
    session: str
    alignment: str
    train_rows: torch.Tensor
    precision: Precision = "fp32"  # how the session's step tensors will travel (``parties.protocol.codec``)
    local: LocalSteps = LocalSteps()  # the communication-efficient mode (``parties.learning.config``); exact

    def encode(self) -> bytes:
        extra: dict[str, object] = {} if self.precision == "fp32" else {"precision": self.precision}
        if not self.local.exact:
            extra["local"] = self.local.model_dump_json()
        return encode({"train_rows": self.train_rows}, session=self.session, alignment=self.alignment, **extra)

    @classmethod
    def decode(cls, body: bytes) -> StartRequest:
        message = checked(body, cls.TENSORS, None)
        try:
            local = LocalSteps.model_validate_json(message.meta.get("local", "{}"))
        except ValidationError as exc:
            raise BadMessage(f"local steps: {exc.errors()[0]['msg']}") from exc
        return cls(message.meta.get("session", ""), message.meta.get("alignment", ""),
                   _required(message, "train_rows"), codec.parse_precision(message.meta.get("precision")), local)


@dataclass(frozen=True)
class StepRequest:
    """Step ``step``: the gradient of the previous step's embedding, and the rows to embed next.

    ``grad`` is absent on the first step, ``rows`` on the final flush.
    ``checkpoint``: save state once the step is applied; ``keep_from``: the
    newest step every party has on disk (older checkpoints may go).
    ``precision``: how ``grad`` travels, and how the answer's embedding must.
    """

    session: str
    step: int
    grad: torch.Tensor | None
    rows: torch.Tensor | None
    checkpoint: bool = False
    keep_from: int | None = None
    precision: Precision = "fp32"

    def encode(self) -> bytes:
        tensors = {"rows": _positions_out(self.rows)} if self.rows is not None else {}
        if self.grad is not None:
            tensors |= codec.pack("grad", self.grad, self.precision)
        meta: dict[str, object] = {"session": self.session, "step": self.step}
        if self.checkpoint:
            meta |= {"checkpoint": 1} | ({} if self.keep_from is None else {"keep_from": self.keep_from})
        if self.precision != "fp32":
            meta["precision"] = self.precision
        return encode(tensors, **meta)

    @classmethod
    def decode(cls, body: bytes, session: str) -> StepRequest:
        """The step addressed to ``session``. Finiteness is left to the trainer, which checks it on every path."""
        message = checked(body, {"rows": _POSITIONS, **codec.any_precision("grad")}, session, check_finite=False)
        precision = codec.parse_precision(message.meta.get("precision"))
        return cls(session, message.int_meta("step"), codec.unpack(message, "grad", precision),
                   _positions_in(message.get("rows")),
                   message.meta.get("checkpoint") == "1", _optional_int(message, "keep_from"), precision)


@dataclass(frozen=True)
class StepReply:
    """The embedding of the step's rows (none on the final flush), and the newest step on the party's disk."""

    session: str
    step: int
    embedding: torch.Tensor | None
    durable: int | None = None
    precision: Precision = "fp32"  # the request's

    def encode(self) -> bytes:
        meta: dict[str, object] = {} if self.durable is None else {"durable": self.durable}
        if self.precision != "fp32":
            meta["precision"] = self.precision
        tensors = {} if self.embedding is None else codec.pack("embedding", self.embedding, self.precision)
        return encode(tensors, session=self.session, step=self.step, **meta)

    @classmethod
    def decode(cls, body: bytes, precision: Precision = "fp32") -> StepReply:
        """The answer to a request at ``precision``: an answer in another precision is a ``BadMessage``."""
        message = decode(body, codec.any_precision("embedding"))
        if codec.parse_precision(message.meta.get("precision")) != precision:
            raise BadMessage(f"the answer is in precision {message.meta.get('precision')!r}, not {precision!r}")
        return cls(message.meta.get("session", ""), _optional_int(message, "step") or 0,
                   codec.unpack(message, "embedding", precision), _optional_int(message, "durable"), precision)


@dataclass(frozen=True)
class EmbedRequest:
    """Embed these rows with the current weights, changing nothing (evaluation)."""

    TENSORS: ClassVar[dict[str, tuple[torch.dtype, ...]]] = {"rows": _POSITIONS}
    session: str
    rows: torch.Tensor

    def encode(self) -> bytes:
        return encode({"rows": _positions_out(self.rows)}, session=self.session)

    @classmethod
    def decode(cls, body: bytes, session: str) -> EmbedRequest:
        return cls(session, _required(checked(body, cls.TENSORS, session), "rows").to(torch.int64))


@dataclass(frozen=True)
class EmbedReply:
    TENSORS: ClassVar[dict[str, torch.dtype]] = {"embedding": torch.float32}
    session: str
    embedding: torch.Tensor | None

    def encode(self) -> bytes:
        return encode({} if self.embedding is None else {"embedding": self.embedding}, session=self.session)

    @classmethod
    def decode(cls, body: bytes) -> EmbedReply:
        message = decode(body, cls.TENSORS)
        return cls(message.meta.get("session", ""), message.get("embedding"))
