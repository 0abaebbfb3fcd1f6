"""Horizontal split learning: branches with the bank's schema and customers of their own, the bank's top.

Each branch holds its customers' columns and runs the client-side bottom on them; the bank holds the
labels (in each branch's row order, checked by a hash of the branch's IDs) and the top. No branch sees
another's rows. Two schedules:

- **relay** (the original protocol): branches train in turn, in a fixed order; each starts from the
  client-side state the previous one left (weights and optimizer moments, handed on through the bank). This
  is exactly sequential training of one model on the concatenated schedule, and the tests prove it bit for bit.

A step costs a branch one round trip: its message carries the gradient of the branch's previous step and the
rows of the next (``LayerPeer.step``); the last gradient is sent on its own before weights move.
- **splitfed**: every branch trains at once on its own copy (one batch each per step, sent in parallel; the
  bank's top takes their batches together), and the bank averages the copies, weighted by training rows
  (FedAvg), every ``fedavg_every`` steps and at every epoch end.

Every branch encodes with one encoder the bank builds from the branches' column sums and value sets on
their training rows (``StatsReply``): one feature space, so the bottoms can be averaged and relayed.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from bank.configurations.layer_peer import LayerPeer
from bank.epochs import EpochBook
from bank.vertical.schedule import Split, epoch_batches, split_rows
from bank.configurations.split_run import ConfigurationSettings, ProgressFn
from bank.audit_record import AuditRecord
from bank.task import Task
from parties.errors import DataError, PeerError, PeerUnavailable, PeerUntrusted
from parties.learning.config import OptimizerConfig
from parties.learning.model import build_optimizer, mlp
from parties.protocol.common import SCHEMA_VERSION
from parties.protocol.layers import LayerStart, StatsReply, ids_sha256
from parties.tables.schema import POLICIES

__all__ = ["BranchLabels", "HorizontalOutcome", "HorizontalTrainer", "branch_labels", "fedavg", "horizontal_top",
           "merge_encoder"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BranchLabels:
    """The bank's labels for one branch's customers, in the branch's row order, and their split."""

    name: str
    ids_sha256: str
    targets: torch.Tensor
    split: Split


def branch_labels(labels: pd.DataFrame, id_column: str, branch_column: str, label_column: str, task: Task,
                  settings: ConfigurationSettings) -> dict[str, BranchLabels]:
    """Per branch (in sorted name order): its customers' labels in file order, and a seeded stratified split.

    A regression task's target scale is fitted here, on every branch's training rows pooled."""
    out = {}
    for name in sorted(labels[branch_column].astype(str).unique()):
        rows = labels[labels[branch_column].astype(str) == name]
        targets = task.targets(rows[label_column])
        out[name] = BranchLabels(name, ids_sha256(rows[id_column].astype(str).tolist()), targets,
                                 split_rows(len(rows), targets, task, settings.training))
    task.fit_target_scale(torch.cat([b.targets[torch.from_numpy(b.split.train)] for b in out.values()]))
    return out


def horizontal_top(settings: ConfigurationSettings, task: Task) -> nn.Sequential:
    """The bank's top: from a branch's embedding to the task's outputs."""
    return mlp(settings.bottom.cut_width, settings.top.hidden, task.output_dim, activate_output=False,
               seed=settings.top.seed)


def _schema_difference(reply: StatsReply, first: StatsReply) -> str:
    """How ``reply``'s columns differ from ``first``'s, per kind ("" if they are the same sets)."""
    parts = []
    for kind, mine, theirs in (("numeric", reply.numeric, first.numeric),
                               ("categorical", reply.categorical, first.categorical)):
        if missing := sorted(set(theirs) - set(mine)):
            parts.append(f"lacks {kind} {missing}")
        if extra := sorted(set(mine) - set(theirs)):
            parts.append(f"has {kind} {extra} besides")
    return ", ".join(parts)


