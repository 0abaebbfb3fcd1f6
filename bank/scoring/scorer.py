"""Scoring new customers with a trained model, across the parties that trained it.

The bank brings the customers (IDs and its own columns). Each partner learns
by PSI which of them it holds, embeds those rows of its own table with its
part of the model, and the bank combines everything in its top model.

A customer some partners lack is reported as unscorable or, when the operator
allows it (``allow_missing``), scored by the model of exactly the parties that
hold them (``bank.scoring.subsets``): the bank-only model, or a head over the present
parties' embeddings. A partner whose minimum-intersection policy refuses the
customers is reported by name, and holds none of them. Every row says which
parties contributed and which model scored it.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from alignment.cache import hashed_points
from alignment.parallel import SlicePool
from alignment.exposure import Exposure, OverlapTooHigh, customer_keys
from alignment.partnership import Partnership
from alignment.psi import partnership_dst, run_initiator
from bank.vertical.aggregation import Aggregation, get_aggregation
from bank.scoring.bank_only import BankOnlyModel
from bank.scoring.manifest import Manifest, SubsetEntry, read_manifest
from bank.vertical.party import ScoringParty
from bank.scoring.subsets import head_from_blob, subset_name
from bank.task import Task
from parties.errors import CutlayerError, DataError, IntersectionTooSmall
from parties.learning.model import build_top
from parties.learning.trained_bottom import ScoringBottom, verify_files
from parties.tables.drift import Drift, judge_drift
from parties.tables.encoding import Fallbacks, merge_fallbacks
from parties.limits import DEFAULT_MAX_OVERLAP, PsiLimits
from parties.tables.table import PartyTable
from parties.transport.jobs import Progress

__all__ = ["Scores", "score_customers"]

logger = logging.getLogger(__name__)

BATCH = 8192


@dataclass
class Scores:
    """One row per customer (``score`` or ``score_<class>``, ``status``, ``parties``, ``model``), and per party
    and column the values that took a declared policy (unseen category, missing value)."""

    table: pd.DataFrame
    fallbacks: dict[str, Fallbacks]
    scored_without: dict[str, int]  # per partner, the customers scored without it (by a partial subset's model)
    models: dict[str, int] = field(default_factory=dict)  # customers scored by each model
    refused: dict[str, str] = field(default_factory=dict)  # partners left out of the alignment (either side's policy), and why
    drift: dict[str, Drift] = field(default_factory=dict)  # per party and column, the population stability index
    drift_warnings: list[str] = field(default_factory=list)


class _Customers:
    """The customers' embeddings, gathered party by party, and which partners hold each customer."""

    def __init__(self, table: PartyTable, names: list[str]) -> None:
        self.table, self.names, self.n = table, names, len(table)
        self.keys = customer_keys(table.normalized_ids)  # how the exposure ledger names them (sorted by a claim)
        self.embeddings: dict[str, torch.Tensor] = {}
        self.held: dict[str, np.ndarray] = {}
        self.why: dict[str, str] = {}  # per partner, what a customer it lacks is told
        self.fallbacks: dict[str, Fallbacks] = {}
        self.drift: dict[str, Drift] = {}

    def align(self, partner: ScoringParty, width: int, manifest: Manifest, bank_name: str, pool: SlicePool,
              say: Progress, book: Partnership, told: Exposure, max_overlap: float) -> str | None:
        """PSI with ``partner`` and its embeddings of the customers it holds; why it was left out, if it was
        (it refused the alignment, or would have matched more than ``max_overlap`` of the bank's customers sent
        to it over the partnership: ``alignment.exposure``)."""
        name = partner.name
        self.embeddings[name] = torch.zeros((self.n, width))
        self.held[name] = np.zeros(self.n, dtype=bool)
        self.why[name] = f"not held by {name}"
        points = hashed_points(self.table.normalized_ids, pool, None, partnership_dst(bank_name, name))
        logged = book.initiated(name, "scoring", self.n)
        try:
            session_id, result = run_initiator(partner, points, pool, id_type=self.table.id_type, admit=logged.admit)
        except BaseException as exc:
            logged.failed(exc)
            raise
        scoring_id = uuid.uuid4().hex
        try:
            matched = customer_keys(self.table.normalized_ids, result.rows)
            told_sent, told_matched = told.claim(name, self.keys, matched, max_overlap)
            committed = partner.commit(session_id, scoring_id, result.peer_positions, purpose="scoring",
                                       log_head=logged.head)
        except (IntersectionTooSmall, OverlapTooHigh) as exc:  # a policy of either side: none is scored with it
            self.why[name] = (f"{name} refused the alignment" if isinstance(exc, IntersectionTooSmall) else
                              f"{name} matched more of these customers than --max-overlap allows")
            with contextlib.suppress(CutlayerError):
                partner.abort(session_id)
            logged.failed(exc, matched=len(result))
            return str(exc)
        except BaseException as exc:
            logged.failed(exc, matched=len(result))
            raise
        logged.ended("committed", matched=len(result), result=len(result), alignment=scoring_id,
                     peer_head=committed.log_head, told_sent=told_sent, told_matched=told_matched)
        self.fallbacks[name] = {}
        for start in range(0, len(result), BATCH):
            positions = torch.arange(start, min(start + BATCH, len(result)))
            z_part, counted, self.drift[name] = partner.embed_for_scoring(manifest.model_id, scoring_id, positions)
            self.embeddings[name][torch.from_numpy(result.rows[start : start + BATCH])] = z_part
            merge_fallbacks(self.fallbacks[name], counted)
            say(f"{name}: embedding {min(start + BATCH, len(result))}/{len(result)}", None)
        self.held[name][result.rows] = True
        return None

    def holders(self) -> np.ndarray:
        """Per customer, which partners hold them (one column per partner, in the model's order)."""
        return np.stack([self.held[n] for n in self.names[1:]], axis=1) if self.names[1:] else np.ones((self.n, 0), bool)


