"""Marvell (Li et al., ICLR 2022): the solver, the noise it draws, and what it buys against the label attacks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from sklearn.metrics import roc_auc_score

from bank.config import TrainingConfig
from bank.vertical.defenses import GradientDefense, marvell_perturb, marvell_solve, symmetric_kl
from bank.lab.attacks.labels import cosine_scores, norm_scores
from bank.lab.report.audit import leakage_rows
from data.prepare import prepare_bank_marketing
from parties.learning.secret import Secret

# (‖ḡ₁ − ḡ₀‖², d, positive fraction, (v₀, v₁)): imbalanced like bank-full, balanced, spread-free, one-dimensional.
CASES = {
    "imbalanced": (1.0, 8, 0.12, (0.02, 0.2)),
    "balanced": (3e-4, 16, 0.5, (1e-4, 5e-5)),
    "no-spread": (2.0, 8, 0.1, (0.0, 0.0)),
    "d=1": (1.0, 1, 0.3, (0.5, 0.1)),
}


def _independent_optimum(u2: float, d: int, p: float, power: float, v: tuple[float, float]) -> float:
    """The same problem over the paper's four numbers, by a general solver from several starts."""
    optimize = pytest.importorskip("scipy.optimize")
    weights = np.array([1 - p, p, 1 - p, p])  # (along₀, along₁, rest₀, rest₁) -> power
    within = {"type": "ineq", "fun": lambda x: power - weights @ x}
    best = np.inf
    for start in np.random.default_rng(0).dirichlet(np.ones(4), size=8):
        found = optimize.minimize(lambda x: float(symmetric_kl(u2, d, v, x[:2], x[2:])), start * power / weights,
                                  method="SLSQP", bounds=[(0, None)] * 4, constraints=[within],
                                  options={"ftol": 1e-14, "maxiter": 1000})
        if found.success and within["fun"](found.x) >= -1e-9 * power:
            best = min(best, found.fun)
    return best


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("s", [0.25, 4.0])
def test_the_solver_spends_the_budget_and_finds_the_optimum(case: tuple, s: float) -> None:
    u2, d, p, v = case
    noise = marvell_solve(u2, d, p, s * u2, v)
    assert noise.power(p) == pytest.approx(s * u2, rel=1e-9)  # the budget binds, and holds
    assert min(noise.along + noise.rest) >= 0
    assert noise.kl == pytest.approx(float(symmetric_kl(u2, d, v, noise.along, noise.rest)), rel=1e-9)
    assert noise.kl <= _independent_optimum(u2, d, p, s * u2, v) * (1 + 1e-7)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_bound_falls_as_the_power_grows_and_no_power_is_no_noise(case: tuple) -> None:
    u2, d, p, v = case
    bounds = [marvell_solve(u2, d, p, s * u2, v).kl for s in (0.0, 0.01, 0.25, 1.0, 4.0, 16.0, 64.0)]
    assert all(a > b for a, b in zip(bounds, bounds[1:])), bounds
    silent = marvell_solve(u2, d, p, 0.0, v)
    assert silent.along == (0.0, 0.0) and silent.rest == (0.0, 0.0)
    tiny = marvell_solve(u2, d, p, 1e-9 * u2, v)
    assert max(tiny.along + tiny.rest) <= 1e-9 * u2 / min(p, 1 - p)


