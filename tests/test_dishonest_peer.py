"""PSI against a peer that does not follow the protocol: each attack, played against the real code and services."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Response

from alignment import curve, psi
from alignment.in_process_peer import LocalPsiPeer
from alignment.parallel import WorkerPool
from alignment.psi import MAX_IDS, TRUNCATED_BYTES, PsiResponder, run_initiator
from alignment.spool import Permuted
from bank.service.aligner import align_with_partners
from bank.vertical.http_partner import HttpPartner
from data.prepare import prepare_bank_marketing
from parties.errors import OverBudget, PeerError, UnknownSession
from parties.limits import PsiLimits
from parties.protocol import psi as psi_routes
from parties.tables.table import load_party_table
from parties.transport.client import make_client
from parties.transport.server import ServerThread
from parties.transport.tls import PeerIdentity, TLSFiles


@pytest.fixture()
def partition(bank_full: Path, tmp_path: Path) -> dict[str, Path]:
    return prepare_bank_marketing(tmp_path / "data", n_partners=2, rows=2000, cache=bank_full.parent, download=False)


def _points(ids: list[str]) -> bytes:
    return curve.hash_to_curve([curve.normalize_id(i) for i in ids])


class EchoingPartner(LocalPsiPeer):
    """A partner that answers with the bank's own blinded values, to make up an intersection."""

    def __init__(self, *args: object, honest_reblinding: bool) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.honest_reblinding = honest_reblinding

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        if self.honest_reblinding:
            return super().get_reblinded(session_id, index)
        return b"".join(self.sent[index][k : k + TRUNCATED_BYTES] for k in range(0, len(self.sent[index]), 32))

    def get_blinded(self, session_id: str, index: int) -> bytes:
        return self.sent[index]  # the bank's own H(X)^a, echoed as if it were the partner's set


@pytest.mark.parametrize("honest_reblinding", [True, False], ids=["true-reblinding", "echoed-reblinding"])
def test_a_partner_echoing_the_banks_values_makes_up_no_intersection(honest_reblinding, pool, threads) -> None:
    bank_ids, partner_ids = [f"B{i}" for i in range(500)], [f"P{i}" for i in range(500)]  # disjoint, same size
    peer = EchoingPartner(_points(partner_ids), pool, threads, honest_reblinding=honest_reblinding)
    _, result = run_initiator(peer, _points(bank_ids), pool, chunk_items=1000)
    assert len(result) == 0


