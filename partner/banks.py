"""What a partner holds for each bank it serves: one space per bank, which no other bank reaches.

A partner may serve several banks (each a certificate its CA signed). Everything it holds for one of them,
its alignments, its PSI, training and scoring sessions, its loaded models and its files, lives in that
bank's ``BankSpace``, found by the caller's certificate name alone: another bank naming the same session,
model or alignment ID finds nothing (404), cannot keep it alive, and uses slots and disk of its own.

On disk: ``<state>/banks/<bank>/`` holds ``alignment.safetensors`` (the training alignment),
``training/<session>/`` (checkpoints) and ``models/<session>/`` (trained bottoms), all counted against the
bank's disk quota (each folder too). The folder of a session unused for ``checkpoint_ttl`` is removed.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from alignment.psi import PsiResponder
from parties.errors import BadMessage
from parties.learning.trained_bottom import ScoringBottom
from parties.learning.training_session import PartySession
from parties.limits import BankQuotas
from parties.storage.checkpoint import remove_idle_sessions
from parties.storage.layout import bank_folder, banks_root, model_folder, training_folder
from parties.storage.quota import DiskQuota
from parties.tables.drift import Drift
from parties.tables.table import AlignedRows, PartyTable, load_alignment

__all__ = ["BankSpace", "Banks", "LEGACY_STATE"]

logger = logging.getLogger(__name__)

#: Files of a partner from before per-bank spaces: they name no bank, so none is given them.
LEGACY_STATE = ("alignment.safetensors", "training", "models")
ENDED = "ended"  # in a training session's folder: the session is over and never comes back (until swept)
SWEEP_EVERY = 60.0  # seconds between sweeps of idle session folders: a start does not walk every folder


def _id(value: str, what: str) -> str:
    if not value or len(value) > 64 or not value.isalnum():
        raise BadMessage(f"a {what} is 1 to 64 letters and digits")
    return value


@dataclass
class BankSpace:
    """One bank's alignments, sessions and models at this partner, and the folder they are kept in."""

    name: str
    state: Path  # the partner's state folder
    alignment: AlignedRows | None = None
    psi: dict[str, PsiResponder] = field(default_factory=dict)
    training: dict[str, PartySession] = field(default_factory=dict)
    scoring_alignments: dict[str, np.ndarray] = field(default_factory=dict)
    models: dict[str, ScoringBottom] = field(default_factory=dict)
    drifts: dict[tuple[str, str], Drift] = field(default_factory=dict)  # (model, scoring alignment) -> drift

    @property
    def folder(self) -> Path:
        return bank_folder(self.state, self.name)

    def training_dir(self, session_id: str) -> Path:
        return training_folder(self.state, self.name, _id(session_id, "session id"))

    def model_dir(self, model_id: str) -> Path:
        return model_folder(self.state, self.name, _id(model_id, "model id"))

    def ended(self, session_id: str) -> bool:
        return (self.training_dir(session_id) / ENDED).exists()


class Banks:
    """Every bank's space at this partner, made when the bank first calls; its disk quota; idle files swept."""

    def __init__(self, state: Path, table: PartyTable, quotas: BankQuotas, party: str) -> None:
        self.state, self.root, self.table, self.quotas = state, banks_root(state), table, quotas
        self.quota = DiskQuota(self.root, quotas.disk_per_bank, party=f"partner {party!r}")
        self._spaces: dict[str, BankSpace] = {}
        self._swept = -SWEEP_EVERY  # when the last sweep ran (monotonic)
        self._lock = threading.Lock()
        legacy = [state / name for name in LEGACY_STATE if (state / name).exists()]
        if legacy:
            logger.warning("%s: state from before per-bank spaces names no bank and is not served; each bank aligns "
                           "again (remove those files once no longer needed)", ", ".join(map(str, legacy)))

    def __getitem__(self, bank: str) -> BankSpace:
        """``bank``'s space (its certificate name), loading its alignment from disk the first time."""
        with self._lock:
            space = self._spaces.get(bank)
            if space is None:
                self.quota.folder(bank)  # checks the name
                space = BankSpace(bank, self.state, load_alignment(bank_folder(self.state, bank), self.table))
                self._spaces[bank] = space
            return space

    def spaces(self) -> list[BankSpace]:
        with self._lock:
            return list(self._spaces.values())

    def reserve(self, bank: str, adding: int) -> AbstractContextManager[None]:
        """Hold ``adding`` bytes of ``bank``'s disk quota here for a write, or refuse (``QuotaExceeded``, 507)."""
        return self.quota.reserve(bank, adding)

    def sweep(self, now: float | None = None) -> list[Path]:
        """Remove the folders of sessions unused for ``checkpoint_ttl`` and not live (checkpoints, and the mark of
        an ended one); return them. Runs at most once a ``SWEEP_EVERY`` seconds, or half the TTL (``now`` given: at
        once)."""
        with self._lock:
            if now is None and time.monotonic() - self._swept < min(SWEEP_EVERY, self.quotas.checkpoint_ttl / 2):
                return []
            self._swept = time.monotonic()
        live = {s.training_dir(sid) for s in self.spaces() for sid in s.training}
        idle = [f for f in self.root.glob("*/training/*") if f not in live] if self.root.is_dir() else []
        removed = remove_idle_sessions(idle, self.quotas.checkpoint_ttl, now)
        for folder in removed:
            logger.info("session %s of %s unused for over %.0f s: its folder was removed",
                        folder.name, folder.parent.parent.name, self.quotas.checkpoint_ttl)
        return removed
