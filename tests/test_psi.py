"""Two-party PSI, in process: it must equal a plain set intersection, in one shared order."""

from __future__ import annotations

import os
import random
import threading
import time
import tracemalloc
from concurrent.futures import CancelledError, ThreadPoolExecutor

import numpy as np
import pytest

from alignment import curve, spool
from alignment.in_process_peer import LocalPsiPeer
from alignment.parallel import WorkerPool
from alignment.psi import TRUNCATED_BYTES, PsiResponder, SessionInfo, intersect, run_initiator
from parties.errors import BadMessage, OutOfOrder, PeerError, UnknownSession


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
def test_psi_equals_set_intersection_in_one_order(bank, partner, pool, threads, where) -> None:
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


@pytest.fixture(params=["in memory", "on disk"])
def where(request, monkeypatch) -> str:
    """Every intersection both ways: in memory, and on disk in runs of 5 values (so a set spans runs)."""
    if request.param == "on disk":
        monkeypatch.setattr(spool, "ON_DISK_FROM", 0)
        monkeypatch.setattr(spool, "RUN_RECORDS", 5)
    return request.param


def test_intersect_refuses_repeated_values(where) -> None:
    value = b"x" * TRUNCATED_BYTES
    with pytest.raises(BadMessage, match="repeats"):
        intersect(value, value + value)
    with pytest.raises(BadMessage, match="repeats"):
        intersect(bytes(range(12)) * 3 + value, value + bytes(24))
    with pytest.raises(BadMessage, match="whole number"):
        intersect(b"abc", b"")


def test_on_disk_and_in_memory_intersections_agree_pair_for_pair(monkeypatch, tmp_path) -> None:
    """Same pairs in the same order (by value), over sets spanning many runs, with empty and trailing-zero values."""
    rng = np.random.default_rng(3)
    common = rng.bytes(12 * 700) + bytes(12) + b"\x01" + bytes(11)  # edge values: all zero, a one then zeros
    own = np.frombuffer(rng.bytes(12 * 900) + common, "V12")[rng.permutation(1602)].tobytes()
    peer = np.frombuffer(common + rng.bytes(12 * 300), "V12")[rng.permutation(1002)].tobytes()
    in_memory = intersect(own, peer)
    assert len(in_memory[0]) == 702
    monkeypatch.setattr(spool, "ON_DISK_FROM", 0)
    monkeypatch.setattr(spool, "RUN_RECORDS", 97)
    on_disk = intersect(own, peer, folder=tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(in_memory, on_disk, strict=True))
    assert os.listdir(tmp_path) == []  # its runs were in unnamed files
    assert intersect(b"", peer, folder=tmp_path)[0].size == 0


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


