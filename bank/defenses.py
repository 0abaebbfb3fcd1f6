"""Label protection at the bank, against a partner that reads labels from its gradients.

* Randomized-response label DP (Ghazi et al., NeurIPS 2021): each training
  label is flipped once, before training, with probability 1/(1+e^ε). Never
  re-drawn per batch: that would break the guarantee.
* Gradient perturbation on what each partner receives: ``max_norm`` (Li et
  al., ICLR 2022) pads every row's gradient with noise up to the batch's
  largest norm, which defeats the norm attack; ``isotropic`` adds Gaussian
  noise scaled by the batch's mean gradient norm (the knob: ``gradient_noise``).

Noise is drawn from generators seeded by the run's seed and the step, so a run
with a defense is as reproducible as one without.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["flip_probability", "perturb_gradient", "randomized_response"]


def flip_probability(epsilon: float) -> float:
    return 1.0 / (1.0 + math.exp(epsilon))


def randomized_response(targets: torch.Tensor, rows: np.ndarray, epsilon: float, seed: int) -> torch.Tensor:
    """Binary targets with the labels of ``rows`` flipped once, each with probability 1/(1+e^ε)."""
    out = targets.clone()
    rng = np.random.default_rng([seed, 7331])
    flip = rows[rng.random(len(rows)) < flip_probability(epsilon)]
    out[torch.from_numpy(flip)] = 1 - out[torch.from_numpy(flip)]
    return out


def perturb_gradient(grad: torch.Tensor, kind: str, scale: float, seed: int, step: int, party: int) -> torch.Tensor:
    """The gradient a partner receives, after the configured perturbation."""
    if kind == "none":
        return grad
    generator = torch.Generator().manual_seed(hash((seed, step, party)) & 0x7FFF_FFFF_FFFF_FFFF)
    noise = torch.randn(grad.shape, generator=generator)
    norms = grad.norm(dim=1, keepdim=True)
    d = grad.shape[1]
    if kind == "max_norm":
        sigma = ((norms.max() ** 2 - norms**2).clamp(min=0) / d).sqrt()
        return grad + sigma * noise
    if kind == "isotropic":
        return grad + scale * norms.mean() / math.sqrt(d) * noise
    raise ValueError(f"unknown gradient defense {kind!r}")
