"""An in-process PSI peer: the responder called directly, no transport.

It drives the same ``PsiResponder`` the partner service wraps in HTTP, so the
contract tests run against both, and it counts the bytes that would cross.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from alignment.parallel import SlicePool
from alignment.psi import Committed, PsiResponder, SessionInfo, check_id_types
from parties.errors import UnknownSession
from parties.tables.ids import IdType

__all__ = ["LocalPsiPeer"]


class LocalPsiPeer:
    """A ``PsiPeer`` whose responder lives in this process."""

    def __init__(self, own_points: bytes, pool: SlicePool, threads: ThreadPoolExecutor,
                 id_type: IdType = "text") -> None:
        self.own_points, self.pool, self.threads, self.id_type = own_points, pool, threads, id_type
        self.sessions: dict[str, PsiResponder] = {}
        self.sent: list[bytes] = []  # what the initiator sent, for inspection
        self.received: list[bytes] = []  # what the initiator received
        self.committed: tuple[str, np.ndarray] | None = None

    def _session(self, session_id: str) -> PsiResponder:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSession(f"no PSI session {session_id}") from None

    def open(self, own_count: int, chunk_items: int, id_type: IdType = "text") -> SessionInfo:
        check_id_types(self.id_type, id_type, "the responder", "the initiator")
        r = PsiResponder(self.own_points, own_count, self.pool, self.threads, chunk_items)
        self.sessions[r.session_id] = r
        return SessionInfo(r.session_id, r.own_count, r.chunk_items, self.id_type)

    def put_blinded(self, session_id: str, index: int, data: bytes) -> None:
        self.sent.append(data)
        self._session(session_id).receive_blinded(index, data)

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        data = self._session(session_id).reblinded_chunk(index, timeout=600)
        self.received.append(data)
        return data

    def get_blinded(self, session_id: str, index: int) -> bytes:
        data = self._session(session_id).blinded_chunk(index, timeout=600)
        self.received.append(data)
        return data

    def abort(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.close()

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, purpose: str = "training",
               log_head: str | None = None) -> Committed:
        self.sent.append(positions.astype("<u4").tobytes())
        self.committed = (alignment_id, self._session(session_id).finish(positions))
        return Committed(len(positions))
