"""Local steps, the communication-efficient mode: K batches per round trip, one update each at every party,
and optionally R more from the last two round trips' batches (reuse).

Not exact (each batch's gradient meets weights that moved since it was computed), so it has its own
tests: what a party does with a round trip's K batches, determinism, convergence on a small dataset, the
round trips it saves, refusals. Recovery after a kill is in ``test_crash_recovery``; exact mode (K = 1)
stays in the exactness tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from training_helpers import federation, saved, state_equal

from bank.config import TrainingConfig
from data.prepare import prepare_bank_marketing
from parties.errors import BadMessage
from parties.learning.bottom import BottomTrainer
from parties.learning.config import LocalSteps
from parties.learning.model import BottomConfig
from parties.protocol import training
from parties.storage.checkpoint import CheckpointWriter, read_checkpoint

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


def _features(n: int = 40, width: int = 6) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, width)).astype(np.float32)


def test_a_round_trip_of_k_batches_is_k_updates_one_per_batch() -> None:
    """K batches at once, then their gradient, leave the weights exactly where K one-batch steps leave them
    when each batch's gradient is the one the bank computed for it."""
    config = BottomConfig(hidden=(8,), cut_width=4, seed=3)
    rows = torch.tensor([3, 9, 1, 30, 22, 7, 15, 0, 11])  # three batches of 4, 4 and 1 rows
    grad = torch.randn(9, 4, generator=torch.Generator().manual_seed(5))
    local = BottomTrainer(_features(), config, local=LocalSteps(steps=3, batch=4))
    one_by_one = BottomTrainer(_features(), config)

    z = local.step(0, None, rows)
    assert z is not None and z.shape == (9, 4)
    local.step(1, grad, None)

    first = one_by_one.step(0, None, rows[:4])
    # The same weights embed the same rows alike, up to the last bit: BLAS may pick another kernel for 9 rows than
    # for 4 (one ulp apart on some CPUs). The updates below use each batch's own rows: those are bit for bit.
    assert torch.allclose(first, z[:4], rtol=0, atol=1e-6)
    one_by_one.step(1, grad[:4], rows[4:8])
    one_by_one.step(2, grad[4:8], rows[8:])
    one_by_one.step(3, grad[8:], None)
    for (name, a), b in zip(local.model.state_dict().items(), one_by_one.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(local.model.state_dict()["0.weight"], BottomTrainer(_features(), config).model.state_dict()["0.weight"])


def test_a_step_with_more_rows_than_agreed_is_refused_and_changes_nothing() -> None:
    trainer = BottomTrainer(_features(), BottomConfig(cut_width=4), local=LocalSteps(steps=2, batch=4))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(BadMessage, match="at most 2 batches of 4 rows, got 9"):
        trainer.step(0, None, torch.arange(9))
    assert trainer.next_step == 0 and state_equal(before, trainer.model.state_dict())
    assert trainer.step(0, None, torch.arange(8)) is not None


@pytest.mark.parametrize(("local", "why"), [
    ('{"steps": 0, "batch": 4}', "greater than or equal to 1"), ('{"steps": 33, "batch": 4}', "less than or equal to 32"),
    ('{"steps": 2}', "need a batch size"), ('{"steps": 4, "batch": 32768}', "at most 65536"),
    ('{"steps": 1, "reuse": 2}', "reuse needs local steps"), ('{"steps": 2, "batch": 4, "ttl": 1}', "Extra inputs"),
    ("[1, 2]", "should be an object"), ("not json", "Invalid JSON"),
])
def test_impossible_local_settings_from_a_bank_are_refused_with_the_reason(local: str, why: str) -> None:
    from parties.protocol.wire import encode
    body = encode({"train_rows": torch.arange(5)}, session="s1", alignment="a1", local=local)
    with pytest.raises(BadMessage, match=why):
        training.StartRequest.decode(body)


def test_the_bank_cannot_ask_for_more_rows_per_round_trip_than_a_partner_takes() -> None:
    with pytest.raises(ValidationError, match="at most 65536 rows per round trip"):
        TrainingConfig(local_steps=32, batch_size=4096)
    with pytest.raises(ValidationError, match="reuse_steps needs local_steps > 1"):
        TrainingConfig(reuse_steps=2)
    assert TrainingConfig(local_steps=16, batch_size=4096, reuse_steps=4).local == LocalSteps(steps=16, batch=4096,
                                                                                              reuse=4)
    assert TrainingConfig().local.exact


def test_the_start_request_carries_the_mode_and_exact_mode_sends_what_it_sent() -> None:
    rows = torch.arange(5)
    exact = training.StartRequest("s1", "a1", rows)
    assert b"local" not in exact.encode()  # an exact run's bytes are unchanged
    assert training.StartRequest.decode(exact.encode()).local.exact
    mode = LocalSteps(steps=4, batch=256, reuse=3)
    local = training.StartRequest.decode(training.StartRequest("s1", "a1", rows, "int8", mode).encode())
    assert (local.precision, local.local) == ("int8", mode)


def test_reuse_learns_more_per_round_trip_and_its_cache_survives_a_checkpoint(tmp_path: Path) -> None:
    config, rows = BottomConfig(hidden=(8,), cut_width=4, seed=3), torch.arange(24)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(8, 4, generator=gen) for _ in range(3)]

    def run(trainer: BottomTrainer, steps: range) -> None:
        for t in steps:
            trainer.step(t, grads[t - 1] if t else None, rows[8 * t : 8 * t + 8] if t < 3 else None)

    plain = BottomTrainer(_features(), config, local=LocalSteps(steps=2, batch=4))
    run(plain, range(4))
    reused = BottomTrainer(_features(), config, local=LocalSteps(steps=2, batch=4, reuse=3))
    run(reused, range(2))
    tensors, meta = reused.state()
    assert meta["cached"] == 2 and "cache.1.grad" in tensors  # the first round trip's two batches
    resumed = BottomTrainer(_features(), config, local=LocalSteps(steps=2, batch=4, reuse=3))
    writer = CheckpointWriter()
    writer.submit(tmp_path, 1, tensors, {"trainer": meta}, None)
    writer.close()
    checkpoint = read_checkpoint(tmp_path, 1)
    resumed.load_state(checkpoint, checkpoint.meta["trainer"])
    run(reused, range(2, 4))
    run(resumed, range(2, 4))
    assert state_equal(reused.model.state_dict(), resumed.model.state_dict())
    assert not state_equal(reused.model.state_dict(), plain.model.state_dict())


