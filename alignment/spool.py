"""Fixed-width records on disk instead of in memory: the blinded sets of a PSI session.

A session holds up to five sets of 12 to 32 bytes per ID; at 10^7 customers a set is hundreds of
megabytes. Only the party's own hashed points (randomly accessed, to shuffle them) and the two
double-blinded sets (intersected) need to be in memory; the rest are written once, in order, and
then read in chunks to be sent or blinded again. A ``Spool`` is such a set: an unnamed file (gone
when it is closed or the process ends, so nothing is left behind by a crash), written in order and
read by slice, like ``bytes``. What a spool holds is blinded under a key of this session only.

``Permuted`` is the other half of the trick: the own set in the session's random order, gathered a
slice at a time when a worker needs it, never copied whole.
"""

from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np

__all__ = ["Permuted", "Spool"]


class Spool:
    """Records of ``width`` bytes, appended in order to an unnamed file, read back by byte slice."""

    def __init__(self, width: int, folder: Path | None = None) -> None:
        self.width = width
        self._file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115: closed by close() or the collector
        self._size = 0
        self._lock = threading.Lock()  # a write never meets a close: its descriptor could be another file's by then

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file.closed:  # its session was closed while a worker still ran
                raise CancelledError("the spool is closed")
            os.pwrite(self._file.fileno(), data, self._size)
            self._size += len(data)

    def __len__(self) -> int:
        """Bytes written, as ``len`` of the bytes it stands for."""
        return self._size

    def __getitem__(self, index: slice) -> bytes:
        if not isinstance(index, slice):
            raise TypeError("a spool is read by slice")
        start, stop, step = index.indices(self._size)
        if step != 1:
            raise ValueError("a spool is read in order")
        if stop <= start:
            return b""
        with self._lock:
            if self._file.closed:  # its session was closed while a worker still ran
                raise CancelledError("the spool is closed")
            return os.pread(self._file.fileno(), stop - start, start)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __del__(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()


class Permuted:
    """``points`` (32-byte records) in ``order``, as a bytes-like object read by slice."""

    def __init__(self, points: bytes, order: np.ndarray, width: int) -> None:
        self._rows = np.frombuffer(points, dtype=np.uint8).reshape(-1, width) if len(points) else \
            np.zeros((0, width), dtype=np.uint8)
        self._order, self.width = order, width

    def __len__(self) -> int:
        return len(self._order) * self.width

    def __getitem__(self, index: slice) -> bytes:
        start, stop, _ = index.indices(len(self))
        if start % self.width or (stop % self.width and stop != len(self)):
            raise ValueError("a permuted set is read in whole records")
        return self._rows[self._order[start // self.width : stop // self.width]].tobytes()
