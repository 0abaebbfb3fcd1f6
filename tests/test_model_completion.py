"""Model completion (Fu et al., USENIX Security 2022): the partner fine-tunes its trained bottom on a few labels.

The synthetic task is one a partner cannot learn from 50 labels alone (an interaction of its
columns) but its bottom learns from the bank's gradients: there the collaboration's share of the
leak is large, and a broken attack (a fresh bottom, the known rows scored, the baseline on other
rows) shows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bank.config import TrainingConfig
from bank.lab.report import audit
from bank.lab.attacks.labels import completion_scores
from bank.lab.report.audit import completion_leakage, draw_known
from data.prepare import prepare_bank_marketing
from parties.learning.bottom import BottomTrainer
from parties.learning.model import BottomConfig, build_bottom, mlp

CONFIG = BottomConfig(hidden=(32,), cut_width=8, seed=3)


@pytest.fixture(scope="module")
def synthetic() -> tuple[np.ndarray, np.ndarray]:
    """Partner columns and labels that depend on them only through products of pairs (about 20% positive)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 12)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] + x[:, 2] * x[:, 3] > 1.0).astype(np.float64)
    return x, y


@pytest.fixture(scope="module")
def trained(synthetic: tuple[np.ndarray, np.ndarray]) -> nn.Module:
    """The partner's bottom after split training: the step protocol, with the bank's top and labels computing
    the gradient of each embedding."""
    x, y = synthetic
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a shared machine
    try:
        return _split_training(x, y)
    finally:
        torch.set_num_threads(previous)


def _split_training(x: np.ndarray, y: np.ndarray) -> nn.Module:
    trainer = BottomTrainer(x, CONFIG)
    top = mlp(CONFIG.cut_width, (), 1, activate_output=False, seed=0)  # the bank's top, seeded
    optimizer = torch.optim.Adam(top.parameters(), lr=1e-2)
    targets = torch.from_numpy(y).float()[:, None]
    generator = torch.Generator().manual_seed(0)
    step, grad = 0, None
    for _ in range(30):
        for rows in torch.randperm(len(x), generator=generator).split(128):
            z = trainer.step(step, grad, rows).requires_grad_()
            optimizer.zero_grad()
            F.binary_cross_entropy_with_logits(top(z), targets[rows]).backward()
            optimizer.step()
            step, grad = step + 1, z.grad
    trainer.step(step, grad, None)
    return trainer.model


def test_the_trained_bottom_gives_away_what_50_labels_alone_do_not(
        synthetic: tuple[np.ndarray, np.ndarray], trained: nn.Module) -> None:
    x, y = synthetic
    leak = completion_leakage(trained, CONFIG, x, y, known=50, draws=3)
    assert leak["model_completion_leak_auc"] > 0.9
    assert leak["from_scratch_leak_auc"] < 0.7
    assert leak["model_completion_advantage"] == pytest.approx(
        leak["model_completion_leak_auc"] - leak["from_scratch_leak_auc"])
    assert leak["model_completion_advantage"] > 0.3
    assert leak["known_labels"] == 50 and leak["completion_draws"] == 3
    assert all(leak[f"{c}_std"] >= 0 for c in ("model_completion_leak_auc", "from_scratch_leak_auc"))


def test_the_attack_leaves_the_partners_bottom_alone_and_scores_only_the_other_rows(
        synthetic: tuple[np.ndarray, np.ndarray], trained: nn.Module) -> None:
    x, y = synthetic
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    known = draw_known(y, 50, seed=0)
    others, scores = completion_scores(trained, x, known, y[known], seed=0)
    assert all(torch.equal(before[k], v) for k, v in trained.state_dict().items())
    assert len(others) == len(x) - 50 and len(scores) == len(others)
    assert not np.isin(known, others).any() and np.array_equal(np.union1d(others, known), np.arange(len(x)))
    assert np.all(np.diff(others) > 0) and np.isfinite(scores).all()
    with pytest.raises(ValueError, match="distinct"):
        completion_scores(trained, x, np.array([1, 1, 2]), np.array([0, 0, 1]))


