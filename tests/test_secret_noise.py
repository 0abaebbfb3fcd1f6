"""Protective noise is the protected party's secret: the other party, knowing the code, every public seed and
everything it receives, cannot draw it again; two runs draw different noise; a pin (for studies) repeats it.

The attacker here plays the counterparty of each defense. It recovers the public training seed from the batch
order it sees, then tries every way the code could have derived the noise from what it knows: the training
seed, the defaults (0), the step and the party, Python's ``hash()`` of them (as an earlier version did), and
this version's own derivation pinned to those seeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bank.config import TrainingConfig
from bank.vertical.defenses import flip_probability
from bank.vertical.schedule import epoch_batches
from data.prepare import prepare_bank_marketing
from parties.learning.config import MonitorConfig, PrivacyConfig
from parties.learning.embedding_noise import EmbeddingNoise
from parties.learning.hijack_monitor import HijackMonitor
from parties.learning.secret import Secret

SEEDS = range(64)  # the public seeds an attacker tries: a brute force over them takes milliseconds


def _hash_seeded(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)


@pytest.fixture(scope="module")
def fed(bank_full: Path, tmp_path_factory: pytest.TempPathFactory):
    from bank.lab.studies.privacy import Federation

    return Federation(prepare_bank_marketing(tmp_path_factory.mktemp("data"), rows=3000, cache=bank_full.parent,
                                             download=False))


def _recover_seed(observed: list[torch.Tensor], train: np.ndarray, batch: int) -> int:
    """The partner's first move: the training seed, from the rows of the first epoch's batches it received."""
    for seed in SEEDS:
        if all(torch.equal(a, b) for a, b in zip(epoch_batches(train, batch, seed, 0), observed)):
            return seed
    raise AssertionError("the public seed should be found from the batch order")


def test_label_dp_flips_cannot_be_regenerated_by_the_partner(fed) -> None:
    config = TrainingConfig(epochs=1, batch_size=256, label_dp_epsilon=1.0, seed=7, max_steps=3)
    coordinator = fed.coordinator(config)
    train = coordinator.split.train
    flipped = (coordinator.train_targets != coordinator.targets).numpy()[train]
    seed = _recover_seed(epoch_batches(train, 256, 7, 0), train, 256)
    assert seed == 7
    p = flip_probability(1.0)
    candidates = [np.random.default_rng([s, 7331]).random(len(train)) < p for s in (seed, 0)]
    candidates += [Secret.pinned_to(s).numpy("label-dp").random(len(train)) < p for s in (seed, 0)]
    chance = p * p + (1 - p) * (1 - p)  # agreement of two independent masks
    for guess in candidates:
        assert abs(float(np.mean(guess == flipped)) - chance) < 0.05, "the partner regenerated the flip mask"


@pytest.mark.parametrize("defense", ["isotropic", "marvell"])
def test_gradient_noise_cannot_be_regenerated_by_the_partner(fed, defense: str) -> None:
    """Step 0's noise is what the partner received minus the clean gradient (the same run without the defense,
    identical up to that step); the attacker correlates it with every standard normal it can draw."""
    base = TrainingConfig(epochs=1, batch_size=256, seed=3, max_steps=1, audit=True)
    noisy = fed.coordinator(base.model_copy(update={"gradient_defense": defense})).run()
    clean = fed.coordinator(base).run()
    received = noisy.audit.tensors()["gradients-partner"]["grads"][:256].double()
    noise = received - clean.audit.tensors()["gradients-partner"]["grads"][:256].double()
    assert noise.abs().max() > 0
    shape = tuple(noise.shape)
    guesses = [torch.randn(shape, generator=_hash_seeded(s, 0, 1), dtype=dtype)
               for s in (3, 0) for dtype in (torch.float32, torch.float64)]
    guesses += [torch.randn(shape, generator=Secret.pinned_to(s).torch(label, 0, 1), dtype=dtype)
                for s in (3, 0) for label in ("gradient", "marvell") for dtype in (torch.float32, torch.float64)]
    for guess in guesses:
        r = float(np.corrcoef(guess.double().flatten().numpy(), noise.flatten().numpy())[0, 1])
        assert abs(r) < 0.1, f"the partner regenerated the gradient noise (correlation {r:.2f})"


def test_embedding_noise_cannot_be_regenerated_by_the_bank() -> None:
    z = torch.randn(200, 16)
    dp = EmbeddingNoise(PrivacyConfig(clip=4.0, noise=0.4), 200)  # the defaults: no pin
    noise = [dp.release(z, torch.arange(200)) - dp.clipped(z) for _ in range(3)]
    for draw, observed in enumerate(noise):
        for guess in (torch.randn(z.shape, generator=_hash_seeded(0, draw)),
                      torch.randn(z.shape, generator=Secret.pinned_to(0).torch("embedding-noise", draw))):
            r = float(np.corrcoef(guess.flatten().numpy(), observed.flatten().numpy())[0, 1])
            assert abs(r) < 0.1, f"the bank regenerated release {draw}'s noise (correlation {r:.2f})"


def test_the_monitors_probe_rows_are_the_partners_secret() -> None:
    config = MonitorConfig(probe_every=1, pairs=4)
    plans = [HijackMonitor(config).plan(step, 256) for step in range(20) for _ in range(1)]
    public = [[(int(o[2 * k]), int(o[2 * k + 1])) for k in range(4)]
              for o in (np.random.default_rng([0, step]).permutation(256)[:8] for step in range(20))]
    assert sum(a == b for a, b in zip(plans, public)) == 0, "a bank that reads the code knows the probe rows"
    pinned = MonitorConfig(probe_every=1, pairs=4, seed=5)
    assert HijackMonitor(pinned).plan(3, 256) == HijackMonitor(pinned).plan(3, 256)  # a pin repeats, for studies


@pytest.mark.parametrize("setting", [
    {"label_dp_epsilon": 1.0}, {"gradient_defense": "isotropic"}, {"gradient_defense": "max_norm"},
    {"gradient_defense": "marvell"}, {"gradient_defense": "marvell", "marvell_persistence": 1.0},
], ids=["label-dp", "isotropic", "max-norm", "marvell", "marvell-persistent"])
def test_two_runs_with_the_same_flags_draw_different_noise_and_models(fed, setting: dict) -> None:
    config = TrainingConfig(epochs=1, batch_size=256, seed=2, max_steps=8, **setting)
    tops = [fed.coordinator(config) for _ in range(2)]
    for coordinator in tops:
        coordinator.run()
    assert not all(torch.equal(a, b) for a, b in zip(tops[0].top.state_dict().values(),
                                                     tops[1].top.state_dict().values()))
    pinned = [fed.coordinator(config.model_copy(update={"defense_seed": 9})) for _ in range(2)]
    for coordinator in pinned:
        coordinator.run()
    assert all(torch.equal(a, b) for a, b in zip(pinned[0].top.state_dict().values(),
                                                 pinned[1].top.state_dict().values()))


def test_without_a_defense_two_runs_are_the_same_model(fed) -> None:
    config = TrainingConfig(epochs=1, batch_size=256, seed=2, max_steps=8)
    runs = [fed.coordinator(config) for _ in range(2)]
    for coordinator in runs:
        coordinator.run()
    assert all(torch.equal(a, b) for a, b in zip(runs[0].top.state_dict().values(), runs[1].top.state_dict().values()))


def test_two_runs_with_the_same_embedding_noise_settings_draw_different_noise(fed) -> None:
    config = TrainingConfig(epochs=1, batch_size=256, seed=2, max_steps=8, audit=True)

    def released(privacy: PrivacyConfig) -> torch.Tensor:
        outcome = fed.coordinator(config, privacy).run()
        return outcome.audit.tensors()["embeddings-partner"]["embedding"]

    fresh = PrivacyConfig(clip=4.0, noise=0.4)
    assert not torch.equal(released(fresh), released(fresh))
    pinned = PrivacyConfig(clip=4.0, noise=0.4, seed=3)
    assert torch.equal(released(pinned), released(pinned))


def test_a_restored_partner_draws_the_noise_it_would_have_drawn(tmp_path: Path) -> None:
    """The secret is part of the partner's checkpoint: a party restarted from it continues the same noise."""
    from parties.learning.bottom import BottomTrainer
    from parties.learning.model import BottomConfig
    from parties.storage.checkpoint import Checkpoint

    features = np.random.default_rng(0).normal(size=(64, 5))
    privacy = PrivacyConfig(clip=1.0, noise=0.5)
    original = BottomTrainer(features, BottomConfig(cut_width=4), privacy, MonitorConfig(probe_every=2))
    rows = torch.arange(32)
    original.step(0, None, rows)
    tensors, meta = original.state()
    restarted = BottomTrainer(features, BottomConfig(cut_width=4), privacy, MonitorConfig(probe_every=2))
    restarted.load_state(Checkpoint(0, tensors, meta), meta)
    assert torch.equal(restarted.embed(rows), original.embed(rows))  # the next release's noise
    assert restarted.monitor.plan(5, 32) == original.monitor.plan(5, 32)
    assert "key" in str(meta["secret"]) and original.secret.pinned is None


