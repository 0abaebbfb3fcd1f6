"""Label protection at the bank, against a partner that reads labels from its gradients.

* Randomized-response label DP (Ghazi et al., NeurIPS 2021): each training
  label is flipped once, before training, with probability 1/(1+e^ε). Never
  re-drawn per batch: that would break the guarantee.
* Gradient perturbation on what each partner receives: ``max_norm`` (Li et
  al., ICLR 2022) pads every row's gradient with noise up to the batch's
  largest norm, which defeats the norm attack; ``isotropic`` adds Gaussian
  noise scaled by the batch's mean gradient norm (the knob: ``gradient_noise``);
  ``marvell`` (Li et al., ICLR 2022) adds class-dependent Gaussian noise that
  minimises a bound on what any attack learns, under a power budget (the knob:
  ``marvell_power``).

Every draw comes from the bank's own ``Secret`` (``parties.learning.secret``), under a label naming
it (the flips; the step and the partner of a gradient's noise; a row's persistent Marvell draw): a
partner that knows the code, the public seed and the batch order still cannot draw the noise again.
The bank keeps the secret with its run, so its own resume draws the same noise.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bank.config import TrainingConfig
from parties.learning.secret import Secret

logger = logging.getLogger(__name__)

__all__ = [
    "SECRET_FILE", "bank_secret", "matched_perturb",
    "GradientDefense", "MarvellNoise", "flip_probability", "marvell_perturb", "marvell_solve", "perturb_gradient",
    "randomized_response", "symmetric_kl",
]


#: Beside the coordinator's checkpoints: the bank's secret for a session's protective noise.
SECRET_FILE = "secret.json"


def bank_secret(config: TrainingConfig, checkpoint_dir: Path | None, session: str) -> Secret:
    """The bank's secret for a session: kept beside its checkpoints (a resume draws the same), else drawn from
    the OS, or pinned by ``defense_seed`` (said in the log, when a defense uses it)."""
    secret = Secret.kept_in(None if checkpoint_dir is None else checkpoint_dir / SECRET_FILE, config.defense_seed)
    if secret.pinned is not None and config.protects:
        logger.warning("session %s: the bank's protective noise is %s", session, secret.describe())
    return secret


def flip_probability(epsilon: float) -> float:
    return 1.0 / (1.0 + math.exp(epsilon))


def randomized_response(targets: torch.Tensor, rows: np.ndarray, epsilon: float, secret: Secret) -> torch.Tensor:
    """Binary targets with the labels of ``rows`` flipped once, each with probability 1/(1+e^ε)."""
    out = targets.clone()
    rng = secret.numpy("label-dp")
    flip = rows[rng.random(len(rows)) < flip_probability(epsilon)]
    out[torch.from_numpy(flip)] = 1 - out[torch.from_numpy(flip)]
    return out


def perturb_gradient(grad: torch.Tensor, kind: str, scale: float, generator: torch.Generator) -> torch.Tensor:
    """The gradient a partner receives, after a perturbation that needs no labels (``marvell``: ``GradientDefense``)."""
    if kind == "none":
        return grad
    noise = torch.randn(grad.shape, generator=generator)
    norms = grad.norm(dim=1, keepdim=True)
    d = grad.shape[1]
    if kind == "max_norm":
        sigma = ((norms.max() ** 2 - norms**2).clamp(min=0) / d).sqrt()
        return grad + sigma * noise
    if kind == "isotropic":
        return grad + scale * norms.mean() / math.sqrt(d) * noise
    raise ValueError(f"unknown gradient defense {kind!r}")


# --- Marvell -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarvellNoise:
    """One batch's optimal noise, per class c (0: negatives, 1: positives), in the paper's form.

    Σ_c = (rest[c] / (d−1))·(I − ĝĝᵀ) + along[c]·ĝĝᵀ, ĝ the unit vector from the negatives'
    mean gradient to the positives': ``along[c]`` is the variance along ĝ, ``rest[c]`` the trace
    spent on the d−1 directions orthogonal to it. ``kl`` is the bound it achieves: the symmetric
    KL divergence between the two classes' perturbed gradient distributions.
    """

    along: tuple[float, float]
    rest: tuple[float, float]
    kl: float

    def power(self, p: float) -> float:
        """The expected squared norm of the noise on a row, p the positive fraction: what the budget bounds."""
        return p * (self.along[1] + self.rest[1]) + (1 - p) * (self.along[0] + self.rest[0])


def symmetric_kl(u2: float, d: int, v: tuple[float, float], along: tuple, rest: tuple) -> np.ndarray:
    """KL(P₁‖P₀) + KL(P₀‖P₁), P_c = N(ḡ_c, v_c·I + Σ_c), ‖ḡ₁ − ḡ₀‖² = ``u2``, Σ_c as in ``MarvellNoise``.

    ``along`` and ``rest`` hold (class 0, class 1) values or arrays of them (evaluated elementwise).
    Along ĝ the means differ by ‖ḡ₁ − ḡ₀‖; on each orthogonal direction only the variances do. A
    variance of 0 counts as 1e-12·u2: two classes without spread on a direction are alike there.
    """
    floor = 1e-12 * u2
    x0 = np.maximum(v[0] + np.asarray(along[0], float), floor)
    x1 = np.maximum(v[1] + np.asarray(along[1], float), floor)
    kl = 0.5 * ((x0 + u2) / x1 + (x1 + u2) / x0 - 2)
    if d > 1:
        y0 = np.maximum(v[0] + np.asarray(rest[0], float) / (d - 1), floor)
        y1 = np.maximum(v[1] + np.asarray(rest[1], float) / (d - 1), floor)
        kl = kl + 0.5 * (d - 1) * (y0 / y1 + y1 / y0 - 2)
    return kl


def marvell_solve(u2: float, d: int, p: float, power: float, v: tuple[float, float] = (0.0, 0.0)) -> MarvellNoise:
    """The noise of Marvell (Li et al., "Label Leakage and Protection in Two-party Split Learning", ICLR 2022).

    Minimises the symmetric KL between the classes' perturbed gradient distributions, modelled as
    N(ḡ_c, v_c·I + Σ_c), over Σ₀, Σ₁ ⪰ 0 with p·tr(Σ₁) + (1−p)·tr(Σ₀) ≤ ``power``; ``u2`` = ‖ḡ₁ − ḡ₀‖²,
    ``d`` the gradient's width, ``p`` the positive fraction, ``v`` = (v₀, v₁) the classes' own variance
    per coordinate. The paper's Theorem 2 gives the optimum the form of ``MarvellNoise`` (four numbers).

    From there, by hand: on the orthogonal directions only the variance ratio y_lo/y_hi matters, so
    that power goes to the class of lower variance, and only up to equal variances (c_eq). Along ĝ
    more power always helps (scale both variances up: the ratio terms stay, u2's terms shrink), so
    the budget binds. What is left is two numbers: the share β of c_eq the orthogonal directions get,
    and the share φ of the rest the positives get along ĝ. The objective is smooth but not jointly
    convex in the variances (x/y + y/x is not), so a grid over [0, 1]² finds the basin and repeated
    4× zooms around the best point refine it (to ~1e-9 of each share).
    """
    if not (u2 > 0 and 0 < p < 1 and d >= 1 and power >= 0):
        raise ValueError(f"Marvell needs ‖ḡ₁ − ḡ₀‖² > 0, 0 < p < 1 and power ≥ 0 (got {u2}, {p}, {power})")
    # In units of u2: the KL is invariant to scaling every variance and u2 together.
    budget, vv = power / u2, (v[0] / u2, v[1] / u2)
    w = (1 - p, p)
    lo = 0 if vv[0] <= vv[1] else 1
    c_eq = (d - 1) * w[lo] * (vv[1 - lo] - vv[lo])
    cap = min(budget, c_eq)

    def shares(beta: np.ndarray, phi: np.ndarray) -> tuple[tuple, tuple]:
        orth = beta * cap
        rest = [np.zeros_like(orth), np.zeros_like(orth)]
        rest[lo] = orth / w[lo]
        left = budget - orth
        return (((1 - phi) * left / w[0], phi * left / w[1]), (rest[0], rest[1]))

    n, centre, half = 41, np.array([0.5, 0.5]), 0.5
    for _ in range(16):
        grid = [np.clip(np.linspace(c - half, c + half, n), 0, 1) for c in centre]
        beta, phi = np.meshgrid(*grid, indexing="ij")
        kl = symmetric_kl(1.0, d, vv, *shares(beta, phi))
        at = np.unravel_index(np.argmin(kl), kl.shape)
        centre, half = np.array([beta[at], phi[at]]), half / 4
    along, rest = shares(np.array(centre[0]), np.array(centre[1]))
    kl = float(symmetric_kl(1.0, d, vv, along, rest))
    return MarvellNoise((float(along[0]) * u2, float(along[1]) * u2), (float(rest[0]) * u2, float(rest[1]) * u2), kl)


def _class_means(grad: torch.Tensor, targets: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, float] | None:
    """(the gradient in float64, the positive rows, each class's mean, their difference, its squared norm), or
    ``None`` for a batch with nothing to hide: one class only, or equal class means."""
    positive = targets.reshape(-1) > 0.5
    n1 = int(positive.sum())
    if n1 in (0, len(grad)):
        return None
    g = grad.double()
    means = [g[~positive].mean(dim=0), g[positive].mean(dim=0)]
    diff = means[1] - means[0]
    u2 = float(diff @ diff)
    if not u2 > 0 or not math.isfinite(u2):
        return None
    return g, positive, means, diff, u2


def marvell_perturb(
    grad: torch.Tensor, targets: torch.Tensor, power: float, generator: torch.Generator,
    persistent: torch.Tensor | None = None, persistence: float = 0.0,
) -> tuple[torch.Tensor, MarvellNoise | None]:
    """One batch's gradients with Marvell's noise at power s = ``power``: P = s·‖ḡ₁ − ḡ₀‖².

    ``targets`` are the batch's binary targets as the loss saw them (after label DP, if on). The
    class means and each class's variance per coordinate come from the batch. A batch of one class,
    or with equal class means, has no direction to hide and comes back unchanged (``None``): within
    the batch nothing tells the classes apart by their mean, and the paper's bound is per batch —
    it says nothing about comparing rows across batches (nor across epochs).

    ``persistent``: each row's own standard-normal draw, the same at every step, and ``persistence`` ρ
    its share: the noise is drawn from √ρ·persistent + √(1−ρ)·fresh, still N(0, I) per row, so each
    batch's noise has exactly the solved covariance and bound. What changes is across epochs: fresh
    noise averages away over a row's E gradients (its variance falls as 1/E, which the cross-epoch
    attacks exploit), the persistent share does not.
    """
    split = _class_means(grad, targets)
    if split is None:
        return grad, None
    g, positive, means, diff, u2 = split
    n, d = grad.shape
    n1 = int(positive.sum())
    v = tuple(float(((g[m] - means[c]) ** 2).sum(dim=1).mean()) / d for c, m in enumerate((~positive, positive)))
    noise = marvell_solve(u2, d, n1 / n, power * u2, v)  # type: ignore[arg-type]
    unit = diff / math.sqrt(u2)
    z = torch.randn(grad.shape, generator=generator, dtype=torch.float64)
    if persistence > 0:  # still N(0, I) for every row at every step: the per-batch bound is unchanged
        assert persistent is not None and persistent.shape == z.shape
        z = math.sqrt(persistence) * persistent + math.sqrt(1.0 - persistence) * z
    on_axis = z @ unit
    rows = positive.long()
    sd_along = torch.tensor(noise.along, dtype=torch.float64).sqrt()[rows]
    sd_rest = (torch.tensor(noise.rest, dtype=torch.float64) / max(d - 1, 1)).sqrt()[rows]
    eta = sd_along[:, None] * on_axis[:, None] * unit + sd_rest[:, None] * (z - on_axis[:, None] * unit)
    return (g + eta).to(grad.dtype), noise


def _psd_sqrt(matrix: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(matrix)
    return vectors * values.clamp(min=0).sqrt()


def matched_perturb(
    grad: torch.Tensor, targets: torch.Tensor, power: float, generator: torch.Generator,
    persistent: torch.Tensor | None = None, persistence: float = 0.0,
) -> tuple[torch.Tensor, float | None]:
    """One batch's gradients with noise that leaves the two classes the same covariance in every direction.

    Each class gets Gaussian noise with the other class's covariance (Σ₁ for the negatives, Σ₀ for the
    positives), so both end with Σ₀ + Σ₁ however their own spread is shaped; and both get the same noise of
    variance s·‖ḡ₁ − ḡ₀‖² along the difference of their means. What is left to tell them apart is that
    difference alone, against the common covariance C: the symmetric KL between the two (Gaussian) classes,
    returned as the bound, is (ḡ₁ − ḡ₀)ᵀ C⁻¹ (ḡ₁ − ḡ₀). ``persistent``/``persistence`` as in ``marvell_perturb``.
    """
    split = _class_means(grad, targets)
    if split is None:
        return grad, None
    g, positive, means, diff, u2 = split
    classes = (~positive, positive)
    covs = [((g[m] - means[c]).T @ (g[m] - means[c])) / max(int(m.sum()), 1) for c, m in enumerate(classes)]
    unit = diff / math.sqrt(u2)
    along = power * u2 * torch.outer(unit, unit)
    roots = [_psd_sqrt(covs[1 - c] + along) for c in range(2)]  # class c gets the other class's covariance
    z = torch.randn(grad.shape, generator=generator, dtype=torch.float64)
    if persistence > 0:
        assert persistent is not None and persistent.shape == z.shape
        z = math.sqrt(persistence) * persistent + math.sqrt(1.0 - persistence) * z
    eta = torch.where(positive[:, None], z @ roots[1].T, z @ roots[0].T)
    common = covs[0] + covs[1] + along
    kl = float(diff @ torch.linalg.lstsq(common, diff[:, None]).solution[:, 0])
    return (g + eta).to(grad.dtype), kl


@dataclass
class GradientDefense:
    """What each partner's gradient goes through before it is sent (``TrainingConfig.gradient_defense``).

    ``batch``: Marvell solves per training batch of this many rows, also when a round trip carries
    several (local steps): each batch's gradients come from a different top-model update, so each
    has its own class means, and the paper's bound is per batch. ``worst_kl_`` holds, per partner,
    the largest bound a batch achieved since ``pop_worst_kl`` last read it.
    """

    kind: str = "none"
    noise: float = 1.0
    power: float = 4.0
    batch: int = 1 << 16
    secret: Secret = field(default_factory=Secret.fresh, repr=False)
    persistence: float = 0.0
    rows: int = 0  # how many rows there are (positions run below it): for each row's persistent draw
    worst_kl_: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    persistent_: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def _persistent(self, party: int, width: int) -> torch.Tensor:
        """Every row's own standard-normal draw for ``party``, from the secret and the party only, so a resumed
        run draws the same."""
        if party not in self.persistent_:
            generator = self.secret.torch("marvell-persistent", party)
            self.persistent_[party] = torch.randn(self.rows, width, generator=generator, dtype=torch.float64)
        return self.persistent_[party]

    @property
    def needs_labels(self) -> bool:
        return self.kind in ("marvell", "matched")

    def __call__(self, grad: torch.Tensor, targets: torch.Tensor | None, step: int, party: int,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind not in ("marvell", "matched"):
            return perturb_gradient(grad, self.kind, self.noise, self.secret.torch("gradient", step, party))
        assert targets is not None and len(targets) == len(grad)
        generator = self.secret.torch("marvell", step, party)
        if self.persistence > 0:
            assert rows is not None and len(rows) == len(grad)
            draws = self._persistent(party, grad.shape[1]).index_select(0, rows).split(self.batch)
        else:
            draws = (None,) * -(-len(grad) // self.batch)
        out = []
        for g, t, own in zip(grad.split(self.batch), targets.split(self.batch), draws):
            if self.kind == "matched":
                perturbed, kl = matched_perturb(g, t, self.power, generator, own, self.persistence)
            else:
                perturbed, noise = marvell_perturb(g, t, self.power, generator, own, self.persistence)
                kl = None if noise is None else noise.kl
            out.append(perturbed)
            if kl is not None:
                self.worst_kl_[party] = max(self.worst_kl_.get(party, 0.0), kl)
        return torch.cat(out)

    def pop_worst_kl(self, party: int) -> float | None:
        """The worst batch's bound since the last call; ``None`` if no batch was solved (not Marvell, or every
        batch had one class only)."""
        return self.worst_kl_.pop(party, None)
