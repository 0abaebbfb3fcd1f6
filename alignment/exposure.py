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


def customer_keys(normalized_ids: Sequence[bytes], rows: Sequence[int] | None = None) -> np.ndarray:
    """A 16-byte digest of each canonical ID (of ``rows`` only, in that order, if given): how the ledger names
    customers."""
    ids = normalized_ids if rows is None else (normalized_ids[int(r)] for r in rows)
    count = len(normalized_ids) if rows is None else len(rows)
    return np.fromiter((hashlib.sha256(i).digest()[:16] for i in ids), dtype=_KEY, count=count)


def _sorted_unique(keys: np.ndarray) -> np.ndarray:
    """``keys`` sorted in place, each once (a copy only if some repeat)."""
    out = keys
    out.sort()
    if len(out) > 1:
        keep = np.empty(len(out), dtype=bool)
        keep[0] = True
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        if not keep.all():
            out = out[keep]
    return out


def _in_sorted(values: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``ref`` (sorted), by binary search: no sorted copy of either."""
    if not len(ref) or not len(values):
        return np.zeros(len(values), dtype=bool)
    at = np.searchsorted(ref, values)
    np.minimum(at, len(ref) - 1, out=at)
    return ref[at] == values


def _not_in(values: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``values`` without those in ``ref`` (sorted); ``values`` itself when ``ref`` is empty."""
    return values[~_in_sorted(values, ref)] if len(ref) else values


def _merged(ref: np.ndarray, new: np.ndarray) -> np.ndarray:
    """The sorted union of ``ref`` (sorted) and ``new``, which holds none of it."""
    out = np.concatenate([ref, new]) if len(ref) else new
    out.sort()
    return out


class Exposure:
    """Per partner: the bank's customers ever sent to it in PSI, and those of them it matched. Thread-safe.

    Each ledger is read from disk when a session is judged and dropped after (at 10^7 customers it is 16 bytes a
    customer); ``folder`` ``None``: kept in memory only (the lab, and tests that play every party in one process)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._memory: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._totals: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def totals(self, partner: str) -> tuple[int, int]:
        """(customers sent to ``partner``, of which it matched) over the partnership so far."""
        with self._lock:
            if partner not in self._totals:
                sent, matched = self._load(partner)
                self._totals[partner] = (len(sent), len(matched))
            return self._totals[partner]

    def claim(self, partner: str, sent: np.ndarray, matched: np.ndarray, ceiling: float) -> tuple[int, int]:
        """Count a session sending ``sent`` customers of which ``partner`` matched ``matched`` (both from
        ``customer_keys``, and both sorted in place: no copy of either), or refuse it (``OverlapTooHigh``) if the
        session alone, or the partnership with it, has the partner matching more than ``ceiling`` beyond chance.
        Returns the totals after it.

        Counted before anything is committed, under one lock with the check: a session that fails later is
        over-counted (the safe side), and no two sessions are judged on totals that miss each other."""
        with self._lock:
            before_sent, before_matched = self._load(partner)
            self._check_not_rolled_back(partner, len(before_sent), len(before_matched))
            matched_new = _not_in(_sorted_unique(matched), before_matched)
            sent = _sorted_unique(sent)
            # The session alone, on what it tells anew: customers the partner had not matched before (scoring ones
            # it was aligned with tells it nothing new, and is never refused for it).
            fresh = (len(matched_new), len(sent) - int(_in_sorted(sent, before_matched).sum()))
            sent_new = _not_in(sent, before_sent)
            del sent
            over_all = (len(before_matched) + len(matched_new), len(before_sent) + len(sent_new), "over the partnership")
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
            self._save(partner, _merged(before_sent, sent_new), _merged(before_matched, matched_new))
            self._totals[partner] = over_all[1], over_all[0]
            return self._totals[partner]

    def _check_not_rolled_back(self, partner: str, sent: int, matched: int) -> None:
        """The ledger on disk holds at least what this process last wrote or read there (it is read per claim)."""
        known = self._totals.get(partner)
        if known is not None and (sent < known[0] or matched < known[1]):
            raise DataError(
                f"the exposure ledger of partner {partner!r} holds ({sent}, {matched}) (customers sent, matched), "
                f"fewer than the ({known[0]}, {known[1]}) this service last recorded there: it was deleted or rolled "
                f"back while the service ran. Restore {self.folder} from a backup: it bounds what {partner} may "
                "still be told")

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
        if self.folder is None:
            self._memory[partner] = (sent, matched)
            return
        with atomic_writer(self._path(partner)) as f:  # written as it is made: never a copy in memory
            np.savez(f, sent=sent, matched=matched)

    def _load(self, partner: str) -> tuple[np.ndarray, np.ndarray]:
        """The ledger's (sent, matched), each sorted and without repeats."""
        empty = np.array([], dtype=_KEY)
        if self.folder is None:
            return self._memory.get(partner, (empty, empty))
        path = self._path(partner)
        if not path.exists():
            return empty, empty
        try:
            with np.load(path, allow_pickle=False) as saved:
                return saved["sent"].astype(_KEY, copy=False), saved["matched"].astype(_KEY, copy=False)
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(f"{path}: not readable ({exc}); it records what partner {partner!r} was "
                            "told of the bank's customers: restore it from a backup") from exc

    def _path(self, partner: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{partner}.npz"