def load_top(model_dir: Path, manifest: Manifest, width: int, task: Task) -> torch.nn.Module:
    """The top model of a manifest's folder (its files checked against the manifest when it was read): the bank's
    own, rebuilt from ``top-config.json`` and its factory, or the MLP whose widths its weights give."""
    from bank.config import TopConfig

    try:
        blob = (model_dir / "top.safetensors").read_bytes()
        if "top-config.json" not in manifest.top:
            return head_from_blob(blob, width, task)
        top = build_top(width, TopConfig.model_validate_json((model_dir / "top-config.json").read_bytes()),
                        task.output_dim)
        top.load_state_dict(load_tensors(blob))
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise DataError(f"{model_dir}: the top model does not load ({exc})") from exc
    return top.eval()


def score_customers(
    table: PartyTable,
    model_dir: Path,
    bank_name: str,
    partners: Mapping[str, ScoringParty],
    pool: SlicePool,
    *,
    allow_missing: bool = False,
    accept_drift: bool = False,
    progress: Progress | None = None,
    partnership: Partnership | None = None,
    max_overlap: Mapping[str, float] | None = None,
    exposure: Exposure | None = None,
) -> Scores:
    """Scores for ``table``'s customers: one row each, with ``score``, ``status``, ``parties`` and ``model``.

    Every party's columns are checked for drift from the training rows (``parties.tables.drift``): above
    the refusal threshold nothing is scored, unless ``accept_drift``."""
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
    widths = {p.name: p.embedding_width for p in manifest.parties}
    top = load_top(model_dir, manifest, aggregation.width(list(widths.values())), task)

    book = partnership or Partnership(PsiLimits(), len(table))
    told = exposure or Exposure()
    customers = _Customers(table, names)
    customers.drift[bank_name] = own.encoder.drift(table.features)
    judge_drift({bank_name: customers.drift[bank_name]}, accept_drift, {bank_name: len(table)})  # before any PSI
    own_rows, customers.fallbacks[bank_name] = own.encoder.encode_rows(table.features)
    customers.embeddings[bank_name] = own.embed_rows(own_rows)
    refused = {}
    for k, name in enumerate(names[1:], start=1):
        partner, entry = partners[name], manifest.party(name)
        say(f"{name}: loading its part of the model", k / (len(names) + 1))
        partner.load_model(manifest.model_id, entry.files, entry.embedding_width)
        say(f"{name}: aligning the customers (PSI)", k / (len(names) + 1))
        ceiling = (max_overlap or {}).get(name, DEFAULT_MAX_OVERLAP)
        reason = customers.align(partner, entry.embedding_width, manifest, bank_name, pool, say, book, told, ceiling)
        if reason is not None:
            refused[name] = reason
            say(f"{name} left out of the alignment: {reason}", None)

    drift_warnings = judge_drift(customers.drift, accept_drift,
                                 {bank_name: len(table), **{p: int(h.sum()) for p, h in customers.held.items()}})
    n = len(table)
    holders = customers.holders()
    scores = np.full((n,) if task.output_dim == 1 else (n, task.output_dim), np.nan)
    model = np.full(n, "", dtype=object)
    parties = np.array([subset_name([bank_name, *(p for p, h in zip(names[1:], row) if h)]) for row in holders],
                       dtype=object)
    status = np.array(["; ".join(customers.why[p] for p, h in zip(names[1:], row) if not h) or "scored"
                       for row in holders], dtype=object)
    for pattern in np.unique(holders, axis=0):
        rows = np.flatnonzero((holders == pattern).all(axis=1))
        present = [bank_name, *(p for p, h in zip(names[1:], pattern) if h)]
        subset = subset_name(present)
        if len(present) == len(names):
            scores[rows], model[rows] = _joint(top, aggregation, customers, names, rows, task), "joint"
            continue
        if not allow_missing:
            continue
        entry = manifest.subsets.get(subset)
        if entry is None:  # a model trained before subsets existed, or more partners than heads
            status[rows] = [f"{s}; the model has no fallback for customers only {subset} hold" for s in status[rows]]
            continue
        say(f"scoring {len(rows)} customers only {subset} hold with the {entry.kind} model", None)
        scores[rows] = _partial(model_dir / "subsets" / subset, entry, task, aggregation, customers, rows, widths)
        model[rows] = entry.kind
        status[rows] = "scored without: " + ", ".join(p for p in names[1:] if p not in present)
    out = pd.DataFrame({table.id_column: list(table.ids)})
    if scores.ndim == 1:
        out["score"] = scores
    else:
        for i, c in enumerate(task.classes_):
            out[f"score_{c}"] = scores[:, i]
    out["status"], out["parties"], out["model"] = status, parties, model
    scored = model != ""
    models = {str(m): int((model == m).sum()) for m in dict.fromkeys(model[scored])}
    without = {name: int((scored & ~customers.held[name]).sum()) for name in names[1:]}
    full = models.get("joint", 0)
    say(f"scored {int(scored.sum())} of {n}" + (f" ({int(scored.sum()) - full} without every partner)"
                                                  if scored.sum() > full else ""), 1.0)
    fallbacks = {party: counts for party, counts in customers.fallbacks.items() if counts}
    return Scores(out, fallbacks, {k: v for k, v in without.items() if v}, models, refused, customers.drift,
                  drift_warnings)


