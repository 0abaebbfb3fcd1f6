"""The privacy audit of a run: what a curious party could learn from what crossed the cut.

Two directions, both measured on an audited run (``TrainingConfig.audit``):

* **Labels, at a partner.** The partner's attacks (``bank.lab.attacks.labels``) turn
  the gradients it received into scores; the leak AUC is the ROC-AUC of a
  score against the true label (0.5: nothing leaks). Per epoch, and across
  epochs after averaging each row's gradients (per-step noise averages out).
  After training, model completion: the partner fine-tunes its own trained
  bottom with a head on a few labels it learned, and scores the other rows.
  Its columns predict the label by themselves, so that AUC is set beside the
  same recipe from a fresh bottom (0.5 is not its floor; the baseline is).
* **Features, at the bank.** An inversion probe: with auxiliary rows whose
  partner features it knows, could the bank decode those features from the
  embeddings it received? Reported per feature as R² over what the bank's own
  columns already predict.

Both need data no single party has (true labels; partner features), so they
are audits run in a simulation, not attacks the product performs.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from safetensors.numpy import load_file
from sklearn.dummy import DummyRegressor
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import r2_score, roc_auc_score
from sklearn.neural_network import MLPRegressor
from torch import nn

from bank.vertical.results import Run
from bank.lab.attacks.labels import (
    CompletionConfig,
    completion_scores,
    cosine_scores,
    few_label_scores,
    gradient_features,
    label_free_scores,
    mean_by_row,
    norm_scores,
    row_means,
)
from bank.lab.references.models import joined_features
from parties.errors import DataError
from parties.learning.model import BottomConfig, InputLayout, build_bottom
from parties.learning.trained_bottom import ScoringBottom
from parties.tables.encoding import TabularEncoder

__all__ = [
    "KNOWN_LABELS", "label_free_leakage", "label_free_table",
    "completion_leakage", "draw_known", "inversion_probe", "inversion_rows", "label_leakage", "leakage_rows",
    "load_bottom", "model_completion",
]


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


#: How many labels the few-label attack knows, in the audit and the studies.
KNOWN_LABELS = (10, 50)

#: From-scratch completion AUCs by (partner's columns and labels, bottom, recipe, known, draw).
_FROM_SCRATCH: dict[tuple[str, str, str, int, int], float] = {}


def label_free_leakage(g: dict[str, np.ndarray], targets: np.ndarray, *, known: tuple[int, ...] = KNOWN_LABELS,
                       draws: int = 5, seed: int = 0) -> dict[str, float]:
    """Leak AUCs of the attacks that need no known positive and no help from the code, from one partner's
    recorded gradients: off-direction energy, the mixture model and k-means on per-row gradient features
    across epochs (no label at all), and a logistic regression on them with ``known`` labels (mean over
    ``draws`` draws of the known rows)."""
    rows, features = gradient_features(g["rows"], g["step"], g["grads"])
    means = row_means(g["rows"], g["grads"])
    labels = targets[rows]
    out = {f"{name}_leak_auc": _leak_auc(labels, scores)
           for name, scores in label_free_scores(features, seed, means).items()}
    features = np.hstack([features, means])  # the few-label attack reads both
    for count in known:
        aucs = []
        for draw in range(seed, seed + draws):
            picked = draw_known(labels, count, draw)
            others, scores = few_label_scores(features, picked, labels[picked])
            aucs.append(_leak_auc(labels[others], scores))
        out[f"few_label_{count}_leak_auc"] = float(np.mean(aucs))
    return out


def label_leakage(run: Run, partition: Path | None = None) -> pd.DataFrame:
    """Leak AUC of the norm and direction attacks, per partner and epoch, and across epochs."""
    _, targets, _ = joined_features(run, partition)
    return pd.DataFrame([r for partner in run.partners for r in leakage_rows(partner, _gradients(run, partner), targets)])


def label_free_table(run: Run, partition: Path | None = None) -> pd.DataFrame:
    """Per partner, the label-free and few-label attacks' leak AUCs (``label_free_leakage``)."""
    _, targets, _ = joined_features(run, partition)
    return pd.DataFrame([{"partner": partner, **label_free_leakage(_gradients(run, partner), targets)}
                         for partner in run.partners])