def merge_encoder(replies: list[StatsReply], names: list[str] | None = None) -> dict[str, Any]:
    """One encoder (``TabularEncoder.to_dict``) from every branch's training-row statistics (``names``: whose).

    Numerics: the pooled mean and population standard deviation (1 where it is 0); categoricals: every value
    any branch saw, sorted. Every branch must hold the same numeric and categorical columns, in any order
    (each encodes in the encoder's order); the column order is the first branch's.
    """
    names = names or [f"#{i + 1}" for i in range(len(replies))]
    first = replies[0]
    for name, reply in zip(names[1:], replies[1:]):
        if difference := _schema_difference(reply, first):
            raise DataError(f"branch {name!r} does not hold the columns branch {names[0]!r} holds: it {difference}; "
                            "horizontal split learning needs one schema at every branch")
    means, scales = {}, {}
    for col in first.numeric:
        n = sum(r.numeric[col][0] for r in replies)
        if n == 0:
            raise DataError(f"column {col!r} has no value in any branch's training rows")
        mean = math.fsum(r.numeric[col][1] for r in replies) / n
        var = max(math.fsum(r.numeric[col][2] for r in replies) / n - mean * mean, 0.0)
        means[col], scales[col] = mean, (math.sqrt(var) if var > 0 else 1.0)
    categories = {col: sorted(set().union(*(r.categorical[col] for r in replies))) for col in first.categorical}
    return {"schema_version": SCHEMA_VERSION, "policies": POLICIES, "numeric": list(first.numeric),
            "categorical": list(first.categorical), "categories": categories, "means": means, "scales": scales}


def fedavg(states: list[dict[str, torch.Tensor]], rows: list[int]) -> dict[str, torch.Tensor]:
    """The row-weighted average of client-side models (FedAvg), in float64, in the given order."""
    total = float(sum(rows))
    return {name: sum((s[name].double() * (n / total) for s, n in zip(states, rows)),
                      torch.zeros_like(states[0][name], dtype=torch.float64)).float()
            for name in states[0]}


def bottom_start(settings: ConfigurationSettings, session: str, encoder: dict[str, Any]) -> LayerStart:
    b = settings.bottom
    return LayerStart(session=session, kind="bottom", hidden=b.hidden, out_width=b.cut_width, seed=b.seed,
                      optimizer=OptimizerConfig(optimizer=b.optimizer, learning_rate=b.learning_rate,
                                                weight_decay=b.weight_decay),
                      encoder=encoder)


@dataclass
class HorizontalOutcome:
    book: EpochBook
    test: dict[str, float]
    per_branch: dict[str, dict[str, float]]
    predictions: pd.DataFrame
    steps: dict[str, int]
    top: nn.Module
    encoder: dict[str, Any]
    audit: AuditRecord | None = None