def _joint(top: torch.nn.Module, aggregation: Aggregation, customers: _Customers, names: list[str],
           rows: np.ndarray, task: Task) -> np.ndarray:
    index = torch.from_numpy(rows)
    with torch.no_grad():
        return task.scores(top(aggregation.combine([customers.embeddings[n][index] for n in names])))


def _partial(folder: Path, entry: SubsetEntry, task: Task, aggregation: Aggregation, customers: _Customers,
             rows: np.ndarray, widths: dict[str, int]) -> np.ndarray:
    """Scores of ``rows`` by the model for customers only ``entry.parties`` hold."""
    if entry.kind == "bank-only":
        bank_only = BankOnlyModel.load(folder, entry.files, task)
        frame = customers.table.features.iloc[rows][list(bank_only.encoder_.schema.columns)]
        scores, counted = bank_only.predict(frame)
        if counted:
            merge_fallbacks(customers.fallbacks.setdefault(f"{entry.parties[0]} (bank-only model)", {}), counted)
        return scores
    blob = verify_files(folder, entry.files, ("head.safetensors",))["head.safetensors"]
    head = head_from_blob(blob, aggregation.width([widths[p] for p in entry.parties]), task)
    index = torch.from_numpy(rows)
    with torch.no_grad():
        return task.scores(head(aggregation.combine([customers.embeddings[p][index] for p in entry.parties])))
