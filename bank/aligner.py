"""The bank aligns its customers with every partner and fixes one row order for all of them.

PSI runs pairwise (the bank with each partner). The training rows are the
customers every party holds. Their order is a seeded pseudo-random
permutation (by ``SHA-256(seed, ID)``, computed at the bank), so the same data
and seed always give the same order, and hence the same split and the same
model, while the order says nothing about the bank's own file. Each partner is
then told which of its rows to keep and in which order, as positions in the
blinded set it sent in its own random order (no IDs): it learns those rows and
nothing of its pairwise intersection beyond them.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from alignment.cache import hashed_points
from alignment.parallel import WorkerPool
from alignment.psi import PsiPeer, PsiResult, check_minimum, partnership_dst, run_initiator
from parties.errors import ConfigError
from parties.tables.table import AlignedRows, PartyTable
from parties.transport.jobs import Progress

__all__ = ["align_with_partners", "seeded_order"]

logger = logging.getLogger(__name__)


def seeded_order(table: PartyTable, rows: np.ndarray, seed: int) -> np.ndarray:
    """``rows`` sorted by ``SHA-256(seed || normalised ID)``: deterministic, and independent of file order."""
    prefix = seed.to_bytes(8, "little", signed=True)
    keys = np.array([hashlib.sha256(prefix + table.normalized_ids[r]).digest() for r in rows], dtype="S32")
    return rows[np.argsort(keys, kind="stable")]


def _positions_in(result: PsiResult, bank_rows: np.ndarray, n_bank: int) -> np.ndarray:
    """The partner's position (in the blinded set it sent) of each of ``bank_rows``."""
    where = np.full(n_bank, -1, dtype=np.int64)
    where[result.rows] = result.peer_positions
    return where[bank_rows]


def align_with_partners(
    table: PartyTable,
    partners: Mapping[str, PsiPeer],
    pool: WorkerPool,
    *,
    min_intersection: int = 1,
    order_seed: int = 0,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    bank_name: str = "bank",
) -> tuple[AlignedRows, dict[str, int]]:
    """Run PSI with each partner, intersect across all, commit everywhere; return the bank's rows."""
    say = progress or (lambda _msg: None)
    if not partners:
        raise ConfigError("no partners configured: start the bank with --partner NAME=URL")
    results: dict[str, tuple[str, PsiResult]] = {}
    try:
        for name, peer in partners.items():
            say(f"{name}: hashing own IDs onto the curve")
            points = hashed_points(table.normalized_ids, pool, cache_dir, partnership_dst(bank_name, name))
            session_id, result = run_initiator(
                peer, points, pool, progress=lambda msg, name=name: say(f"{name}: {msg}")
            )
            results[name] = (session_id, result)
            logger.info("PSI with %s: %d common customers", name, len(result))
            check_minimum(len(result), min_intersection, f"partner {name!r}")
        first = next(iter(results.values()))[1].rows
        in_all = np.ones(len(first), dtype=bool)
        for _, result in results.values():
            in_all &= np.isin(first, result.rows)
        rows = seeded_order(table, first[in_all], order_seed)
        check_minimum(len(rows), min_intersection, "all partners together")
        alignment = AlignedRows(uuid.uuid4().hex, rows)
        pairwise = {name: len(result) for name, (_, result) in results.items()}
        say("committing the alignment")
        for name, (session_id, result) in list(results.items()):
            partners[name].commit(session_id, alignment.alignment_id, _positions_in(result, rows, len(table)))
            del results[name]
    except BaseException:
        for name, (session_id, _) in results.items():
            try:
                partners[name].abort(session_id)
            except Exception:
                logger.warning("could not abort the PSI session with %s", name)
        raise
    return alignment, pairwise
