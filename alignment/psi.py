"""Two-party ECDH-PSI with one-sided output: session state and the protocol driver, with no transport.

The protocol (A: initiator, the bank; B: responder, a partner; ``H`` hashes
onto the curve, ``a``/``b`` are fresh per-session keys; ``π_A``/``π_B`` are fresh
per-session random permutations)::

    A -> B   open(n_A)                           B answers n_B and starts blinding its set
    A -> B   π_A(H(X))^a     (32 B per ID)        B starts computing H(X)^ab in A's order
    B -> A   π_B(H(Y))^b     (32 B per ID)        A computes H(Y)^ba while B computes H(X)^ab
    B -> A   π_A(H(X))^ab    (12 B per ID)        A maps each value back to its own row, intersects
    A -> B   commit(positions into π_B's order)   B keeps those rows, in that order

Only the bank learns the intersection. Each side sends its blinded set in a
fresh random order, so neither learns the other's file order; the partner
learns only the rows the bank commits (and their training order), never its
pairwise intersection beyond them. The bank sends nothing after it receives
the partner's values but the commit, so a partner cannot echo the bank's own
values back to make up an intersection.

What a dishonest partner can still do: claim IDs it does not hold (it can
hash any ID it guesses), or return values out of order (which only corrupts
the bank's result). What a dishonest bank can do: commit rows that are not in
the intersection, up to the partner's whole table (the partner cannot check
a one-sided result); each side's defence is its policy: limits on what the
other may bring, enforced before any blinding, a log of every session
(``alignment.partnership``), sessions bound to the certificate.

Truncation: 12 bytes (96 bits). For sets of n_A, n_B items the chance that
any two different IDs share a truncated value is at most n_A * n_B / 2**96,
i.e. 2**-48 at 2**24 IDs on each side. Bytes per ID: 32 + 12 one way for the
bank's IDs, 32 for the partner's: 38 per ID for sets of equal size.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from alignment import curve
from alignment.parallel import SlicePool
from alignment.spool import ChunkedReceiver, Spool, chunk_of, in_order, intersect, n_chunks
from parties.errors import (
    BadMessage,
    IdTypeMismatch,
    IntersectionTooSmall,
    NotReady,
    OutOfOrder,
    PeerError,
    UnknownSession,
)
from parties.observability import PSI_IDS
from parties.protocol.psi import (  # the wire's version and bound
    MAX_CHUNK_ITEMS,
    MAX_IDS,
    PROTOCOL_VERSION,
)
from parties.tables.ids import IdType

__all__ = [
    "CHUNK_ITEMS",
    "Committed",
    "MAX_IDS",
    "PROTOCOL_VERSION",
    "TRUNCATED_BYTES",
    "PsiPeer",
    "PsiResponder",
    "PsiResult",
    "SessionInfo",
    "check_id_types",
    "fresh_order",
    "intersect",
    "partnership_dst",
    "run_initiator",
]

logger = logging.getLogger(__name__)

TRUNCATED_BYTES = 12
#: IDs per chunk on the wire: 2 MiB of 32-byte points.
CHUNK_ITEMS = 1 << 16


@dataclass(frozen=True)
class PsiResult:
    """The bank's view of the intersection.

    ``rows`` indexes the bank's own ID list and ``peer_positions`` the partner's blinded set as the
    partner sent it (its own random order), pair by pair, in the agreed order: by double-blinded value.
    """

    rows: np.ndarray
    peer_positions: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def fresh_order(n: int) -> np.ndarray:
    """A random permutation of ``range(n)`` from the OS's randomness: the order a blinded set is sent in."""
    return np.random.default_rng(secrets.randbits(128)).permutation(n)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    peer_count: int
    chunk_items: int
    id_type: IdType = "text"
    log_head: str | None = None  # the hash of the peer's log record of this session's opening, if it keeps a log


@dataclass(frozen=True)
class Committed:
    rows: int  # the rows the peer kept
    log_head: str | None = None  # the hash of its log record of the commit, if it keeps a log


