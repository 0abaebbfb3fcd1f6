"""The party protocol's messages, in one place.

JSON messages are pydantic models that carry the schema version and the
session. Bulk data (blinded points, positions, later tensors) travels as
binary bodies described by the headers below; nothing is ever pickled.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ALIGNMENT_HEADER",
    "CALLER_HEADER",
    "OCTET_STREAM",
    "PURPOSE_HEADER",
    "SCHEMA_VERSION",
    "AlignmentInfo",
    "AlignmentRequest",
    "CheckpointList",
    "SessionList",
    "SessionSummary",
    "ErrorResponse",
    "RestoreRequest",
    "FinishRequest",
    "LoadModelRequest",
    "ModelFiles",
    "TrainSessionInfo",
    "Identity",
    "JobStatus",
    "PrivacyReport",
    "PsiOpenRequest",
    "PsiOpenResponse",
]

SCHEMA_VERSION = 1
OCTET_STREAM = "application/octet-stream"
ALIGNMENT_HEADER = "x-cutlayer-alignment"
#: Only honoured in --insecure mode, where no certificate can say who calls.
CALLER_HEADER = "x-cutlayer-caller"
#: What a committed PSI result is for: the training alignment, or a batch of customers to score.
PURPOSE_HEADER = "x-cutlayer-purpose"

Version = Annotated[int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Version = SCHEMA_VERSION


class ErrorResponse(BaseModel):
    error: str
    detail: str


class Identity(Message):
    name: str
    role: str


class PsiOpenRequest(Message):
    version: int = Field(2, description="the PSI protocol version (alignment.psi.PROTOCOL_VERSION)")
    count: int = Field(ge=0, le=1 << 26, description="IDs the initiator will send")
    chunk_items: int = Field(ge=1, le=1 << 18)


class PsiOpenResponse(Message):
    session: str
    count: int = Field(ge=0)
    chunk_items: int = Field(ge=1)


class AlignmentRequest(Message):
    partners: list[str] | None = Field(None, description="default: every configured partner")
    min_intersection: int | None = Field(None, ge=1)
    order_seed: int = Field(0, description="seeds the shared row order (same data and seed: same order)")


class AlignmentInfo(Message):
    alignment_id: str
    rows: int
    pairwise: dict[str, int] = Field(default_factory=dict)


class JobStatus(Message):
    job_id: str
    kind: str
    state: Literal["pending", "running", "succeeded", "failed"]
    progress: str = ""
    fraction: float | None = None
    error: str | None = None
    result: dict[str, object] | None = None


class TrainSessionInfo(Message):
    session: str
    embedding_width: int = Field(ge=1)


class FinishRequest(Message):
    restore_best: bool = True


class ModelFiles(Message):
    """What a party wrote when training finished: file names and their SHA-256, in its own folder."""

    session: str
    files: dict[str, str] = Field(default_factory=dict)


class CheckpointList(Message):
    session: str
    steps: list[int]


class SessionSummary(Message):
    """A session a party holds, for its owner or operator: no rows, no IDs."""

    kind: Literal["training", "psi"]
    session: str
    owner: str  # the bank that opened it
    state: str  # partner: "live" (in memory); bank: "running", "stopped" (resumable), "finished", "ended"
    idle_seconds: float | None = None
    step: int | None = None  # training: the next step


class SessionList(Message):
    sessions: list[SessionSummary]


class RestoreRequest(Message):
    step: int = Field(ge=0)


class LoadModelRequest(Message):
    """The bank's manifest entry for this party: the digests its files must have."""

    files: dict[str, str]
    embedding_width: int = Field(ge=1)


class PrivacyReport(Message):
    """A partner's embedding-DP spend so far: the ε of its most-released row."""

    session: str
    enabled: bool
    epsilon: float | None = None
    delta: float | None = None
    max_releases: int | None = None
    noise_multiplier: float | None = None
    budget: float | None = None