def test_local_steps_over_the_services_are_deterministic_converge_and_save_round_trips(
        pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=3000, cache=bank_full.parent, download=False)
    runs = []
    with federation(pki, paths, start_partner, tmp_path, BOTTOMS) as fed:
        models = fed.partner_core("partner").banks["bank"].folder / "models"
        for local, reuse in ((1, 0), (4, 0), (4, 0), (4, 4)):
            config = TrainingConfig(epochs=6, batch_size=64, restore_best=False, local_steps=local, reuse_steps=reuse)
            coordinator = fed.coordinator(config, BOTTOMS["bank"])
            outcome = coordinator.run()
            partner = coordinator.parties[1]
            runs.append((outcome, partner.round_trips, saved(models / outcome.session_id / "bottom.safetensors")))
            partner.close()
    (exact, exact_trips, exact_model), (a, a_trips, a_model), (b, b_trips, b_model), (r, _, r_model) = runs
    batches = -(-len(a.split.train) // 64)
    assert a.steps == 6 * (-(-batches // 4) + 1)  # per epoch: ceil(batches / 4) round trips and the flush
    assert exact.steps == 6 * (batches + 1)
    assert a_trips == b_trips and a_trips < 0.4 * exact_trips
    assert a.test_metrics == b.test_metrics and state_equal(a_model, b_model)  # the same config, the same model
    assert not state_equal(a_model, exact_model)  # stale by a round trip: not the exact model
    for run in (a, r):
        assert run.test_metrics["roc_auc"] > 0.85 and abs(run.test_metrics["roc_auc"] - exact.test_metrics["roc_auc"]) < 0.02
    assert r.steps == a.steps and not state_equal(r_model, a_model)  # reuse: the same round trips, more learning
