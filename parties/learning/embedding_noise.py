"""Embedding noise at a partner: clip each released row, add Gaussian noise. Obfuscation, with no ε claimed.

Each released embedding row is clipped to L2 norm ``clip`` and gets N(0, noise²·I) from the partner's own
secret (``parties.learning.secret``). This makes the embeddings harder to invert (the privacy study
measures by how much), but it is not differential privacy, and no ε is reported: a per-row ε would treat
each release as depending on that row alone, while the bottom that computes it trains on every row without
per-sample clipping or noise (and NoPeek couples the rows of a batch), so later releases depend on every
row and such an ε bounds nothing the bank learns. Bounding it would take DP-SGD on the bottom's updates
composed with the releases. What the partner reports is how often each row was released.

A bank that asks for the same rows again cannot average the noise away: every release of a row from one
state of the model (an evaluation between two steps; scoring with a trained model) carries the same noise
(``state``). A bank that moves the model a little between releases still draws new noise: this is
obfuscation against a curious bank, not a bound against a determined one.
"""

from __future__ import annotations

import numpy as np
import torch

from parties.learning.config import PrivacyConfig
from parties.learning.secret import Secret
from parties.protocol.training import PrivacyReport

__all__ = ["EmbeddingNoise", "PrivacyConfig"]


class EmbeddingNoise:
    """Clips and noises a party's released embeddings and counts each row's releases."""

    def __init__(self, config: PrivacyConfig, n_rows: int, secret: Secret | None = None) -> None:
        """``secret``: where the noise comes from (default: the config's pin, else a fresh secret)."""
        if config.clip is None:
            raise ValueError("embedding noise needs a clip norm")
        self.config, self.clip = config, config.clip
        self.secret = secret or Secret.of(config.seed)
        self.releases = np.zeros(n_rows, dtype=np.int64)
        self._draws = 0
        self._table: tuple[object, torch.Tensor] | None = None  # (model state, every row's noise from it)

    def report(self, session: str) -> PrivacyReport:
        return PrivacyReport(session=session, enabled=True, max_releases=int(self.releases.max()))

    def clipped(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` with each row scaled down to L2 norm ``clip`` at most (differentiable)."""
        norms = z.norm(dim=1, keepdim=True).clamp(min=1e-12)
        return z * torch.clamp(self.clip / norms, max=1.0)

    def release(self, z: torch.Tensor, rows: torch.Tensor, state: object | None = None) -> torch.Tensor:
        """``z`` clipped row by row, plus noise; differentiable in ``z`` (the noise is a constant).

        ``state``: the model state the release comes from (a step number, a model id): every release of a row
        from one state carries the same noise. ``None``: a training step's release, drawn once for the step."""
        clipped = self.clipped(z)
        if state is None:
            generator = self.secret.torch("embedding-noise", self._draws)
            self._draws += 1
            noise = torch.randn(z.shape, generator=generator)
        else:
            if self._table is None or self._table[0] != state:
                generator = self.secret.torch("embedding-noise-state", state)
                self._table = (state, torch.randn((len(self.releases), z.shape[1]), generator=generator))
            noise = self._table[1].index_select(0, rows)
        noise = noise * self.config.noise
        np.add.at(self.releases, rows.numpy(), 1)
        return clipped + noise
