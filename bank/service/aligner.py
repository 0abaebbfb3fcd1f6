"""The bank aligns its customers with every partner and fixes one row order for all of them.

PSI runs pairwise (the bank with each partner). The training rows are the
customers every party holds. Their order is a seeded pseudo-random
permutation (by ``SHA-256(seed, ID)``, computed at the bank), so the same data
and seed always give the same order, and hence the same split and the same
model, while the order says nothing about the bank's own file. Each partner is
then told which of its rows to keep and in which order, as positions in the
blinded set it sent in its own random order (no IDs): it learns those rows and
nothing of its pairwise intersection beyond them.

The pairwise sessions run concurrently, one thread per partner, sharing the
bank's worker pool: while one partner blinds or re-blinds, the bank's workers
serve another. Each session keeps its own fresh key and order, and its own
partnership DST: the bank's blinded set is never reused across partners (the
DST makes the bank's hashes differ per partnership, so one blinded set could
not serve two partners anyway, and colluding partners see unrelated values).
The result does not depend on which session ends first: the pairwise results
are combined in the configured partner order, and the training order is the
seeded hash order. ``mode="sequential"`` runs them one after another (the
bench's reference figure).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

import numpy as np

from alignment.cache import hashed_points
from alignment.exposure import Exposure, customer_keys
from alignment.parallel import SlicePool
from alignment.partnership import Partnership
from alignment.psi import PsiPeer, PsiResult, check_minimum, partnership_dst, run_initiator
from parties.errors import ComputeUnavailable, ConfigError, CutlayerError
from parties.limits import DEFAULT_MAX_OVERLAP, PsiLimits
from parties.tables.table import AlignedRows, PartyTable
from parties.transport.jobs import Progress

__all__ = ["ABOVE_EXPECTED", "CEILINGS", "AlignmentMode", "align_with_partners", "overlap_ceiling", "overlap_warnings",
           "seeded_order"]

AlignmentMode = Literal["concurrent", "sequential"]

logger = logging.getLogger(__name__)


def seeded_order(table: PartyTable, rows: np.ndarray, seed: int) -> np.ndarray:
    """``rows`` sorted by ``SHA-256(seed || normalised ID)``: deterministic, and independent of file order."""
    prefix = seed.to_bytes(8, "little", signed=True)
    ids = table.normalized_ids
    # 16 bytes of the digest order the rows as all 32 would (a tie on 16 bytes is a 2^-128 event), in half the memory
    keys = np.fromiter((hashlib.sha256(prefix + ids[r]).digest()[:16] for r in rows), dtype="S16", count=len(rows))
    return rows[np.argsort(keys, kind="stable")]


def _positions_in(result: PsiResult, bank_rows: np.ndarray, n_bank: int) -> np.ndarray:
    """The partner's position (in the blinded set it sent) of each of ``bank_rows``."""
    where = np.full(n_bank, -1, dtype=np.int64)
    where[result.rows] = result.peer_positions
    return where[bank_rows]


def _named(exc: BaseException, name: str) -> BaseException:
    """``exc`` with the partner's name in its message (same type), unless it names it already or is the bank's own
    compute failing (its Ray cluster: a partner's arrives as the partner's refusal)."""
    if not isinstance(exc, CutlayerError) or isinstance(exc, ComputeUnavailable) or repr(name) in str(exc):
        return exc
    try:
        named = type(exc)(f"partner {name!r}: {exc}")
    except TypeError:  # an exception type with another signature: keep it as it is
        return exc
    return named


class _Board:
    """Each partner's latest step on one progress line, so concurrent partners stay readable apiece."""

    def __init__(self, names: list[str], say: Progress | Callable[[str], None]) -> None:
        self._say, self._lock = say, threading.Lock()
        self._steps: dict[str, str] = dict.fromkeys(names, "waiting")

    def reporter(self, name: str) -> Callable[[str], None]:
        def report(message: str) -> None:
            logger.info("alignment with %s: %s", name, message)
            with self._lock:
                self._steps[name] = message
                line = "; ".join(f"{n}: {m}" for n, m in self._steps.items())
                self._say(line)  # under the lock: lines reach the job in the order they were made

        return report


class _Cancellable:
    """A PSI peer that refuses further calls once ``cancel`` is set: another partner's failure ends this one too."""

    def __init__(self, peer: PsiPeer, cancel: threading.Event) -> None:
        self._peer, self._cancel = peer, cancel

    def __getattr__(self, attr: str) -> Any:
        call = getattr(self._peer, attr)
        if attr == "abort":  # always let a session be closed
            return call

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self._cancel.is_set():
                raise CancelledError("another partner's alignment failed")
            return call(*args, **kwargs)

        return guarded


