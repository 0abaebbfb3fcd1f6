"""The PSI exchange between the bank (initiator) and a partner (responder): routes and messages.

The flow (``alignment.psi`` drives it, without transport)::

    POST   SESSIONS                  PsiOpenRequest -> PsiOpenResponse
    PUT    BLINDED  (index)          the bank's blinded IDs, one chunk (octets)
    GET    BLINDED  (index)          the partner's blinded IDs, one chunk
    GET    REBLINDED (index)         the bank's IDs, blinded by both
    POST   COMMIT                    positions (little-endian uint32) -> AlignmentInfo
    DELETE SESSION                   abort
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from parties.errors import BadMessage
from parties.protocol.common import Message
from parties.tables.ids import IdType

__all__ = [
    "ALIGNMENT_HEADER",
    "BLINDED",
    "LOG_HEAD",
    "LOG_HEAD_HEADER",
    "COMMIT",
    "MAX_CHUNK_ITEMS",
    "MAX_IDS",
    "PROTOCOL_VERSION",
    "PURPOSE_HEADER",
    "REBLINDED",
    "SESSION",
    "SESSIONS",
    "PsiOpenRequest",
    "PsiOpenResponse",
    "decode_positions",
    "encode_positions",
]

#: 2: one-sided output (only the bank learns the intersection), shuffled sets, and the bank
#: receives before it sends anything echoable (``alignment.psi``).
PROTOCOL_VERSION = 2
#: The most IDs either side of a session accepts from the other: what a commit's uint32 positions can name.
#: Memory does not bound it (the sets are on disk, ``alignment.spool``); each party's policy does, per peer
#: (``parties.limits.PsiLimits``: by default twice its own set a session, four times a day).
MAX_IDS = (1 << 32) - 1
#: The most IDs in one chunk of a PUT or GET.
MAX_CHUNK_ITEMS = 1 << 18
#: Which alignment a commit fixes (the bank's ID for it).
ALIGNMENT_HEADER = "x-cutlayer-alignment"
#: What a committed PSI result is for: the training alignment, or a batch of customers to score.
PURPOSE_HEADER = "x-cutlayer-purpose"
#: The hash of the sender's session-log record of this session (``parties.storage.session_log``), which the
#: receiver keeps in its own log: a commit carries the bank's "opened" record's.
LOG_HEAD_HEADER = "x-cutlayer-log-head"
LOG_HEAD = r"^[0-9a-f]{64}$"

SESSIONS = "/psi/sessions"
SESSION = "/psi/sessions/{session_id}"
BLINDED = "/psi/sessions/{session_id}/blinded/{index}"
REBLINDED = "/psi/sessions/{session_id}/reblinded/{index}"
COMMIT = "/psi/sessions/{session_id}/commit"


class PsiOpenRequest(Message):
    version: int = Field(PROTOCOL_VERSION, description="the PSI protocol version")
    count: int = Field(ge=1, le=MAX_IDS, description="IDs the initiator will send (a session of none would only "
                       "make the responder blind its set)")
    chunk_items: int = Field(ge=1, le=MAX_CHUNK_ITEMS)
    id_type: IdType = Field("text", description="how the initiator's IDs were canonicalised (parties.tables.ids)")


class PsiOpenResponse(Message):
    session: str
    count: int = Field(ge=0)
    chunk_items: int = Field(ge=1)
    id_type: IdType = "text"
    log_head: str = Field(pattern=LOG_HEAD, description="the hash of the responder's session-log record of this "
                          "session's opening, for the initiator to keep")


def encode_positions(positions: np.ndarray) -> bytes:
    """Committed positions in the partner's shuffled set, as little-endian uint32."""
    return np.asarray(positions).astype("<u4").tobytes()


def decode_positions(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise BadMessage("positions are little-endian uint32 values")
    return np.frombuffer(data, dtype="<u4").astype(np.int64)