def test_a_resumed_bank_keeps_its_secret(fed, tmp_path: Path) -> None:
    config = TrainingConfig(epochs=1, batch_size=256, label_dp_epsilon=1.0, max_steps=2)
    first = fed.coordinator(config)
    first.checkpoint_dir = None
    from bank.vertical.coordinator import Coordinator

    def coordinator() -> Coordinator:
        return Coordinator(config, fed.task, fed.targets, first.parties, alignment_id="sim",
                           checkpoint_dir=tmp_path / "coordinator")

    a, b = coordinator(), coordinator()
    assert torch.equal(a.train_targets, b.train_targets)  # read back from the bank's own run folder
    assert (tmp_path / "coordinator" / "secret.json").stat().st_mode & 0o077 == 0
    assert not torch.equal(a.train_targets, first.train_targets)  # another session, another secret


def test_asking_again_for_the_same_rows_does_not_average_the_embedding_noise_away() -> None:
    """Every release of a row from one model state carries the same noise: a bank that asks a thousand times
    for an evaluation, or scores the same customers again, learns no more than from one release."""
    from parties.learning.bottom import BottomTrainer
    from parties.learning.model import BottomConfig

    features = np.random.default_rng(0).normal(size=(40, 5))
    trainer = BottomTrainer(features, BottomConfig(cut_width=4), PrivacyConfig(clip=1.0, noise=2.0))
    rows = torch.arange(10)
    first = trainer.embed(rows)
    assert all(torch.equal(first, trainer.embed(rows)) for _ in range(5))
    trainer.step(0, None, rows)
    trainer.step(1, torch.ones(10, 4), rows)  # the weights move: a new state, new noise
    assert not torch.equal(first, trainer.embed(rows))
    noise = EmbeddingNoise(PrivacyConfig(clip=1.0, noise=2.0), 40)
    z = torch.zeros(10, 4)
    assert torch.equal(noise.release(z, rows, state="model-a"), noise.release(z, rows, state="model-a"))


def test_the_split_the_partners_see_says_nothing_of_the_labels() -> None:
    """A split stratified with the public seed let a partner replay it and read the labels (0.90 AUC): by default
    the split does not depend on the labels at all; stratified, its shuffles are the bank's secret."""
    from bank.vertical.schedule import split_rows
    from bank.task import Task

    rng = np.random.default_rng(0)
    labels = torch.from_numpy((rng.random(2000) < 0.12).astype(np.float32))
    task = Task("binary")
    config = TrainingConfig(seed=3)
    a = split_rows(2000, labels, task, config)
    b = split_rows(2000, labels[torch.randperm(2000)], task, config)  # other labels, the same split
    assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("train", "val", "test"))
    stratified = config.model_copy(update={"stratify": True})
    s1, s2 = (split_rows(2000, labels, task, stratified, secret=Secret.fresh()) for _ in range(2))
    assert not np.array_equal(s1.test, s2.test)  # the bank's secret, not the public seed
    p1, p2 = (split_rows(2000, labels, task, stratified, secret=Secret.pinned_to(5)) for _ in range(2))
    assert np.array_equal(p1.test, p2.test)
    assert abs(float(labels[p1.test].mean()) - float(labels.mean())) < 0.01  # and stratified it is
