"""What each partner has been told of the bank's customers, over the whole partnership, and its bound.

A partner learns which of the IDs it claimed are the bank's customers when the bank commits. One that
claims IDs it does not hold matches more of the bank's customers than it honestly could; the bank refuses,
before committing anything, a session after which the partner would have matched more than a share
``ceiling`` of all the bank's customers ever sent to it (one-sided binomial test at ``CHANCE``: a small
batch all held by an honest partner passes, 240 of 240 does not). The totals run over every session,
training and scoring alike: claims spread over several sessions, or over many small batches, add up.

What this bounds: a partner holding a share ``s`` of the bank's customers can be told at most about
``ceiling - s`` of them beyond those it holds, over the partnership. The operator brings the ceiling close to
the honest share with ``--expect-overlap`` (ceiling = expected + 0.05) or ``--max-overlap``.

Customers are kept as 16-byte digests of their canonical IDs, per partner, in ``<state>/exposure/``.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from parties.errors import AlignmentError, DataError
from parties.storage.files import atomic_write_bytes

__all__ = ["CHANCE", "Exposure", "OverlapTooHigh", "customer_keys"]

#: How unlikely a match count must be, for a partner holding at most the allowed share, before it is refused.
CHANCE = 1e-3
_KEY = "S16"


class OverlapTooHigh(AlignmentError):
    """A partner matched more of the bank's customers than the bank's operator allows: nothing was committed."""


def customer_keys(normalized_ids: Sequence[bytes]) -> np.ndarray:
    """A 16-byte digest of each canonical ID, row by row: how the ledger names customers."""
    return np.array([hashlib.sha256(i).digest()[:16] for i in normalized_ids], dtype=_KEY)


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

    def check(self, partner: str, sent: np.ndarray, matched: np.ndarray, ceiling: float) -> None:
        """Refuse (``OverlapTooHigh``) a session sending ``sent`` customers of which ``partner`` matched
        ``matched`` (both from ``customer_keys``), if afterwards it would have matched too many of all."""
        before_sent, before_matched = self._load(partner)
        total_sent = len(np.union1d(before_sent, sent))
        total_matched = len(np.union1d(before_matched, matched))
        if not total_sent or total_matched / total_sent <= ceiling:
            return
        from scipy.stats import binom  # scikit-learn's dependency; only when a share is over the limit

        if binom.sf(total_matched - 1, total_sent, ceiling) >= CHANCE:
            return
        earlier = (f" ({len(before_matched):,} of {len(before_sent):,} in earlier sessions)"
                   if len(before_sent) else "")
        raise OverlapTooHigh(
            f"partner {partner!r} would have matched {total_matched:,} of the {total_sent:,} bank customers sent "
            f"to it ({total_matched / total_sent:.1%}){earlier}, more than the {ceiling:.0%} allowed. A partner "
            "that claims IDs it does not hold learns which of them are the bank's customers once the bank "
            "commits; nothing was committed. If the partnership agreement says this partner holds that many, say "
            "so: --expect-overlap SHARE (allows SHARE + 0.05) or --max-overlap SHARE")

    def add(self, partner: str, sent: np.ndarray, matched: np.ndarray) -> None:
        """Count a committed session (before it is committed: a crash between the two over-counts, never under)."""
        with self._lock:
            before_sent, before_matched = self._load(partner)
            after = (np.union1d(before_sent, sent).astype(_KEY), np.union1d(before_matched, matched).astype(_KEY))
            if self.folder is not None:
                buffer = io.BytesIO()
                np.savez(buffer, sent=after[0], matched=after[1])
                atomic_write_bytes(self._path(partner), buffer.getvalue())
            self._cache[partner] = after

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
