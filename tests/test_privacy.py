"""Privacy defenses: embedding DP with honest accounting, label protection, and the hijack monitor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from bank.config import TrainingConfig
from bank.vertical.defenses import flip_probability, perturb_gradient, randomized_response
from data.prepare import prepare_bank_marketing
from parties.learning.secret import Secret
from parties.errors import CutlayerError
from parties.learning.embedding_noise import EmbeddingNoise, PrivacyConfig
from parties.learning.model import BottomConfig
from tests.training_helpers import federation

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


def test_embedding_dp_clips_noises_and_counts() -> None:
    z = torch.randn(50, 8) * 10
    rows = torch.arange(50)
    clipped = EmbeddingNoise(PrivacyConfig(clip=1.0, noise=0.0), 100).release(z, rows)
    assert torch.all(clipped.norm(dim=1) <= 1.0 + 1e-6)
    small = torch.full((3, 8), 0.01)
    assert torch.equal(EmbeddingNoise(PrivacyConfig(clip=1.0), 10).release(small, torch.arange(3)), small)
    dp = EmbeddingNoise(PrivacyConfig(clip=1.0, noise=2.0), 100)
    a, b = dp.release(z, rows), dp.release(z, rows)
    assert not torch.equal(a, b)  # fresh noise on every release
    # The noise is the partner's secret: another session draws other noise; only a pin repeats it.
    assert not torch.equal(a, EmbeddingNoise(PrivacyConfig(clip=1.0, noise=2.0), 100).release(z, rows))
    pinned = [EmbeddingNoise(PrivacyConfig(clip=1.0, noise=2.0, seed=4), 100).release(z, rows) for _ in range(2)]
    assert torch.equal(*pinned)
    assert dp.releases[:50].tolist() == [2] * 50 and dp.releases[50:].sum() == 0


def test_embedding_noise_claims_no_epsilon_and_counts_releases(pki, bank_full: Path, tmp_path: Path,
                                                                start_partner) -> None:
    """Embedding noise is obfuscation: the bottom trains on every row without per-sample clipping or noise, so a
    per-row ε would bound nothing. The partner says how often each row was released, and no ε anywhere."""
    paths = prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)
    start = lambda data, **kw: start_partner(data, privacy=PrivacyConfig(clip=1.0, noise=4.0), **kw)  # noqa: E731
    with federation(pki, paths, start, tmp_path, BOTTOMS) as fed:
        coordinator = fed.coordinator(TrainingConfig(epochs=3, batch_size=64, max_steps=40), BOTTOMS["bank"])
        partner = coordinator.parties[1]
        reports = []
        original = partner.privacy
        partner.privacy = lambda: reports.append(original()) or reports[-1]  # what the bank reads every epoch
        outcome = coordinator.run()
    report = reports[-1]
    assert report.enabled and report.max_releases >= 2  # every epoch released every training row at least once
    assert "epsilon" not in report.model_dump() and not any(k.startswith("epsilon") for k in outcome.history[-1])
    with pytest.raises(ValueError):
        PrivacyConfig(clip=1.0, budget=3.0)  # an ε budget is not a setting any more


def test_randomized_response_flips_once_at_the_stated_rate() -> None:
    targets = torch.zeros(20_000)
    rows = np.arange(0, 20_000, 2)
    flipped = randomized_response(targets, rows, epsilon=1.0, secret=Secret.pinned_to(0))
    assert flipped[1::2].sum() == 0  # rows outside the training split keep their labels
    assert float(flipped[rows].mean()) == pytest.approx(flip_probability(1.0), abs=0.015)
    assert torch.equal(flipped, randomized_response(targets, rows, epsilon=1.0, secret=Secret.pinned_to(0)))


def test_max_norm_defeats_the_norm_attack() -> None:
    gen = torch.Generator().manual_seed(0)
    labels = (torch.rand(2000, generator=gen) < 0.12).float()
    grads = torch.randn(2000, 8, generator=gen) * (0.05 + 0.9 * labels[:, None])  # positives: larger gradients
    before = roc_auc_score(labels, grads.norm(dim=1))
    after = roc_auc_score(labels, perturb_gradient(grads, "max_norm", 0.0, Secret.pinned_to(0).torch("gradient", 1, 1)).norm(dim=1))
    assert before > 0.95 and abs(after - 0.5) < 0.1


class HijackingCoordinator:
    """Feature-space hijacking: the partner's gradient is that of an adversarial loss on its embedding alone."""

    @staticmethod
    def install(coordinator, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        w = torch.randn(8, 1, generator=generator)

        def adversarial(top, leaves, rows):  # a per-row critic, as FSHA's discriminator
            return torch.tanh(leaves[1] @ w).mean() + 0.0 * leaves[0].sum()

        coordinator._loss = adversarial


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_hijack_monitor_catches_a_hijacking_bank_and_not_an_honest_one(
    pki, bank_full: Path, tmp_path: Path, start_partner, seed: int
) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False, seed=seed)
    from parties.learning.hijack_monitor import MonitorConfig

    start = lambda data, **kw: start_partner(data, monitor=MonitorConfig(probe_every=3, seed=seed), **kw)  # noqa: E731
    config = TrainingConfig(epochs=2, batch_size=64, seed=seed)
    with federation(pki, paths, start, tmp_path, BOTTOMS) as fed:
        honest = fed.coordinator(config, BOTTOMS["bank"]).run()  # no false alarm
        assert honest.history
        hijacker = fed.coordinator(config, BOTTOMS["bank"])
        HijackingCoordinator.install(hijacker, seed)
        with pytest.raises(CutlayerError, match="hijack suspected"):
            hijacker.run()
