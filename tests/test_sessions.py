"""Session lifecycle: abandoned sessions expire or make room for their owner, finished ones never come back,
and each owner can list and end its sessions."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from bank.__main__ import main
from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.errors import OutOfOrder, PeerError, UnknownSession
from parties.transport.client import make_client
from parties.transport.tls import PeerIdentity, TLSFiles

CONFIG = TrainingConfig(epochs=1, batch_size=256)


@pytest.fixture()
def partition(bank_full: Path, tmp_path: Path) -> dict[str, Path]:
    return prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)


def _client(pki: Path, name: str, role: str = "bank") -> httpx.Client:
    return make_client(TLSFiles.from_dir(pki, name), caller=PeerIdentity(name, role))


def _aligned(pki: Path, partition, start_partner, start_bank, **partner_settings: object):
    partner = start_partner(partition["partner"], name="partner", **partner_settings)
    bank = start_bank(partition["bank"], {"partner": partner.url})
    op = BankOperator(bank.url, TLSFiles.from_dir(pki, "bank"), "bank")
    op.wait(op.start_alignment())
    return partner, bank, op


def _abandon_a_training(pki: Path, partner, session: str) -> None:
    """What a bank killed mid-training leaves at the partner: a live session nobody drives."""
    core = partner.app.state.core
    with _client(pki, "bank") as client:
        HttpPartner("partner", partner.url, client).start_training(
            session, core.alignment_of("bank").alignment_id, torch.arange(100, dtype=torch.int64))


def test_a_bank_restarted_after_crashes_can_always_start_a_new_training(pki, partition, start_partner,
                                                                        start_bank) -> None:
    partner, bank, op = _aligned(pki, partition, start_partner, start_bank, max_training_sessions=2)
    for session in ("crashed1", "crashed2"):  # two bank processes SIGKILLed mid-training, without a resume
        _abandon_a_training(pki, partner, session)
    with op:
        result = op.wait(op.start_training(CONFIG))
    assert result["test"]["roc_auc"] > 0.5
    live = {s.session for s in partner.app.state.core.sessions().sessions}
    assert live.isdisjoint({"crashed1", "crashed2", result["session"]})  # unloaded, ended


def test_a_finished_session_never_comes_back(pki, partition, start_partner, start_bank) -> None:
    partner, bank, op = _aligned(pki, partition, start_partner, start_bank)
    with op:
        session = op.wait(op.start_training(CONFIG.model_copy(update={"checkpoint_every": 1})))["session"]
    with _client(pki, "bank") as client:
        proxy = HttpPartner("partner", partner.url, client, retry_deadline=1)
        proxy.attach(session, 8)
        with pytest.raises(UnknownSession, match="has ended"):
            proxy.privacy()
        with pytest.raises(OutOfOrder, match="has ended"):
            proxy.start_training(session, partner.app.state.core.alignment_of("bank").alignment_id, torch.arange(10))


def test_an_idle_training_session_expires_and_frees_its_slot(pki, partition, start_partner, start_bank) -> None:
    partner, bank, op = _aligned(pki, partition, start_partner, start_bank, max_training_sessions=1,
                                 training_session_ttl=0.5)
    _abandon_a_training(pki, partner, "crashed")  # the bank's only slot, held by a session nobody drives
    time.sleep(0.6)
    assert partner.app.state.core.sessions().sessions == []
    with op:
        op.wait(op.start_training(CONFIG))


def test_abandoned_psi_sessions_make_room_for_their_bank(pki, partition, start_partner, start_bank) -> None:
    partner, bank, op = _aligned(pki, partition, start_partner, start_bank, max_psi_sessions=2)
    with _client(pki, "bank") as mine, op:
        for _ in range(2):  # every slot of this bank's, opened and abandoned
            HttpPartner("partner", partner.url, mine).open(10, 1024)
        op.wait(op.start_alignment())  # its own least recently used session makes room
    assert [s.kind for s in partner.app.state.core.sessions("bank").sessions] == ["psi"]


def test_each_owner_lists_and_ends_its_sessions(pki, partition, start_partner, start_bank, capsys) -> None:
    partner, bank, op = _aligned(pki, partition, start_partner, start_bank)
    _abandon_a_training(pki, partner, "abandoned")
    with _client(pki, "partner", "partner") as own:  # the partner's operator
        listed = own.get(f"{partner.url}/admin/sessions").json()["sessions"]
        assert [(s["kind"], s["session"], s["owner"]) for s in listed] == [("training", "abandoned", "bank")]
        assert own.delete(f"{partner.url}/admin/sessions/bank/abandoned").status_code == 204
        assert own.get(f"{partner.url}/admin/sessions").json()["sessions"] == []
    with _client(pki, "bank") as client:
        proxy = HttpPartner("partner", partner.url, client, retry_deadline=1)
        proxy.attach("abandoned", 8)
        with pytest.raises(UnknownSession):
            proxy.privacy()

    with op:  # the bank's operator: a stopped session, ended for good here and at the partner
        session = op.wait(op.start_training(CONFIG))["session"]
        assert [(s.session, s.state) for s in op.sessions().sessions] == [(session, "finished")]
        with pytest.raises(PeerError, match="finished; only a stopped session resumes"):
            op.resume_training(session)
        op.end_session(session)
        with pytest.raises(PeerError, match="ended; only a stopped session resumes"):
            op.resume_training(session)
    assert main(["sessions", "--url", bank.url, "--tls-dir", str(pki)]) == 0
    assert capsys.readouterr().out.split() == [session, "ended"]
