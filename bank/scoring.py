"""Scoring new customers with a trained model, across the parties that trained it.

The bank brings the customers (IDs and its own columns). Each partner learns
by PSI which of them it holds, embeds those rows of its own table with its
part of the model, and the bank combines everything in its top model.
Customers a partner does not hold are reported as unscorable, or, when the
operator allows it, scored with that partner's embedding set to zero.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file

from alignment.cache import hashed_points
from alignment.parallel import WorkerPool
from alignment.session import run_initiator
from bank.aggregation import get_aggregation
from bank.manifest import read_manifest
from bank.proxy import HttpPartner
from bank.task import Task
from parties.dataset import FeatureSchema, PartyTable
from parties.errors import DataError
from parties.features import Fallbacks, merge_fallbacks
from parties.jobs import Progress
from parties.model import mlp
from parties.scoring import ScoringBottom

__all__ = ["Scores", "model_schema", "score_customers"]

logger = logging.getLogger(__name__)

BATCH = 8192


def _top(model_dir: Path, width: int, task: Task) -> torch.nn.Module:
    weights = load_file(str(model_dir / "top.safetensors"))
    hidden = tuple(weights[k].shape[0] for k in sorted(weights, key=lambda k: int(k.split(".")[0])) if k.endswith("weight"))[:-1]
    top = mlp(width, hidden, task.output_dim, activate_output=False, seed=0)
    top.load_state_dict(weights)
    return top.eval()


def model_schema(model_dir: Path, bank_name: str) -> FeatureSchema:
    """The bank's columns as the trained model encodes them: customers to score are read with this schema,
    so a column means at scoring what it meant at training, whatever types the new file suggests."""
    manifest = read_manifest(model_dir)
    return ScoringBottom(model_dir / "bank", manifest.party(bank_name).files).encoder.schema


@dataclass
class Scores:
    """One row per customer (``score`` or ``score_<class>``, and ``status``), and per party and column the
    values that took a declared policy (unseen category, missing value) instead of a trained encoding."""

    table: pd.DataFrame
    fallbacks: dict[str, Fallbacks]
    scored_without: dict[str, int]  # per partner, the customers scored with its embedding set to zero


def score_customers(
    table: PartyTable,
    model_dir: Path,
    bank_name: str,
    partners: Mapping[str, HttpPartner],
    pool: WorkerPool,
    *,
    allow_missing: bool = False,
    progress: Progress | None = None,
) -> Scores:
    """Scores for ``table``'s customers: one row each, with ``score`` and ``status``."""
    say = progress or (lambda _msg, _frac=None: None)
    manifest = read_manifest(model_dir)
    own = ScoringBottom(model_dir / "bank", manifest.party(bank_name).files)
    missing = [c for c in own.encoder.schema.columns if c not in table.features.columns]
    if missing:
        raise DataError(f"{table.path}: the model needs the bank's columns {missing}")
    task = Task.from_dict(manifest.task)
    aggregation = get_aggregation(manifest.aggregation)
    names = [p.name for p in manifest.parties]
    if set(names[1:]) != set(partners):
        raise DataError(f"model {manifest.model_id} was trained with partners {names[1:]}, not {sorted(partners)}")
    top = _top(model_dir, aggregation.width([p.embedding_width for p in manifest.parties]), task)

    n = len(table)
    own_features, own_fallbacks = own.encoder.encode(table.features[list(own.encoder.schema.columns)])
    embeddings = {bank_name: own.embed(torch.from_numpy(own_features))}
    fallbacks: dict[str, Fallbacks] = {bank_name: own_fallbacks}
    held = {}
    points = hashed_points(table.normalized_ids, pool, None)
    for k, name in enumerate(names[1:], start=1):
        partner, entry = partners[name], manifest.party(name)
        say(f"{name}: loading its part of the model", k / (len(names) + 1))
        partner.load_model(manifest.model_id, entry.files, entry.embedding_width)
        say(f"{name}: aligning the customers (PSI)", k / (len(names) + 1))
        session_id, result = run_initiator(partner, points, pool)
        scoring_id = uuid.uuid4().hex
        partner.commit(session_id, scoring_id, np.arange(len(result)), result.digest, purpose="scoring")
        z = torch.zeros((n, entry.embedding_width))
        fallbacks[name] = {}
        for start in range(0, len(result), BATCH):
            positions = torch.arange(start, min(start + BATCH, len(result)))
            z_part, counted = partner.embed_for_scoring(manifest.model_id, scoring_id, positions)
            z[torch.from_numpy(result.rows[start : start + BATCH])] = z_part
            merge_fallbacks(fallbacks[name], counted)
            say(f"{name}: embedding {min(start + BATCH, len(result))}/{len(result)}", None)
        embeddings[name] = z
        held[name] = np.zeros(n, dtype=bool)
        held[name][result.rows] = True
    complete = np.all(list(held.values()), axis=0) if held else np.ones(n, dtype=bool)
    with torch.no_grad():
        scores = task.scores(top(aggregation.combine([embeddings[name] for name in names])))
    status = np.where(complete, "scored", "")
    for name, mask in held.items():
        lacking = ~mask
        status = np.where(lacking, np.char.add(status.astype(str), f"not held by {name}; "), status)
    out = pd.DataFrame({table.id_column: list(table.ids)})
    if scores.ndim == 1:
        out["score"] = np.where(complete | allow_missing, scores, np.nan)
    else:
        for i, c in enumerate(task.classes_):
            out[f"score_{c}"] = np.where(complete | allow_missing, scores[:, i], np.nan)
    out["status"] = [s.strip().rstrip(";") if s != "scored" else s for s in status]
    if allow_missing:
        out.loc[~complete, "status"] = "scored without: " + out.loc[~complete, "status"].str.replace("not held by ", "")
    scored = n if allow_missing else int(complete.sum())
    fallback = f" ({n - int(complete.sum())} without every partner)" if allow_missing and not complete.all() else ""
    say(f"scored {scored} of {n}{fallback}", 1.0)
    without = {name: int((~mask).sum()) for name, mask in held.items()} if allow_missing else {}
    return Scores(out, {party: counts for party, counts in fallbacks.items() if counts},
                  {name: count for name, count in without.items() if count})
