"""What a party's PSI sessions with each peer may cost and reveal, and the log they are kept in.

PSI tells a side which of the IDs it brought the other side holds. Nothing in the protocol can stop a peer
from bringing IDs it guessed rather than IDs it holds: with IDs anyone can enumerate (sequential numbers,
phone numbers), a peer that brings the whole space learns which of them the other side holds. What each
party does here, on both sides of every session:

- a peer that announces more IDs than the partnership agreed is refused before anything is blinded
  (``peer_max_ids``; by default twice this party's own set);
- every ID a peer brings counts against its budget over 24 hours, aborted and refused sessions too
  (``peer_ids_per_day``; by default four times this party's own set), and so does every session it opens
  (``sessions_per_hour``); the budget is read back from the log, so a restart does not refill it;
- every session (peer, declared and received sizes, result size, purpose, how it ended) is appended to a
  hash-chained log (``parties.storage.session_log``) that the two organisations can lay side by side.

The bank, which alone learns the intersection, also refuses one that covers more of its customers than its
operator expects (``check_overlap``), before it commits anything: until the commit, a partner learns nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from parties.errors import AlignmentError, OverBudget
from parties.settings import PsiLimits
from parties.storage.session_log import SessionLog

__all__ = ["CHANCE", "DAY", "HOUR", "InitiatedSession", "OverlapTooHigh", "Partnership", "check_overlap"]

HOUR, DAY = 3600.0, 86400.0
#: Defaults, as multiples of this party's own set: what a peer may bring to one session, and in a day.
SESSION_MULTIPLE, DAY_MULTIPLE = 2, 4


class OverlapTooHigh(AlignmentError):
    """A partner matched more of the bank's customers than the bank's operator allows: nothing was committed."""


class Partnership:
    """One party's PSI limits towards its peers and its session log; thread-safe.

    ``log`` ``None`` keeps the records in memory only (the lab, and tests that play every party in one process).
    """

    def __init__(self, limits: PsiLimits, own_count: int, log: SessionLog | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.limits, self.own_count, self.log, self.clock = limits, own_count, log, clock
        self._memory: list[dict[str, object]] = []
        self._lock = threading.Lock()

    @classmethod
    def at(cls, path: Path, limits: PsiLimits, own_count: int) -> Partnership:
        return cls(limits, own_count, SessionLog(path))

    def max_ids(self, peer: str) -> int:
        """The most IDs ``peer`` may bring to one session."""
        agreed = self.limits.peer_max_ids
        return agreed.get(peer, agreed.get("*", SESSION_MULTIPLE * max(self.own_count, 1)))

    def ids_per_day(self) -> int:
        return self.limits.peer_ids_per_day or DAY_MULTIPLE * max(self.own_count, 1)

    def used(self, peer: str) -> tuple[int, int]:
        """``peer``'s IDs brought in the last 24 hours and sessions opened in the last hour."""
        now = self.clock()
        ids = sessions = 0
        for r in self._records(since=now - DAY):
            if r.get("peer") != peer or r.get("event") != "opened":
                continue
            ids += int(r.get("declared", 0))  # type: ignore[call-overload]
            sessions += float(r["unix"]) >= now - HOUR  # type: ignore[arg-type]
        return ids, sessions

    def admit(self, peer: str, declared: int, *, session: str, side: str) -> None:
        """Count a session of ``declared`` IDs from ``peer`` against its limits, or refuse it (``OverBudget``).

        ``side``: who ``peer`` is to this party (``bank`` or ``partner``), for the messages."""
        with self._lock:
            reason = self._refusal(peer, declared, side)
            if reason is not None:
                self._append("refused", peer=peer, session=session, declared=declared, own=self.own_count,
                             reason=reason)
                raise OverBudget(reason)
            self._append("opened", peer=peer, session=session, declared=declared, own=self.own_count)

    def _refusal(self, peer: str, declared: int, side: str) -> str | None:
        most = self.max_ids(peer)
        if declared > most:
            named = peer in self.limits.peer_max_ids or "*" in self.limits.peer_max_ids
            why = "the size the partnership agreed" if named else (
                f"{SESSION_MULTIPLE} x this party's own {self.own_count:,} customers, the default")
            return (f"{side} {peer!r} announced {declared:,} IDs for one PSI session; at most {most:,} are accepted "
                    f"from it ({why}). If the partnership agreed on more, set --peer-max-ids {peer}=N")
        ids, sessions = self.used(peer)
        if sessions >= self.limits.sessions_per_hour:
            return (f"{side} {peer!r} opened {sessions} PSI sessions in the last hour; the limit is "
                    f"{self.limits.sessions_per_hour} (--psi-sessions-per-hour)")
        if ids + declared > self.ids_per_day():
            return (f"{side} {peer!r} brought {ids:,} IDs to PSI in the last 24 hours; {declared:,} more would pass "
                    f"the limit of {self.ids_per_day():,} (--peer-ids-per-day; every session counts, aborted ones "
                    "too)")
        return None

    def record(self, event: str, peer: str, **fields: str | int | float | None) -> None:
        """How a session ended (``committed``, ``aborted``, ``expired``, ``refused``) or anything else to keep."""
        with self._lock:
            self._append(event, peer=peer, **fields)

    def initiated(self, peer: str, purpose: str) -> InitiatedSession:
        """A session this party opens with ``peer`` (the bank's side): admit it, then say how it ended."""
        return InitiatedSession(self, peer, purpose)

    def records(self, since: float | None = None) -> list[dict[str, object]]:
        with self._lock:
            return self._records(since)

    def _records(self, since: float | None) -> list[dict[str, object]]:
        if self.log is not None:
            return self.log.records(since=since)
        return [r for r in self._memory if since is None or float(r["unix"]) >= since]  # type: ignore[arg-type]

    def _append(self, event: str, **fields: str | int | float | None) -> None:
        if self.log is not None:
            self.log.append(event, **fields)
        else:
            self._memory.append({"event": event, "unix": self.clock(), **fields})

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


