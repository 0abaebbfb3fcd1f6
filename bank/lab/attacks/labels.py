"""Label-inference attacks a curious partner could run on what it holds.

Pure functions over what a partner holds: its rows' gradients, the step each
arrived in, and (for the direction attack) one row it knows to be positive;
after training, its own bottom model, its encoded columns and a few rows whose
labels it has learned (model completion). They return attack scores;
``bank.lab.report.audit`` turns scores into leak AUCs, which needs the true labels and
so only happens in an audit.
Definitions: ``../shared/PRIVACY-NOTES.md`` (Li et al., ICLR 2022; Fu et al.,
USENIX Security 2022).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from parties.learning.model import mlp

__all__ = ["CompletionConfig", "completion_scores", "cosine_scores", "few_label_scores", "gradient_features",
           "label_free_scores", "mean_by_row", "norm_scores", "row_means"]


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


# --- attacks that need neither the code's help nor a known positive ------------------------------------------
#
# A binary task's gradients are close to one-dimensional in each batch: the factor (p - y) puts each row on
# one side of the batch's top direction or the other. A defense that blurs only the class-mean difference,
# or gives one class more spread off that direction than the other, is read without any label by how far
# each row sits from that direction and which side it falls on, across epochs.


def gradient_features(rows: np.ndarray, steps: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, what an attacker measures of its gradients against each batch's top singular direction.

    In each step's batch the top right singular vector v is oriented so that the minority of rows lies on its
    positive side (the positives, on an imbalanced task). Per row, over every step that carried it: the mean
    and spread of its projection on v, the mean energy off v (absolute and as a share of its norm), and the
    mean norm. Returns the rows (ascending) and their features, one row each (standardised columns).
    """
    grads = np.asarray(grads, dtype=np.float64)
    projection = np.zeros(len(grads))
    residual = np.zeros(len(grads))
    for step in np.unique(steps):
        at = np.flatnonzero(steps == step)
        g = grads[at]
        _, _, vt = np.linalg.svd(g, full_matrices=False)
        v = vt[0]
        p = g @ v
        if (p > 0).mean() > 0.5:  # the minority side is the positive one
            v, p = -v, -p
        projection[at] = p
        residual[at] = np.linalg.norm(g - np.outer(p, v), axis=1)
    norm = np.linalg.norm(grads, axis=1)
    share = np.divide(residual**2, norm**2, out=np.zeros_like(norm), where=norm > 0)
    unique, inverse = np.unique(rows, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(unique))

    def mean(x: np.ndarray) -> np.ndarray:
        return np.bincount(inverse, weights=x, minlength=len(unique)) / counts

    p_mean = mean(projection)
    p_std = np.sqrt(np.maximum(mean(projection**2) - p_mean**2, 0.0))
    features = np.column_stack([p_mean, p_std, mean(residual), mean(share), mean(norm)])
    spread = features.std(axis=0)
    return unique, (features - features.mean(axis=0)) / np.where(spread > 0, spread, 1.0)


