"""The bank aligns with every partner at once: the same result as one after another, and a failure named."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from alignment import cache, spool
from alignment.parallel import WorkerPool
from bank.lab.bench.scale import write_synthetic_parties
from bank.service.aligner import align_with_partners
from bank.vertical.http_partner import HttpPartner
from parties.errors import PeerError
from parties.limits import PsiLimits
from parties.tables.table import load_party_table
from parties.transport.client import make_client
from parties.transport.pki import write_dev_pki
from parties.transport.server import ServerThread
from parties.transport.tls import PeerIdentity, TLSFiles
from partner.service import create_app as create_partner_app
from partner.settings import PartnerSettings

PARTNERS = ("partner1", "partner2", "partner3")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Path], dict[str, ServerThread]]]:
    """Three real partner services (mutual TLS) over seeded synthetic tables that overlap the bank's in part."""
    out = tmp_path_factory.mktemp("concurrent")
    write_dev_pki(out / "pki", {"bank": "bank", **dict.fromkeys(PARTNERS, "partner")})
    paths = write_synthetic_parties(out / "data", 600, len(PARTNERS), seed=3)
    servers: dict[str, ServerThread] = {}
    try:
        for name in PARTNERS:
            files = TLSFiles.from_dir(out / "pki", name)
            # One bank aligns many times here: a budget of 4 sessions a day would stop it (test_partnership.py).
            settings = PartnerSettings(name=name, data=paths[name], tls_ca=files.ca, tls_cert=files.cert,
                                       tls_key=files.key, state_dir=out / f"state-{name}", workers=1,
                                       psi_limits=PsiLimits(peer_ids_per_day=1 << 20))
            servers[name] = ServerThread(create_partner_app(settings), settings.tls_files()).start()
        yield out / "pki", paths, servers
    finally:
        for s in servers.values():
            s.stop()


def _align(federation, mode: str, wrap=lambda name, peer: peer):
    pki, paths, servers = federation
    table = load_party_table(paths["bank"], "customer_id", "y")
    with make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank")) as client, \
            WorkerPool(1) as pool:
        peers = {n: wrap(n, HttpPartner(n, servers[n].url, client, retry_deadline=2)) for n in PARTNERS}
        alignment, pairwise = align_with_partners(table, peers, pool, order_seed=7, mode=mode)
    partner_rows = {n: servers[n].app.state.core.alignment_of("bank").rows.copy() for n in PARTNERS}
    return alignment, pairwise, partner_rows


def test_a_partner_holds_no_hashed_set_between_sessions_and_reads_it_back_from_its_cache(
        federation, caplog: pytest.LogCaptureFixture) -> None:
    first, _, first_rows = _align(federation, "sequential")
    servers = federation[2]
    assert all(servers[n].app.state.core.psi._points == {} for n in PARTNERS)
    with caplog.at_level(logging.INFO, logger="alignment.cache"):
        again, _, again_rows = _align(federation, "sequential")
    assert np.array_equal(first.rows, again.rows)
    assert all(np.array_equal(first_rows[n], again_rows[n]) for n in PARTNERS)
    # Every partner (and the bank) read its hashed set back from its own cache: nothing was hashed again.
    assert caplog.text.count("hashed ID set read from the cache") >= len(PARTNERS)
    assert "hashing again" not in caplog.text


def test_hashed_sets_kept_on_disk_align_exactly_as_in_memory(federation, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every hashed set a spool (as for large tables: ``alignment.cache.HASHED_ON_DISK_FROM``), at the bank and at
    each partner service, shuffled on disk in runs and buckets of 64: the same rows at every party as with the sets in memory."""
    in_memory, _, in_memory_rows = _align(federation, "concurrent")
    monkeypatch.setattr(cache, "HASHED_ON_DISK_FROM", 1)
    monkeypatch.setattr(spool, "SHUFFLE_RECORDS", 64)
    on_disk, _, on_disk_rows = _align(federation, "concurrent")
    assert len(on_disk) > 0 and np.array_equal(in_memory.rows, on_disk.rows)
    assert all(np.array_equal(in_memory_rows[n], on_disk_rows[n]) for n in PARTNERS)


class _Meeting:
    """A peer whose sessions all wait at ``open`` until every partner's session has opened."""

    def __init__(self, peer: HttpPartner, barrier: threading.Barrier) -> None:
        self._peer, self._barrier = peer, barrier

    def open(self, own_count: int, chunk_items: int, id_type: str = "text"):
        self._barrier.wait()  # sequential alignment never gets past this: the next partner has not started
        return self._peer.open(own_count, chunk_items, id_type)

    def __getattr__(self, attr: str):
        return getattr(self._peer, attr)


def test_concurrent_alignment_equals_sequential_and_runs_at_once(federation) -> None:
    sequential, seq_pairwise, seq_rows = _align(federation, "sequential")
    barrier = threading.Barrier(len(PARTNERS), timeout=30)
    concurrent, conc_pairwise, conc_rows = _align(federation, "concurrent", lambda _n, p: _Meeting(p, barrier))
    # The same customers in the same order, at the bank and at every partner; the alignments are two.
    assert len(sequential) > 0 and np.array_equal(sequential.rows, concurrent.rows)
    assert sequential.alignment_id != concurrent.alignment_id
    assert seq_pairwise == conc_pairwise and list(conc_pairwise) == list(PARTNERS)
    for name in PARTNERS:
        assert np.array_equal(seq_rows[name], conc_rows[name])
    # And it is the true three-way intersection, in the seeded order.
    _, paths, _ = federation
    ids = [load_party_table(paths[n], "customer_id").ids for n in ("bank", *PARTNERS)]
    common = set(ids[0]).intersection(*map(set, ids[1:]))
    assert {ids[0][r] for r in concurrent.rows} == common and len(concurrent) == len(common)
    assert [ids[1][r] for r in conc_rows["partner1"]] == [ids[0][r] for r in concurrent.rows]


class _Dropping:
    """A peer that fails mid-session, after the bank's blinded set went out: the connection drops."""

    def __init__(self, peer: HttpPartner) -> None:
        self._peer = peer

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        raise PeerError("the connection dropped")  # names no partner: the aligner must

    def __getattr__(self, attr: str):
        return getattr(self._peer, attr)


@pytest.mark.parametrize("mode", ["concurrent", "sequential"])
def test_a_partner_failing_mid_alignment_is_named_and_nobody_keeps_a_session(federation, mode) -> None:
    _, _, servers = federation
    before = {n: servers[n].app.state.core.alignment_of("bank") for n in PARTNERS}
    with pytest.raises(PeerError, match=r"partner 'partner2': the connection dropped"):
        _align(federation, mode, lambda n, p: _Dropping(p) if n == "partner2" else p)
    for name in PARTNERS:
        core = servers[name].app.state.core
        assert core.alignment_of("bank") is before[name]  # nothing was committed anywhere
        assert not core.banks["bank"].psi  # every PSI session was aborted: the failing one's and the others'
