"""The training protocol: one contract over HTTP and in process; every bad message refused without effect."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as raw_safetensors

from bank.config import TrainingConfig
from bank.vertical.in_process_party import InProcessParty
from data.prepare import prepare_bank_marketing
from parties.errors import CutlayerError
from parties.learning.model import BottomConfig
from parties.protocol.wire import SAFETENSORS, encode
from parties.transport.client import make_client
from parties.transport.tls import TLSFiles
from tests.training_helpers import federation, state_equal

BOTTOMS = {"bank": BottomConfig(cut_width=6, seed=1), "partner": BottomConfig(hidden=(8,), cut_width=6, seed=2)}


@pytest.fixture()
def fed(pki, bank_full: Path, tmp_path: Path, start_partner):
    paths = prepare_bank_marketing(tmp_path / "data", rows=600, cache=bank_full.parent, download=False)
    with federation(pki, paths, start_partner, tmp_path, BOTTOMS) as f:
        yield f


def _party(fed, kind: str):
    if kind == "http":
        return fed.proxies()[0]
    return InProcessParty("partner", fed.tables["partner"], lambda: fed.partner_alignment("partner"), BOTTOMS["partner"])


@pytest.mark.parametrize("kind", ["http", "in-process"])
def test_the_party_contract(fed, kind: str) -> None:
    party = _party(fed, kind)
    n = len(fed.alignment)
    assert party.start_training("s1", fed.alignment.alignment_id, torch.arange(n // 2)) == 6
    rows = torch.tensor([3, 1, 4, 1, 5])
    z0 = party.step(0, None, rows)
    assert z0.shape == (5, 6) and z0.dtype == torch.float32 and not z0.requires_grad
    assert torch.equal(z0[1], z0[3])  # the same row twice, the same embedding
    with pytest.raises(CutlayerError, match="expected step 1"):
        party.step(7, torch.zeros(5, 6), rows)
    with pytest.raises(CutlayerError, match="gradient shape"):
        party.step(1, torch.zeros(4, 6), rows)
    with pytest.raises(CutlayerError, match="must carry the gradient"):
        party.step(1, None, rows)
    z1 = party.step(1, torch.ones(5, 6), rows)  # the refusals above changed nothing: step 1 still works
    assert not torch.equal(z0, z1)  # the gradient was applied
    before = party.embed(rows)
    assert torch.equal(party.embed(rows), before)  # evaluation changes nothing
    assert party.step(2, torch.zeros(5, 6), None) is None  # the flush
    files = party.finish(restore_best=False)
    assert files.session == "s1"
    party.end()


def test_the_wrong_alignment_is_refused(fed) -> None:
    party = fed.proxies()[0]
    with pytest.raises(CutlayerError, match="not this partner's current alignment"):
        party.start_training("s1", "another-alignment", torch.arange(10))


def _snapshot(fed):
    trainer = fed.partner_core("partner").training("bank", "s1").trainer
    return copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict()), trainer.next_step


def test_invalid_step_messages_get_4xx_and_change_nothing(fed, pki) -> None:
    party = fed.proxies()[0]
    party.start_training("s1", fed.alignment.alignment_id, torch.arange(100))
    rows = torch.arange(8)
    party.step(0, None, rows)  # an embedding now awaits its gradient
    url = f"{fed.partners['partner'].url}/train/sessions/s1/step"
    good_grad = torch.full((8, 6), 0.01)
    nan_grad = good_grad.clone()
    nan_grad[2, 3] = float("nan")
    cases = {
        "wrong-shape": (encode({"grad": torch.zeros(8, 5), "rows": rows}, session="s1", step=1), 400, "gradient shape"),
        "nan": (encode({"grad": nan_grad, "rows": rows}, session="s1", step=1), 400, "NaN"),
        "wrong-dtype": (encode({"grad": good_grad.double(), "rows": rows}, session="s1", step=1), 400, "expected torch.float32"),
        "wrong-step": (encode({"grad": good_grad, "rows": rows}, session="s1", step=5), 409, "expected step 1"),
        "replayed-step-other-content": (encode({"grad": good_grad, "rows": rows}, session="s1", step=0), 409, "different request"),
        "old-step": (encode({"grad": good_grad, "rows": rows}, session="s1", step=-1), 409, "expected step 1"),
        "rows-out-of-range": (encode({"grad": good_grad, "rows": torch.tensor([0, 10**6])}, session="s1", step=1), 400, "rows must lie"),
        "session-mismatch": (encode({"grad": good_grad, "rows": rows}, session="s2", step=1), 400, "another session"),
        "no-step": (encode({"grad": good_grad, "rows": rows}, session="s1"), 400, "no 'step'"),
        "unknown-tensor": (encode({"grad": good_grad, "weights": rows}, session="s1", step=1), 400, "unexpected tensor"),
        "old-schema": (raw_safetensors({"grad": good_grad}, metadata={"schema_version": "0", "session": "s1", "step": "1"}), 400, "schema version"),
        "garbage": (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", 400, "not a valid safetensors"),
        "oversized": (b"\x00" * (65 << 20), 413, "over the limit"),
    }
    before = _snapshot(fed)
    with make_client(TLSFiles.from_dir(pki, "bank")) as client:
        for name, (body, status, reason) in cases.items():
            response = client.post(url, content=body, headers={"content-type": SAFETENSORS})
            assert response.status_code == status, (name, response.text)
            assert reason in response.json()["detail"], name
        unknown = client.post(url.replace("/s1/", "/nope/"), content=cases["wrong-step"][0])
        assert unknown.status_code == 404 and "no training session" in unknown.json()["detail"]
    with make_client(TLSFiles.from_dir(pki, "partner2")) as impostor:  # a partner's certificate posing as the bank
        response = impostor.post(url, content=encode({"grad": good_grad, "rows": rows}, session="s1", step=1))
        assert response.status_code == 403
    after = _snapshot(fed)
    assert state_equal(before[0], after[0]) and before[2] == after[2] == 1
    assert str(before[1]) == str(after[1])
    # The session is intact: the right message still goes through.
    assert party.step(1, good_grad, rows).shape == (8, 6)


def test_a_partner_can_be_configured_independently(fed) -> None:
    """The bank needs only the width: here it differs from the bank's own."""
    coordinator = fed.coordinator(TrainingConfig(epochs=1, max_steps=2, batch_size=32), BottomConfig(cut_width=3))
    outcome = coordinator.run()
    assert outcome.widths == {"bank": 3, "partner": 6}


def test_a_repeated_step_is_answered_from_the_store_and_applied_once(fed) -> None:
    party = fed.proxies()[0]
    party.start_training("s1", fed.alignment.alignment_id, torch.arange(100))
    rows = torch.arange(8)
    party.step(0, None, rows)
    grad = torch.full((8, 6), 0.01)
    first = party.step(1, grad, rows)
    after_first = _snapshot(fed)
    again = party.step(1, grad, rows)  # as if the first answer had been lost on the way back
    assert torch.equal(first, again)
    after_again = _snapshot(fed)
    assert state_equal(after_first[0], after_again[0]) and after_first[2] == after_again[2] == 2