class PsiPeer(Protocol):
    """What the initiator needs from the other side, whatever the transport."""

    def open(self, own_count: int, chunk_items: int, id_type: IdType = "text") -> SessionInfo:
        """Open a session for ``own_count`` IDs canonicalised as ``id_type``; a peer of another type refuses."""
        ...

    def put_blinded(self, session_id: str, index: int, data: bytes) -> None: ...

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        """Chunk ``index`` of our blinded set, blinded again by the peer, in the order we sent it."""
        ...

    def get_blinded(self, session_id: str, index: int) -> bytes:
        """Chunk ``index`` of the peer's blinded set, in the peer's random order."""
        ...

    def abort(self, session_id: str) -> None: ...

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, purpose: str = "training",
               log_head: str | None = None) -> Committed:
        """Tell the peer which of its blinded set's positions to keep, in which order; ``log_head``: the hash of this
        side's log record of the session, for the peer to keep."""
        ...


def _wait(future: Future[bytes], timeout: float, what: str) -> bytes:
    try:
        return future.result(timeout=timeout)
    except TimeoutError as exc:
        raise NotReady(f"{what} is not ready yet; retry") from exc
    except CancelledError as exc:
        raise UnknownSession("the PSI session was aborted") from exc
    except ValueError as exc:  # an invalid point from the peer
        raise BadMessage(f"{what}: {exc}") from exc