def draw_known(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` distinct positions of ``labels``, drawn uniformly (seeded) and redrawn until both classes are in.

    The rows whose labels a partner has learned (model completion's known rows); sorted.
    """
    labels = np.asarray(labels)
    if not 2 <= count < len(labels) or not 0 < labels.sum() < len(labels):
        raise ValueError(f"cannot draw {count} known rows with both classes from {len(labels)} rows "
                         f"({int(labels.sum())} positive)")
    rng = np.random.default_rng(seed)
    for _ in range(10_000):
        known = np.sort(rng.choice(len(labels), size=count, replace=False))
        if 0 < labels[known].sum() < count:
            return known
    raise ValueError(f"{count} known rows drawn 10000 times never held both classes")


def completion_leakage(
    trained: nn.Module, config: BottomConfig, features: np.ndarray, labels: np.ndarray, *, known: int = 50,
    draws: int = 5, seed: int = 0, recipe: CompletionConfig = CompletionConfig(), layout: InputLayout | None = None,
) -> dict[str, float]:
    """Model completion's leak AUC, its from-scratch baseline, and what the collaboration added.

    ``trained``: the partner's trained bottom; ``config``: its bottom configuration (the baseline is
    ``build_bottom`` of it: the very weights the partner started from); ``features``, ``labels``: the
    partner's encoded columns and the true labels of its training rows. For each of ``draws`` draws
    (seeds ``seed``, ``seed + 1``, ...) of ``known`` rows, both the trained and the fresh bottom are
    fine-tuned on the same rows by the same recipe and score every other row.

    The partner's own columns predict the label by themselves: with the same labels it could reach
    ``from_scratch_leak_auc`` without any split training. ``model_completion_advantage`` (the paired
    difference, trained minus fresh) is what the trained bottom, i.e. the collaboration, gave away.
    ``layout``: what the encoded columns are (``TabularEncoder.layout``; default: plain numbers), which a
    bottom with column embeddings is built from.
    Each figure is a mean over the draws; ``_std`` is its spread (sample standard deviation).
    """
    labels = np.asarray(labels)
    fresh = build_bottom(layout or features.shape[1], config)
    aucs: dict[str, list[float]] = {"model_completion_leak_auc": [], "from_scratch_leak_auc": []}
    # The baseline depends on the partner's columns, labels, start and recipe only: a study's settings share it.
    data = hashlib.sha256(np.ascontiguousarray(features).tobytes() + labels.tobytes()).hexdigest()
    for draw in range(seed, seed + draws):
        positions = draw_known(labels, known, draw)
        key = (data, config.model_dump_json(), repr(recipe), known, draw)
        for column, bottom in (("model_completion_leak_auc", trained), ("from_scratch_leak_auc", fresh)):
            if column == "from_scratch_leak_auc" and key in _FROM_SCRATCH:
                aucs[column].append(_FROM_SCRATCH[key])
                continue
            others, scores = completion_scores(bottom, features, positions, labels[positions], seed=draw,
                                               config=recipe)
            aucs[column].append(_leak_auc(labels[others], scores))
        _FROM_SCRATCH[key] = aucs["from_scratch_leak_auc"][-1]
        while len(_FROM_SCRATCH) > 64:
            _FROM_SCRATCH.pop(next(iter(_FROM_SCRATCH)))
    aucs["model_completion_advantage"] = list(
        np.subtract(aucs["model_completion_leak_auc"], aucs["from_scratch_leak_auc"]))
    out: dict[str, float] = {}
    for column, values in aucs.items():
        out[column] = float(np.mean(values))
        out[f"{column}_std"] = float(np.std(values, ddof=1)) if draws > 1 else 0.0
    return out | {"known_labels": known, "completion_draws": draws}


def load_bottom(folder: Path) -> ScoringBottom:
    """A party's trained bottom and encoder from its model folder, each file checked against its ``files.json``."""
    listing = Path(folder) / "files.json"
    if not listing.exists():
        raise DataError(f"{listing}: missing; the party wrote no model files there")
    return ScoringBottom(folder, json.loads(listing.read_text()))


def model_completion(run: Run, known: int = 50, draws: int = 5, seed: int = 0,
                     partition: Path | None = None) -> pd.DataFrame:
    """Model completion by each partner of a run, from its own model files, on the run's training rows.

    One row per partner: see ``completion_leakage``; the known rows are drawn among the training rows.
    """
    features, targets, splits = joined_features(run, partition)
    train = splits["train"]
    out = []
    for partner in run.partners:
        bottom = load_bottom(run.model_dir(partner))
        x = features[partner][train]
        if x.shape[1] != bottom.encoder.width:
            raise DataError(f"{partner}'s columns encode to width {x.shape[1]}, its model expects "
                            f"{bottom.encoder.width}: is this the partition the run was trained on?")
        out.append({"partner": partner, **completion_leakage(bottom.model, bottom.config, x, targets[train],
                                                              known=known, draws=draws, seed=seed,
                                                              layout=bottom.encoder.layout)})
    return pd.DataFrame(out)


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
    """Per partner feature: R² of decoding it from (embedding, bank's columns), minus from the bank's columns.

    ``own`` may have no columns (an attacker that holds none of its own, e.g. a compute party): its baseline
    is then the constant guess, the mean of the auxiliary rows (R² about 0).
    """
    order = np.random.default_rng(seed).permutation(len(truth))
    aux, held = order[: int(aux_fraction * len(order))], order[int(aux_fraction * len(order)) :]

    def probe(x: np.ndarray) -> dict[str, float]:
        if x.shape[1] == 0:
            constant = DummyRegressor(strategy="mean").fit(np.zeros((len(aux), 1)), truth[aux])
            return _r2_by_feature(truth[held], constant.predict(np.zeros((len(held), 1))), names)
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
