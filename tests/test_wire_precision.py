"""Compressed step tensors: fewer bytes, agreed at the session's start, named in every step message;
fp32 stays the default and the wire bytes of an exact run do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from training_helpers import federation, saved, state_equal

from bank.config import TrainingConfig
from data.prepare import prepare_bank_marketing
from parties.errors import BadMessage
from parties.learning.model import BottomConfig
from parties.protocol import codec, training
from parties.protocol.wire import decode, encode

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


@pytest.mark.parametrize(("precision", "tolerance", "ratio"), [
    ("fp16", 1e-3, 0.5), ("bf16", 1e-2, 0.5), ("int8", 1 / 127, 0.25 + 1 / 128),
])
def test_each_precision_rounds_within_its_bound_in_its_share_of_the_bytes(precision, tolerance, ratio) -> None:
    grad = torch.randn(256, 32) * torch.logspace(-4, 2, 256)[:, None]  # rows of very different scales
    grad[3] = 0.0
    exact = training.StepRequest("s1", 5, grad, torch.arange(256), precision="fp32").encode()
    packed = training.StepRequest("s1", 5, grad, torch.arange(256), precision=precision).encode()
    got = training.StepRequest.decode(packed, "s1")
    assert got.precision == precision and got.grad.dtype == torch.float32
    row_scale = grad.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    assert float(((got.grad - grad).abs() / row_scale).max()) <= tolerance  # relative to each row's largest value
    assert torch.equal(got.grad[3], torch.zeros(32))
    grad_bytes = 256 * 32 * 4
    assert len(packed) - (len(exact) - grad_bytes) <= grad_bytes * ratio + 160  # + the header's extra entries


def test_fp32_messages_are_the_exact_runs_bytes() -> None:
    grad, rows = torch.randn(4, 3), torch.arange(4)
    body = training.StepRequest("s1", 2, grad, rows).encode()
    # No precision key, nothing rounded; positions as int32.
    assert body == encode({"rows": rows.to(torch.int32), "grad": grad}, session="s1", step=2)
    assert torch.equal(training.StepRequest.decode(body, "s1").grad, grad)
    z = torch.randn(4, 8)
    assert training.StepReply("s1", 2, z).encode() == encode({"embedding": z}, session="s1", step=2)


def _step(tensors: dict[str, torch.Tensor], **meta: object) -> bytes:
    return encode({"rows": torch.arange(2), **tensors}, session="s1", step=1, **meta)


@pytest.mark.parametrize(("body", "why"), [
    (_step({"grad": torch.zeros(2, 3)}, precision="fp8"), "precision 'fp8' is not one of"),
    (_step({"grad": torch.zeros(2, 3, dtype=torch.int8)}, precision="int8"), "one int8 exponent per row"),
    (_step({"grad": torch.zeros(2, 3, dtype=torch.int8), "grad.exp": torch.tensor([1, 121], dtype=torch.int8)},
           precision="int8"), "at most 120"),
    (_step({"grad": torch.zeros(2, 3, dtype=torch.int8), "grad.exp": torch.tensor([1.0, 2.0])}, precision="int8"),
     "one int8 exponent per row"),
    (_step({"grad": torch.zeros(2, 3, dtype=torch.float16)}), "is torch.float16; expected torch.float32"),
    (_step({"grad": torch.zeros(2, 3)}, precision="fp16"), r"expected torch.float16 \(precision fp16\)"),
    (_step({"grad": torch.zeros(2, 3, dtype=torch.float16), "grad.exp": torch.ones(2, dtype=torch.int8)},
           precision="fp16"), "carries no exponents"),
    (_step({"grad": torch.zeros(2, 3, dtype=torch.int8), "grad.exp": torch.ones(3, dtype=torch.int8)},
           precision="int8"), "one int8 exponent per row"),
])
def test_a_malformed_compressed_step_is_refused_with_its_reason(body: bytes, why: str) -> None:
    with pytest.raises(BadMessage, match=why):
        training.StepRequest.decode(body, "s1")


def test_an_answer_in_another_precision_is_refused() -> None:
    reply = training.StepReply("s1", 1, torch.randn(2, 4), precision="fp16").encode()
    assert training.StepReply.decode(reply, "fp16").embedding.shape == (2, 4)
    for asked in ("fp32", "int8"):
        with pytest.raises(BadMessage):
            training.StepReply.decode(reply, asked)
    with pytest.raises(BadMessage, match="is torch.float16; expected torch.float32"):
        decode(reply, codec.allowed("embedding", "fp32"))


def test_compressed_training_over_the_services_is_deterministic_and_sends_fewer_bytes(
        pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=2000, cache=bank_full.parent, download=False)
    results = {}
    with federation(pki, paths, start_partner, tmp_path, BOTTOMS) as fed:
        models = fed.partner_core("partner").banks["bank"].folder / "models"
        for precision in ("fp32", "int8", "int8", "fp16"):
            config = TrainingConfig(epochs=3, batch_size=128, restore_best=False, wire_precision=precision)
            coordinator = fed.coordinator(config, BOTTOMS["bank"])
            outcome = coordinator.run()
            partner = coordinator.parties[1]
            assert partner.precision == precision
            results.setdefault(precision, []).append(
                (outcome, partner.bytes_sent + partner.bytes_received,
                 saved(models / outcome.session_id / "bottom.safetensors")))
            partner.close()
    (exact, exact_bytes, _), = results["fp32"]
    (a, a_bytes, a_model), (b, _, b_model) = results["int8"]
    assert a.test_metrics == b.test_metrics and state_equal(a_model, b_model)  # the same config, the same model
    assert a.test_metrics != exact.test_metrics  # rounded, so not the exact run
    for outcome, sent, _ in (results["int8"][0], results["fp16"][0]):
        assert abs(outcome.test_metrics["roc_auc"] - exact.test_metrics["roc_auc"]) < 0.02
    # Steps dominate the bytes; evaluation embeddings stay float32.
    assert a_bytes < 0.6 * exact_bytes and results["fp16"][0][1] < 0.8 * exact_bytes