class HorizontalTrainer:
    """The bank's loop over its branches (``peers``, by name) in the relay or SplitFed schedule."""

    def __init__(self, settings: ConfigurationSettings, task: Task, labels: dict[str, BranchLabels],
                 peers: dict[str, LayerPeer], *, progress: ProgressFn | None = None,
                 session_id: str | None = None) -> None:
        if settings.configuration not in ("relay", "splitfed"):
            raise ValueError(f"{settings.configuration} is not a horizontal configuration")
        if sorted(labels) != sorted(peers):
            raise DataError(f"labels name branches {sorted(labels)}, the run reaches {sorted(peers)}")
        self.settings, self.task, self.labels, self.peers = settings, task, labels, peers
        self.order = sorted(peers)
        self.progress = progress or (lambda message, fraction: None)
        self.session_id = session_id or f"{settings.configuration}-{uuid.uuid4().hex[:12]}"
        self.top = horizontal_top(settings, task)
        self.top_opt = build_optimizer(self.top.parameters(), settings.top)
        self.steps = dict.fromkeys(self.order, 0)
        self.train_rows = {b: len(labels[b].split.train) for b in self.order}
        self._pool = ThreadPoolExecutor(max_workers=len(self.order), thread_name_prefix="branch")
        self.audit = AuditRecord() if settings.audit else None
        self.encoder: dict[str, Any] = {}

    # --- set-up ---------------------------------------------------------------------------------------------
    def _stats(self, branch: str) -> StatsReply:
        try:
            return self.peers[branch].stats(self.labels[branch].split.train.tolist())
        except (PeerUnavailable, PeerUntrusted):
            raise
        except PeerError as exc:
            text = str(exc)
            if "positions must" not in text:  # another refusal (who may call, too few rows): its own words say why
                raise
            # It refused the rows our labels name: say which files to check.
            raise PeerError(f"branch {branch!r} refused the column statistics of the training rows the bank's labels "
                            f"name for it ({len(self.labels[branch].targets)} rows in all; it answered: {text}): "
                            "do the labels name more rows for it than it holds? check both files") from exc

    def start(self) -> None:
        replies = list(self._pool.map(self._stats, self.order))
        self.encoder = merge_encoder(replies, self.order)
        start = bottom_start(self.settings, self.session_id, self.encoder)
        infos = list(self._pool.map(lambda b: self.peers[b].start(start), self.order))
        for b, info in zip(self.order, infos):
            expected = self.labels[b]
            if info.rows != len(expected.targets) or info.ids_sha256 != expected.ids_sha256:
                raise PeerError(f"branch {b!r} holds {info.rows} rows whose IDs do not match the bank's labels "
                                f"for it ({len(expected.targets)} rows): check both files")
        # One starting point for every branch: the first branch's initial model, with no optimizer state.
        weights, state = self.peers[self.order[0]].weights(optimizer=False)
        for b in self.order[1:]:
            self.peers[b].load_weights(weights, state)

    # --- steps ----------------------------------------------------------------------------------------------
    def _top_step(self, embeddings: list[torch.Tensor], targets: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        leaves = [z.requires_grad_(True) for z in embeddings]
        loss = self.task.loss(self.top(torch.cat(leaves) if len(leaves) > 1 else leaves[0]), targets)
        self.top_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.top_opt.step()
        return float(loss.detach()), [z.grad for z in leaves]  # type: ignore[misc]

    def _record(self, branch: str, epoch: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if self.audit is not None:  # what the branch receives: the gradient of its embedding
            self.audit.record(branch, epoch, self.steps[branch], rows, grad)

    def _relay_epoch(self, epoch: int, handed: tuple[dict[str, torch.Tensor], dict[str, object]] | None) -> tuple[list[float], tuple[dict[str, torch.Tensor], dict[str, object]]]:
        t = self.settings.training
        losses = []
        for i, b in enumerate(self.order):
            peer = self.peers[b]
            if i > 0:  # the first branch holds it already: every branch got the relay's model at the epoch's end
                assert handed is not None
                peer.load_weights(*handed)
            pending: torch.Tensor | None = None
            for rows in epoch_batches(self.labels[b].split.train, t.batch, t.seed, epoch):
                self.steps[b] += 1
                z = peer.step(self.steps[b], pending, rows)  # the last step's gradient and this step's rows
                loss, (grad,) = self._top_step([z], self.labels[b].targets[rows])
                self._record(b, epoch, rows, grad)
                pending = grad
                losses.append(loss)
            if pending is not None:
                peer.backward(self.steps[b], pending)
            handed = peer.weights(optimizer=True)
        assert handed is not None
        return losses, handed

    def _splitfed_epoch(self, epoch: int) -> list[float]:
        t = self.settings.training
        batches = {b: epoch_batches(self.labels[b].split.train, t.batch, t.seed, epoch) for b in self.order}
        longest = max(len(v) for v in batches.values())
        losses = []
        pending: dict[str, torch.Tensor] = {}  # each branch's last gradient, sent with its next rows

        def step(b: str, j: int) -> torch.Tensor:
            return self.peers[b].step(self.steps[b], pending.pop(b, None), batches[b][j])

        for j in range(longest):
            active = [b for b in self.order if j < len(batches[b])]
            for b in active:
                self.steps[b] += 1
            zs = list(self._pool.map(lambda b: step(b, j), active))
            targets = torch.cat([self.labels[b].targets[batches[b][j]] for b in active])
            loss, grads = self._top_step(zs, targets)
            for b, g in zip(active, grads):
                self._record(b, epoch, batches[b][j], g)
                pending[b] = g
            losses.append(loss)
            every = self.settings.fedavg_every
            if (every and (j + 1) % every == 0) or j == longest - 1:
                self._flush(pending)
                self._average()
        return losses

    def _flush(self, pending: dict[str, torch.Tensor]) -> None:
        """Send every gradient still owed (before the weights are read: a branch applies it first)."""
        list(self._pool.map(lambda b: self.peers[b].backward(self.steps[b], pending[b]), list(pending)))
        pending.clear()

    def _average(self) -> None:
        got = list(self._pool.map(lambda b: self.peers[b].weights(optimizer=False), self.order))
        average = fedavg([w for w, _ in got], [self.train_rows[b] for b in self.order])
        list(self._pool.map(lambda b: self.peers[b].load_weights(average, {}), self.order))

    # --- evaluation -----------------------------------------------------------------------------------------
    def _outputs(self, part: str) -> dict[str, torch.Tensor]:
        def one(b: str) -> torch.Tensor:
            positions = getattr(self.labels[b].split, part)
            return self.peers[b].predict(torch.from_numpy(positions.astype(np.int64)))

        with torch.no_grad():
            return {b: self.top(z) for b, z in zip(self.order, self._pool.map(one, self.order))}

    def _scored(self, part: str) -> tuple[np.ndarray, torch.Tensor, dict[str, np.ndarray]]:
        outputs = self._outputs(part)
        per = {b: self.task.scores(outputs[b]) for b in self.order}
        targets = torch.cat([self.labels[b].targets[torch.from_numpy(getattr(self.labels[b].split, part))]
                             for b in self.order])
        return np.concatenate([per[b] for b in self.order]), targets, per

    def embeddings(self, branch: str, positions: np.ndarray) -> np.ndarray:
        """What the bank sees of a branch's rows: their embeddings (for the leakage audit)."""
        return self.peers[branch].predict(torch.from_numpy(positions.astype(np.int64))).numpy()

    # --- the loop -------------------------------------------------------------------------------------------
    def run(self) -> HorizontalOutcome:
        t = self.settings.training
        try:
            self.start()
            book = EpochBook(t.patience, self.task.objective)
            best: tuple[dict[str, int], dict[str, Any]] | None = None
            handed = None
            for epoch in range(t.epochs):
                began = time.perf_counter()
                if self.settings.configuration == "relay":
                    losses, handed = self._relay_epoch(epoch, handed)
                    for b in self.order[:-1]:  # every branch evaluates (and checkpoints) the model the relay reached
                        self.peers[b].load_weights(*handed)
                else:
                    losses = self._splitfed_epoch(epoch)
                trained = time.perf_counter() - began  # an epoch's time is its training steps (and averaging)
                scores, targets, _ = self._scored("val")
                val = self.task.metrics(targets, scores)
                list(self._pool.map(lambda b: self.peers[b].checkpoint(self.steps[b]), self.order))
                row = {"epoch": epoch + 1, "train_loss": float(np.mean(losses)),
                       "epoch_seconds": round(trained, 4), "steps": sum(self.steps.values()),
                       "eval_seconds": round(time.perf_counter() - began - trained, 4)}
                if book.record_validation(val, row):
                    best = (dict(self.steps), {"top": copy.deepcopy(self.top.state_dict()),
                                               "top_opt": copy.deepcopy(self.top_opt.state_dict())})
                said = f"validation {book.metric} {val[book.metric]:.4f}"
                self.progress(f"epoch {epoch + 1}/{t.epochs}: {said}", (epoch + 1) / t.epochs)
                logger.info("epoch %d: %s", epoch + 1, said)
                if book.stop:
                    break
            if t.restore_best and best is not None:
                for b in self.order:
                    self.peers[b].restore(best[0][b])
                self.top.load_state_dict(best[1]["top"])
            scores, targets, per = self._scored("test")
        except BaseException:
            for peer in self.peers.values():
                peer.end()
            self._pool.shutdown()
            raise
        self._pool.shutdown()
        test = self.task.metrics(targets, scores)
        per_branch = {}
        for b in self.order:
            y = self.labels[b].targets[torch.from_numpy(self.labels[b].split.test)]
            # A branch whose test customers all have one label has no ROC-AUC.
            one_class = self.task.kind == "binary" and not 0 < float(y.mean()) < 1
            per_branch[b] = {} if one_class else self.task.metrics(y, per[b])
        predictions = pd.DataFrame({
            "branch": np.concatenate([[b] * len(self.labels[b].split.test) for b in self.order]),
            "position": np.concatenate([self.labels[b].split.test for b in self.order]),
            "target": targets.numpy(), **self.task.score_columns(scores)})
        return HorizontalOutcome(book, test, per_branch, predictions, dict(self.steps), self.top, self.encoder, self.audit)
