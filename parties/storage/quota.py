"""The disk a bank may fill at a party that serves several: counted on disk, refused before it is written.

A bank decides how many sessions it opens, checkpoints it asks for and models it trains; without a quota one
bank could fill the disk every other bank's training needs.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from parties.errors import BadMessage, QuotaExceeded, StorageError

__all__ = ["FOLDER_BYTES", "DiskQuota"]

#: A bank's name as a folder name: no separators, no leading dot, nothing a path could climb out with.
_BANK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MB = 1 << 20
#: What a folder costs on disk (a block on ext4 and xfs): counted, or one bank could make folders without end.
FOLDER_BYTES = 4096


class DiskQuota:
    """Bytes one bank may keep at this party (its checkpoints, models and alignments), counted on disk."""

    def __init__(self, root: Path, limit: int | None, *, party: str, flag: str = "--disk-quota-per-bank") -> None:
        """``limit`` None: no quota. ``party`` (this party, e.g. ``partner 'telco'``) and ``flag`` (what sets the
        limit) are for messages."""
        if limit is not None and limit < 0:
            raise ValueError(f"a disk quota is a number of bytes, at least 0, not {limit}")
        self.root = Path(root)
        self.limit = limit
        self.party = party
        self.flag = flag
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # bytes reserved by writes under way, per bank
        self._locks: dict[str, threading.Lock] = {}

    def folder(self, bank: str) -> Path:
        """Where ``bank``'s files live at this party: ``root / bank``."""
        if not isinstance(bank, str) or not _BANK.fullmatch(bank):
            raise BadMessage(f"bank name {str(bank)[:80]!r} cannot name a folder: 1 to 64 letters, digits, "
                             "'_', '.' or '-', starting with a letter or digit")
        return self.root / bank

    def used(self, bank: str) -> int:
        """Bytes of the regular files under ``folder(bank)``, at any depth, and ``FOLDER_BYTES`` per folder in it;
        0 if it does not exist.

        Symbolic links inside are not followed (a link is no bytes of the bank's); a file linked twice counts once.
        """
        folder = self.folder(bank)
        try:
            return _tree_size(folder)
        except OSError as exc:
            raise StorageError(f"cannot count what bank {bank!r} keeps under {folder}: {exc.strerror or exc}") from exc

    def check(self, bank: str, adding: int) -> None:
        """Raise ``QuotaExceeded`` if ``bank`` keeping ``adding`` more bytes would pass the quota (counting what
        other writes of its own have reserved and not yet finished)."""
        with self.reserve(bank, adding):
            pass

    @contextmanager
    def reserve(self, bank: str, adding: int) -> Iterator[None]:
        """Hold ``adding`` bytes of ``bank``'s quota while the caller writes them, or raise ``QuotaExceeded``.

        Two writes of one bank at once (two sessions' checkpoints) cannot both pass a check that only one fits."""
        if adding < 0:
            raise ValueError(f"adding is a number of bytes, at least 0, not {adding}")
        self.folder(bank)  # checks the name
        if self.limit is None:
            yield
            return
        with self._lock_of(bank):
            used, held = self.used(bank), self._held.get(bank, 0)
            if used + held + adding > self.limit:
                raise QuotaExceeded(
                    f"bank {bank!r} keeps {_amount(used + held)} at {self.party}; {_amount(adding)} more would "
                    f"pass its quota of {self.limit / _MB:.1f} MB ({self.limit:,} bytes, {self.flag}). End finished "
                    f"sessions, or ask the operator of {self.party} to raise the quota or remove {bank}'s old models "
                    f"and checkpoints"  # no path: the message goes to the bank
                )
            self._held[bank] = held + adding
        try:
            yield
        finally:
            with self._lock_of(bank):
                self._held[bank] -= adding

    def _lock_of(self, bank: str) -> threading.Lock:
        """One lock per bank: counting one bank's tree never waits on another's."""
        with self._lock:
            return self._locks.setdefault(bank, threading.Lock())

def _amount(n: int) -> str:
    return f"{n / _MB:.1f} MB ({n:,} bytes)"


def _tree_size(top: Path) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    todo = [str(top)]
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
                            total += FOLDER_BYTES
                        elif entry.is_file(follow_symlinks=False):
                            stat = entry.stat(follow_symlinks=False)
                            if (stat.st_dev, stat.st_ino) not in seen:
                                seen.add((stat.st_dev, stat.st_ino))
                                total += stat.st_size
                    except FileNotFoundError:  # removed while counting (an expired checkpoint)
                        continue
        except (FileNotFoundError, NotADirectoryError):  # no folder yet, or it went away
            continue
    return total