def align_with_partners(
    table: PartyTable,
    partners: Mapping[str, PsiPeer],
    pool: SlicePool,
    *,
    min_intersection: int = 1,
    order_seed: int = 0,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    bank_name: str = "bank",
    mode: AlignmentMode = "concurrent",
    partnership: Partnership | None = None,
    exposure: Exposure | None = None,
    max_overlap: float | Mapping[str, float] = DEFAULT_MAX_OVERLAP,
) -> tuple[AlignedRows, dict[str, int]]:
    """Run PSI with each partner, intersect across all, commit everywhere; return the bank's rows.

    ``partnership``: the bank's limits on what each partner may bring, and its session log; ``exposure``: what
    each partner has been told of the bank's customers so far (defaults: the default limits, in memory). A
    partner that would have matched more than ``max_overlap`` (one share, or one per partner) of the bank's
    customers sent to it, in the session or over the partnership, is refused before anything is committed
    (``alignment.exposure``).
    A partner's failure stops the others' sessions (each is aborted at its partner) and is raised
    with the partner's name in its message.
    """
    say = progress or (lambda _msg: None)
    if not partners:
        raise ConfigError("no partners configured: start the bank with --partner NAME=URL")
    book = partnership or Partnership(PsiLimits(), len(table))
    told = exposure or Exposure()
    everyone: list[np.ndarray] = []  # the ledger's names of all the bank's customers, made once a session needs them
    board = _Board(list(partners), say)
    cancel = threading.Event()
    opened: dict[str, tuple[str, PsiResult]] = {}  # sessions to abort if anything fails before their commit
    failures: list[BaseException] = []  # in the order they happened; another partner's cancel is none
    lock = threading.Lock()

    logged = {name: book.initiated(name, "training", len(table)) for name in partners}
    totals: dict[str, tuple[int, int]] = {}  # per partner, (customers sent, matched) over the partnership

    def pairwise(name: str) -> tuple[str, PsiResult]:
        report = board.reporter(name)
        try:
            report("hashing own IDs onto the curve")
            points = hashed_points(table.normalized_ids, pool, cache_dir, partnership_dst(bank_name, name))
            peer = _Cancellable(partners[name], cancel)
            session_id, result = run_initiator(peer, points, pool, progress=report, cancel=cancel,
                                               id_type=table.id_type, admit=logged[name].admit, spool_dir=cache_dir,
                                               hand_over=True)  # 32 bytes a customer, freed once blinded
            with lock:
                opened[name] = (session_id, result)
                if not everyone:
                    everyone.append(customer_keys(table.normalized_ids))  # (sorted in place by the first claim)
            report(f"{len(result):,} common customers")  # logged by the reporter
            check_minimum(len(result), min_intersection, f"partner {name!r}")
            ceiling = max_overlap if isinstance(max_overlap, float) else max_overlap[name]
            matched = customer_keys(table.normalized_ids, result.rows)
            totals[name] = told.claim(name, everyone[0], matched, ceiling)
            return session_id, result
        except BaseException as exc:
            cancel.set()
            logged[name].failed(exc)
            named = _named(exc, name)
            if not isinstance(exc, CancelledError):
                report(f"failed: {exc}")
                with lock:
                    failures.append(named)
            if named is exc:
                raise
            raise named from exc

    try:
        if mode == "sequential":
            results = {name: pairwise(name) for name in partners}
        else:
            results = _concurrently(list(partners), pairwise, failures)
        everyone.clear()
        first = next(iter(results.values()))[1].rows
        in_all = np.ones(len(first), dtype=bool)
        for _, result in list(results.values())[1:]:  # a flag per bank customer, not a sort of each result
            held = np.zeros(len(table), dtype=bool)
            held[result.rows] = True
            in_all &= held[first]
        rows = seeded_order(table, first[in_all], order_seed)
        check_minimum(len(rows), min_intersection, "all partners together")
        alignment = AlignedRows(uuid.uuid4().hex, rows)
        counts = {name: len(result) for name, (_, result) in results.items()}
        say("committing the alignment")
        for name, (session_id, result) in results.items():
            committed = partners[name].commit(session_id, alignment.alignment_id,
                                              _positions_in(result, rows, len(table)), log_head=logged[name].head)
            del opened[name]
            logged[name].ended("committed", matched=len(result), result=len(rows), alignment=alignment.alignment_id,
                               peer_head=committed.log_head, told_sent=totals[name][0], told_matched=totals[name][1])
    except BaseException as exc:
        for name, (session_id, _) in opened.items():
            try:
                partners[name].abort(session_id)
            except Exception:
                logger.warning("could not abort the PSI session with %s", name)
            logged[name].failed(exc)
        raise
    return alignment, counts


def _concurrently(
    names: list[str], pairwise: Callable[[str], tuple[str, PsiResult]], failures: list[BaseException],
) -> dict[str, tuple[str, PsiResult]]:
    """``pairwise`` for every partner at once, in the partners' order; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="align") as threads:
        futures: dict[str, Future[tuple[str, PsiResult]]] = {n: threads.submit(pairwise, n) for n in names}
        wait(futures.values())  # after a failure the others stop at their next step
    if failures:
        for later in failures[1:]:
            logger.warning("alignment also failed: %s", later)
        raise failures[0]
    return {n: futures[n].result() for n in names}  # a cancelled one raises here


#: A partner matching less than this share of the overlap the operator expects is warned about.
FAR_BELOW = 0.75
#: A partner matching more than the share the operator expects plus this is refused (before any commit).
ABOVE_EXPECTED = 0.05
CEILINGS = "overlap-ceilings.json"  # per partner, the largest share it may match (set by its alignments)


def overlap_ceiling(max_overlap: float | None, expected: float | None, default: float) -> float:
    """The largest share of the bank's customers a partner may match: as asked, else what the operator expects
    plus ``ABOVE_EXPECTED``, else the bank's setting."""
    if max_overlap is not None:
        return max_overlap
    if expected is not None:
        return min(1.0, expected + ABOVE_EXPECTED)
    return default


def overlap_warnings(shares: dict[str, float], customers: int, expected: float | None, id_type: str) -> list[str]:
    """Per partner whose share of the bank's customers is far below ``expected``: what it matched, and what to check."""
    if expected is None:
        return []
    return [f"partner {name!r} matched {share:.1%} of the bank's {customers:,} customers, far below the "
            f"{expected:.0%} expected: check that both parties' files hold the same customers and write their IDs "
            f"alike (the bank reads its IDs as {id_type}; the partner's service log reports IDs written in more "
            "than one way)"
            for name, share in shares.items() if share < FAR_BELOW * expected]