@dataclass
class PsiResponder:
    """The responder's side of one session: a fresh key and order, the rounds, the committed rows."""

    own_points: bytes | bytearray | Spool  # the own hashed set (``alignment.cache.hashed_points``)
    peer_count: int
    pool: SlicePool
    threads: ThreadPoolExecutor
    chunk_items: int = CHUNK_ITEMS
    owner: str = ""  # the bank's certificate name: only it may use the session
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    spool_dir: Path | None = None  # where the blinded sets are kept on disk (None: the system's temporary folder)
    last_used: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_items <= MAX_CHUNK_ITEMS:
            raise BadMessage(f"chunk_items must be between 1 and {MAX_CHUNK_ITEMS}")
        if self.peer_count < 0:
            raise BadMessage("peer count must be non-negative")
        self._key = curve.generate_key()
        self._lock = threading.Lock()
        self.cancelled = threading.Event()
        self.own_count = len(self.own_points) // curve.POINT_BYTES
        self._order = fresh_order(self.own_count)
        # Every blinded set is on disk, and so are large hashed sets: the session's memory is 8 bytes per own ID (its
        # order), and 32 more until its own set is blinded when the hashed points are in memory.
        self._spools = [Spool(curve.POINT_BYTES, self.spool_dir), Spool(curve.POINT_BYTES, self.spool_dir),
                        Spool(TRUNCATED_BYTES, self.spool_dir)]
        self._peer_blinded = ChunkedReceiver("blinded", self.peer_count, curve.POINT_BYTES, self.chunk_items,
                                             self._spools[1])
        self._own_blinded: Future[Spool] = self.threads.submit(self._blind_own)
        # Blinded (on disk), the hashed points are no longer needed: not held for the rest of the session.
        self._own_blinded.add_done_callback(lambda _done: setattr(self, "own_points", b""))
        self._peer_double: Future[Spool] | None = None
        self._start_reblinding()

    def _blind_own(self) -> Spool:
        with in_order(self.own_points, self._order, curve.POINT_BYTES, self.spool_dir, self.cancelled) as shuffled:
            return self.pool.blind(self._key, shuffled, curve.POINT_BYTES, self.cancelled, validate=False,
                                   into=self._spools[0])

    def touch(self) -> None:
        self.last_used = time.monotonic()

    @property
    def received(self) -> int:
        """How many of the peer's blinded IDs have arrived so far (for the session log)."""
        return self._peer_blinded.received

    def close(self) -> None:
        """Stop the session's blinding: slices not yet started never run."""
        self.cancelled.set()
        for future in (self._own_blinded, self._peer_double):
            if future is not None:
                future.cancel()
        for spool in self._spools:
            spool.close()

    def _start_reblinding(self) -> None:
        if self._peer_double is None and self._peer_blinded.complete:
            self._peer_double = self.threads.submit(
                self.pool.blind, self._key, self._peer_blinded.value(), TRUNCATED_BYTES, self.cancelled,
                into=self._spools[2])

    @contextmanager
    def _alive(self) -> Iterator[None]:
        """A request to a session closed before or while it runs (its files are gone) is told so, as a 4xx."""
        if self.cancelled.is_set():
            raise UnknownSession("the PSI session was aborted")
        try:
            yield
        except CancelledError as exc:
            raise UnknownSession("the PSI session was aborted") from exc

    def receive_blinded(self, index: int, data: bytes) -> None:
        with self._alive(), self._lock:
            self._peer_blinded.add(index, data)
            PSI_IDS.labels("received").inc(len(data) // curve.POINT_BYTES)
            self._start_reblinding()

    def blinded_chunk(self, index: int, timeout: float) -> bytes:
        with self._alive():
            self._check_index(index, self.own_count)
            chunk = chunk_of(_wait(self._own_blinded, timeout, "our blinded set"), index, self.chunk_items,
                             curve.POINT_BYTES)
        PSI_IDS.labels("sent").inc(len(chunk) // curve.POINT_BYTES)
        return chunk

    def reblinded_chunk(self, index: int, timeout: float) -> bytes:
        with self._alive():
            self._check_index(index, self.peer_count)
            if self._peer_double is None:
                raise OutOfOrder("the peer's blinded set is not complete yet")
            return chunk_of(_wait(self._peer_double, timeout, "the re-blinded set"), index, self.chunk_items,
                            TRUNCATED_BYTES)

    def finish(self, positions: np.ndarray) -> np.ndarray:
        """This party's rows at ``positions`` of the blinded set it sent, in the bank's order."""
        if self._peer_double is None:
            raise OutOfOrder("the exchange is not complete")
        if len(positions) and (positions.min() < 0 or positions.max() >= self.own_count):
            raise BadMessage(f"commit positions fall outside the {self.own_count} rows sent")
        if len(np.unique(positions)) != len(positions):
            raise BadMessage("commit positions repeat a row")
        return self._order[positions].astype(np.int64)

    def _check_index(self, index: int, count: int) -> None:
        if not 0 <= index < max(1, n_chunks(count, self.chunk_items)):
            raise BadMessage(f"chunk {index} does not exist")


def _receive(what: str, count: int, width: int, chunk_items: int, get: Callable[[int], bytes],
             spool: Spool | None = None) -> bytearray | Spool:
    received = ChunkedReceiver(what, count, width, chunk_items, spool)
    for i in range(received.expected_chunks()):
        try:
            received.add(i, get(i))
        except (BadMessage, OutOfOrder) as exc:
            raise PeerError(f"the peer sent a bad {what}: {exc}") from exc
    return received.value()


def run_initiator(
    peer: PsiPeer,
    own_points: bytes | bytearray | Spool,
    pool: SlicePool,
    *,
    chunk_items: int = CHUNK_ITEMS,
    max_peer_count: int = MAX_IDS,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    id_type: IdType = "text",
    admit: Callable[[SessionInfo], None] | None = None,
    spool_dir: Path | None = None,
    hand_over: bool = False,
) -> tuple[str, PsiResult]:
    """Run the initiator's side of one session against ``peer``; return (session id, result).

    ``hand_over``: ``own_points`` is the session's to free: a ``bytearray`` is emptied once the own set is
    blinded, so its 32 bytes an ID are not held through the rest of the session (the intersection's peak); a
    ``Spool`` (a large set, on disk) is closed once shuffled into the session's order.

    ``admit(info)``: the party's own limits on what the peer announced (``alignment.partnership``), called
    before anything is blinded; what it raises aborts the session.

    ``id_type``: how ``own_points``' IDs were canonicalised; a peer whose IDs are of another type is
    refused (``IdTypeMismatch``): matched, the two would silently share fewer customers than they do.
    Every size the peer announces is checked against what was agreed before anything is read.
    ``cancel`` set stops the blinding between slices (``CancelledError``); the session is aborted.
    The blinded sets sent and received are kept on disk, in ``spool_dir`` (None: the system's temporary
    folder), and so, when they are large, is the intersection of the two double-blinded sets.
    """
    say = progress or (lambda _msg: None)
    own_count = len(own_points) // curve.POINT_BYTES
    key = curve.generate_key()
    order = fresh_order(own_count)
    info = peer.open(own_count, chunk_items, id_type)
    spools = ExitStack()
    try:
        check_id_types(id_type, info.id_type, "the bank", "the partner")
        if info.chunk_items != chunk_items:
            raise PeerError(f"the peer answered chunks of {info.chunk_items} IDs; {chunk_items} were asked")
        if not 0 <= info.peer_count <= max_peer_count:
            raise PeerError(f"the peer announced {info.peer_count} IDs; at most {max_peer_count} are accepted")
        if admit is not None:
            admit(info)
        say("blinding own IDs")
        with in_order(own_points, order, curve.POINT_BYTES, spool_dir, cancel) as shuffled:
            if hand_over and isinstance(own_points, Spool):  # shuffled into a copy on disk: done with
                own_points.close()
            own_blinded = pool.blind(key, shuffled, cancel=cancel, validate=False,  # own hashes: nothing to check
                                     into=spools.enter_context(closing(Spool(curve.POINT_BYTES, spool_dir))))
        del shuffled  # (a view of own_points, which hand_over empties)
        if hand_over and isinstance(own_points, bytearray):  # (bytes, as small sets are hashed into, cannot be)
            own_points.clear()
        for i in range(n_chunks(own_count, chunk_items)):
            peer.put_blinded(info.session_id, i, chunk_of(own_blinded, i, chunk_items, curve.POINT_BYTES))
        # The peer re-blinds our set while we re-blind its own: fetch its set first, then ours back.
        say("receiving the peer's blinded IDs")
        peer_blinded = _receive("blinded set", info.peer_count, curve.POINT_BYTES, chunk_items,
                                lambda i: peer.get_blinded(info.session_id, i),
                                spools.enter_context(closing(Spool(curve.POINT_BYTES, spool_dir))))
        say("re-blinding the peer's IDs")
        try:
            peer_double = pool.blind(key, peer_blinded, TRUNCATED_BYTES, cancel,
                                     into=spools.enter_context(closing(Spool(TRUNCATED_BYTES, spool_dir))))
        except ValueError as exc:
            raise PeerError(f"the peer's blinded set is unusable: {exc}") from exc
        say("receiving own IDs blinded by the peer")
        own_double = _receive("re-blinded set", own_count, TRUNCATED_BYTES, chunk_items,
                              lambda i: peer.get_reblinded(info.session_id, i),
                              spools.enter_context(closing(Spool(TRUNCATED_BYTES, spool_dir))))
        try:
            own_idx, peer_idx = intersect(own_double, peer_double, folder=spool_dir)
        except BadMessage as exc:
            raise PeerError(f"the peer's values are unusable: {exc}") from exc
        spools.close()
        return info.session_id, PsiResult(rows=order[own_idx].astype(np.int64), peer_positions=peer_idx)
    except BaseException:
        spools.close()
        if hand_over and isinstance(own_points, Spool):  # the session's: not left to the garbage collector
            own_points.close()
        try:
            peer.abort(info.session_id)
        except Exception:  # the peer may be the reason we are here
            logger.warning("could not abort PSI session %s at the peer", info.session_id)
        raise


def partnership_dst(bank: str, partner: str) -> bytes:
    """The hash-to-curve DST of one partnership: a bank's and a partner's hashes of the same ID never
    match another partnership's, so a blinded value seen in one cannot be tested in another."""
    return curve.psi_dst(f"{bank}|{partner}")


def check_id_types(own: IdType, theirs: IdType, us: str, them: str) -> None:
    """Both sides' IDs are of one type, or nothing they share is found: refuse, saying how to agree."""
    if own != theirs:
        raise IdTypeMismatch(
            f"{us}'s customer IDs are {own} and {them}'s are {theirs}: matched, IDs such as 12 and 0012 would be "
            f"one customer on one side and two on the other. Declare the same id_type in both parties' schema "
            f"files (or --id-type on serve): integer if every ID is a whole number, else text")


def check_minimum(size: int, minimum: int, who: str) -> None:
    if size == 0:
        raise IntersectionTooSmall(
            f"the intersection with {who} is empty: check that both parties' files hold the same customers and write "
            "their IDs alike (text IDs 0012 and 12 are two customers; integer IDs are one)")
    if size < minimum:
        raise IntersectionTooSmall(
            f"the intersection with {who} has {size} customers, under the minimum of {minimum}"
        )