def test_each_side_sends_its_set_in_a_fresh_random_order(pool, threads, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, orders = [], []
    generate, fresh = curve.generate_key, psi.fresh_order
    monkeypatch.setattr(curve, "generate_key", lambda: keys.append(generate()) or keys[-1])
    monkeypatch.setattr(psi, "fresh_order", lambda n: orders.append(fresh(n)) or orders[-1])
    bank_points, partner_points = _points([f"C{i}" for i in range(300)]), _points([f"C{i}" for i in range(100, 400)])
    peer = LocalPsiPeer(partner_points, pool, threads)
    session_id, result = run_initiator(peer, bank_points, pool, chunk_items=1000)
    (bank_key, partner_key), (bank_order, partner_order) = keys, orders
    # What the partner received is the bank's set blinded, in the bank's fresh order, not in its file order.
    assert peer.sent[0] == curve.blind(bank_key, Permuted(bank_points, bank_order, curve.POINT_BYTES)[:])
    assert peer.sent[0] != curve.blind(bank_key, bank_points)
    assert np.mean(bank_order == np.arange(300)) < 0.05
    # And the same for what the bank received of the partner's set.
    assert peer.received[0] == curve.blind(partner_key, Permuted(partner_points, partner_order, curve.POINT_BYTES)[:])
    assert np.mean(partner_order == np.arange(300)) < 0.05
    assert len(result) == 200


def test_the_partner_learns_only_the_committed_rows(pki: Path, partition, start_partner) -> None:
    """Nothing the bank sends lets a partner intersect: only the bank's blinded set and the commit cross."""
    partner = start_partner(partition["partner1"])
    table = load_party_table(partition["bank"], "customer_id", "y")
    sent: list[tuple[str, bytes]] = []
    client = make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank"))
    client.event_hooks = {"request": [lambda request: sent.append((request.url.path, request.content))]}
    with client, WorkerPool(1) as pool:
        alignment, pairwise = align_with_partners(table, {"partner": HttpPartner("partner", partner.url, client)}, pool)
    # The JSON open request aside (told by its route: a commit's first position can be the byte "{").
    bodies = [body for path, body in sent if path != psi_routes.SESSIONS]
    # 32 bytes per bank ID (its blinded set) and 4 per committed row: no value of the partner's set comes back.
    assert sum(map(len, bodies)) == 32 * len(table) + 4 * len(alignment)
    core = partner.app.state.core
    assert len(core.alignment_of("bank").rows) == len(alignment) == pairwise["partner"]


# --- sizes a partner announces ----------------------------------------------------------------------


def _lying_partner(count: int, chunk_items: int | None, body_bytes: int) -> FastAPI:
    app = FastAPI()

    @app.post("/psi/sessions")
    async def open_session(body: dict) -> dict:
        return {"session": "s1", "count": count, "chunk_items": chunk_items or body["chunk_items"], "log_head": "0" * 64}

    @app.put("/psi/sessions/s1/blinded/{index}", status_code=204)
    async def put(index: int) -> Response:
        return Response(status_code=204)

    @app.get("/psi/sessions/s1/blinded/{index}")
    async def blinded(index: int) -> Response:
        return Response(content=b"\x01" * body_bytes, media_type="application/octet-stream")

    @app.delete("/psi/sessions/s1", status_code=204)
    async def abort() -> Response:
        return Response(status_code=204)

    return app


@pytest.mark.parametrize(("count", "chunk_items", "body_bytes", "refusal"), [
    (MAX_IDS + 1, None, 320, f"announced {MAX_IDS + 1} IDs"),
    (10, 7, 320, "chunks of 7 IDs; 65536 were asked"),
    (10, None, 50 << 20, r"announced 52428800 bytes \(its blinded IDs\); no more than 2097152"),
], ids=["too-many-ids", "other-chunk-size", "oversized-body"])
def test_the_bank_reads_no_more_than_was_agreed(pki: Path, count, chunk_items, body_bytes, refusal, pool) -> None:
    server = ServerThread(_lying_partner(count, chunk_items, body_bytes), TLSFiles.from_dir(pki, "partner")).start()
    try:
        with make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank")) as client:
            partner = HttpPartner("partner", server.url, client)
            with pytest.raises(PeerError, match=refusal):
                run_initiator(partner, _points(["a", "b", "c"]), pool)
            assert partner.bytes_received < 1 << 20
    finally:
        server.stop()


# --- what a bank may ask ----------------------------------------------------------------------------


def test_budgets_stop_a_probing_bank_before_any_blinding(pki: Path, partition, start_partner) -> None:
    limits = PsiLimits(peer_max_ids={"*": 100}, sessions_per_hour=3)  # the refused ask counts too
    partner = start_partner(partition["partner1"], psi_limits=limits)
    with make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank")) as client:
        peer = HttpPartner("partner", partner.url, client)
        with pytest.raises(OverBudget, match="announced 101 IDs for one PSI session; at most 100 are accepted"):
            peer.open(101, 64)
        first, second = peer.open(2, 64), peer.open(2, 64)
        for info in (first, second):
            peer.abort(info.session_id)  # aborted sessions count too: reopening at once is no way around it
        with pytest.raises(OverBudget, match="asked for 3 PSI sessions in the last hour \\(refused ones count\\); "
                                             "the limit is 3"):
            peer.open(2, 64)
    # Another bank has its own budget.
    with make_client(TLSFiles.from_dir(pki, "bank2"), caller=PeerIdentity("bank2", "bank")) as client:
        assert HttpPartner("partner", partner.url, client).open(2, 64).peer_count > 0


def test_a_session_is_only_its_banks(pki: Path, partition, start_partner, pool) -> None:
    partner = start_partner(partition["partner1"])
    with make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank")) as mine, \
            make_client(TLSFiles.from_dir(pki, "bank2"), caller=PeerIdentity("bank2", "bank")) as theirs:
        owner, other = HttpPartner("partner", partner.url, mine), HttpPartner("partner", partner.url, theirs)
        info = owner.open(3, 64)
        owner.put_blinded(info.session_id, 0, curve.blind(curve.generate_key(), _points(["a", "b", "c"])))
        for attempt in (lambda: other.get_blinded(info.session_id, 0), lambda: other.abort(info.session_id),
                        lambda: other.commit(info.session_id, "stolen", np.arange(1), log_head="0" * 64)):
            with pytest.raises(UnknownSession):
                attempt()
        assert len(owner.get_reblinded(info.session_id, 0)) == 3 * TRUNCATED_BYTES  # untouched, still the owner's


def test_abort_stops_blinding_that_has_not_run_yet(threads) -> None:
    points = _points([f"id-{i}" for i in range(60_000)])
    with WorkerPool(workers=1) as pool:
        started = time.perf_counter()
        responder = PsiResponder(points, 0, pool, threads)
        time.sleep(0.2)
        responder.close()
        with pytest.raises((CancelledError, UnknownSession)):
            responder.blinded_chunk(0, timeout=30)
        elapsed = time.perf_counter() - started
    full = 60_000 / 15_000  # seconds to blind them all at a generous 15,000 X25519 per second
    assert elapsed < full / 2, elapsed



# --- points and hashes ------------------------------------------------------------------------------


def _twist_point() -> bytes:
    u = 2
    while curve.is_on_curve(u.to_bytes(32, "little")):
        u += 1
    return u.to_bytes(32, "little")


@pytest.mark.parametrize("bad", ["twist", "non-canonical", "low-order"])
def test_a_partner_refuses_points_off_the_curve(bad, pki: Path, partition, start_partner) -> None:
    point = {"twist": _twist_point(), "non-canonical": (curve.P + 9).to_bytes(32, "little"),
             "low-order": bytes(32)}[bad]
    partner = start_partner(partition["partner1"])
    with make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank")) as client:
        peer = HttpPartner("partner", partner.url, client)
        info = peer.open(2, 64)
        peer.put_blinded(info.session_id, 0, _points(["a"]) + point)
        with pytest.raises(PeerError, match=r"HTTP 400.*point 1"):
            peer.get_reblinded(info.session_id, 0)


def test_the_hashes_are_bound_to_the_partnership(pki: Path, partition, start_partner) -> None:
    """The partner hashes under the DST of the bank its certificate names: a bank that hashes as another
    bank (or a value carried over from another partnership) matches nothing."""
    assert psi.partnership_dst("bank", "partner") != psi.partnership_dst("bank2", "partner")
    partner = start_partner(partition["partner1"])
    table = load_party_table(partition["bank"], "customer_id", "y")
    with make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank")) as client, \
            WorkerPool(1) as pool:
        peer = HttpPartner("partner", partner.url, client)
        with pytest.raises(Exception, match="intersection with partner 'partner' is empty"):
            align_with_partners(table, {"partner": peer}, pool, bank_name="bank2")
        alignment, _ = align_with_partners(table, {"partner": peer}, pool, bank_name="bank")
    assert len(alignment) > 1000
