"""NoPeek: a partner makes its embedding less revealing of its features, on its own.

Vepakomma, Singh, Gupta, Raskar, "NoPeek: Information leakage reduction to
share activations in distributed deep learning" (ICDMW 2020) add α·dCor(x, z)
to the loss: the distance correlation between a batch's raw inputs x and the
activations z sent across the cut. dCor is 0 exactly when x and z are
independent and 1 when z is a similarity transform of x, and it sees any
dependence, not only linear. Here x is the partner's encoded features of the
batch's rows and z its embedding of them (after clipping, before noise, when
embedding DP is on too); the penalty is the partner's alone: the bank's
gradient and everything it sees are as before.

The estimator is the standard sample one (Székely, Rizzo, Bakirov 2007):
double-centred pairwise Euclidean distance matrices A (of x) and B (of z),
dCov²(x, z) = mean(A·B), dVar²(x) = mean(A·A), and, as NoPeek uses it, the
square-root form dCor = sqrt(dCov² / sqrt(dVar²(x)·dVar²(z))) in [0, 1]. A
batch with no spread (every row of x, or of z, the same) has dCor 0 and a zero
gradient, never NaN. It costs O(n²) per batch of n rows in time and memory,
so a batch of more than ``MAX_ROWS`` is measured in near-equal chunks and the
chunks' dCor averaged.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["MAX_ROWS", "NoPeek", "distance_correlation"]

#: Most rows one dCor is computed over: a 1024 x 1024 distance matrix is 8 MB in float64.
MAX_ROWS = 1024

# dCor² under this counts as 0 (its square root's gradient would be unbounded there).
_FLOOR = 1e-12


def _centred_distances(v: torch.Tensor) -> torch.Tensor:
    # Exact differences, not the |a|²+|b|²-2ab shortcut: that one loses close rows to rounding, and its
    # gradient at a zero distance is not defined; cdist's is 0 there.
    d = torch.cdist(v, v, compute_mode="donot_use_mm_for_euclid_dist")
    return d - d.mean(dim=0, keepdim=True) - d.mean(dim=1, keepdim=True) + d.mean()


def _dcor(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    a, b = _centred_distances(x), _centred_distances(z)
    dcov2, var_x, var_z = (a * b).mean(), (a * a).mean(), (b * b).mean()
    dcor2 = dcov2 / (var_x * var_z).clamp(min=torch.finfo(var_x.dtype).tiny).sqrt()
    return dcor2.clamp(min=_FLOOR).sqrt() * (dcor2 > _FLOOR)


def distance_correlation(x: torch.Tensor, z: torch.Tensor, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """Sample distance correlation of the rows of ``x`` and ``z`` (a 0-d tensor, differentiable in both).

    Computed in float64 and returned in ``z``'s dtype. Over ``max_rows`` rows: the mean over near-equal
    chunks of consecutive rows.
    """
    if x.dim() != 2 or z.dim() != 2 or x.shape[0] != z.shape[0]:
        raise ValueError(f"x and z must be matrices with one row per sample, got {tuple(x.shape)} and {tuple(z.shape)}")
    x64, z64 = x.to(torch.float64), z.to(torch.float64)
    chunks = math.ceil(x.shape[0] / max_rows)
    if chunks <= 1:
        return _dcor(x64, z64).to(z.dtype)
    pieces = zip(torch.tensor_split(x64, chunks), torch.tensor_split(z64, chunks))
    return torch.stack([_dcor(xc, zc) for xc, zc in pieces]).mean().to(z.dtype)


class NoPeek:
    """α·dCor(x, z) for each training batch of a party's bottom model, and what it measured.

    ``penalty`` is called once per update; ``end_epoch`` (at the step that ends an epoch) closes the
    epoch's mean. The measurements travel in checkpoints (``state``, ``load_state``).
    """

    def __init__(self, alpha: float) -> None:
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ValueError(f"NoPeek needs a positive, finite weight, got {alpha}")
        self.alpha = alpha
        self.last: float | None = None  # the latest batch's dCor
        self.epochs: list[float] = []  # each finished epoch's mean dCor over its batches
        self._sum, self._batches = 0.0, 0  # the epoch in progress

    def penalty(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """α·dCor(x, z), to add to the loss of the batch whose features are ``x`` and embedding ``z``."""
        dcor = distance_correlation(x, z)
        self.last = float(dcor.detach())
        self._sum += self.last
        self._batches += 1
        return self.alpha * dcor

    def end_epoch(self) -> tuple[float, int] | None:
        """Close the epoch in progress: its mean dCor and how many batches it averages (None if none)."""
        if not self._batches:
            return None
        mean, batches = self._sum / self._batches, self._batches
        self.epochs.append(mean)
        self._sum, self._batches = 0.0, 0
        return mean, batches

    def state(self) -> dict[str, Any]:
        return {"last": self.last, "epochs": list(self.epochs), "sum": self._sum, "batches": self._batches}

    def load_state(self, state: dict[str, Any]) -> None:
        self.last, self.epochs = state["last"], list(state["epochs"])
        self._sum, self._batches = state["sum"], state["batches"]
