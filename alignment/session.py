"""Two-party ECDH-PSI: session state and the protocol driver, with no transport.

The protocol (A: initiator, the bank; B: responder, a partner; ``H`` hashes
onto the curve, ``a``/``b`` are fresh per-session keys)::

    A -> B   open(n_A)                           B answers n_B and starts blinding H(Y)^b
    A -> B   H(X)^a          (32 B per ID)        B starts computing H(X)^ab
    B -> A   H(Y)^b          (32 B per ID)        A computes H(Y)^ba
    A -> B   H(Y)^ba         (12 B per ID)        B now holds both double-blinded sets
    B -> A   H(X)^ab         (12 B per ID)        A now holds both double-blinded sets
    A -> B   commit(positions, digest)            B keeps its aligned rows

Both sides intersect the truncated double-blinded values and order the
intersection by them, so both get the same order without revealing an ID.
Only blinded values cross: 32 + 12 = 44 bytes per input ID.

Truncation: 12 bytes (96 bits). For sets of n_A, n_B items the chance that
any two different IDs share a truncated value is at most n_A * n_B / 2**96,
i.e. 2**-48 at 2**24 IDs on each side.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from alignment import curve
from alignment.parallel import WorkerPool
from parties.errors import (
    AlignmentMismatch,
    BadMessage,
    IntersectionTooSmall,
    NotReady,
    OutOfOrder,
    PeerError,
)

__all__ = [
    "CHUNK_ITEMS",
    "PROTOCOL_VERSION",
    "TRUNCATED_BYTES",
    "PsiPeer",
    "PsiResponder",
    "PsiResult",
    "SessionInfo",
    "intersect",
    "run_initiator",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
TRUNCATED_BYTES = 12
#: IDs per chunk on the wire: 2 MiB of 32-byte points.
CHUNK_ITEMS = 1 << 16
MAX_CHUNK_ITEMS = 1 << 18


def n_chunks(count: int, chunk_items: int) -> int:
    return (count + chunk_items - 1) // chunk_items


def chunk_of(blob: bytes, index: int, chunk_items: int, width: int) -> bytes:
    step = chunk_items * width
    return blob[index * step : (index + 1) * step]


@dataclass(frozen=True)
class PsiResult:
    """One side's view of the intersection.

    ``rows`` indexes this party's own ID list, in the agreed order; ``digest``
    commits to the ordered double-blinded values, so two sides can check they
    agree without showing them.
    """

    rows: np.ndarray
    digest: bytes

    def __len__(self) -> int:
        return len(self.rows)


def intersect(own_double: bytes, peer_double: bytes, width: int = TRUNCATED_BYTES) -> PsiResult:
    """Intersect two sets of double-blinded values; order by value."""
    for name, blob in (("own", own_double), ("peer", peer_double)):
        if len(blob) % width:
            raise BadMessage(f"{name} double-blinded set is not a whole number of {width}-byte values")
    own = np.frombuffer(own_double, dtype=f"S{width}")
    peer = np.frombuffer(peer_double, dtype=f"S{width}")
    for name, values in (("own", own), ("peer", peer)):
        if len(np.unique(values)) != len(values):
            raise BadMessage(f"the {name} double-blinded set repeats a value")
    # Fixed-width byte strings sort by their raw bytes: the order both sides agree on.
    common, own_idx, _ = np.intersect1d(own, peer, return_indices=True)
    digest = hashlib.sha256(common.tobytes()).digest()
    return PsiResult(rows=own_idx.astype(np.int64), digest=digest)


class ChunkedReceiver:
    """Collects ``count`` fixed-width records sent as numbered chunks, strictly in order."""

    def __init__(self, name: str, count: int, width: int, chunk_items: int) -> None:
        self.name, self.count, self.width, self.chunk_items = name, count, width, chunk_items
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def complete(self) -> bool:
        return self._received == self.count

    def expected_chunks(self) -> int:
        return n_chunks(self.count, self.chunk_items)

    def add(self, index: int, data: bytes) -> None:
        if self.complete:
            raise OutOfOrder(f"all {self.name} chunks were already received")
        if index != len(self._parts):
            raise OutOfOrder(f"{self.name} chunk {index} arrived; expected chunk {len(self._parts)}")
        expected = min(self.chunk_items, self.count - self._received) * self.width
        if len(data) != expected:
            raise BadMessage(f"{self.name} chunk {index} has {len(data)} bytes; expected {expected}")
        self._parts.append(data)
        self._received += expected // self.width

    def value(self) -> bytes:
        if not self.complete:
            raise OutOfOrder(f"{self.name}: {self._received} of {self.count} records received")
        return b"".join(self._parts)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    peer_count: int
    chunk_items: int


class PsiPeer(Protocol):
    """What the initiator needs from the other side, whatever the transport."""

    def open(self, own_count: int, chunk_items: int) -> SessionInfo: ...

    def put_blinded(self, session_id: str, index: int, data: bytes) -> None: ...

    def get_blinded(self, session_id: str, index: int) -> bytes: ...

    def put_reblinded(self, session_id: str, index: int, data: bytes) -> None: ...

    def get_reblinded(self, session_id: str, index: int) -> bytes: ...

    def abort(self, session_id: str) -> None: ...

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, digest: bytes) -> int:
        """Tell the peer which of its intersected rows to keep, in which order; returns its row count."""
        ...


def _wait(future: Future[bytes], timeout: float, what: str) -> bytes:
    try:
        return future.result(timeout=timeout)
    except TimeoutError as exc:
        raise NotReady(f"{what} is not ready yet; retry") from exc
    except ValueError as exc:  # low-order point from the peer
        raise BadMessage(f"{what}: {exc}") from exc


@dataclass
class PsiResponder:
    """The responder's side of one session: a fresh key, the rounds, the result."""

    own_points: bytes
    peer_count: int
    pool: WorkerPool
    threads: ThreadPoolExecutor
    chunk_items: int = CHUNK_ITEMS
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_used: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_items <= MAX_CHUNK_ITEMS:
            raise BadMessage(f"chunk_items must be between 1 and {MAX_CHUNK_ITEMS}")
        if self.peer_count < 0:
            raise BadMessage("peer count must be non-negative")
        self._key = curve.generate_key()
        self._lock = threading.Lock()
        self.own_count = len(self.own_points) // curve.POINT_BYTES
        self._peer_blinded = ChunkedReceiver("blinded", self.peer_count, curve.POINT_BYTES, self.chunk_items)
        self._own_double = ChunkedReceiver("re-blinded", self.own_count, TRUNCATED_BYTES, self.chunk_items)
        self._own_blinded: Future[bytes] = self.threads.submit(self.pool.blind, self._key, self.own_points)
        self._peer_double: Future[bytes] | None = None
        self._result: PsiResult | None = None
        self._start_reblinding()

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def _start_reblinding(self) -> None:
        if self._peer_double is None and self._peer_blinded.complete:
            self._peer_double = self.threads.submit(
                self.pool.blind, self._key, self._peer_blinded.value(), TRUNCATED_BYTES
            )

    def receive_blinded(self, index: int, data: bytes) -> None:
        with self._lock:
            self._peer_blinded.add(index, data)
            self._start_reblinding()

    def blinded_chunk(self, index: int, timeout: float) -> bytes:
        self._check_index(index, self.own_count)
        return chunk_of(_wait(self._own_blinded, timeout, "our blinded set"), index, self.chunk_items, curve.POINT_BYTES)

    def reblinded_chunk(self, index: int, timeout: float) -> bytes:
        self._check_index(index, self.peer_count)
        if self._peer_double is None:
            raise OutOfOrder("the peer's blinded set is not complete yet")
        return chunk_of(_wait(self._peer_double, timeout, "the re-blinded set"), index, self.chunk_items, TRUNCATED_BYTES)

    def receive_reblinded(self, index: int, data: bytes) -> None:
        with self._lock:
            if self._peer_double is None:
                raise OutOfOrder("send the blinded set before the re-blinded one")
            self._own_double.add(index, data)

    def outcome(self, timeout: float) -> PsiResult:
        """This side's intersection, once both double-blinded sets are here."""
        with self._lock:
            if self._result is None:
                if self._peer_double is None or not self._own_double.complete:
                    raise OutOfOrder("the exchange is not complete")
                peer_double = _wait(self._peer_double, timeout, "the re-blinded set")
                self._result = intersect(self._own_double.value(), peer_double)
            return self._result

    def finish(self, positions: np.ndarray, digest: bytes, timeout: float = 600.0) -> np.ndarray:
        """Check the initiator's digest and return this party's rows in the final order."""
        result = self.outcome(timeout)
        if digest != result.digest:
            raise AlignmentMismatch("the two sides computed different intersections; nothing was kept")
        if len(positions) and (positions.min() < 0 or positions.max() >= len(result)):
            raise BadMessage("commit positions fall outside the intersection")
        if len(np.unique(positions)) != len(positions):
            raise BadMessage("commit positions repeat a row")
        return result.rows[positions]

    def _check_index(self, index: int, count: int) -> None:
        if not 0 <= index < max(1, n_chunks(count, self.chunk_items)):
            raise BadMessage(f"chunk {index} does not exist")


