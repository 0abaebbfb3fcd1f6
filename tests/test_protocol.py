"""The protocol in one place: each exchange's messages survive their own encode/decode pair, and both
services declare exactly the routes ``parties.protocol`` names, which the bank's proxies fill."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bank.service.app import create_app as create_bank_app
from parties.errors import BadMessage
from parties.protocol import common, control, psi, scoring, training
from parties.protocol.wire import encode
from bank.settings import BankSettings
from partner.settings import PartnerSettings
from parties.tables.encoding import UNSEEN
from partner.service import create_app as create_partner_app


def _templates(module: object) -> set[str]:
    return {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.startswith("/")}


def _served(app: object) -> set[str]:
    paths = set(app.openapi()["paths"])  # type: ignore[attr-defined]  # every router's routes, as declared
    hot = app.hot  # type: ignore[attr-defined]
    return paths | ({route.path for route, _ in hot.routes} if hot is not None else set())


def test_the_partner_serves_exactly_the_routes_of_its_exchanges(tmp_path: Path) -> None:
    settings = PartnerSettings(name="partner", data=tmp_path / "unused.csv", insecure=True, state_dir=tmp_path)
    expected = (_templates(psi) | _templates(training) | _templates(scoring) | _templates(common)
                | {control.ADMIN_SESSIONS, control.ADMIN_SESSION, control.ADMIN_ALIGNMENTS})
    assert _served(create_partner_app(settings)) == expected


def test_the_bank_serves_exactly_its_operator_routes(tmp_path: Path) -> None:
    settings = BankSettings(name="bank", data=tmp_path / "unused.csv", insecure=True, state_dir=tmp_path)
    expected = (_templates(control) - {control.ADMIN_SESSIONS, control.ADMIN_SESSION, control.ADMIN_ALIGNMENTS}
                | _templates(common))
    assert _served(create_bank_app(settings)) == expected


def test_filled_routes_cannot_add_segments_or_queries() -> None:
    assert common.fill(training.STEP, session_id="s1") == "/train/sessions/s1/step"
    assert common.fill(training.STEP, session_id="a/../b?x=1") == "/train/sessions/a%2F..%2Fb%3Fx%3D1/step"


def test_training_messages_round_trip() -> None:
    grad, rows = torch.randn(4, 3), torch.tensor([5, 1, 9, 2])
    step = training.StepRequest("s1", 7, grad, rows, checkpoint=True, keep_from=5)
    got = training.StepRequest.decode(step.encode(), "s1")
    assert (got.session, got.step, got.checkpoint, got.keep_from) == ("s1", 7, True, 5)
    assert torch.equal(got.grad, grad) and torch.equal(got.rows, rows)
    first = training.StepRequest.decode(training.StepRequest("s1", 0, None, rows).encode(), "s1")
    assert first.grad is None and not first.checkpoint and first.keep_from is None

    z = torch.randn(4, 8)
    reply = training.StepReply.decode(training.StepReply("s1", 7, z, durable=6).encode())
    assert torch.equal(reply.embedding, z) and (reply.step, reply.durable) == (7, 6)
    flush = training.StepReply.decode(training.StepReply("s1", 8, None).encode())
    assert flush.embedding is None and flush.durable is None

    start = training.StartRequest.decode(training.StartRequest("s1", "a1", rows).encode())
    assert (start.session, start.alignment) == ("s1", "a1") and torch.equal(start.train_rows, rows)
    assert torch.equal(training.EmbedRequest.decode(training.EmbedRequest("s1", rows).encode(), "s1").rows, rows)
    assert torch.equal(training.EmbedReply.decode(training.EmbedReply("s1", z).encode()).embedding, z)


@pytest.mark.parametrize(("body", "why"), [
    (training.StepRequest("other", 1, None, torch.tensor([1])).encode(), "another session"),
    (encode({"grad": torch.zeros(2, dtype=torch.float64)}, session="s1", step=1), "is torch.float64"),
    (encode({"labels": torch.zeros(2)}, session="s1", step=1), "unexpected tensor 'labels'"),
    (encode({}, session="s1"), "no 'step'"),
    (encode({}, session="s1", step="x"), "not an integer"),
])
def test_a_step_request_is_refused_with_its_reason(body: bytes, why: str) -> None:
    with pytest.raises(BadMessage, match=why):
        training.StepRequest.decode(body, "s1")


def test_scoring_and_psi_messages_round_trip() -> None:
    rows, z = torch.arange(5), torch.randn(5, 2)
    request = scoring.ScoringRequest.decode(scoring.ScoringRequest("a1", rows).encode())
    assert request.alignment == "a1" and torch.equal(request.rows, rows)
    fallbacks = {"job": {UNSEEN: 2}}
    reply = scoring.ScoringReply.decode(scoring.ScoringReply("m1", z, fallbacks).encode())
    assert reply.model == "m1" and torch.equal(reply.embedding, z) and reply.fallbacks == fallbacks
    with pytest.raises(BadMessage, match="the message carries no rows"):
        scoring.ScoringRequest.decode(encode({}, alignment="a1"))

    positions = np.array([3, 0, 2**32 - 1])
    assert psi.decode_positions(psi.encode_positions(positions)).tolist() == positions.tolist()
    with pytest.raises(BadMessage, match="uint32"):
        psi.decode_positions(b"\x00" * 5)
