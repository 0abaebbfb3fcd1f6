"""Privacy defenses: embedding DP with honest accounting, label protection, and the hijack monitor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from bank.config import TrainingConfig
from bank.defenses import flip_probability, perturb_gradient, randomized_response
from data.prepare import prepare_bank_marketing
from parties.learning.secret import Secret
from parties.errors import BudgetExhausted, ConfigError, CutlayerError
from parties.learning.bottom import BottomTrainer
from parties.learning.embedding_dp import RDP_ORDERS, EmbeddingDP, PrivacyConfig, epsilon_after
from parties.learning.model import BottomConfig
from tests.training_helpers import federation

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


def test_embedding_dp_clips_noises_and_counts() -> None:
    z = torch.randn(50, 8) * 10
    rows = torch.arange(50)
    clipped = EmbeddingDP(PrivacyConfig(clip=1.0, noise=0.0), 100).release(z, rows)
    assert torch.all(clipped.norm(dim=1) <= 1.0 + 1e-6)
    small = torch.full((3, 8), 0.01)
    assert torch.equal(EmbeddingDP(PrivacyConfig(clip=1.0), 10).release(small, torch.arange(3)), small)
    dp = EmbeddingDP(PrivacyConfig(clip=1.0, noise=2.0), 100)
    a, b = dp.release(z, rows), dp.release(z, rows)
    assert not torch.equal(a, b)  # fresh noise on every release
    # The noise is the partner's secret: another session draws other noise; only a pin repeats it.
    assert not torch.equal(a, EmbeddingDP(PrivacyConfig(clip=1.0, noise=2.0), 100).release(z, rows))
    pinned = [EmbeddingDP(PrivacyConfig(clip=1.0, noise=2.0, seed=4), 100).release(z, rows) for _ in range(2)]
    assert torch.equal(*pinned)
    assert dp.releases[:50].tolist() == [2] * 50 and dp.releases[50:].sum() == 0
    assert dp.epsilon() == pytest.approx(epsilon_after(2, 1.0, 1e-5))


def test_accounting_has_no_subsampling_amplification() -> None:
    # Noise multiplier 2 (σ = 4, C = 1): ε grows with every release of a row, as PRIVACY-NOTES computes.
    eps = [epsilon_after(k, 2.0, 1e-5) for k in (1, 10, 50)]
    assert 1.5 < eps[0] < 2.5 and 6.5 < eps[1] < 9 and 18 < eps[2] < 24


def _accountants_epsilon(releases: int, noise_multiplier: float, delta: float) -> float:
    """What Opacus's RDPAccountant reports after ``releases`` steps at sampling rate 1 (its public ``step``)."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(releases):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=1.0)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(("releases", "noise_multiplier", "delta"), [
    (1, 2.0, 1e-5), (3, 0.25, 1e-5), (10, 0.25, 1e-5), (20, 1.0, 1e-5), (60, 1.0, 1e-6), (100, 1.0, 1e-5),
    (30, 0.5, 1e-5), (400, 4.0, 1e-3),
])
def test_epsilon_is_the_accountants(releases: int, noise_multiplier: float, delta: float) -> None:
    assert epsilon_after(releases, noise_multiplier, delta) == pytest.approx(
        _accountants_epsilon(releases, noise_multiplier, delta), rel=0, abs=1e-9)


def test_epsilon_uses_the_accountants_orders_and_known_figures() -> None:
    from opacus.accountants import RDPAccountant

    assert list(RDP_ORDERS) == list(RDPAccountant.DEFAULT_ALPHAS)
    # The README's privacy table: C=1 with σ=2 and σ=0.5 (noise multipliers 1 and 0.25), 10 epochs, each row
    # released once per epoch: ε 19 and 139.
    assert epsilon_after(10, 1.0, 1e-5) == pytest.approx(19.0536, abs=1e-4)
    assert epsilon_after(10, 0.25, 1e-5) == pytest.approx(138.6884, abs=1e-4)


def test_epsilon_grows_with_every_release_and_is_cached() -> None:
    eps = [epsilon_after(k, 1.0, 1e-5) for k in range(0, 40)]
    assert eps[0] == 0.0 and all(b > a > 0 for a, b in zip(eps[1:], eps[2:]))
    before = epsilon_after.cache_info().hits
    epsilon_after(39, 1.0, 1e-5)
    assert epsilon_after.cache_info().hits == before + 1
    assert epsilon_after(5, 0.0, 1e-5) == float("inf")


def test_epsilon_fails_loudly_without_opacus_analysis(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Opacus that moved its RDP analysis must stop the run, not report ε = 0."""
    import sys

    epsilon_after.cache_clear()
    monkeypatch.setitem(sys.modules, "opacus.accountants.analysis.rdp", None)
    try:
        with pytest.raises(ConfigError, match="compute_rdp, get_privacy_spent"):
            epsilon_after(7, 1.3, 1e-5)
        with pytest.raises(ConfigError):
            EmbeddingDP(PrivacyConfig(clip=1.0, noise=2.6, budget=100.0), 10).check(torch.arange(3))
    finally:
        epsilon_after.cache_clear()


def test_a_release_over_budget_is_refused_and_changes_nothing() -> None:
    trainer = BottomTrainer(np.random.rand(20, 5).astype(np.float32), BottomConfig(cut_width=4),
                            PrivacyConfig(clip=1.0, noise=2.0, budget=epsilon_after(2, 1.0, 1e-5) + 0.01))
    rows = torch.arange(10)
    trainer.step(0, None, rows)
    trainer.step(1, torch.zeros(10, 4), rows)  # the second release of rows 0-9
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(BudgetExhausted, match="over the budget"):
        trainer.step(2, torch.zeros(10, 4), rows)
    assert trainer.next_step == 2 and all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.embed(torch.arange(10, 20)).shape == (10, 4)  # other rows still have budget


def test_partners_report_their_epsilon_every_epoch(pki, bank_full: Path, tmp_path: Path, start_partner) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)
    start = lambda data, **kw: start_partner(data, privacy=PrivacyConfig(clip=1.0, noise=4.0), **kw)  # noqa: E731
    with federation(pki, paths, start, tmp_path, BOTTOMS) as fed:
        outcome = fed.coordinator(TrainingConfig(epochs=3, batch_size=64), BOTTOMS["bank"]).run()
    eps = [row["epsilon_partner"] for row in outcome.history]
    # Each epoch releases every training row once and every validation row once: one release per row.
    assert eps == pytest.approx([epsilon_after(k, 2.0, 1e-5) for k in (1, 2, 3)])


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
