"""A party's log of PSI sessions: append-only JSON lines, each chained to the one before by SHA-256.

Both sides of a partnership keep one, so the partnership agreement (who intersected what, how often, how
large, for what purpose) can be enforced on a record neither side can quietly rewrite: editing, deleting,
reordering or inserting a line breaks the chain at that line. Cutting lines off the end leaves a shorter
chain that still verifies; the peer's own log, and its last ``hash``, are what show that.

The log holds only what the caller passes (sizes, names, purposes, reasons): never customer IDs.
One writer per file: a party's service owns its log.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from parties.errors import DataError, LogTampered, StorageError
from parties.storage.files import open_private_log

__all__ = ["GENESIS", "RESERVED", "SessionLog", "VerifiedLog", "verify_log"]

_log = logging.getLogger(__name__)

#: The ``prev`` of the first record.
GENESIS = "0" * 64
#: Keys the log sets itself; a caller's field may not take one of these names.
RESERVED = frozenset({"seq", "time", "unix", "event", "prev", "hash"})

_Value = str | int | float | bool | None  # what JSON holds exactly, and nothing nested


class VerifiedLog(list[dict[str, object]]):
    """The whole records of a log whose chain verifies, in order.

    ``torn`` is True when the file's last line had no newline: a write cut short by a crash. That line is
    not among the records (it was never a whole record), and it is no sign of tampering.
    """

    def __init__(self, records: list[dict[str, object]], *, torn: bool) -> None:
        super().__init__(records)
        self.torn = torn


def verify_log(path: Path) -> VerifiedLog:
    """The records of the log at ``path``, or ``LogTampered`` naming the file, the 1-based line and the fault.

    A torn last line is logged as a warning and left out (``VerifiedLog.torn``); the file is not changed.
    """
    path = Path(path)
    records, _ = _read(path, _load(path))
    if records.torn:
        _log.warning("%s: line %d is torn (no newline: a write cut short by a crash) and was left out",
                     path, len(records) + 1)
    return records


class SessionLog:
    """Append-only JSON lines; each record carries the SHA-256 of the one before (``prev``) and its own (``hash``).

    Opening reads and verifies the file if it exists (``LogTampered`` on damage) and drops a torn last line;
    nothing is created until the first ``append``. The records of the last ``keep_seconds`` stay in memory
    too (a party reads its PSI budgets from them); older ones are read from the file when asked for.
    """

    def __init__(self, path: Path | None, keep_seconds: float = 86400.0) -> None:
        """``path`` ``None``: a chain kept in memory only (the lab, and tests that play every party in one
        process), its last ``keep_seconds`` readable."""
        self.path, self.keep_seconds = (Path(path) if path is not None else None), keep_seconds
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._broken: str | None = None
        data = _load(self.path) if self.path is not None and self.path.exists() else b""
        records, self._size = _read(self.path or Path("-"), data)
        if records.torn:
            # Whole records end in a newline; appending after a partial line would glue the next one to it.
            _log.warning("%s: dropped the torn line %d (%d bytes, a write cut short by a crash)",
                         self.path, len(records) + 1, len(data) - self._size)
            _truncate(self.path, self._size)
        self._seq = len(records)
        self._head = str(records[-1]["hash"]) if records else GENESIS
        cutoff = time.time() - keep_seconds
        self._recent: list[dict[str, object]] = [r for r in records if r["unix"] >= cutoff]  # type: ignore[operator]

    @property
    def head(self) -> str:
        """The hash of the last record (``GENESIS`` before the first): what a peer keeps to anchor this chain."""
        with self._lock:
            return self._head

    def append(self, event: str, /, **fields: _Value) -> dict[str, object]:
        """Write one record (flushed and fsynced before returning) and return it, ``hash`` included."""
        if not isinstance(event, str) or not event:
            raise ValueError(f"an event is a non-empty string, not {event!r}")
        _check_fields(fields)
        with self._lock:
            if self._broken is not None:
                raise StorageError(self._broken)
            unix = time.time()
            record: dict[str, object] = {
                "seq": self._seq, "time": _iso(unix), "unix": unix, "event": event, **fields, "prev": self._head,
            }
            record["hash"] = _digest(record)
            line = (json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode()
            if self.path is not None:
                self._write(line)
            self._seq, self._head = self._seq + 1, str(record["hash"])
            self._size += len(line)
            self._recent.append(record)
            cutoff = unix - self.keep_seconds
            if self._recent[0]["unix"] < cutoff:  # type: ignore[operator]
                self._recent = [r for r in self._recent if r["unix"] >= cutoff]  # type: ignore[operator]
            return dict(record)

    def records(self, since: float | None = None) -> list[dict[str, object]]:
        """Copies of the records, all of them or those whose ``unix`` is at or after ``since`` (from memory
        when ``since`` lies within ``keep_seconds``, else read and verified from the file)."""
        with self._lock:
            if self.path is None or (since is not None and since >= time.time() - self.keep_seconds):
                return [dict(r) for r in self._recent if since is None or r["unix"] >= since]  # type: ignore[operator]
            records = _read(self.path, _load(self.path))[0] if self.path.exists() else []
            return [dict(r) for r in records if since is None or r["unix"] >= since]  # type: ignore[operator]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> SessionLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _write(self, line: bytes) -> None:
        try:
            if self._file is None:
                created = not self.path.exists()
                self._file = open_private_log(self.path)
                if created:
                    _fsync(self.path.parent)  # the new name must survive a crash too
            fd = self._file.fileno()
            if os.fstat(fd).st_size != self._size:
                raise LogTampered(f"{self.path} changed since this log read it (another writer?): reopen it")
            view = memoryview(line)
            while view:  # os.write, not the buffered file: a failed write must leave nothing to flush later
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            self._undo()
            raise StorageError(f"could not append to the session log {self.path}: {exc.strerror or exc}") from exc

    def _undo(self) -> None:
        """Cut a half-written line off, so the next append still continues a valid chain."""
        if self._file is None:  # the open failed: nothing was written
            return
        try:
            os.ftruncate(self._file.fileno(), self._size)
            os.fsync(self._file.fileno())
        except OSError as exc:
            self._broken = (f"the session log {self.path} may end in a partial line ({exc}): "
                            "reopen it (opening drops a torn last line)")


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _digest(record: dict[str, object]) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _check_fields(fields: dict[str, _Value]) -> None:
    taken = sorted(RESERVED & fields.keys())
    if taken:
        raise ValueError(f"{', '.join(taken)}: the log sets these itself; name the field otherwise")
    for name, value in fields.items():
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise TypeError(f"field {name!r}: a session log keeps strings, numbers, booleans or None, "
                            f"not {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"field {name!r}: {value} is not a number JSON can hold")


def _load(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read the session log {path}: {exc.strerror or exc}") from exc


def _read(path: Path, data: bytes) -> tuple[VerifiedLog, int]:
    """The verified records and the bytes their whole lines take (the file's length less a torn tail)."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends in a newline (or is empty); else a torn last line
    records: list[dict[str, object]] = []
    prev = GENESIS
    for number, raw in enumerate(lines, start=1):
        record = _parse(path, number, raw)
        missing = sorted(RESERVED - record.keys())
        if missing:
            raise LogTampered(f"{path}, line {number}: the record lacks {', '.join(missing)}")
        seq = record["seq"]
        if type(seq) is not int or seq != number - 1:
            raise LogTampered(f"{path}, line {number}: seq is {seq!r}, expected {number - 1}: "
                              "a line was deleted, inserted or moved")
        if record["prev"] != prev:
            before = "the genesis hash" if number == 1 else f"the hash of line {number - 1}"
            raise LogTampered(f"{path}, line {number}: prev is not {before}: a line was inserted, deleted or moved")
        try:
            digest = _digest(record)
        except ValueError as exc:  # a number too large for a float (1e400) reads back as inf
            raise LogTampered(f"{path}, line {number}: a number is out of range ({exc})") from exc
        if record["hash"] != digest:
            raise LogTampered(f"{path}, line {number}: the hash does not match the record: it was edited")
        if not isinstance(record["unix"], (int, float)) or isinstance(record["unix"], bool):
            raise LogTampered(f"{path}, line {number}: unix is not a number")
        prev = str(record["hash"])
        records.append(record)
    return VerifiedLog(records, torn=bool(tail)), len(data) - len(tail)


def _parse(path: Path, number: int, raw: bytes) -> dict[str, object]:
    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError("a key appears twice")
        return dict(pairs)

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    try:
        record = json.loads(raw.decode("utf-8"), object_pairs_hook=unique, parse_constant=refuse)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LogTampered(f"{path}, line {number}: not a JSON record ({exc})") from exc
    if not isinstance(record, dict):
        raise LogTampered(f"{path}, line {number}: not a JSON object")
    return record


def _truncate(path: Path, size: int) -> None:
    try:
        with open(path, "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())
    except OSError as exc:
        raise StorageError(f"could not drop the torn last line of {path}: {exc.strerror or exc}") from exc


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
