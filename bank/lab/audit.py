"""The privacy audit of a run: what a curious party could learn from what crossed the cut.

Two directions, both measured on an audited run (``TrainingConfig.audit``):

* **Labels, at a partner.** The partner's attacks (``bank.lab.attacks``) turn
  the gradients it received into scores; the leak AUC is the ROC-AUC of a
  score against the true label (0.5: nothing leaks). Per epoch, and across
  epochs after averaging each row's gradients (per-step noise averages out).
* **Features, at the bank.** An inversion probe: with auxiliary rows whose
  partner features it knows, could the bank decode those features from the
  embeddings it received? Reported per feature as R² over what the bank's own
  columns already predict.

Both need data no single party has (true labels; partner features), so they
are audits run in a simulation, not attacks the product performs.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from safetensors.numpy import load_file
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import r2_score, roc_auc_score
from sklearn.neural_network import MLPRegressor

from bank.lab.analysis import Run
from bank.lab.attacks import cosine_scores, mean_by_row, norm_scores
from bank.lab.references import joined_features
from parties.errors import DataError
from parties.tables.encoding import TabularEncoder

__all__ = ["inversion_probe", "inversion_rows", "label_leakage", "leakage_rows"]


def _leak_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    return float(roc_auc_score(labels, scores)) if 0 < labels.mean() < 1 else float("nan")


def _gradients(run: Run, partner: str) -> dict[str, np.ndarray]:
    path = run.audit_dir / f"gradients-{partner}.safetensors"
    if not path.exists():
        raise DataError(f"{path}: missing; train with audit on (`--audit`)")
    return load_file(str(path))


def leakage_rows(partner: str, g: dict[str, np.ndarray], targets: np.ndarray) -> list[dict[str, object]]:
    """Leak AUCs from one partner's recorded gradients (``epoch``, ``rows``, ``grads``) and the true labels."""
    labels = targets[g["rows"]]
    # The direction attack's one known positive: the first positive training row.
    known = int(g["rows"][np.flatnonzero(labels == 1)[0]])
    rows: list[dict[str, object]] = []
    for epoch in np.unique(g["epoch"]):
        at = g["epoch"] == epoch
        reference = g["grads"][at][g["rows"][at] == known][0]
        others = g["rows"][at] != known
        y, grads = labels[at][others], g["grads"][at][others]
        rows.append({"partner": partner, "epoch": int(epoch) + 1,
                     "norm_leak_auc": _leak_auc(y, norm_scores(grads)),
                     "direction_leak_auc": _leak_auc(y, cosine_scores(grads, reference))})
    unique, mean = mean_by_row(g["rows"], g["grads"].astype(np.float64))
    others = unique != known
    reference = mean[unique == known][0]
    y = targets[unique][others]
    rows.append({"partner": partner, "epoch": "all (row means)",
                 "norm_leak_auc": _leak_auc(y, norm_scores(mean[others])),
                 "direction_leak_auc": _leak_auc(y, cosine_scores(mean[others], reference))})
    return rows


def label_leakage(run: Run, partition: Path | None = None) -> pd.DataFrame:
    """Leak AUC of the norm and direction attacks, per partner and epoch, and across epochs."""
    _, targets, _ = joined_features(run, partition)
    return pd.DataFrame([r for partner in run.partners for r in leakage_rows(partner, _gradients(run, partner), targets)])


def _r2_by_feature(truth: np.ndarray, predicted: np.ndarray, names: list[str]) -> dict[str, float]:
    """R² per original feature; a one-hot block scores as the variance-weighted R² of its columns."""
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(n.split("=")[0], []).append(i)
    return {f: float(r2_score(truth[:, cols], predicted[:, cols], multioutput="variance_weighted"))
            for f, cols in groups.items()}


def inversion_rows(
    partner: str, embedding: np.ndarray, truth: np.ndarray, own: np.ndarray, names: list[str], seed: int = 0,
    aux_fraction: float = 0.5,
) -> list[dict[str, object]]:
    """Per partner feature: R² of decoding it from (embedding, bank's columns), minus from the bank's columns."""
    order = np.random.default_rng(seed).permutation(len(truth))
    aux, held = order[: int(aux_fraction * len(order))], order[int(aux_fraction * len(order)) :]

    def probe(x: np.ndarray) -> dict[str, float]:
        model = MLPRegressor(hidden_layer_sizes=(64,), max_iter=400, early_stopping=True, random_state=seed)
        with warnings.catch_warnings():  # a probe that stops at max_iter still gives a valid lower bound
            warnings.simplefilter("ignore", ConvergenceWarning)
            model.fit(x[aux], truth[aux])
        return _r2_by_feature(truth[held], model.predict(x[held]), names)

    with_embedding, bank_only = probe(np.hstack([embedding, own])), probe(own)
    return [{"partner": partner, "feature": f, "r2_embedding_and_bank": with_embedding[f],
             "r2_bank_only": bank_only[f], "advantage": with_embedding[f] - bank_only[f]} for f in with_embedding]


def inversion_probe(run: Run, seed: int = 0, aux_fraction: float = 0.5, partition: Path | None = None) -> pd.DataFrame:
    """How well the bank could decode each partner feature from the embeddings it received."""
    features, _, _ = joined_features(run, partition)
    out = []
    for partner in run.partners:
        path = run.audit_dir / f"embeddings-{partner}.safetensors"
        if not path.exists():
            raise DataError(f"{path}: missing; train with audit on (`--audit`)")
        record = load_file(str(path))
        positions, embedding = record["rows"], record["embedding"]
        encoder_file = run.model_dir(partner) / "encoder.json"
        names = TabularEncoder.from_dict(json.loads(encoder_file.read_text())).feature_names()
        out += inversion_rows(partner, embedding, features[partner][positions], features["bank"][positions], names,
                              seed, aux_fraction)
    return pd.DataFrame(out)
