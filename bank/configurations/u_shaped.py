"""U-shaped and vanilla split learning: the bank owns the rows; a compute party holds the layers after its cut.

- **U-shaped**: bank bottom -> (cut 1) -> compute party's trunk -> (cut 2) -> bank head and loss. Two round
  trips a step (forward, then backward); the labels and the head never leave the bank. By the chain rule this
  is the computation of the unsplit model ``bottom -> trunk -> head``, and ``tests/test_configurations.py``
  proves it bit for bit against ``bank.lab.references.twins``.
- **Vanilla**: bank bottom -> (cut) -> compute party's server layers and loss. One round trip a step, and the
  compute party sees every training label: the configuration of the original protocol, for a bank that
  trusts its compute party with labels (the audit says what that costs).

The compute party checkpoints at every epoch end; if it restarts (it answers ``UnknownSession``), the bank
resumes both sides from the last checkpoint and replays from there: the same model, bit for bit.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from bank.audit_record import AuditRecord
from bank.config import TrainingConfig
from bank.epochs import EpochBook
from bank.configurations.layer_peer import LayerPeer
from bank.vertical.schedule import Split, epoch_batches, split_rows
from bank.configurations.split_run import ConfigurationSettings, ProgressFn
from bank.task import Task
from parties.errors import PeerError, UnknownSession
from parties.learning.config import OptimizerConfig
from parties.learning.model import build_bottom, build_optimizer, mlp
from parties.protocol.layers import LayerStart
from parties.tables.encoding import TabularEncoder
from parties.tables.table import PartyTable

__all__ = ["OwnerData", "OwnerOutcome", "OwnerTrainer", "compute_start", "owner_data", "owner_head"]

logger = logging.getLogger(__name__)

#: How many times one run resumes a compute party that restarted before it gives up.
MAX_RESUMES = 3


@dataclass(frozen=True)
class OwnerData:
    """The bank's rows as its bottom reads them: encoded on its own training rows, with the task's targets."""

    features: torch.Tensor
    targets: torch.Tensor
    split: Split
    encoder: TabularEncoder
    task: Task


def owner_data(table: PartyTable, training: TrainingConfig) -> OwnerData:
    if table.labels is None:
        raise PeerError("the bank's table has no label column")
    task = Task(training.task, training.positive_label).fit(table.labels)
    targets = task.targets(table.labels)
    split = split_rows(len(table), targets, task, training)
    task.fit_target_scale(targets[torch.from_numpy(split.train)])
    encoder = TabularEncoder(table.schema).fit(table.features.iloc[split.train])
    return OwnerData(torch.from_numpy(encoder.transform(table.features)), targets, split, encoder, task)


def _optimizer(config: OptimizerConfig) -> OptimizerConfig:
    return OptimizerConfig(optimizer=config.optimizer, learning_rate=config.learning_rate,
                           weight_decay=config.weight_decay)


def owner_head(settings: ConfigurationSettings, task: Task) -> nn.Sequential | None:
    """U-shaped: the bank's head after the trunk (one linear layer to the task's outputs); vanilla: none."""
    if settings.configuration != "u-shaped":
        return None
    return mlp(settings.trunk.width, (), task.output_dim, activate_output=False, seed=settings.top.seed)


def compute_start(settings: ConfigurationSettings, session: str, task: Task,
                  resume_step: int | None = None) -> LayerStart:
    """What the bank asks the compute party to hold: the trunk (U-shaped) or the server layers and the task's
    loss (vanilla)."""
    cut = settings.bottom.cut_width
    if settings.configuration == "u-shaped":
        t = settings.trunk
        return LayerStart(session=session, kind="trunk", in_width=cut, hidden=t.hidden, out_width=t.width,
                          seed=t.seed, optimizer=_optimizer(t), resume_step=resume_step)
    top = settings.top
    assert task.kind is not None, "fit the task first"
    return LayerStart(session=session, kind="server", in_width=cut, hidden=top.hidden, out_width=task.output_dim,
                      seed=top.seed, optimizer=_optimizer(top), resume_step=resume_step, task=task.kind)


@dataclass
class OwnerOutcome:
    book: EpochBook
    test: dict[str, float]
    predictions: pd.DataFrame
    test_scores: np.ndarray
    steps: int
    resumes: int
    bottom: nn.Module
    head: nn.Module | None
    audit: AuditRecord | None = None


class OwnerTrainer:
    """The bank's loop: its bottom (and head), the compute party through ``peer``."""

    def __init__(self, settings: ConfigurationSettings, data: OwnerData, peer: LayerPeer, *,
                 progress: ProgressFn | None = None, session_id: str | None = None) -> None:
        if settings.configuration not in ("u-shaped", "vanilla"):
            raise ValueError(f"{settings.configuration} is not a bank-owned configuration")
        self.settings, self.data, self.peer = settings, data, peer
        self.progress = progress or (lambda message, fraction: None)
        self.session_id = session_id or f"{settings.configuration}-{uuid.uuid4().hex[:12]}"
        self.bottom = build_bottom(data.features.shape[1], settings.bottom)
        self.bottom_opt = build_optimizer(self.bottom.parameters(), settings.bottom)
        self.head = owner_head(settings, data.task)
        self.head_opt = build_optimizer(self.head.parameters(), settings.top) if self.head is not None else None
        self.u_shaped = settings.configuration == "u-shaped"
        self.audit = AuditRecord() if settings.audit else None

    # --- one step -------------------------------------------------------------------------------------------
    def _step(self, step: int, rows: torch.Tensor, epoch: int) -> float:
        x, y = self.data.features[rows], self.data.targets[rows]
        h1 = self.bottom(x)
        if self.u_shaped:
            assert self.head is not None and self.head_opt is not None
            h2 = self.peer.forward(step, h1.detach()).requires_grad_(True)
            loss = self.data.task.loss(self.head(h2), y)
            self.head_opt.zero_grad(set_to_none=True)
            loss.backward()
            assert h2.grad is not None
            if self.audit is not None:  # what the compute party receives: the gradient at its output
                self.audit.record("compute", epoch, step, rows, h2.grad)
            g1 = self.peer.backward(step, h2.grad)
            loss_value = float(loss.detach())
        else:
            g1, loss_value = self.peer.train(step, h1.detach(), self.data.task.loss_targets(y))
        self.bottom_opt.zero_grad(set_to_none=True)
        h1.backward(g1)
        self.bottom_opt.step()
        if self.head_opt is not None:
            self.head_opt.step()
        return loss_value

    # --- evaluation -----------------------------------------------------------------------------------------
    def outputs(self, positions: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            h1 = self.bottom(self.data.features[torch.from_numpy(positions)])
        out = self.peer.predict(h1)
        if self.head is not None:
            with torch.no_grad():
                out = self.head(out)
        return out

    def scores(self, positions: np.ndarray) -> np.ndarray:
        return self.data.task.scores(self.outputs(positions))

    def embeddings(self, positions: np.ndarray) -> np.ndarray:
        """What the compute party sees of these rows: the bank's cut-layer activations."""
        with torch.no_grad():
            return self.bottom(self.data.features[torch.from_numpy(positions)]).numpy()

    # --- the loop -------------------------------------------------------------------------------------------
    def _own_state(self) -> dict[str, Any]:
        state = {"bottom": self.bottom.state_dict(), "bottom_opt": self.bottom_opt.state_dict()}
        if self.head is not None and self.head_opt is not None:
            state |= {"head": self.head.state_dict(), "head_opt": self.head_opt.state_dict()}
        return copy.deepcopy(state)

    def _load_own(self, state: dict[str, Any]) -> None:
        self.bottom.load_state_dict(state["bottom"])
        self.bottom_opt.load_state_dict(copy.deepcopy(state["bottom_opt"]))
        if self.head is not None and self.head_opt is not None:
            self.head.load_state_dict(state["head"])
            self.head_opt.load_state_dict(copy.deepcopy(state["head_opt"]))

    def run(self) -> OwnerOutcome:
        s, t = self.settings, self.settings.training
        split = self.data.split
        task = self.data.task
        self.peer.start(compute_start(s, self.session_id, task))
        self.peer.checkpoint(0)
        # Every epoch end: (epoch, step, the bank's own state); the compute party holds the same step on disk.
        saved: list[tuple[int, int, dict[str, Any]]] = [(-1, 0, self._own_state())]
        book = EpochBook(t.patience, task.objective)
        best: tuple[int, dict[str, Any]] = (0, saved[0][2])
        n_batches = len(epoch_batches(split.train, t.batch, t.seed, 0))
        step, epoch, resumes = 0, 0, 0
        try:
            while epoch < t.epochs:
                began = time.perf_counter()
                try:
                    losses = []
                    for i, rows in enumerate(epoch_batches(split.train, t.batch, t.seed, epoch)):
                        if t.max_steps is not None and step >= t.max_steps:
                            break
                        step += 1
                        losses.append(self._step(step, rows, epoch))
                        if i % 10 == 0:
                            self.progress(f"epoch {epoch + 1}/{t.epochs}, step {step}",
                                          (epoch + (i + 1) / n_batches) / t.epochs)
                    trained = time.perf_counter() - began  # an epoch's time is its training steps
                    val = task.metrics(self.data.targets[torch.from_numpy(split.val)], self.scores(split.val))
                    self.peer.checkpoint(step)
                except UnknownSession:
                    if resumes >= MAX_RESUMES:
                        raise
                    resumes += 1
                    epoch, step, own = saved[-1]
                    epoch += 1
                    logger.warning("the compute party lost session %s (it restarted?): resuming both sides from "
                                   "step %d, the start of epoch %d", self.session_id, step, epoch + 1)
                    self._load_own(own)
                    self.peer.start(compute_start(s, self.session_id, task, resume_step=step))
                    if self.audit is not None:  # the steps after ``step`` are trained, and recorded, again
                        self.audit.truncate(step + 1)
                    continue
                saved.append((epoch, step, self._own_state()))
                row = {"epoch": epoch + 1, "train_loss": float(np.mean(losses)) if losses else float("nan"),
                       "epoch_seconds": round(trained, 4), "step": step,
                       "eval_seconds": round(time.perf_counter() - began - trained, 4)}
                if book.record_validation(val, row):
                    best = (step, saved[-1][2])
                logger.info("epoch %d: validation %s %.4f", epoch + 1, book.metric, val[book.metric])
                if book.stop or (t.max_steps is not None and step >= t.max_steps):
                    break
                epoch += 1
            # The compute party may restart here too (all its steps are on disk by now): resume it at the step it
            # ends with (the best epoch's, or the last) and go on, instead of failing a finished run.
            while True:
                try:
                    if t.restore_best:
                        self.peer.restore(best[0])
                        self._load_own(best[1])
                    test_scores = self.scores(split.test)
                    break
                except UnknownSession:
                    if resumes >= MAX_RESUMES:
                        raise
                    resumes += 1
                    final = best[0] if t.restore_best else step
                    logger.warning("the compute party lost session %s (it restarted?) after training: resuming it "
                                   "at step %d", self.session_id, final)
                    self.peer.start(compute_start(s, self.session_id, task, resume_step=final))
        except BaseException:
            self.peer.end()
            raise
        test_targets = self.data.targets[torch.from_numpy(split.test)]
        test = task.metrics(test_targets, test_scores)
        predictions = pd.DataFrame({"position": split.test, "target": test_targets.numpy(),
                                    **task.score_columns(test_scores)})
        return OwnerOutcome(book, test, predictions, test_scores, step, resumes, self.bottom, self.head, self.audit)