def run_initiator(
    peer: PsiPeer,
    own_points: bytes,
    pool: WorkerPool,
    *,
    chunk_items: int = CHUNK_ITEMS,
    progress: Callable[[str], None] | None = None,
) -> tuple[str, PsiResult]:
    """Run the initiator's side of one session against ``peer``; return (session id, result)."""
    say = progress or (lambda _msg: None)
    own_count = len(own_points) // curve.POINT_BYTES
    key = curve.generate_key()
    info = peer.open(own_count, chunk_items)
    try:
        chunk_items = info.chunk_items
        say("blinding own IDs")
        own_blinded = pool.blind(key, own_points)
        for i in range(n_chunks(own_count, chunk_items)):
            peer.put_blinded(info.session_id, i, chunk_of(own_blinded, i, chunk_items, curve.POINT_BYTES))
        say("receiving the peer's blinded IDs")
        received = ChunkedReceiver("peer blinded", info.peer_count, curve.POINT_BYTES, chunk_items)
        for i in range(received.expected_chunks()):
            received.add(i, peer.get_blinded(info.session_id, i))
        say("re-blinding the peer's IDs")
        try:
            peer_double = pool.blind(key, received.value(), TRUNCATED_BYTES)
        except ValueError as exc:
            raise PeerError(f"the peer sent an invalid point: {exc}") from exc
        for i in range(n_chunks(info.peer_count, chunk_items)):
            peer.put_reblinded(info.session_id, i, chunk_of(peer_double, i, chunk_items, TRUNCATED_BYTES))
        own_double = ChunkedReceiver("own re-blinded", own_count, TRUNCATED_BYTES, chunk_items)
        for i in range(own_double.expected_chunks()):
            own_double.add(i, peer.get_reblinded(info.session_id, i))
        return info.session_id, intersect(own_double.value(), peer_double)
    except BaseException:
        try:
            peer.abort(info.session_id)
        except Exception:  # the peer may be the reason we are here
            logger.warning("could not abort PSI session %s at the peer", info.session_id)
        raise


def check_minimum(size: int, minimum: int, who: str) -> None:
    if size == 0:
        raise IntersectionTooSmall(f"the intersection with {who} is empty")
    if size < minimum:
        raise IntersectionTooSmall(
            f"the intersection with {who} has {size} customers, under the minimum of {minimum}"
        )