def test_a_session_keeps_its_blinded_sets_on_disk_in_unnamed_files(tmp_path, threads) -> None:
    """Past the own hashed points, a session's memory is its order (8 bytes an ID) and the result: the blinded
    sets it sent and received (76 bytes an ID more, held for the session's life) are in files of ``spool_dir``
    that have no name, so neither a crash nor a reader of the folder finds them."""
    n = 1 << 13
    ids = [b"%d" % i for i in np.random.default_rng(1).permutation(4 * n)[: 2 * n]]
    bank_points, partner_points = curve.hash_to_curve(ids[:n]), curve.hash_to_curve(ids[n // 2 : n // 2 + n])
    pool = WorkerPool(1)  # inline: every allocation is this process's
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()

    def spooled() -> list[str]:  # this process's open files in spool_dir
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:  # the listing's own descriptor, closed by now
                continue
        return [link for link in links if link.startswith(str(spool_dir))]

    run_initiator(LocalPsiPeer(partner_points[:3200], pool, threads), bank_points[:3200], pool)  # imports, caches
    peer = LocalPsiPeer(partner_points, pool, threads)
    peer.open = lambda count, chunk_items, id_type="text": _open_spooled(peer, count, chunk_items, spool_dir)
    tracemalloc.start()
    try:
        session_id, result = run_initiator(peer, bank_points, pool, chunk_items=1024, spool_dir=spool_dir)
        peer.sent.clear()
        peer.received.clear()  # what the test peer records for inspection
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(result) == n // 2
    assert held < 40 * n, f"{held / n:.0f} bytes an ID held by the open session and the result"
    assert os.listdir(spool_dir) == [] and len(spooled()) == 3  # the responder's three sets: open, nameless
    peer.commit(session_id, "a", result.peer_positions)
    peer.abort(session_id)
    assert spooled() == []


def _open_spooled(peer: LocalPsiPeer, count: int, chunk_items: int, spool_dir) -> SessionInfo:
    r = PsiResponder(peer.own_points, count, peer.pool, peer.threads, chunk_items, spool_dir=spool_dir)
    peer.sessions[r.session_id] = r
    return SessionInfo(r.session_id, r.own_count, r.chunk_items, peer.id_type)


def test_a_bucket_far_above_its_share_is_refused_before_it_is_read(monkeypatch) -> None:
    """A partner chooses the values it returns: all sharing a first byte would put the whole set in one bucket."""
    monkeypatch.setattr(spool, "ON_DISK_FROM", 0)
    rng = np.random.default_rng(5)
    skewed = b"".join(b"\x00" + rng.bytes(11) for _ in range(6000))
    with pytest.raises(BadMessage, match="own double-blinded set is not uniform: 6,000 of its 6,000 values"):
        intersect(skewed, rng.bytes(12 * 6000))
    assert len(intersect(rng.bytes(12 * 6000), rng.bytes(12 * 6000))[0]) == 0  # uniform values pass


def test_a_request_to_a_session_closed_under_it_is_told_so(pool, threads) -> None:
    """Closed while a bank's upload or download was under way, a session answers UnknownSession (a 4xx), not a crash."""
    points = curve.hash_to_curve([curve.normalize_id(i) for i in COMMON])
    peer = LocalPsiPeer(points, pool, threads)
    info = peer.open(2, 1)
    responder = peer.sessions[info.session_id]
    responder.blinded_chunk(0, timeout=60)
    responder.close()
    for call in (lambda: responder.receive_blinded(0, bytes(32)), lambda: responder.blinded_chunk(0, timeout=1),
                 lambda: responder.reblinded_chunk(0, timeout=1)):
        with pytest.raises(UnknownSession, match="aborted"):
            call()


def test_a_handed_over_set_is_freed_once_blinded_and_the_result_is_the_same(threads) -> None:
    """``hand_over``: the caller's hashed points are the session's; they are emptied once the own set is blinded
    (before the intersection, the session's peak), and the session's result does not change."""
    ids = [b"%d" % i for i in range(3000)]
    bank_points, partner_points = curve.hash_to_curve(ids[:2000]), curve.hash_to_curve(ids[1000:])
    pool = WorkerPool(1)
    seen: list[int] = []

    class Watching(LocalPsiPeer):
        def get_blinded(self, session_id: str, index: int) -> bytes:  # after the own set was blinded and sent
            seen.append(len(handed))
            return super().get_blinded(session_id, index)

    kept = bytearray(bank_points)
    _, reference = run_initiator(LocalPsiPeer(partner_points, pool, threads), kept, pool, chunk_items=512)
    handed = bytearray(bank_points)
    _, result = run_initiator(Watching(partner_points, pool, threads), handed, pool, chunk_items=512, hand_over=True)
    assert kept == bank_points and seen and set(seen) == {0} and handed == b""
    assert len(result) == 1000
    assert np.array_equal(np.sort(result.rows), np.sort(reference.rows))


def test_a_responder_lets_go_of_its_hashed_points_once_its_own_set_is_blinded(pool, threads) -> None:
    """The responder's own hashed points (32 bytes an ID) are needed only to blind its own set, which is then on
    disk: the session drops them, and every chunk it serves after is the same."""
    points = curve.hash_to_curve([curve.normalize_id(i) for i in range(1500)])
    peer = LocalPsiPeer(points, pool, threads)
    info = peer.open(10, 256)
    responder = peer.sessions[info.session_id]
    first = responder.blinded_chunk(0, timeout=60)
    chunks = [first] + [responder.blinded_chunk(i, timeout=60) for i in range(1, 6)]
    deadline = time.monotonic() + 10  # dropped by the blinding's completion callback, just after it completes
    while responder.own_points and time.monotonic() < deadline:
        time.sleep(0.01)
    assert responder.own_points == b"" and responder.own_count == 1500
    assert sum(len(c) for c in chunks) == len(points) and responder.blinded_chunk(0, timeout=60) == first
    peer.abort(info.session_id)


def _on_disk(points: bytes) -> spool.Spool:
    kept = spool.Spool(curve.POINT_BYTES)
    kept.write(points)
    return kept


@pytest.mark.parametrize("count", [0, 1, 5, 97, 1000])
def test_a_set_on_disk_is_shuffled_on_disk_into_exactly_the_gathered_order(monkeypatch, tmp_path, count) -> None:
    """``permuted_on_disk`` (two passes over runs of 7 records: many runs, many buckets, a short last one) writes
    the same bytes ``Permuted`` gathers in memory, for random orders, and leaves no file behind."""
    monkeypatch.setattr(spool, "SHUFFLE_RECORDS", 7)
    rng = np.random.default_rng(count)
    points = rng.bytes(curve.POINT_BYTES * count)
    order = rng.permutation(count)
    with spool.in_order(_on_disk(points), order, curve.POINT_BYTES, tmp_path) as shuffled:
        assert isinstance(shuffled, spool.Spool)
        assert shuffled[:] == spool.Permuted(points, order, curve.POINT_BYTES)[:]
        assert len(shuffled[:]) == len(points)
    assert shuffled._file.closed  # on leaving
    assert os.listdir(tmp_path) == []


def test_hashed_points_on_disk_align_the_same_customers_and_a_handed_over_set_is_closed(
    monkeypatch, pool, threads,
) -> None:
    """Both parties' hashed sets as spools (large sets, ``alignment.cache.HASHED_ON_DISK_FROM``): the same customers, in
    one order on both sides, as with the sets in memory; the bank's handed-over spool is closed once shuffled."""
    monkeypatch.setattr(spool, "SHUFFLE_RECORDS", 64)
    bank_ids, partner_ids = COMMON[:40] + _random_ids(random.Random(1), 300), _random_ids(random.Random(2), 200) + COMMON
    bank_points = curve.hash_to_curve([curve.normalize_id(i) for i in bank_ids])
    partner_points = curve.hash_to_curve([curve.normalize_id(i) for i in partner_ids])
    _, in_memory = run_initiator(LocalPsiPeer(partner_points, pool, threads), bank_points, pool, chunk_items=50)
    handed = _on_disk(bank_points)
    peer = LocalPsiPeer(_on_disk(partner_points), pool, threads)
    session_id, on_disk = run_initiator(peer, handed, pool, chunk_items=50, hand_over=True)
    peer.commit(session_id, "alignment", on_disk.peer_positions)
    assert peer.committed is not None
    bank_side = [bank_ids[i] for i in on_disk.rows]
    assert bank_side == [partner_ids[i] for i in peer.committed[1]]
    assert sorted(bank_side) == sorted(bank_ids[i] for i in in_memory.rows) == sorted(COMMON[:40])
    with pytest.raises(CancelledError):
        handed[:32]


def test_a_sealed_spool_keeps_nothing_readable_on_disk_and_reads_back_at_any_offset() -> None:
    """Hashed points on disk are encrypted under the spool's own key: the file holds none of them, and slices that
    start and end anywhere (not on the cipher's 64-byte blocks) read back as written."""
    points = np.random.default_rng(9).bytes(32 * 1000)
    sealed, plain = spool.Spool(32, sealed=True), spool.Spool(32)
    for start in range(0, len(points), 32 * 37):  # writes of 37 records: 1,184 bytes, so most start mid-block
        sealed.write(points[start : start + 32 * 37])
        plain.write(points[start : start + 32 * 37])
    on_disk = os.pread(sealed._file.fileno(), len(points), 0)
    assert len(on_disk) == len(points) and on_disk != points
    assert not any(points[k : k + 16] in on_disk for k in range(0, len(points), 32))
    assert os.pread(plain._file.fileno(), len(points), 0) == points  # a blinded set's spool is written as it is
    rng = np.random.default_rng(10)
    for a, b in [(0, len(points)), (5, 70), (63, 65), (64, 128), *(sorted(rng.integers(0, len(points), 2)) for _ in range(50))]:
        assert sealed[int(a) : int(b)] == points[int(a) : int(b)]
    other = spool.Spool(32, sealed=True)
    other.write(points[:640])
    assert os.pread(other._file.fileno(), 640, 0) != on_disk[:640]  # a key per spool


def test_a_cancelled_shuffle_stops_and_a_failed_session_closes_the_set_it_was_handed(monkeypatch, pool, threads) -> None:
    """A session aborted while its set is shuffled on disk stops between runs (it does not shuffle the whole set for
    nobody), and a session that fails closes the hashed set handed to it at once, not at the next garbage collection."""
    monkeypatch.setattr(spool, "SHUFFLE_RECORDS", 8)
    points = curve.hash_to_curve([curve.normalize_id(i) for i in range(200)])
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(CancelledError):
        spool.permuted_on_disk(_on_disk(points), np.arange(200)[::-1].copy(), curve.POINT_BYTES, cancel=cancel)

    class Greedy(LocalPsiPeer):
        def open(self, own_count, chunk_items, id_type="text"):
            info = super().open(own_count, chunk_items, id_type)
            return SessionInfo(info.session_id, 1 << 40, info.chunk_items, info.id_type)

    handed = _on_disk(points)
    with pytest.raises(PeerError, match="announced"):
        run_initiator(Greedy(points, pool, threads), handed, pool, chunk_items=50, hand_over=True)
    with pytest.raises(CancelledError):
        handed[:32]


def test_one_worker_hashes_a_set_slice_by_slice_into_the_same_points(monkeypatch) -> None:
    """Inline (one worker), a large set is hashed a slice at a time, not whole (about 1.5 KB an ID while it runs),
    into memory or a spool: the same points."""
    from alignment import parallel

    monkeypatch.setattr(parallel, "SLICE_RECORDS", 7)
    ids = [curve.normalize_id(f"C{i}") for i in range(30)]
    calls: list[int] = []
    whole, real = curve.hash_to_curve(ids), curve.hash_to_curve
    monkeypatch.setattr(curve, "hash_to_curve", lambda part, dst=curve.DEFAULT_DST: calls.append(len(part)) or real(part, dst))
    with WorkerPool(1) as pool:
        assert pool.hash_to_curve(ids) == whole
        assert pool.hash_to_curve(ids, into=_on_disk(b""))[:] == whole
    assert calls == [7, 7, 7, 7, 2] * 2