def _batch(n: int = 4000, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients as a partner sees them with BCE: positives few, larger, pointing the other way."""
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=gen) < 0.12).float()
    direction = torch.randn(d, generator=gen)
    scale = torch.where(labels == 1, -0.8, 0.1)[:, None]
    grads = scale * direction * (1 + 0.3 * torch.rand(n, 1, generator=gen)) + 0.05 * torch.randn(n, d, generator=gen)
    return grads, labels


def test_the_noise_has_the_solved_covariance_per_class() -> None:
    grads, labels = _batch(n=60_000)
    perturbed, noise = marvell_perturb(grads, labels, 4.0, torch.Generator().manual_seed(1))
    assert noise is not None
    eta = (perturbed - grads).double()
    pos = labels == 1
    diff = grads[pos].double().mean(0) - grads[~pos].double().mean(0)
    unit = diff / diff.norm()
    for c, rows in ((0, ~pos), (1, pos)):
        along = eta[rows] @ unit
        rest = eta[rows] - along[:, None] * unit
        assert float(along.var()) == pytest.approx(noise.along[c], rel=0.05)
        assert float((rest**2).sum(1).mean()) == pytest.approx(noise.rest[c], rel=0.05, abs=1e-6 * float(diff @ diff))
    p = float(pos.double().mean())
    assert float((eta**2).sum(1).mean()) == pytest.approx(4.0 * float(diff @ diff), rel=0.05)  # the budget
    assert noise.power(p) == pytest.approx(4.0 * float(diff @ diff), rel=1e-6)


def test_a_batch_with_nothing_to_hide_comes_back_unchanged() -> None:
    grads, labels = _batch(n=200)
    for targets in (torch.zeros(200), torch.ones(200)):  # one class only
        out, noise = marvell_perturb(grads, targets, 4.0, torch.Generator().manual_seed(0))
        assert out is grads and noise is None
    same = grads[:1].repeat(200, 1)  # both classes' mean gradients equal
    out, noise = marvell_perturb(same, labels, 4.0, torch.Generator().manual_seed(0))
    assert out is same and noise is None


def test_marvell_defeats_the_norm_and_direction_attacks_as_the_power_grows() -> None:
    grads, labels = _batch()
    reference = grads[labels == 1][0]
    leaks = {}
    for s in (None, 1.0, 16.0):
        g = grads if s is None else marvell_perturb(grads, labels, s, torch.Generator().manual_seed(0))[0]
        leaks[s] = (roc_auc_score(labels, norm_scores(g.numpy())),
                    roc_auc_score(labels, cosine_scores(g.numpy(), reference.numpy())))
    assert min(leaks[None]) > 0.95
    for attack in (0, 1):
        assert abs(leaks[16.0][attack] - 0.5) < abs(leaks[1.0][attack] - 0.5) < abs(leaks[None][attack] - 0.5)
    assert max(abs(a - 0.5) for a in leaks[16.0]) < 0.1


def test_the_defense_is_reproducible_and_solves_per_batch() -> None:
    grads, labels = _batch(n=512)
    grads[256:] *= 5  # the second batch's gradients (a later top-model update) are larger
    defense = GradientDefense("marvell", power=4.0, batch=256, secret=Secret.pinned_to(3))
    once = defense(grads, labels, step=7, party=1)
    assert torch.equal(once, GradientDefense("marvell", power=4.0, batch=256, secret=Secret.pinned_to(3))(grads, labels, 7, 1))
    assert not torch.equal(once, defense(grads, labels, 8, 1)) and not torch.equal(once, defense(grads, labels, 7, 2))
    # A round trip of two batches (local steps) is two solves, the first as if it travelled alone.
    alone = GradientDefense("marvell", power=4.0, batch=256, secret=Secret.pinned_to(3))(grads[:256], labels[:256], 7, 1)
    assert torch.equal(once[:256], alone)
    whole = GradientDefense("marvell", power=4.0, batch=512, secret=Secret.pinned_to(3))(grads, labels, 7, 1)
    assert not torch.equal(whole[:256], alone)
    # It reports the larger of the two batches' bounds, once.
    fresh = GradientDefense("marvell", power=4.0, batch=256, secret=Secret.pinned_to(3))
    fresh(grads, labels, 7, 1)
    bounds = [marvell_solve(u2, d, p, 4.0 * u2, v).kl for u2, d, p, v in (_stats(grads[:256], labels[:256]),
                                                                         _stats(grads[256:], labels[256:]))]
    assert fresh.pop_worst_kl(1) == pytest.approx(max(bounds), rel=1e-6) and fresh.pop_worst_kl(1) is None


def _stats(grads: torch.Tensor, labels: torch.Tensor) -> tuple:
    g, pos = grads.double(), labels == 1
    m0, m1 = g[~pos].mean(0), g[pos].mean(0)
    v = tuple(float(((g[r] - m) ** 2).sum(1).mean()) / g.shape[1] for r, m in ((~pos, m0), (pos, m1)))
    return float((m1 - m0) @ (m1 - m0)), g.shape[1], float(pos.double().mean()), v


def test_no_defense_sends_the_gradient_itself() -> None:
    grads, labels = _batch(n=64)
    assert GradientDefense("none", secret=Secret.pinned_to(1))(grads, None, 0, 1) is grads


@pytest.mark.parametrize("settings, message", [
    ({"gradient_defense": "marvell", "marvell_power": 0.0}, "marvell_power"),
    ({"gradient_defense": "marvell", "marvell_power": float("nan")}, "marvell_power"),
    ({"gradient_defense": "marvell", "task": "regression"}, "binary"),
], ids=["zero-power", "nan-power", "regression"])
def test_impossible_marvell_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainingConfig(**settings)


def _leaks(fed, training: TrainingConfig) -> tuple[dict[str, float], float, list[dict]]:
    outcome = fed.coordinator(training).run()
    assert outcome.audit is not None
    grads = {k: v.numpy() for k, v in outcome.audit.tensors()["gradients-partner"].items()}
    per_epoch = [r for r in leakage_rows("partner", grads, fed.targets.numpy()) if isinstance(r["epoch"], int)]
    leak = {a: float(np.mean([r[f"{a}_leak_auc"] for r in per_epoch])) for a in ("norm", "direction")}
    return leak, outcome.test_metrics["roc_auc"], outcome.history


def test_marvell_in_training_trades_leakage_for_accuracy_as_the_power_grows(bank_full: Path, tmp_path: Path) -> None:
    from bank.lab.studies.privacy import Federation

    fed = Federation(prepare_bank_marketing(tmp_path / "data", rows=3000, cache=bank_full.parent, download=False))
    # Pinned noise, as the privacy study pins it: the claim is about the defense's power, and the bank's own
    # secret noise (fresh per run) put the s=16 run's test ROC-AUC on either side of 0.7 (0.69 seen in CI).
    runs = {s: _leaks(fed, TrainingConfig(epochs=3, batch_size=128, audit=True, **(
        {} if s is None else {"gradient_defense": "marvell", "marvell_power": s, "defense_seed": 7})))
            for s in (None, 1.0, 16.0)}
    (none, none_auc, plain), (one, one_auc, h1), (sixteen, sixteen_auc, h16) = runs.values()
    assert min(none.values()) > 0.9
    for attack in ("norm", "direction"):
        assert abs(sixteen[attack] - 0.5) < abs(one[attack] - 0.5) < abs(none[attack] - 0.5) - 0.2
        assert abs(sixteen[attack] - 0.5) < 0.1
    assert none_auc > 0.85 and one_auc > none_auc - 0.05 and sixteen_auc > 0.7  # still a model
    # Each epoch records its worst batch's bound; more power, a smaller bound.
    assert "marvell_kl_partner" not in plain[0]
    assert all(a["marvell_kl_partner"] > b["marvell_kl_partner"] for a, b in zip(h1, h16))


def test_marvell_training_is_reproducible_with_local_steps(bank_full: Path, tmp_path: Path) -> None:
    from bank.lab.studies.privacy import Federation

    fed = Federation(prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False))
    config = TrainingConfig(epochs=1, batch_size=64, local_steps=2, max_steps=6, audit=True,
                            gradient_defense="marvell", marvell_power=2.0, defense_seed=11)  # pinned, for the study
    runs = [fed.coordinator(config).run().audit.tensors()["gradients-partner"]["grads"] for _ in range(2)]
    assert torch.equal(*runs)
    unpinned = fed.coordinator(config.model_copy(update={"defense_seed": None})).run()
    assert not torch.equal(runs[0], unpinned.audit.tensors()["gradients-partner"]["grads"])  # the bank's secret
    plain = fed.coordinator(config.model_copy(update={"gradient_defense": "none"})).run()
    assert not torch.equal(runs[0], plain.audit.tensors()["gradients-partner"]["grads"])


def _noise_over_epochs(persistence: float, epochs: int = 16) -> torch.Tensor:
    """The noise each of 512 rows gets at each of ``epochs`` steps, same gradients and labels every time."""
    generator = torch.Generator().manual_seed(5)
    grad = torch.randn(512, 8, generator=generator)
    targets = (torch.rand(512, generator=generator) < 0.2).float()
    grad[targets == 1] += 1.0
    rows = torch.randperm(2000, generator=generator)[:512]
    defense = GradientDefense("marvell", power=4.0, secret=Secret.pinned_to(3), persistence=persistence, rows=2000)
    return torch.stack([defense(grad, targets, step, 1, rows) - grad for step in range(epochs)])


def test_persistent_noise_keeps_each_steps_noise_but_does_not_average_away_across_epochs() -> None:
    fresh, persistent, half = (_noise_over_epochs(rho) for rho in (0.0, 1.0, 0.5))
    # Each step's noise has the same spread whatever the persistence: the per-batch bound is unchanged.
    for noise in (persistent, half):
        assert noise[0].pow(2).mean().item() == pytest.approx(fresh[0].pow(2).mean().item(), rel=0.15)
    # Averaged over 16 epochs, fresh noise shrinks about 16-fold in power; persistent noise does not shrink.
    power = {name: n.mean(dim=0).pow(2).mean().item() / n[0].pow(2).mean().item()
             for name, n in (("fresh", fresh), ("persistent", persistent), ("half", half))}
    assert power["fresh"] < 0.12
    assert power["persistent"] > 0.9
    assert 0.4 < power["half"] < 0.65  # ρ + (1 − ρ)/16


def test_no_persistence_is_the_defense_as_it_was() -> None:
    generator = torch.Generator().manual_seed(1)
    grad, targets = torch.randn(300, 4, generator=generator), (torch.rand(300, generator=generator) < 0.3).float()
    rows = torch.arange(300)
    plain = GradientDefense("marvell", power=2.0, secret=Secret.pinned_to(9))(grad, targets, 7, 1)
    zero = GradientDefense("marvell", power=2.0, secret=Secret.pinned_to(9), persistence=0.0, rows=300)(grad, targets, 7, 1, rows)
    assert torch.equal(plain, zero)


def test_persistent_noise_is_the_same_in_every_process(tmp_path: Path) -> None:
    """The run's persistent draws come from the seed alone: a restarted bank (another process, another hash seed)
    draws the same, so a resumed run and a rerun give the same model."""
    import os
    import subprocess
    import sys

    script = (
        "import torch; from bank.vertical.defenses import GradientDefense; from parties.learning.secret import Secret\n"
        "g = torch.Generator().manual_seed(0); grad = torch.randn(64, 4, generator=g)\n"
        "t = (torch.arange(64) % 3 == 0).float()\n"
        "d = GradientDefense('marvell', power=2.0, secret=Secret.pinned_to(5), persistence=1.0, rows=100)\n"
        "print(d(grad, t, 3, 1, torch.arange(64) + 10).sum().item().hex())\n"
    )
    outputs = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120,
                       env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout
        for h in (1, 2, 3)
    }
    assert len(outputs) == 1, outputs


def _one_dimensional_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A binary task's batch as it reaches a partner: each row's gradient (p - y) times one direction, plus a
    little spread: nearly one-dimensional, the positives the minority with the larger factor."""
    generator = torch.Generator().manual_seed(seed)
    targets = (torch.rand(1024, generator=generator) < 0.12).float()
    p = torch.rand(1024, generator=generator) * 0.3
    direction = torch.randn(16, generator=generator)
    grad = (p - targets)[:, None] * direction + 0.02 * torch.randn(1024, 16, generator=generator)
    return grad, targets


@pytest.mark.parametrize(("defense", "leaks"), [("marvell", True), ("matched", False)])
def test_the_off_direction_energy_reads_marvell_but_not_matched_noise(defense: str, leaks: bool) -> None:
    """Marvell's model spreads each class alike in every direction; task gradients are not, so it gives one
    class off-direction noise the other lacks, and a partner with no label reads it. Matched noise gives each
    class the other's covariance."""
    from bank.lab.attacks.labels import gradient_features, label_free_scores

    grad, targets = _one_dimensional_batch(0)
    rows = torch.arange(1024)
    protect = GradientDefense(defense, power=1.0, batch=1024, secret=Secret.pinned_to(3), persistence=1.0, rows=1024)
    noisy = [protect(grad, targets, step, 1, rows) for step in range(6)]  # six epochs of the same rows
    unique, features = gradient_features(rows.repeat(6).numpy(), torch.arange(6).repeat_interleave(1024).numpy(),
                                         torch.cat(noisy).numpy())
    auc = roc_auc_score(targets.numpy()[unique], label_free_scores(features)["off_direction"])
    leak = max(auc, 1 - auc)
    assert (leak > 0.9) if leaks else (leak < 0.65), leak
