"""What a party's PSI sessions with each peer may cost and reveal, and the log they are kept in.

PSI tells a side which of the IDs it brought the other side holds. Nothing in the protocol can stop a peer
from bringing IDs it guessed rather than IDs it holds: with IDs anyone can enumerate (sequential numbers,
phone numbers), a peer that brings the whole space learns which of them the other side holds. What each
party does here, on both sides of every session:

- a peer that announces more IDs than the partnership agreed is refused before anything is blinded
  (``peer_max_ids``; by default twice this party's own set);
- every ID a peer brings counts against its budget over 24 hours, aborted sessions too
  (``peer_ids_per_day``; by default four times this party's own set), and every session it asks for, refused
  ones too, against ``sessions_per_hour``; both are read back from the log, so a restart refills nothing;
- every session (peer, declared and received sizes, result size, purpose, how it ended, and the peer's chain
  head when it gave one) is appended to a hash-chained log (``parties.storage.session_log``). Each side keeps
  the other's head, so a log its owner rewrote no longer holds the hashes its peer kept (``verify-log
  --against``). Past ``sessions_per_hour`` refusals in an hour, further ones are counted, not written one by one.

The bank, which alone learns the intersection, also bounds what each partner is told of its customers over
the whole partnership (``alignment.exposure``) before it commits anything: until the commit, a partner learns
nothing.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from alignment.psi import SessionInfo
from parties.errors import AlignmentError, OverBudget
from parties.limits import PsiLimits
from parties.storage.session_log import SessionLog

__all__ = ["DAY", "HOUR", "InitiatedSession", "Partnership"]

HOUR, DAY = 3600.0, 86400.0
#: Defaults, as multiples of this party's own set: what a peer may bring to one session, and in a day.
SESSION_MULTIPLE, DAY_MULTIPLE = 2, 4

Value = str | int | float | None


@dataclass
class _Window:
    """One peer's recent use: what its budgets are judged on."""

    opened: deque[tuple[float, int]] = field(default_factory=deque)  # (when, IDs declared), last 24 hours
    asked: deque[float] = field(default_factory=deque)  # sessions asked for, refused ones too, last hour
    refusals_written: deque[float] = field(default_factory=deque)  # refusal records written, last hour
    unwritten: int = 0  # refusals counted but not written one by one

    def prune(self, now: float) -> None:
        while self.opened and now - self.opened[0][0] > DAY:
            self.opened.popleft()
        for times in (self.asked, self.refusals_written):
            while times and now - times[0] > HOUR:
                times.popleft()