def test_the_baseline_is_a_fresh_bottom_fine_tuned_on_the_same_known_rows(
        synthetic: tuple[np.ndarray, np.ndarray], trained: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = synthetic
    calls: list[tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray, int]] = []

    def recording(bottom: nn.Module, features: np.ndarray, known: np.ndarray, labels: np.ndarray, **kw):
        calls.append(({k: v.clone() for k, v in bottom.state_dict().items()}, known.copy(), labels.copy(), kw["seed"]))
        return completion_scores(bottom, features, known, labels, **kw)

    monkeypatch.setattr(audit, "completion_scores", recording)
    monkeypatch.setattr(audit, "_FROM_SCRATCH", {})
    completion_leakage(trained, CONFIG, x, y, known=40, draws=2, seed=7)
    assert len(calls) == 4
    fresh = build_bottom(x.shape[1], CONFIG).state_dict()
    for (attack, baseline) in (calls[0:2], calls[2:4]):
        assert all(torch.equal(attack[0][k], v) for k, v in trained.state_dict().items())
        assert all(torch.equal(baseline[0][k], v) for k, v in fresh.items())  # the partner's initial weights
        assert np.array_equal(attack[1], baseline[1]) and np.array_equal(attack[2], baseline[2])
        assert attack[3] == baseline[3]
    assert not np.array_equal(calls[0][1], calls[2][1])  # each draw its own known rows
    assert [c[3] for c in calls] == [7, 7, 8, 8]


