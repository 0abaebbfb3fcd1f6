"""Label-inference attacks a curious partner could run on the gradients it receives.

Pure functions over what a partner holds: its rows' gradients, the step each
arrived in, and (for the direction attack) one row it knows to be positive.
They return attack scores; ``bank.lab.audit`` turns scores into leak AUCs, which
needs the true labels and so only happens in an audit.
Definitions: ``../shared/PRIVACY-NOTES.md`` (Li et al., ICLR 2022).
"""

from __future__ import annotations

import numpy as np

__all__ = ["cosine_scores", "mean_by_row", "norm_scores"]


def norm_scores(grads: np.ndarray) -> np.ndarray:
    """Norm attack: on imbalanced data, positives get larger gradients."""
    return np.linalg.norm(grads, axis=1)


def cosine_scores(grads: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Direction attack: cosine of each gradient with a known positive's gradient.

    With binary cross-entropy the factor (p - y) flips the gradient's sign
    with the label, so positives point one way and negatives the other.
    """
    norms = np.linalg.norm(grads, axis=1) * np.linalg.norm(reference)
    return np.divide(grads @ reference, norms, out=np.zeros(len(grads)), where=norms > 0)


def mean_by_row(rows: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average each row's gradients over every time it was seen (the cross-epoch attack's input)."""
    unique, inverse = np.unique(rows, return_inverse=True)
    sums = np.zeros((len(unique), grads.shape[1]))
    np.add.at(sums, inverse, grads)
    counts = np.bincount(inverse, minlength=len(unique))[:, None]
    return unique, sums / counts
