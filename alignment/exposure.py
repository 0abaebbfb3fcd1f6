"""What each partner has been told of the bank's customers, over the whole partnership, and its bound.

A partner learns which of the IDs it claimed are the bank's customers when the bank commits. One that
claims IDs it does not hold matches more of the bank's customers than it honestly could; the bank refuses,
before committing anything, a session after which the partner would have matched more than a share
``ceiling`` of the customers sent in that session that it had not matched before, or of all the bank's
customers ever sent to it (one-sided
binomial tests at ``CHANCE``: a small batch all held by an honest partner passes, 240 of 240 does not). The
totals run over every session, training and scoring alike: claims spread over several sessions, or over
many small batches, add up.

What this bounds: a partner can be told about ``ceiling`` of any group of customers the bank sends it,
whatever share of them it truly holds (and a little more, by chance, on small groups); over the partnership,
about ``ceiling - s`` of them beyond its own, for a partner holding a share ``s``. The ceiling is the
operator's: ``--expect-overlap`` (expected + 0.05) or ``--max-overlap``; without either, the share the partner
matched at its first alignment + 0.05 (``bank.service.core``), and 0.95 for that first alignment.

Customers are kept as 16-byte digests of their canonical IDs, per partner, in ``<state>/exposure/``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from parties.errors import AlignmentError, DataError
from parties.storage.files import atomic_writer

__all__ = ["CHANCE", "Exposure", "OverlapTooHigh", "customer_keys"]

#: How unlikely a match count must be, for a partner holding at most the allowed share, before it is refused.
CHANCE = 1e-3
_KEY = "S16"


class OverlapTooHigh(AlignmentError):
    """A partner matched more of the bank's customers than the bank's operator allows: nothing was committed."""


def _beyond(matched: int, sent: int, ceiling: float) -> bool:
    """Whether ``matched`` of ``sent`` is more than ``ceiling`` beyond chance (one-sided binomial, ``CHANCE``)."""
    if not sent or matched / sent <= ceiling:
        return False
    from scipy.stats import binom  # scikit-learn's dependency; only when a share is over the limit

    return bool(binom.sf(matched - 1, sent, ceiling) < CHANCE)


def customer_keys(normalized_ids: Sequence[bytes]) -> np.ndarray:
    """A 16-byte digest of each canonical ID, row by row: how the ledger names customers."""
    return np.fromiter((hashlib.sha256(i).digest()[:16] for i in normalized_ids), dtype=_KEY, count=len(normalized_ids))


class Exposure:
    """Per partner: the bank's customers ever sent to it in PSI, and those of them it matched. Thread-safe.

    ``folder`` ``None``: kept in memory only (the lab, and tests that play every party in one process)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def totals(self, partner: str) -> tuple[int, int]:
        """(customers sent to ``partner``, of which it matched) over the partnership so far."""
        sent, matched = self._load(partner)
        return len(sent), len(matched)

    def claim(self, partner: str, sent: np.ndarray, matched: np.ndarray, ceiling: float) -> tuple[int, int]:
        """Count a session sending ``sent`` customers of which ``partner`` matched ``matched`` (both from
        ``customer_keys``), or refuse it (``OverlapTooHigh``) if the session alone, or the partnership with it,
        has the partner matching more than ``ceiling`` beyond chance. Returns the totals after it.

        Counted before anything is committed, under one lock with the check: a session that fails later is
        over-counted (the safe side), and no two sessions are judged on totals that miss each other."""
        with self._lock:
            before_sent, before_matched = self._load(partner)
            sent_all, matched_all = np.union1d(before_sent, sent), np.union1d(before_matched, matched)
            # The session alone, on what it tells anew: customers the partner had not matched before (scoring ones
            # it was aligned with tells it nothing new, and is never refused for it).
            fresh = (len(np.setdiff1d(matched, before_matched)), len(np.setdiff1d(sent, before_matched)))
            over_all = (len(matched_all), len(sent_all), "over the partnership")
            for n_matched, n_sent, what in ((*fresh, "in this session that it had not matched before"), over_all):
                if _beyond(n_matched, n_sent, ceiling):
                    earlier = (f" ({len(before_matched):,} of {len(before_sent):,} in earlier sessions)"
                               if what == over_all[2] and len(before_sent) else "")
                    raise OverlapTooHigh(
                        f"partner {partner!r} would have matched {n_matched:,} of the {n_sent:,} bank customers sent "
                        f"to it {what} ({n_matched / n_sent:.1%}){earlier}, more than the {ceiling:.0%} allowed. A "
                        "partner that claims IDs it does not hold learns which of them are the bank's customers once "
                        "the bank commits; nothing was committed. If the partnership agreement says this partner "
                        "holds that many, say so: --expect-overlap SHARE (allows SHARE + 0.05) or --max-overlap SHARE")
            self._save(partner, sent_all.astype(_KEY, copy=False), matched_all.astype(_KEY, copy=False))
            return len(sent_all), len(matched_all)

    def verify_against(self, records: list[dict[str, object]]) -> None:
        """Refuse (``DataError``) a ledger holding less than the session log's committed records say it held
        (deleted, or restored from an older copy): a partner would be allowed to learn again what it was told."""
        logged: dict[str, tuple[int, int, int]] = {}
        for r in records:
            if r.get("event") == "committed" and "told_sent" in r:
                logged[str(r["peer"])] = (int(r["told_sent"]), int(r["told_matched"]), int(r["seq"]))
        for partner, (sent, matched, seq) in logged.items():
            now_sent, now_matched = self.totals(partner)
            if now_sent < sent or now_matched < matched:
                raise DataError(
                    f"the exposure ledger of partner {partner!r} holds ({now_sent}, {now_matched}) (customers sent, "
                    f"matched), fewer than the session log's record {seq} says it held, ({sent}, {matched}): it was "
                    f"deleted or rolled back. Restore {self.folder} from a backup: it bounds what {partner} may still "
                    "be told")

    def _save(self, partner: str, sent: np.ndarray, matched: np.ndarray) -> None:
        if self.folder is not None:
            with atomic_writer(self._path(partner)) as f:  # written as it is made: never a copy in memory
                np.savez(f, sent=sent, matched=matched)
        self._cache[partner] = (sent, matched)

    def _load(self, partner: str) -> tuple[np.ndarray, np.ndarray]:
        if partner not in self._cache:
            empty = np.array([], dtype=_KEY)
            path = self._path(partner) if self.folder is not None else None
            if path is None or not path.exists():
                self._cache[partner] = (empty, empty)
            else:
                try:
                    with np.load(path, allow_pickle=False) as saved:
                        self._cache[partner] = (saved["sent"].astype(_KEY), saved["matched"].astype(_KEY))
                except (OSError, ValueError, KeyError) as exc:
                    raise DataError(f"{path}: not readable ({exc}); it records what partner {partner!r} was "
                                    "told of the bank's customers: restore it from a backup") from exc
        return self._cache[partner]

    def _path(self, partner: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{partner}.npz"
