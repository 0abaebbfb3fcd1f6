"""Two-party PSI, in process: it must equal a plain set intersection, in one shared order."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from alignment import curve
from alignment.in_process_peer import LocalPsiPeer
from alignment.parallel import WorkerPool
from alignment.psi import TRUNCATED_BYTES, intersect, run_initiator
from parties.errors import BadMessage, OutOfOrder


def run_psi(bank: list[str], partner: list[str], pool: WorkerPool, threads: ThreadPoolExecutor, chunk_items: int = 7):
    bank_points = curve.hash_to_curve([curve.normalize_id(i) for i in bank])
    partner_points = curve.hash_to_curve([curve.normalize_id(i) for i in partner])
    peer = LocalPsiPeer(partner_points, pool, threads)
    session_id, bank_result = run_initiator(peer, bank_points, pool, chunk_items=chunk_items)
    peer.commit(session_id, "alignment", bank_result.peer_positions)
    assert peer.committed is not None
    return bank_result, peer.committed[1], peer


def _random_ids(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.getrandbits(40):x}" for _ in range(n)]


rng = random.Random(7)
COMMON = _random_ids(rng, 60)
CASES = {
    "empty-both": ([], []),
    "empty-bank": ([], COMMON[:5]),
    "size-one": (["only"], ["only"]),
    "disjoint": (COMMON[:20], COMMON[20:45]),
    "identical": (COMMON, list(reversed(COMMON))),
    "partial": (COMMON[:40] + _random_ids(rng, 13), _random_ids(rng, 9) + COMMON[25:60]),
    "non-ascii-and-padding": (
        ["  Zoë-01", "ﾃｽﾄ-7", "Ωmega\t", "müller", "cafe\u0301"],
        ["Zoë-01", " ﾃｽﾄ-7 ", "Ωmega", "mueller", "caf\u00e9"],
    ),
}


@pytest.mark.parametrize(("bank", "partner"), CASES.values(), ids=CASES.keys())
def test_psi_equals_set_intersection_in_one_order(bank, partner, pool, threads) -> None:
    bank_result, partner_rows, _ = run_psi(bank, partner, pool, threads)
    norm = curve.normalize_id
    expected = {norm(i) for i in bank} & {norm(i) for i in partner}
    bank_side = [norm(bank[i]) for i in bank_result.rows]
    partner_side = [norm(partner[i]) for i in partner_rows]
    assert set(bank_side) == expected and len(bank_side) == len(expected)
    assert bank_side == partner_side  # the committed rows are the same customers, in the same order


def test_fresh_keys_per_session_give_different_blinded_values(pool, threads) -> None:
    _, _, first = run_psi(COMMON, COMMON, pool, threads, chunk_items=100)
    _, _, second = run_psi(COMMON, COMMON, pool, threads, chunk_items=100)
    assert first.sent[0] != second.sent[0]
    assert first.received[0] != second.received[0]


def test_no_raw_id_or_unblinded_hash_crosses(pool, threads) -> None:
    ids = [f"ACC-{i:05d}" for i in range(50)]
    _, _, peer = run_psi(ids, ids[10:], pool, threads, chunk_items=16)
    wire = b"".join(peer.sent + peer.received)
    hashed = curve.hash_to_curve([curve.normalize_id(i) for i in ids])
    for i, raw in enumerate(ids):
        assert raw.encode() not in wire
        assert hashed[32 * i : 32 * i + 12] not in wire


def test_parallel_pool_matches_inline(threads) -> None:
    ids = [curve.normalize_id(f"id-{i}") for i in range(9000)]
    dst = curve.psi_dst("bank|partner")  # the workers must hash with the caller's DST
    with WorkerPool(workers=2) as parallel:
        points = parallel.hash_to_curve(ids, dst)
        assert points == curve.hash_to_curve(ids, dst)
        key = curve.generate_key()
        assert parallel.blind(key, points, 12) == curve.blind(key, points, 12)


def test_intersect_refuses_repeated_values() -> None:
    value = b"x" * TRUNCATED_BYTES
    with pytest.raises(BadMessage, match="repeats"):
        intersect(value, value + value)
    with pytest.raises(BadMessage, match="whole number"):
        intersect(b"abc", b"")


def test_chunks_must_arrive_in_order_and_whole(pool, threads) -> None:
    points = curve.hash_to_curve([curve.normalize_id("a"), curve.normalize_id("b")])
    peer = LocalPsiPeer(points, pool, threads)
    info = peer.open(3, 2)
    responder = peer.sessions[info.session_id]
    with pytest.raises(OutOfOrder, match="expected chunk 0"):
        responder.receive_blinded(1, bytes(64))
    with pytest.raises(BadMessage, match="expected 64"):
        responder.receive_blinded(0, bytes(32))
    with pytest.raises(OutOfOrder, match="not complete"):
        responder.reblinded_chunk(0, timeout=1)
    with pytest.raises(OutOfOrder, match="not complete"):
        responder.finish(np.arange(1))