def row_means(rows: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """Each row's gradients averaged over every step that carried it, in raw coordinates (standardised), in the
    order of ``np.unique(rows)``: noise that changes from step to step averages away here."""
    _, mean = mean_by_row(rows, np.asarray(grads, dtype=np.float64))
    spread = mean.std(axis=0)
    return (mean - mean.mean(axis=0)) / np.where(spread > 0, spread, 1.0)


def label_free_scores(features: np.ndarray, seed: int = 0, means: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Scores with no label at all, from ``gradient_features``: the off-direction energy alone, a 2-component
    Gaussian mixture and k-means (the smaller cluster taken as positive). Orientation does not matter: the leak
    AUC counts a reversed ranking as the leak it is."""
    from sklearn.cluster import KMeans
    from sklearn.mixture import GaussianMixture

    out = {"off_direction": features[:, 2], "projection": features[:, 0]}
    if means is not None:  # the rows' raw gradients averaged over the epochs: their first principal component
        centred = means - means.mean(axis=0)
        out["row_mean_pca"] = centred @ np.linalg.svd(centred, full_matrices=False)[2][0]
    gmm = GaussianMixture(2, covariance_type="full", random_state=seed, n_init=3).fit(features)
    proba = gmm.predict_proba(features)
    minority = int(np.argmin(proba.sum(axis=0)))
    out["mixture"] = proba[:, minority]
    kmeans = KMeans(2, random_state=seed, n_init=10).fit(features)
    minority = int(np.argmin(np.bincount(kmeans.labels_, minlength=2)))
    distance = kmeans.transform(features)
    out["kmeans"] = distance[:, 1 - minority] - distance[:, minority]
    return out


def few_label_scores(features: np.ndarray, known: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A logistic regression on ``gradient_features`` fitted on the ``known`` rows' ``labels``: the positions of
    every other row and their scores."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(max_iter=1000).fit(features[known], labels)
    others = np.setdiff1d(np.arange(len(features)), known)
    return others, model.decision_function(features[others])


@dataclass(frozen=True)
class CompletionConfig:
    """Model completion's fine-tuning, fixed (never tuned per run): full-batch Adam on the known rows.

    First the head alone on the frozen bottom (``probe_steps``), then bottom and head together, gently
    (``steps``): with 50 labels a longer or faster joint fine-tune wipes out what the bottom learned,
    and a joint one from a random head leaves the head near its random start (on a synthetic task,
    leak AUC 0.82 +- 0.26 over draws; 0.99 +- 0.01 with the probe first). The same recipe serves the
    trained bottom and the from-scratch baseline, so their difference is the bottom's doing. On the
    privacy study's runs the baseline is no straw man: it matches a logistic regression on the
    partner's raw columns with the same labels (0.82). The probe alone would score the trained bottom
    about 0.02 higher, and a fresh one 0.08 lower: it would inflate the advantage, so it is not used.
    ``head_hidden`` () is a linear head on the cut layer.
    """

    head_hidden: tuple[int, ...] = ()
    probe_steps: int = 300
    probe_learning_rate: float = 1e-2
    steps: int = 100
    learning_rate: float = 1e-3
    weight_decay: float = 1e-3


def completion_scores(
    bottom: nn.Module, features: np.ndarray, known: np.ndarray, labels: np.ndarray, *, seed: int = 0,
    config: CompletionConfig = CompletionConfig(),
) -> tuple[np.ndarray, np.ndarray]:
    """Model completion (Fu et al., passive): fine-tune ``bottom`` + a small head on the ``known`` rows' labels.

    ``features``: the partner's encoded columns for its training rows; ``known``: positions in them whose
    ``labels`` (0/1, in ``known``'s order) the partner has learned. ``bottom`` is copied, never changed:
    the partner's trained bottom for the attack, or a freshly initialised one for the from-scratch
    baseline (what the partner's own columns give with the same labels, without any collaboration).
    Returns the positions of every other row, ascending, and their scores (higher: more likely positive).
    ``seed`` initialises the head; everything else is deterministic (full batch, no sampling).
    """
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    known = np.asarray(known, dtype=np.int64)
    if len(np.unique(known)) != len(known) or known.min(initial=0) < 0 or known.max(initial=-1) >= len(x):
        raise ValueError(f"known rows must be distinct positions in [0, {len(x)})")
    # One intra-op thread, as references.py trains: these tensors are tiny, and with more threads a busy
    # machine made each fit 100 times slower (11 s instead of 0.13), and reductions may split differently.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _complete(copy.deepcopy(bottom), x, known, labels, seed, config)
    finally:
        torch.set_num_threads(previous)


def _complete(bottom: nn.Module, x: torch.Tensor, known: np.ndarray, labels: np.ndarray, seed: int,
              config: CompletionConfig) -> tuple[np.ndarray, np.ndarray]:
    x_known = x[torch.from_numpy(known)]
    y_known = torch.as_tensor(np.asarray(labels), dtype=torch.float32).reshape(-1, 1)
    with torch.no_grad():
        z_known = bottom(x_known)
    head = mlp(z_known.shape[1], config.head_hidden, 1, activate_output=False, seed=seed)
    _fit(head, z_known, y_known, config.probe_steps, config.probe_learning_rate, config.weight_decay)
    model = nn.Sequential(bottom, head)
    _fit(model, x_known, y_known, config.steps, config.learning_rate, config.weight_decay)
    others = np.setdiff1d(np.arange(len(x)), known)
    model.eval()
    with torch.no_grad():
        scores = model(x[torch.from_numpy(others)]).squeeze(1).numpy().astype(np.float64)
    return others, scores


def _fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, learning_rate: float,
         weight_decay: float) -> None:
    """Full-batch Adam on binary cross-entropy."""
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        optimizer.step()
