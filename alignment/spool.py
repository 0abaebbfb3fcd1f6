"""Fixed-width records on disk instead of in memory: the hashed and blinded sets of a PSI session.

A session holds up to six sets of 12 to 32 bytes per ID; at 10^7 customers a set is hundreds of
megabytes, at 10^8 gigabytes. A ``Spool`` is such a set: an unnamed file (gone when it is closed or the
process ends, so nothing is left behind by a crash), written in order and read by slice, like ``bytes``.
What a spool holds is blinded under a key of this session only, or, for hashed points, encrypted (``sealed``).

The own set is blinded in the session's random order. ``Permuted`` gathers it a slice at a time from
hashed points in memory; ``permuted_on_disk`` shuffles hashed points kept on disk (large sets: see
``alignment.cache``) into a new spool in two passes, so neither the set nor a copy of it is ever in
memory (``in_order`` picks). ``ChunkedReceiver`` fills a set (in memory or a spool) from the numbered
chunks a peer sends; ``intersect_on_disk`` intersects two sets too large for memory. Both on-disk passes
go through ``Partitioned``: a set cut into buckets, one run at a time.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from parties.errors import BadMessage, OutOfOrder

__all__ = [
    "ON_DISK_FROM",
    "SHUFFLE_RECORDS",
    "ChunkedReceiver",
    "Partitioned",
    "Permuted",
    "Spool",
    "chunk_of",
    "in_order",
    "intersect",
    "intersect_on_disk",
    "n_chunks",
    "permuted_on_disk",
]


class Spool:
    """Records of ``width`` bytes, appended in order to an unnamed file, read back by byte slice.

    ``sealed``: what it holds is not blinded under a session key (a party's hashed points, ``H(id)``, which
    would let whoever reads the disk test an ID), so it is written encrypted, ChaCha20 under a key of this spool
    only, kept in memory: the file's blocks, even once freed, say nothing.
    """

    def __init__(self, width: int, folder: Path | None = None, *, sealed: bool = False) -> None:
        self.width = width
        self._file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 -- closed by close(), or when collected
        self._size = 0
        self._lock = threading.Lock()  # a write never meets a close: its descriptor could be another file's by then
        self._key = (secrets.token_bytes(32), secrets.token_bytes(12)) if sealed else None

    def _cipher(self, data: bytes | memoryview, at: int) -> bytes | memoryview:
        """``data`` at byte ``at`` of the file, encrypted or decrypted (the same XOR with the keystream there)."""
        if self._key is None:
            return data
        key, nonce = self._key
        block, skip = divmod(at, 64)  # ChaCha20's keystream comes in 64-byte blocks, counted from the nonce
        stream = Cipher(algorithms.ChaCha20(key, block.to_bytes(4, "little") + nonce), mode=None).encryptor()
        return stream.update(bytes(skip) + bytes(data))[skip:]

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file.closed:  # its session was closed while a worker still ran
                raise CancelledError("the spool is closed")
            view, at = memoryview(self._cipher(data, self._size)), self._size
            while view:  # a short write (a disk nearly full) is written on, or raises
                done = os.pwrite(self._file.fileno(), view, at)
                view, at = view[done:], at + done
            self._size = at

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
            data = os.pread(self._file.fileno(), stop - start, start)
        if len(data) != stop - start:
            raise OSError(f"the spool returned {len(data)} of {stop - start} bytes")
        return bytes(self._cipher(data, start))

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


#: Records per run of the partition pass: a run is sorted by bucket in memory (20 bytes a record), then written.
RUN_RECORDS = 1 << 20
BUCKETS = 256  # by a value's first byte: blinded values are uniform, so each bucket holds 1/256 of a set


class Partitioned:
    """A set of ``width``-byte values (each with its position) split into ``buckets`` buckets, on disk.

    ``bucket_of(values, positions)`` names each value's bucket (by default its first byte: ``BUCKETS``). One
    pass: each run of ``run_records`` values (``RUN_RECORDS``) is ordered by bucket and written as one block; a bucket is
    then its segment of every run. Memory: one run, and one bucket when it is read.
    """

    def __init__(self, values: bytes | bytearray | Spool, width: int, folder: Path | None = None,
                 buckets: int = BUCKETS,
                 bucket_of: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                 run_records: int | None = None, sealed: bool = False) -> None:
        self.width, self.count, self.buckets = width, len(values) // width, buckets
        self._record = np.dtype([("value", f"V{width}"), ("position", "<i8")])
        self._spool = Spool(self._record.itemsize, folder, sealed=sealed)
        self._bounds: list[np.ndarray] = []  # per run: where each bucket starts in the spool (records), and ends
        step = run_records or RUN_RECORDS
        for start in range(0, self.count, step):
            stop = min(self.count, start + step)
            raw = np.frombuffer(values[start * width : stop * width], dtype=np.uint8).reshape(-1, width)
            positions = np.arange(start, stop, dtype=np.int64)
            keys = raw[:, 0] if bucket_of is None else bucket_of(raw, positions)
            order = np.argsort(keys, kind="stable")
            run = np.empty(stop - start, dtype=self._record)
            run["value"] = raw[order].reshape(-1).view(f"V{width}")
            run["position"] = positions[order]
            offset = len(self._spool) // self._record.itemsize
            self._bounds.append(offset + np.searchsorted(keys[order], np.arange(buckets + 1)))
            self._spool.write(run.tobytes())

    def size(self, b: int) -> int:
        """Values in bucket ``b``."""
        return sum(int(bounds[b + 1] - bounds[b]) for bounds in self._bounds)

    def bucket(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Bucket ``b``: its values (fixed-width bytes) and their positions in the set."""
        size = self._record.itemsize
        parts = [self._spool[int(bounds[b]) * size : int(bounds[b + 1]) * size] for bounds in self._bounds]
        records = np.frombuffer(b"".join(parts), dtype=self._record)
        return records["value"].view(f"S{self.width}"), records["position"]

    def close(self) -> None:
        self._spool.close()