#: How unlikely a match count must be, for a partner holding at most the allowed share, before it is refused.
CHANCE = 1e-3


class InitiatedSession:
    """One PSI session this party opens with ``peer``, as its log keeps it: admitted, then ended once."""

    def __init__(self, book: Partnership, peer: str, purpose: str) -> None:
        self.book, self.peer, self.purpose = book, peer, purpose
        self.session: str | None = None

    def admit(self, session_id: str, count: int) -> None:
        """``run_initiator``'s ``admit``: the peer's announced size against this party's limits."""
        self.book.admit(self.peer, count, session=session_id, side="partner")
        self.session = session_id

    def ended(self, event: str, **fields: str | int | float | None) -> None:
        """Log how the session ended (the first call only; nothing if it was never admitted)."""
        if self.session is not None:
            self.book.record(event, self.peer, session=self.session, purpose=self.purpose, **fields)
            self.session = None

    def failed(self, exc: BaseException, **fields: str | int | float | None) -> None:
        """A policy refused it (``AlignmentError``: too large an overlap, too small an intersection), or it broke."""
        self.ended("refused" if isinstance(exc, AlignmentError) else "aborted", reason=str(exc)[:500], **fields)


def check_overlap(partner: str, matched: int, customers: int, max_overlap: float, who: str = "of the bank's") -> None:
    """Refuse a partner matching more than ``max_overlap`` of ``customers`` beyond chance (``OverlapTooHigh``);
    ``who`` says whose they are, for the message.

    A partner that claims every ID it can guess matches all of them and learns them at the commit; an honest
    partner rarely holds nearly all. "Beyond chance": a partner holding ``max_overlap`` of the population
    would match so many under ``CHANCE`` of the time (one-sided binomial), so a small batch all held by an
    honest partner passes while 240 of 240 does not. Called before anything is committed."""
    if not customers or matched / customers <= max_overlap:
        return
    from scipy.stats import binom  # scikit-learn's dependency; only when a share is over the limit

    if binom.sf(matched - 1, customers, max_overlap) >= CHANCE:
        return
    raise OverlapTooHigh(
        f"partner {partner!r} matched {matched:,} {who} {customers:,} customers ({matched / customers:.1%}), "
        f"more than the {max_overlap:.0%} allowed. A partner that claims IDs it does not hold learns which of them "
        "are the bank's customers once the bank commits; nothing was committed. If the partnership agreement says "
        "this partner holds that many, say so: --expect-overlap SHARE (allows SHARE + 0.05) or --max-overlap SHARE")
