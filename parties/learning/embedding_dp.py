"""Embedding differential privacy at a partner: clip each row, add Gaussian noise, account honestly.

Each released embedding row is clipped to L2 norm ``clip`` and gets
N(0, noise²·I). Replacing one row's features moves its clipped embedding by at
most 2·clip, so one release is a Gaussian mechanism with noise multiplier
noise / (2·clip). The bank chooses the batches, so there is no subsampling
amplification: the sampling rate is 1, and every release of a row counts:
one per epoch in training, plus every evaluation and scoring release. The
spent ε is that of the most-released row, from Opacus's RDP accountant used
on its own. A release that would exceed the budget is refused.

ε comes from Opacus's public RDP analysis (``compute_rdp``, ``get_privacy_spent``)
at the orders its ``RDPAccountant`` uses by default, not from the accountant's
state: an Opacus that moved that analysis fails loudly, never reports ε = 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from parties.errors import BudgetExhausted, ConfigError
from parties.learning.config import PrivacyConfig
from parties.learning.secret import Secret
from parties.protocol.training import PrivacyReport

__all__ = ["RDP_ORDERS", "EmbeddingDP", "PrivacyConfig", "epsilon_after"]

#: The RDP orders ε is optimised over: those of Opacus's ``RDPAccountant.DEFAULT_ALPHAS`` (1.6).
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def _rdp_analysis() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Opacus's ``compute_rdp`` and ``get_privacy_spent``; imported late: opacus configures logging at import."""
    try:
        from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
    except ImportError as exc:
        raise ConfigError(
            "embedding DP accounts ε with opacus.accountants.analysis.rdp (compute_rdp, get_privacy_spent), which "
            f"this Opacus does not have ({exc}); install a version pyproject.toml allows") from exc
    return compute_rdp, get_privacy_spent


@functools.lru_cache(maxsize=4096)
def epsilon_after(releases: int, noise_multiplier: float, delta: float) -> float:
    """ε after ``releases`` full-batch (sampling rate 1) Gaussian releases.

    Cached: the budget check asks for the same few values at every step.
    """
    if releases == 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    compute_rdp, get_privacy_spent = _rdp_analysis()
    rdp = compute_rdp(q=1.0, noise_multiplier=noise_multiplier, steps=releases, orders=list(RDP_ORDERS))
    epsilon, _order = get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return float(epsilon)


class EmbeddingDP:
    """Clips and noises a party's released embeddings and counts each row's releases."""

    def __init__(self, config: PrivacyConfig, n_rows: int, secret: Secret | None = None) -> None:
        """``secret``: where the noise comes from (default: the config's pin, else a fresh secret)."""
        if config.clip is None:
            raise ValueError("embedding DP needs a clip norm")
        self.config, self.clip = config, config.clip
        self.secret = secret or Secret.of(config.seed)
        self.releases = np.zeros(n_rows, dtype=np.int64)
        self._draws = 0

    @property
    def noise_multiplier(self) -> float:
        return self.config.noise / (2 * self.clip)

    def epsilon(self, releases: int | None = None) -> float:
        k = int(self.releases.max()) if releases is None else releases
        return epsilon_after(k, self.noise_multiplier, self.config.delta)

    def report(self, session: str) -> PrivacyReport:
        return PrivacyReport(session=session, enabled=True, epsilon=self.epsilon(), delta=self.config.delta,
                             max_releases=int(self.releases.max()), noise_multiplier=self.noise_multiplier,
                             budget=self.config.budget)

    def check(self, rows: torch.Tensor) -> None:
        """Refuse, before anything is released, a release that would pass the budget."""
        if self.config.budget is None:
            return
        after = int(np.bincount(rows.numpy(), minlength=len(self.releases)).max() + self.releases[rows.numpy()].max())
        spent = self.epsilon(after)
        if spent > self.config.budget:
            raise BudgetExhausted(
                f"releasing these rows would spend ε={spent:.2f} (δ={self.config.delta:g}), over the budget of "
                f"{self.config.budget:g}"
            )

    def clipped(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` with each row scaled down to L2 norm ``clip`` at most (differentiable)."""
        norms = z.norm(dim=1, keepdim=True).clamp(min=1e-12)
        return z * torch.clamp(self.clip / norms, max=1.0)

    def release(self, z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``z`` clipped row by row, plus noise; differentiable in ``z`` (the noise is a constant)."""
        self.check(rows)
        clipped = self.clipped(z)
        generator = self.secret.torch("embedding-noise", self._draws)
        self._draws += 1
        noise = torch.randn(z.shape, generator=generator) * self.config.noise
        np.add.at(self.releases, rows.numpy(), 1)
        return clipped + noise