#: Records per run, and places per bucket, of the on-disk shuffle: a run and a bucket are 10 MB of 32-byte points.
SHUFFLE_RECORDS = 1 << 18


def permuted_on_disk(points: bytes | bytearray | Spool, order: np.ndarray, width: int,
                     folder: Path | None = None, cancel: threading.Event | None = None) -> Spool:
    """``Permuted(points, order, width)`` written to a spool, with neither the set nor a copy of it in memory:
    records are partitioned by the place they go to (``SHUFFLE_RECORDS`` places a bucket), then each bucket is
    put in order and appended. Memory: 4 bytes a record (its place; 8 past 2^31 records), and a run and a bucket
    with their sort (about 45 MB). Disk: the partitioned runs (``width`` + 8 bytes a record) and the result.
    ``cancel`` set stops it between runs and buckets (``CancelledError``)."""

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise CancelledError("shuffling cancelled")

    count = len(order)
    place = np.empty(count, dtype=np.int32 if count < 1 << 31 else np.int64)
    for start in range(0, count, SHUFFLE_RECORDS):  # no temporary the size of the set
        stop = min(count, start + SHUFFLE_RECORDS)
        place[order[start:stop]] = np.arange(start, stop, dtype=place.dtype)

    def bucket_of(_values: np.ndarray, positions: np.ndarray) -> np.ndarray:
        check()
        return place[positions] // SHUFFLE_RECORDS

    buckets = max(1, -(-count // SHUFFLE_RECORDS))
    out = Spool(width, folder, sealed=True)  # hashed points: sealed, as they come (alignment.cache)
    try:
        with closing(Partitioned(points, width, folder, buckets, bucket_of, run_records=SHUFFLE_RECORDS,
                                 sealed=True)) as parts:
            for b in range(buckets):
                check()
                values, positions = parts.bucket(b)
                out.write(values[np.argsort(place[positions])].tobytes())
    except BaseException:
        out.close()
        raise
    return out


@contextmanager
def in_order(points: bytes | bytearray | Spool, order: np.ndarray, width: int, folder: Path | None = None,
             cancel: threading.Event | None = None) -> Iterator[Permuted | Spool]:
    """``points`` in ``order``, read by slice: gathered from memory, or, for points kept on disk (a ``Spool``),
    a shuffled copy on disk (``permuted_on_disk``), closed on leaving."""
    if not isinstance(points, Spool):
        yield Permuted(points, order, width)
        return
    shuffled = permuted_on_disk(points, order, width, folder, cancel)
    try:
        yield shuffled
    finally:
        shuffled.close()


def intersect_on_disk(own: bytes | bytearray | Spool, peer: bytes | bytearray | Spool, width: int,
                      folder: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``psi.intersect`` for sets larger than memory: each set partitioned on disk, then intersected bucket by bucket.

    Buckets split by first byte and each sorted by value, so the pairs come out in the same order as the
    in-memory intersection's: by value. A value repeated within a set is refused (``ValueError`` naming the set).
    Blinded values are uniform, so a bucket holds about 1/256 of its set; one far larger was made so (by a peer
    sending chosen or repeated values) and is refused before it is read (``ValueError``).
    """
    with ExitStack() as stack:
        own_parts = stack.enter_context(closing(Partitioned(own, width, folder)))
        peer_parts = stack.enter_context(closing(Partitioned(peer, width, folder)))
        own_rows, peer_rows = [], []
        for b in range(BUCKETS):
            for what, parts in (("own", own_parts), ("peer", peer_parts)):
                if (held := parts.size(b)) > 2 * parts.count // BUCKETS + 4096:
                    raise ValueError(f"the {what} double-blinded set is not uniform: {held:,} of its {parts.count:,} "
                                     f"values share a first byte")
            (own_values, own_pos), (peer_values, peer_pos) = own_parts.bucket(b), peer_parts.bucket(b)
            for what, values in (("own", own_values), ("peer", peer_values)):
                if len(np.unique(values)) != len(values):
                    raise ValueError(f"the {what} double-blinded set repeats a value")
            _, i, j = np.intersect1d(own_values, peer_values, assume_unique=True, return_indices=True)
            own_rows.append(own_pos[i])
            peer_rows.append(peer_pos[j])
        return np.concatenate(own_rows).astype(np.int64), np.concatenate(peer_rows).astype(np.int64)


def n_chunks(count: int, chunk_items: int) -> int:
    return (count + chunk_items - 1) // chunk_items


def chunk_of(blob: bytes, index: int, chunk_items: int, width: int) -> bytes:
    step = chunk_items * width
    return bytes(blob[index * step : (index + 1) * step])


class ChunkedReceiver:
    """Collects ``count`` fixed-width records sent as numbered chunks, strictly in order."""

    def __init__(self, name: str, count: int, width: int, chunk_items: int, spool: Spool | None = None) -> None:
        self.name, self.count, self.width, self.chunk_items = name, count, width, chunk_items
        # Filled in place (never the chunks and their join at once), in memory or on disk.
        self._buffer: bytearray | Spool = spool if spool is not None else bytearray(count * width)
        self._chunks = 0
        self.received = 0  # records so far

    @property
    def complete(self) -> bool:
        return self.received == self.count

    def expected_chunks(self) -> int:
        return n_chunks(self.count, self.chunk_items)

    def add(self, index: int, data: bytes) -> None:
        if self.complete:
            raise OutOfOrder(f"all {self.name} chunks were already received")
        if index != self._chunks:
            raise OutOfOrder(f"{self.name} chunk {index} arrived; expected chunk {self._chunks}")
        expected = min(self.chunk_items, self.count - self.received) * self.width
        if len(data) != expected:
            raise BadMessage(f"{self.name} chunk {index} has {len(data)} bytes; expected {expected}")
        if isinstance(self._buffer, Spool):
            self._buffer.write(data)
        else:
            at = self.received * self.width
            self._buffer[at : at + expected] = data
        self._chunks += 1
        self.received += expected // self.width

    def value(self) -> bytearray | Spool:
        if not self.complete:
            raise OutOfOrder(f"{self.name}: {self.received} of {self.count} records received")
        return self._buffer


def _unique(blob: bytes, width: int, what: str) -> np.ndarray:
    if len(blob) % width:
        raise BadMessage(f"the {what} is not a whole number of {width}-byte values")
    values = np.frombuffer(blob, dtype=f"S{width}")
    if len(np.unique(values)) != len(values):
        raise BadMessage(f"the {what} repeats a value")
    return values


#: From this many values in the two sets together, they are intersected on disk (``alignment.spool``).
ON_DISK_FROM = 1 << 21


def intersect(own_double: bytes | bytearray | Spool, peer_double: bytes | bytearray | Spool,
              width: int = 12, folder: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions in each of two sets of double-blinded values (``width``: psi.TRUNCATED_BYTES) of their common
    values, ordered by value; large sets are intersected on disk, in ``folder`` (None: the system's temporary
    folder), in the same order."""
    for what, blob in (("own", own_double), ("peer", peer_double)):
        if len(blob) % width:
            raise BadMessage(f"the {what} double-blinded set is not a whole number of {width}-byte values")
    if (len(own_double) + len(peer_double)) // width >= ON_DISK_FROM:
        try:
            return intersect_on_disk(own_double, peer_double, width, folder)
        except ValueError as exc:  # a repeated value
            raise BadMessage(str(exc)) from exc
    own = _unique(own_double[:], width, "own double-blinded set")
    peer = _unique(peer_double[:], width, "peer double-blinded set")
    # Fixed-width byte strings sort by their raw bytes: an order that says nothing about either file.
    _, own_idx, peer_idx = np.intersect1d(own, peer, return_indices=True)
    return own_idx.astype(np.int64), peer_idx.astype(np.int64)
