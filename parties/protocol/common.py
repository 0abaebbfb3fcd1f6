"""What every exchange shares: the schema version, the JSON message base, headers and routes.

JSON messages are pydantic models that carry the schema version. Bulk data
(blinded points, positions, tensors) travels as binary bodies: octets for PSI,
safetensors for tensors (``parties.protocol.wire``); nothing is ever pickled.
A route is a path template, filled the same way by the caller (``fill``) and
declared as is by the service.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CALLER_HEADER",
    "HEALTH",
    "IDENTITY",
    "OCTET_STREAM",
    "SCHEMA_VERSION",
    "ErrorResponse",
    "Identity",
    "Message",
    "fill",
]

SCHEMA_VERSION = 1
OCTET_STREAM = "application/octet-stream"
#: Only honoured in --insecure mode, where no certificate can say who calls.
CALLER_HEADER = "x-cutlayer-caller"

#: Every service answers these (``parties.transport.app``).
HEALTH = "/health"  # liveness: the process answers
READY = "/ready"  # readiness: it can do its work (state folder writable, disk, certificate)
IDENTITY = "/identity"

Version = Annotated[int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Version = SCHEMA_VERSION


class ErrorResponse(BaseModel):
    """Every refusal's body: the error's class name (``parties.errors``) and the reason."""

    error: str
    detail: str


class Identity(Message):
    name: str
    role: str


def fill(template: str, **params: object) -> str:
    """``template`` with its ``{name}`` parts filled, each quoted as one path segment.

    A session ID or model ID is never allowed to add a segment or a query: a
    ``/`` or ``?`` in it is quoted, and the service's route then does not match.
    """
    return template.format(**{k: quote(str(v), safe="") for k, v in params.items()})
