"""NoPeek: a partner's distance-correlation penalty on its own embedding.

The estimator against its definition and known values; the update it makes (the bank's gradient plus
α·∇dCor, exact and local steps, with and without embedding DP); α = 0 leaving training bit for bit as it
was; what it buys on bank-marketing (less dCor, less inversion); ``partner serve --nopeek`` end to end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from training_helpers import PartnerProcess, federation

import bank.__main__ as bank_cli
from bank.config import TrainingConfig
from bank.lab.report.audit import inversion_rows
from bank.lab.studies.privacy import Federation
from bank.vertical.coordinator import Coordinator
from data.prepare import prepare_bank_marketing
from parties.cli import run_cli
from parties.learning.bottom import BottomTrainer
from parties.learning.config import LocalSteps, PrivacyConfig
from parties.learning.embedding_noise import EmbeddingNoise
from parties.learning.model import BottomConfig, build_bottom
from parties.learning.nopeek import NoPeek, distance_correlation
from parties.storage.checkpoint import Checkpoint
from parties.tables.encoding import TabularEncoder

BOTTOMS = {"bank": BottomConfig(cut_width=8, seed=1), "partner": BottomConfig(hidden=(16,), cut_width=8, seed=2)}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the estimator ---------------------------------------------------------------------------------


def _reference_dcor(x: np.ndarray, z: np.ndarray) -> float:
    """dCor from its definition, one entry at a time (Székely, Rizzo, Bakirov 2007)."""
    n = len(x)
    a = np.array([[np.linalg.norm(x[i] - x[j]) for j in range(n)] for i in range(n)])
    b = np.array([[np.linalg.norm(z[i] - z[j]) for j in range(n)] for i in range(n)])
    big_a = np.array([[a[i, j] - a[i].mean() - a[:, j].mean() + a.mean() for j in range(n)] for i in range(n)])
    big_b = np.array([[b[i, j] - b[i].mean() - b[:, j].mean() + b.mean() for j in range(n)] for i in range(n)])
    dcov2, var_x, var_z = (big_a * big_b).mean(), (big_a**2).mean(), (big_b**2).mean()
    return float(np.sqrt(dcov2 / np.sqrt(var_x * var_z)))


def test_dcor_is_the_definitions() -> None:
    x = torch.randn(30, 4, generator=_gen(1))
    z = torch.tanh(x[:, :2] @ torch.randn(2, 3, generator=_gen(2))) + 0.3 * torch.randn(30, 3, generator=_gen(3))
    assert float(distance_correlation(x, z)) == pytest.approx(_reference_dcor(x.numpy(), z.numpy()), abs=1e-6)


def test_dcor_of_a_sample_with_itself_or_a_similar_copy_is_one() -> None:
    x = torch.randn(200, 5, generator=_gen(0))
    rotation, _ = torch.linalg.qr(torch.randn(5, 5, generator=_gen(1)))
    assert float(distance_correlation(x, x)) == pytest.approx(1.0, abs=1e-6)
    assert float(distance_correlation(x, 3 * x @ rotation + 7)) == pytest.approx(1.0, abs=1e-6)


def test_dcor_of_independent_samples_is_small_and_of_a_nonlinear_function_high() -> None:
    x = torch.randn(2000, 1, generator=_gen(0))
    independent = torch.randn(2000, 3, generator=_gen(1))
    squared = x**2  # uncorrelated with x: Pearson's r sees nothing
    assert abs(float(torch.corrcoef(torch.cat([x, squared], 1).T)[0, 1])) < 0.1
    assert float(distance_correlation(x, independent)) < 0.1
    assert float(distance_correlation(x, squared)) > 0.45
    assert float(distance_correlation(x, torch.exp(x))) > 0.9


def test_dcor_does_not_change_with_the_scale_of_either_sample() -> None:
    x, z = torch.randn(300, 6, generator=_gen(0)), torch.randn(300, 2, generator=_gen(1))
    z = z + x[:, :2] ** 2
    base = float(distance_correlation(x, z))
    assert 0.2 < base < 0.9
    for sx, sz in ((10.0, 1.0), (1.0, 1e-3), (0.01, 250.0)):
        assert float(distance_correlation(sx * x, sz * z)) == pytest.approx(base, rel=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 64], ids=["one row", "two equal rows", "constant batch"])
def test_a_batch_without_spread_has_dcor_zero_and_a_finite_gradient(rows: int) -> None:
    z = torch.full((rows, 4), 0.5, requires_grad=True)
    x = torch.randn(rows, 6, generator=_gen(0), requires_grad=True)
    d = distance_correlation(x, z)
    d.backward()
    assert float(d.detach()) == 0.0
    assert torch.isfinite(z.grad).all() and torch.isfinite(x.grad).all()
    # Features without spread, embeddings with it: the same.
    z2 = torch.randn(rows, 4, generator=_gen(1), requires_grad=True)
    d2 = distance_correlation(torch.ones(rows, 6), z2)
    d2.backward()
    assert float(d2.detach()) == 0.0 and torch.isfinite(z2.grad).all()


def test_the_gradient_is_the_estimators() -> None:
    x = torch.randn(12, 3, generator=_gen(0), dtype=torch.float64)
    z = (x[:, :2] ** 2 + 0.5 * torch.randn(12, 2, generator=_gen(1), dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: distance_correlation(x, z), (z,))


def test_a_batch_over_max_rows_is_the_mean_over_near_equal_chunks() -> None:
    x = torch.randn(10, 3, generator=_gen(0))
    z = x**2 + torch.randn(10, 3, generator=_gen(1))
    chunks = [float(distance_correlation(x[s], z[s])) for s in (slice(0, 4), slice(4, 7), slice(7, 10))]
    assert float(distance_correlation(x, z, max_rows=4)) == pytest.approx(np.mean(chunks), abs=1e-6)


def test_nopeek_records_each_epochs_mean_and_refuses_a_weight_of_zero() -> None:
    nopeek = NoPeek(0.5)
    x = torch.randn(50, 3, generator=_gen(0))
    values = [float(nopeek.penalty(x, x[:, :k] ** 2)) / 0.5 for k in (1, 2, 3)]
    assert nopeek.last == pytest.approx(values[-1])
    assert nopeek.end_epoch() == (pytest.approx(np.mean(values)), 3)
    assert nopeek.end_epoch() is None and nopeek.epochs == [pytest.approx(np.mean(values))]
    with pytest.raises(ValueError):
        NoPeek(0.0)


# --- the update: the bank's gradient through z, plus α·∇dCor ------------------------------------------


def _features(n: int = 40, width: int = 6) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(n, width)).astype(np.float32)


@pytest.mark.parametrize("dp", [False, True], ids=["nopeek alone", "with embedding DP"])
@pytest.mark.parametrize("local", [False, True], ids=["exact", "local steps"])
def test_an_update_descends_the_banks_loss_plus_alpha_dcor(dp: bool, local: bool) -> None:
    alpha, lr = 0.7, 0.05
    config = BottomConfig(hidden=(8,), cut_width=4, seed=3, optimizer="sgd", learning_rate=lr)
    privacy = PrivacyConfig(nopeek=alpha, clip=0.5 if dp else None, noise=0.3 if dp else 0.0)
    x = _features()
    rows = torch.tensor([3, 9, 1, 30, 22, 7, 15, 0])
    grad = torch.randn(8, 4, generator=_gen(5))
    trainer = BottomTrainer(x, config, privacy, local=LocalSteps(steps=2, batch=4) if local else None)
    trainer.step(0, None, rows)
    trainer.step(1, grad, None)

    reference = build_bottom(x.shape[1], config)
    clip = EmbeddingNoise(privacy, len(x)).clipped if dp else (lambda z: z)
    for part in ((slice(0, 4), slice(4, 8)) if local else (slice(0, 8),)):
        features = torch.from_numpy(x)[rows[part]]
        z = clip(reference(features))
        loss = (z * grad[part]).sum() + alpha * distance_correlation(features, z)
        reference.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad
    moved = False
    for (name, got), want, start in zip(trainer.model.state_dict().items(), reference.state_dict().values(),
                                        build_bottom(x.shape[1], config).state_dict().values()):
        assert torch.allclose(got, want, atol=1e-6), name
        moved |= not torch.allclose(got, start, atol=1e-4)
    assert moved
    assert trainer.nopeek is not None and len(trainer.nopeek.epochs) == 1  # the flush closed the epoch


def test_a_restored_trainer_with_nopeek_continues_exactly_like_the_original() -> None:
    config = BottomConfig(hidden=(8,), cut_width=4, seed=3)
    privacy = PrivacyConfig(nopeek=0.3, clip=1.0, noise=0.1)
    original = BottomTrainer(_features(), config, privacy)
    original.step(0, None, torch.arange(0, 8))
    original.step(1, torch.full((8, 4), 0.1), torch.arange(8, 16))  # mid-epoch: an embedding is pending
    tensors, meta = original.state()
    restored = BottomTrainer(_features(), config, privacy)
    restored.load_state(Checkpoint(meta["next_step"] - 1, tensors, meta), meta)
    for trainer in (original, restored):
        trainer.step(2, torch.full((8, 4), -0.2), None)
    assert all(torch.equal(a, b) for a, b in zip(original.model.parameters(), restored.model.parameters()))
    assert original.nopeek is not None and restored.nopeek is not None
    assert restored.nopeek.epochs == original.nopeek.epochs and len(original.nopeek.epochs) == 1
    assert restored.privacy_report("s") == original.privacy_report("s")


# --- α = 0 is today's training, bit for bit ------------------------------------------------------------


@pytest.fixture(scope="module")
def small_federation(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Federation:
    out = tmp_path_factory.mktemp("nopeek-data")
    return Federation(prepare_bank_marketing(out, rows=1500, cache=bank_full.parent, download=False))


def _trained(fed: Federation, training: TrainingConfig, privacy: PrivacyConfig | None, out: Path,
             ) -> dict[str, torch.Tensor]:
    """Every weight of the model trained: the top, and each party's bottom as it wrote it when training ended."""
    parties = [fed.party("bank", fed.bank, training.bank_bottom, model_dir=lambda s: out / "bank"),
               fed.party("partner", fed.partner, BottomConfig(seed=1), model_dir=lambda s: out / "partner",
                         privacy=privacy)]
    coordinator = Coordinator(training, fed.task, fed.targets, parties, alignment_id="sim")
    coordinator.run()
    assert coordinator.top is not None
    weights = {f"top.{k}": v for k, v in coordinator.top.state_dict().items()}
    for name in ("bank", "partner"):
        weights |= {f"{name}.{k}": v for k, v in load_file(out / name / "bottom.safetensors").items()}
    return weights


