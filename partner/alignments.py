"""The partner's side of every bank's PSI: limits and log, each bank's own slots, the commit into its space.

A bank's session is checked against the partnership's limits before anything is blinded
(``alignment.partnership``: the IDs it announces, its budget over 24 hours, its sessions per hour) and
every session, refused ones included, is kept in the hash-chained log ``<state>/psi-sessions.log``. A
bank holds at most ``max_psi_sessions`` open sessions; opening another closes its own least recently used,
never another bank's.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from alignment.cache import hashed_points
from alignment.parallel import SlicePool
from alignment.partnership import Partnership
from alignment.psi import (
    MAX_CHUNK_ITEMS,
    PROTOCOL_VERSION,
    PsiResponder,
    check_id_types,
    check_minimum,
    partnership_dst,
)
from parties.errors import BadMessage, IntersectionTooSmall, UnknownSession
from parties.memory import release
from parties.protocol.control import AlignmentInfo
from parties.protocol.psi import PsiOpenRequest, PsiOpenResponse
from parties.tables.table import AlignedRows, PartyTable, save_alignment
from partner.banks import Banks
from partner.settings import PartnerSettings

__all__ = ["MAX_SCORING_ALIGNMENTS", "PsiDesk"]

logger = logging.getLogger(__name__)

MAX_SCORING_ALIGNMENTS = 4  # per bank: customers aligned for scoring, the oldest dropped first


class PsiDesk:
    """Every bank's PSI sessions at this partner, and what they may cost."""

    def __init__(self, settings: PartnerSettings, table: PartyTable, banks: Banks, pool: SlicePool,
                 threads: ThreadPoolExecutor) -> None:
        self.settings, self.table, self.banks, self.pool, self.threads = settings, table, banks, pool, threads
        self.partnership = Partnership.at(settings.state_path / "psi-sessions.log", settings.psi_limits, len(table))
        self._points: dict[str, Future[bytes]] = {}  # per bank: this table being hashed under the partnership's DST
        self._lock = threading.Lock()

    def open_session(self, bank: str, request: PsiOpenRequest) -> PsiOpenResponse:
        if request.version != PROTOCOL_VERSION:
            raise BadMessage(f"PSI protocol version {request.version}; this partner speaks {PROTOCOL_VERSION}")
        check_id_types(self.table.id_type, request.id_type, "the partner", "the bank")  # before any budget or blinding
        if not 1 <= request.chunk_items <= MAX_CHUNK_ITEMS:
            raise BadMessage(f"chunk_items must be between 1 and {MAX_CHUNK_ITEMS}")
        space = self.banks[bank]
        session_id = uuid.uuid4().hex
        head = self.partnership.admit(bank, request.count, session=session_id, side="bank")  # before any blinding
        with self._lock:
            self._expire()
            if len(space.psi) >= self.settings.max_psi_sessions:
                # A bank that abandoned its sessions (it crashed, or gave up) must still be able to align:
                # its own least recently used session makes room. Another bank's slots are its own.
                oldest = min(space.psi, key=lambda sid: space.psi[sid].last_used)
                self._drop(bank, oldest, "aborted", "its bank opened another with every slot taken")
        hashing = self._hashed_for(bank)
        try:
            points = hashing.result()
        finally:
            # Not held for the service's life (32 bytes an ID): the hash cache on disk serves the next session, and
            # a hashing that failed is tried again then.
            with self._lock:
                if self._points.get(bank) is hashing:
                    del self._points[bank]
        responder = PsiResponder(points, request.count, self.pool, self.threads, request.chunk_items, bank,
                                 session_id=session_id, spool_dir=self.settings.cache_dir)
        with self._lock:
            space.psi[session_id] = responder
        logger.info("PSI session %s opened by %s", session_id, bank)
        return PsiOpenResponse(session=session_id, count=responder.own_count, chunk_items=responder.chunk_items,
                               id_type=self.table.id_type, log_head=head)

    def _hashed_for(self, bank: str) -> Future[bytes]:
        with self._lock:
            if bank not in self._points:
                dst = partnership_dst(bank, self.settings.name)
                self._points[bank] = self.threads.submit(
                    hashed_points, self.table.normalized_ids, self.pool, self.settings.cache_dir, dst)
            return self._points[bank]

    def session(self, bank: str, session_id: str) -> PsiResponder:
        """``bank``'s PSI session ``session_id``: another bank's is as unknown as a missing one."""
        responder = self.banks[bank].psi.get(session_id)
        if responder is None:
            raise UnknownSession(f"no PSI session {session_id} (it may have expired)")
        responder.touch()
        return responder

    def abort(self, bank: str, session_id: str) -> None:
        self.session(bank, session_id)
        with self._lock:
            if self._drop(bank, session_id, "aborted", "by its bank"):
                logger.info("PSI session %s aborted by %s", session_id, bank)

    def end(self, bank: str, session_id: str) -> bool:
        """This partner's operator ends ``bank``'s session; whether there was one."""
        with self._lock:
            return self._drop(bank, session_id, "aborted", "by this partner's operator")

    def _drop(self, bank: str, session_id: str, event: str, reason: str) -> bool:
        responder = self.banks[bank].psi.pop(session_id, None)
        if responder is None:
            return False
        responder.close()  # blinding not yet started never starts
        self.partnership.record(event, bank, session=session_id, received=responder.received, reason=reason)
        return True

    def commit(self, bank: str, session_id: str, alignment_id: str, positions: np.ndarray,
               purpose: str = "training", peer_head: str | None = None) -> AlignmentInfo:
        """Keep the rows the bank chose (positions in the blinded set this side sent), in its order.

        ``min_intersection`` is a commit policy: fewer rows are refused. It is not a privacy control:
        the bank has its PSI result before it commits (the limits bound what it can learn).
        """
        responder = self.session(bank, session_id)
        if not alignment_id or len(alignment_id) > 64:
            raise BadMessage("an alignment id is 1 to 64 characters")
        if purpose not in ("training", "scoring"):
            raise BadMessage(f"unknown purpose {purpose!r}")
        rows = responder.finish(positions)
        space = self.banks[bank]
        try:
            check_minimum(len(rows), self.settings.min_intersection, "the bank")
        except IntersectionTooSmall as exc:
            with self._lock:
                self._drop(bank, session_id, "refused", str(exc))
            raise
        if purpose == "scoring":  # customers to score: kept apart from the training alignment
            with self._lock:
                space.scoring_alignments[alignment_id] = rows
                while len(space.scoring_alignments) > MAX_SCORING_ALIGNMENTS:
                    space.scoring_alignments.pop(next(iter(space.scoring_alignments)))
        else:
            aligned = AlignedRows(alignment_id, rows)
            with self.banks.reserve(bank, rows.nbytes):
                save_alignment(space.folder, self.table, aligned)
            space.alignment = aligned
        with self._lock:
            space.psi.pop(session_id, None)
            responder.close()
        head = self.partnership.record("committed", bank, session=session_id, received=responder.received,
                                       result=len(rows), purpose=purpose, alignment=alignment_id, peer_head=peer_head)
        logger.info("alignment %s of %s committed for %s: %d rows", alignment_id, bank, purpose, len(rows))
        release()  # the session's sets and buffers
        return AlignmentInfo(alignment_id=alignment_id, rows=len(rows), log_head=head)

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for space in self.banks.spaces():
            for sid, r in list(space.psi.items()):
                if now - r.last_used > self.settings.psi_session_ttl:
                    self._drop(space.name, sid, "expired", f"idle for over {self.settings.psi_session_ttl:.0f} s")
                    logger.info("PSI session %s of %s expired", sid, space.name)

    def close(self) -> None:
        with self._lock:
            for space in self.banks.spaces():
                for sid in list(space.psi):
                    self._drop(space.name, sid, "aborted", "this partner stopped")
        self.partnership.close()