def test_a_studys_settings_share_the_baseline_and_it_is_the_one_computed_afresh(
        synthetic: tuple[np.ndarray, np.ndarray], trained: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = synthetic
    monkeypatch.setattr(audit, "_FROM_SCRATCH", {})
    fresh = build_bottom(x.shape[1], CONFIG)
    first = completion_leakage(trained, CONFIG, x, y, known=30, draws=2, seed=3)
    assert len(audit._FROM_SCRATCH) == 2
    calls = []
    monkeypatch.setattr(audit, "completion_scores", lambda *a, **kw: calls.append(a[0]) or completion_scores(*a, **kw))
    other = completion_leakage(fresh, CONFIG, x, y, known=30, draws=2, seed=3)  # another setting's bottom
    assert len(calls) == 2 and all(b is fresh for b in calls)  # only the attack ran again
    assert other["from_scratch_leak_auc"] == first["from_scratch_leak_auc"]
    assert other["model_completion_leak_auc"] == pytest.approx(first["from_scratch_leak_auc"])  # fresh is the baseline
    monkeypatch.setattr(audit, "_FROM_SCRATCH", {})
    assert completion_leakage(trained, CONFIG, x, y, known=30, draws=2, seed=3) == first
    flipped = completion_leakage(trained, CONFIG, x, 1 - y, known=30, draws=2, seed=3)  # other labels: recomputed
    assert len(audit._FROM_SCRATCH) == 4 and flipped != first


def test_the_same_seed_gives_the_same_leak_and_another_seed_other_rows(
        synthetic: tuple[np.ndarray, np.ndarray], trained: nn.Module) -> None:
    x, y = synthetic
    first = completion_leakage(trained, CONFIG, x, y, known=50, draws=2, seed=0)
    assert completion_leakage(trained, CONFIG, x, y, known=50, draws=2, seed=0) == first
    assert completion_leakage(trained, CONFIG, x, y, known=50, draws=2, seed=5) != first


def test_known_rows_are_seeded_distinct_and_hold_both_classes() -> None:
    labels = np.zeros(1000)
    labels[:5] = 1  # 0.5% positive: most uniform draws of 20 hold none
    for seed in range(20):
        known = draw_known(labels, 20, seed)
        assert len(np.unique(known)) == 20 and 0 < labels[known].sum() < 20
        assert np.array_equal(known, draw_known(labels, 20, seed))
    assert not np.array_equal(draw_known(labels, 20, 0), draw_known(labels, 20, 1))
    with pytest.raises(ValueError, match="both classes"):
        draw_known(np.zeros(100), 10, 0)
    with pytest.raises(ValueError):
        draw_known(labels, 1, 0)


MEASURED = {
    "test_roc_auc", "norm_leak_auc", "direction_leak_auc", "cross_epoch_norm_leak_auc",
    "cross_epoch_direction_leak_auc", "model_completion_leak_auc", "model_completion_leak_auc_std",
    "from_scratch_leak_auc", "from_scratch_leak_auc_std", "model_completion_advantage",
    "model_completion_advantage_std", "known_labels", "completion_draws", "strongest_label_leak_auc",
    "strongest_gradient_leak_auc", "strongest_label_attack", "inversion_r2_advantage", "inversion_r2_max",
    "inversion_worst_feature", "label_dp_epsilon", "off_direction_leak_auc", "projection_leak_auc",
    "row_mean_pca_leak_auc",
    "mixture_leak_auc", "kmeans_leak_auc", "few_label_10_leak_auc", "few_label_50_leak_auc",
}


def test_measure_returns_every_column_for_a_partner_bottom_of_the_sweeps_choice(
        bank_full: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bank.lab.studies import privacy as privacy_study
    from bank.lab.studies.privacy import LABEL_ATTACKS, Federation, leak, measure
    from parties.learning.embedding_noise import PrivacyConfig

    attacked: list[tuple[nn.Module, BottomConfig, np.ndarray]] = []

    def recording(trained: nn.Module, config: BottomConfig, features: np.ndarray, labels: np.ndarray, **kw):
        attacked.append((trained, config, features))
        return completion_leakage(trained, config, features, labels, **kw)

    monkeypatch.setattr(privacy_study, "completion_leakage", recording)
    fed = Federation(prepare_bank_marketing(tmp_path / "data", rows=2500, cache=bank_full.parent, download=False))
    bottom = BottomConfig(hidden=(8,), cut_width=4, seed=2)
    # The label-DP flips and embedding noise are each party's secret, fresh per run, so the joint model
    # differs from run to run: batches of 64 give it enough steps to learn every time (25 runs: test ROC-AUC
    # 0.63-0.82; at 256 it ranged 0.49-0.63).
    row = measure(fed, TrainingConfig(epochs=3, batch_size=64, label_dp_epsilon=3.0),
                  PrivacyConfig(clip=1.0, noise=0.5), bottom, known_labels=30, draws=2)
    assert set(row) == MEASURED
    # The partner's trained bottom of the sweep's configuration, on its training rows (80% of the aligned).
    ((trained, config, features),) = attacked
    assert config == bottom and trained[-2].out_features == 4 and trained[0].out_features == 8
    assert len(features) == pytest.approx(0.8 * len(fed.targets), abs=2)
    assert not all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(),
                                                       build_bottom(features.shape[1], bottom).state_dict().values()))
    assert row["known_labels"] == 30 and row["completion_draws"] == 2
    assert row["strongest_label_leak_auc"] == max(max(row[c], 1 - row[c]) for c in LABEL_ATTACKS)
    assert leak(row[f"{row['strongest_label_attack']}_leak_auc"]) == row["strongest_label_leak_auc"]
    assert row["model_completion_advantage"] == pytest.approx(
        row["model_completion_leak_auc"] - row["from_scratch_leak_auc"])
    assert 0.5 < row["test_roc_auc"] <= 1 and 0.5 < row["from_scratch_leak_auc"] <= 1  # its columns predict
    assert row["label_dp_epsilon"] == 3.0 and row["inversion_r2_max"] >= row["inversion_r2_advantage"]


def test_the_privacy_study_command_takes_the_number_of_known_labels(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bank.lab.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["privacy-study", "--out", str(tmp_path)]).known_labels == 50
    assert parser.parse_args(["privacy-study", "--out", str(tmp_path), "--known-labels", "200"]).known_labels == 200
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["privacy-study", "--out", str(tmp_path), "--known-labels", "1"])
    assert exit_.value.code == 2 and "at least 2 known labels" in capsys.readouterr().err