@pytest.mark.parametrize("mode", [{}, {"local_steps": 2, "reuse_steps": 1}], ids=["exact", "local steps"])
def test_alpha_zero_trains_bit_for_bit_as_without_nopeek(small_federation: Federation, mode: dict,
                                                        tmp_path: Path) -> None:
    training = TrainingConfig(epochs=2, batch_size=128, **mode)
    without = _trained(small_federation, training, None, tmp_path / "without")
    for k, privacy in enumerate((PrivacyConfig(), PrivacyConfig(nopeek=0.0))):
        same = _trained(small_federation, training, privacy, tmp_path / f"zero-{k}")
        assert same.keys() == without.keys() and len(without) > 6
        assert all(torch.equal(same[k], without[k]) for k in without), privacy
    # The comparison sees NoPeek when it is on: every party's weights move (the bank's follow the partner's).
    other = _trained(small_federation, training, PrivacyConfig(nopeek=0.05), tmp_path / "on")
    for prefix in ("partner.", "bank.", "top."):
        assert any(not torch.equal(other[k], without[k]) for k in without if k.startswith(prefix)), prefix


# --- what it buys ---------------------------------------------------------------------------------------


def _held_out_leakage(fed: Federation, alpha: float) -> tuple[float, float, float]:
    """(test ROC-AUC, dCor(features, embedding), mean inversion R² advantage) on the held-out rows."""
    coordinator = fed.coordinator(TrainingConfig(epochs=10, batch_size=256, audit=True), PrivacyConfig(nopeek=alpha))
    outcome = coordinator.run()
    assert outcome.audit is not None
    record = outcome.audit.tensors()["embeddings-partner"]  # the final model's validation and test rows
    positions, embedding = record["rows"].numpy(), record["embedding"]
    features, names = {}, []
    for name, table in (("bank", fed.bank), ("partner", fed.partner)):
        frame = table.features.iloc[fed.alignments[name].rows]
        encoder = TabularEncoder(table.schema).fit(frame.iloc[coordinator.split.train])
        features[name], names = encoder.transform(frame.iloc[positions]), encoder.feature_names()
    dcor = float(distance_correlation(torch.from_numpy(features["partner"]), embedding))
    rows = inversion_rows("partner", embedding.numpy(), features["partner"], features["bank"], names)
    return outcome.test_metrics["roc_auc"], dcor, float(np.mean([r["advantage"] for r in rows]))