class Partnership:
    """One party's PSI limits towards its peers and its session log; thread-safe.

    ``log`` ``None``: a chain kept in memory (the lab, and tests that play every party in one process): the
    limits hold, and heads are sent, for the life of the object.
    """

    def __init__(self, limits: PsiLimits, own_count: int, log: SessionLog | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.limits, self.own_count, self.clock = limits, own_count, clock
        self.log = log if log is not None else SessionLog(None)
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()
        now = clock()
        for r in self.log.records(since=now - DAY):
            peer, when = str(r.get("peer")), float(r["unix"])  # type: ignore[arg-type]
            window = self._windows.setdefault(peer, _Window())
            if r["event"] == "opened":
                window.opened.append((when, int(r.get("declared") or 0)))  # type: ignore[call-overload]
            if r["event"] in ("opened", "refused") and now - when <= HOUR:
                window.asked.extend([when] * int(r.get("count") or 1))  # type: ignore[call-overload]
                if r["event"] == "refused":
                    window.refusals_written.append(when)

    @classmethod
    def at(cls, path: Path, limits: PsiLimits, own_count: int) -> Partnership:
        return cls(limits, own_count, SessionLog(path))

    @property
    def head(self) -> str:
        """This party's chain head, for its peer to keep."""
        return self.log.head

    def max_ids(self, peer: str) -> int:
        """The most IDs ``peer`` may bring to one session."""
        agreed = self.limits.peer_max_ids
        return agreed.get(peer, agreed.get("*", SESSION_MULTIPLE * max(self.own_count, 1)))

    def ids_per_day(self) -> int:
        return self.limits.peer_ids_per_day or DAY_MULTIPLE * max(self.own_count, 1)

    def admit(self, peer: str, declared: int, *, session: str, side: str, own: int | None = None,
              peer_head: str | None = None) -> str:
        """Count a session of ``declared`` IDs from ``peer`` against its limits, or refuse it (``OverBudget``);
        return the hash of the record that logged it (the chain head), for the peer to keep.

        ``side``: who ``peer`` is to this party (``bank`` or ``partner``), for the messages; ``own``: the IDs
        this party brings (default: its whole set); ``peer_head``: the peer's chain head, if it sent one."""
        now = self.clock()
        with self._lock:
            window = self._windows.setdefault(peer, _Window())
            window.prune(now)
            reason = self._refusal(peer, declared, side, window)
            window.asked.append(now)
            fields = {"session": session, "declared": declared, "own": self.own_count if own is None else own,
                      "peer_head": peer_head}
            if reason is not None:
                if len(window.refusals_written) < self.limits.sessions_per_hour:
                    self._write(peer, "refused", reason=reason, **fields)
                    window.refusals_written.append(now)
                else:
                    window.unwritten += 1
                raise OverBudget(reason)
            window.opened.append((now, declared))
            self._write(peer, "opened", **fields)
            return self.head

    def _refusal(self, peer: str, declared: int, side: str, window: _Window) -> str | None:
        most = self.max_ids(peer)
        if declared > most:
            named = peer in self.limits.peer_max_ids or "*" in self.limits.peer_max_ids
            why = "the size the partnership agreed" if named else (
                f"{SESSION_MULTIPLE} x this party's own {self.own_count:,} customers, the default")
            return (f"{side} {peer!r} announced {declared:,} IDs for one PSI session; at most {most:,} are accepted "
                    f"from it ({why}). If the partnership agreed on more, set --peer-max-ids {peer}=N")
        if len(window.asked) >= self.limits.sessions_per_hour:
            return (f"{side} {peer!r} asked for {len(window.asked)} PSI sessions in the last hour (refused ones "
                    f"count); the limit is {self.limits.sessions_per_hour} (--psi-sessions-per-hour)")
        ids = sum(n for _, n in window.opened)
        if ids + declared > self.ids_per_day():
            return (f"{side} {peer!r} brought {ids:,} IDs to PSI in the last 24 hours; {declared:,} more would pass "
                    f"the limit of {self.ids_per_day():,} (--peer-ids-per-day; every session counts, aborted ones "
                    "and scorings too): each session's IDs leave the count 24 hours after it opened, or this party's "
                    "operator raises the limit as the partnership agrees")
        return None

    def record(self, event: str, peer: str, **fields: Value) -> str:
        """How a session ended (``committed``, ``aborted``, ``expired``, ``refused``); returns the chain head."""
        with self._lock:
            self._write(peer, event, **fields)
            return self.head

    def records(self) -> list[dict[str, object]]:
        """Every record of the log, read and verified from its file."""
        return self.log.records()

    def initiated(self, peer: str, purpose: str, own: int) -> InitiatedSession:
        """A session this party opens with ``peer`` bringing ``own`` IDs (the bank's side)."""
        return InitiatedSession(self, peer, purpose, own)

    def _write(self, peer: str, event: str, **fields: Value) -> None:
        self._flush(peer)  # what was only counted goes in before anything newer
        self.log.append(event, peer=peer, **{k: v for k, v in fields.items() if v is not None})

    def _flush(self, peer: str) -> None:
        window = self._windows.setdefault(peer, _Window())
        if window.unwritten:
            self.log.append("refused", peer=peer, count=window.unwritten,
                            reason=f"{window.unwritten} more refusals, over --psi-sessions-per-hour, counted here")
        window.unwritten = 0

    def close(self) -> None:
        with self._lock:
            for peer in self._windows:
                self._flush(peer)
        self.log.close()


class InitiatedSession:
    """One PSI session this party opens with ``peer``, as its log keeps it: admitted, then ended once."""

    def __init__(self, book: Partnership, peer: str, purpose: str, own: int) -> None:
        self.book, self.peer, self.purpose, self.own = book, peer, purpose, own
        self.session: str | None = None
        self.head: str | None = None  # the hash of this side's record of the session's opening: sent at the commit

    def admit(self, info: SessionInfo) -> None:
        """``run_initiator``'s ``admit``: the peer's announced size against this party's limits."""
        self.head = self.book.admit(self.peer, info.peer_count, session=info.session_id, side="partner", own=self.own,
                                    peer_head=info.log_head)
        self.session = info.session_id

    def ended(self, event: str, **fields: Value) -> None:
        """Log how the session ended (the first call only; nothing if it was never admitted)."""
        if self.session is not None:
            self.book.record(event, self.peer, session=self.session, purpose=self.purpose, **fields)
            self.session = None

    def failed(self, exc: BaseException, **fields: Value) -> None:
        """A policy refused it (``AlignmentError``: too large an overlap, too small an intersection), or it broke."""
        self.ended("refused" if isinstance(exc, AlignmentError) else "aborted", reason=str(exc)[:500], **fields)
