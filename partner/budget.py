"""What each bank's PSI sessions may cost this partner: checked when a session opens, before any blinding.

PSI tells the bank which of the IDs it sent the partner holds. Minimum sizes cannot stop a bank from
probing (it can pad its set with IDs it made up); budgets bound how much it can ask, and how often.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable

from parties.errors import OverBudget
from parties.settings import PsiBudget

__all__ = ["PsiBudgets"]

HOUR, DAY = 3600.0, 86400.0


class PsiBudgets:
    """Per bank (its certificate name): IDs per session, sessions per hour, IDs per day."""

    def __init__(self, budget: PsiBudget, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget, self.clock = budget, clock
        self._opened: dict[str, deque[tuple[float, int]]] = defaultdict(deque)  # (when, IDs) per bank
        self._lock = threading.Lock()

    def charge(self, bank: str, ids: int) -> None:
        """Count a session of ``ids`` IDs against ``bank``'s budget, or refuse it (``OverBudget``, HTTP 429)."""
        b = self.budget
        if ids > b.max_ids_per_session:
            raise OverBudget(f"a PSI session may bring at most {b.max_ids_per_session} IDs; {ids} were announced")
        now = self.clock()
        with self._lock:
            opened = self._opened[bank]
            while opened and now - opened[0][0] > DAY:
                opened.popleft()
            last_hour = sum(1 for when, _ in opened if now - when <= HOUR)
            if last_hour >= b.sessions_per_hour:
                raise OverBudget(f"{bank} opened {last_hour} PSI sessions in the last hour; the limit is "
                                 f"{b.sessions_per_hour}")
            today = sum(n for _, n in opened)
            if today + ids > b.ids_per_day:
                raise OverBudget(f"{bank} brought {today} IDs to PSI in the last 24 hours; {ids} more would pass "
                                 f"the limit of {b.ids_per_day}")
            opened.append((now, ids))