def test_nopeek_lowers_held_out_dcor_and_inversion_at_little_cost(bank_full: Path, tmp_path: Path) -> None:
    fed = Federation(prepare_bank_marketing(tmp_path / "data", rows=3000, cache=bank_full.parent, download=False))
    auc_off, dcor_off, inversion_off = _held_out_leakage(fed, 0.0)
    auc_on, dcor_on, inversion_on = _held_out_leakage(fed, 0.1)
    assert dcor_on < dcor_off - 0.05
    assert inversion_on < inversion_off - 0.05
    assert auc_on > auc_off - 0.03


# --- partner serve --nopeek, end to end ------------------------------------------------------------------


def test_partner_serve_with_nopeek_alone_trains_and_reports_its_dcor(pki, bank_full: Path, tmp_path: Path) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1200, cache=bank_full.parent, download=False)
    started: list[PartnerProcess] = []

    def start(data: Path, name: str, bottom: BottomConfig) -> PartnerProcess:
        started.append(PartnerProcess(pki, data, tmp_path / name, bottom, "--nopeek", "0.2"))
        return started[-1]

    try:
        with federation(pki, paths, start, tmp_path, BOTTOMS) as fed:
            outcome = fed.coordinator(TrainingConfig(epochs=3, batch_size=128), BOTTOMS["bank"]).run()
    finally:
        for partner in started:
            partner.process.stop()
    dcor = [row["dcor_partner"] for row in outcome.history]  # each epoch's, from the partner's privacy report
    assert len(dcor) == 3 and all(0.0 < d <= 1.0 for d in dcor)
    logged = [line for line in started[0].log.read_text().splitlines() if "NoPeek (α=0.2) mean dCor" in line]
    assert len(logged) == 3 and all(f"{d:.4f} over" in line for d, line in zip(dcor, logged))


def test_a_bad_nopeek_weight_is_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["walkthrough", "--out", str(tmp_path / "run"), "--nopeek", "-0.5"],
         "error: --nopeek: Input should be greater than or equal to 0"),
        (["walkthrough", "--out", str(tmp_path / "run"), "--nopeek", "inf"],
         "python -m bank walkthrough: error: argument --nopeek: 'inf' is not a finite number"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run_cli(lambda: bank_cli.main(argv))
        assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == message
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_alpha_is_a_partner_setting_with_a_default_of_off() -> None:
    assert PrivacyConfig().nopeek == 0.0 and not PrivacyConfig().active
    assert PrivacyConfig(nopeek=0.1).active and not PrivacyConfig(nopeek=0.1).embedding_noise
    trainer = BottomTrainer(_features(), BottomConfig(cut_width=4), PrivacyConfig(nopeek=0.1))
    assert trainer.dp is None and trainer.nopeek is not None
    assert trainer.privacy_report("s").enabled is False and trainer.privacy_report("s").nopeek == 0.1
    assert BottomTrainer(_features(), BottomConfig(cut_width=4), PrivacyConfig()).nopeek is None
