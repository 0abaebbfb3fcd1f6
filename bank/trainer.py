"""The training coordinator: the bank's top model, the step loop over every party, evaluation.

The bank decides the split of the aligned rows and the order of batches and
shares only row positions, never labels. Each step, every party embeds the
batch concurrently (the bank's own bottom runs while it waits for the
partners); the bank aggregates, computes the loss, updates its top model and
keeps each party's embedding gradient to send with the next step.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.model_selection import train_test_split

from bank.aggregation import get_aggregation
from bank.config import TrainingConfig
from bank.proxy import TrainingParty
from bank.task import Task
from parties.errors import ConfigError
from parties.model import build_optimizer, mlp

__all__ = ["AuditRecord", "Coordinator", "Split", "TrainingOutcome", "epoch_batches", "split_rows"]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str, float], None]


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def split_rows(n: int, targets: torch.Tensor, task: Task, config: TrainingConfig) -> Split:
    """A seeded train/validation/test split of the aligned positions, stratified by label."""
    positions = np.arange(n)
    labels = targets.numpy() if task.stratify else None
    try:
        rest, test = train_test_split(
            positions, test_size=config.test_fraction, random_state=config.seed, stratify=labels
        )
        train, val = train_test_split(
            rest,
            test_size=config.val_fraction / (1 - config.test_fraction),
            random_state=config.seed,
            stratify=None if labels is None else labels[rest],
        )
    except ValueError as exc:
        raise ConfigError(f"cannot split {n} aligned rows as configured: {exc}") from exc
    return Split(np.sort(train), np.sort(val), np.sort(test))


def epoch_batches(train: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The batches of one epoch: a permutation seeded by (seed, epoch), cut into batches."""
    order = np.random.default_rng([seed, epoch]).permutation(train)
    return [torch.from_numpy(order[i : i + batch_size].astype(np.int64)) for i in range(0, len(order), batch_size)]


@dataclass
class AuditRecord:
    """What crossed the cut, kept for analysis only (``TrainingConfig.audit``).

    ``gradients[name]`` holds, per training row and epoch, the gradient that
    partner received; ``embeddings[name]`` the final model's embeddings of the
    validation and test rows, as the bank received them.
    """

    gradients: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    embeddings: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def add_gradients(self, name: str, epoch: int, step: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        record = self.gradients.setdefault(name, {"epoch": [], "step": [], "rows": [], "grads": []})
        record["epoch"].append(torch.full((len(rows),), epoch, dtype=torch.int64))
        record["step"].append(torch.full((len(rows),), step, dtype=torch.int64))
        record["rows"].append(rows.clone())
        record["grads"].append(grad.detach().clone())

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """One flat tensor dict per file: ``gradients-<name>`` and ``embeddings-<name>``."""
        out = {f"gradients-{n}": {k: torch.cat(v) for k, v in r.items()} for n, r in self.gradients.items()}
        out |= {f"embeddings-{n}": r for n, r in self.embeddings.items()}
        return out


@dataclass
class TrainingOutcome:
    session_id: str
    history: list[dict[str, Any]]
    test_metrics: dict[str, float]
    best_epoch: int
    steps: int
    split: Split
    test_scores: np.ndarray
    widths: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    audit: AuditRecord | None = None


class Coordinator:
    """Runs one training session across ``parties`` (the bank's own first)."""

    def __init__(
        self,
        config: TrainingConfig,
        task: Task,
        targets: torch.Tensor,
        parties: Sequence[TrainingParty],
        *,
        alignment_id: str,
        session_id: str | None = None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.config, self.task, self.targets, self.parties = config, task, targets, list(parties)
        self.alignment_id = alignment_id
        self.session_id = session_id or uuid.uuid4().hex
        self.progress = progress or (lambda _msg, _frac: None)
        self.aggregation = get_aggregation(config.aggregation)
        self.split = split_rows(len(targets), targets, task, config)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.parties) - 1), thread_name_prefix="party")
        self.wait_seconds = {p.name: 0.0 for p in self.parties}
        self.top: torch.nn.Module | None = None
        self.train_rows_sent = 0  # rows embedded for training (each also gets a gradient back)
        self.eval_rows_sent = 0  # rows embedded for evaluation
        self.audit = AuditRecord() if config.audit else None

    # --- calling every party at once ----------------------------------------------------

    def _timed(self, party: TrainingParty, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.wait_seconds[party.name] += time.perf_counter() - started

    def _step_all(
        self,
        step: int,
        grads: list[torch.Tensor | None],
        rows: torch.Tensor | None,
        while_waiting: Callable[[], None] = lambda: None,
    ) -> list[Any]:
        """One step at every party: send to the partners, compute here meanwhile, then collect.

        The partners' requests are on the wire while the bank runs
        ``while_waiting`` and its own bottom, without a thread: on a small
        model a thread hop costs as much as the overlap gains.
        """
        own, *others = self.parties
        started = time.perf_counter()
        pending = [p.submit_step(step, g, rows) for p, g in zip(others, grads[1:])]
        while_waiting()
        first = self._timed(own, lambda: own.step(step, grads[0], rows))
        results = [first]
        for p, finish in zip(others, pending):
            results.append(finish())
            self.wait_seconds[p.name] += time.perf_counter() - started  # from sending to its answer
        return results

    def _all(self, call: Callable[[TrainingParty], Any]) -> list[Any]:
        """``call`` on every party: the partners in threads, the bank's own in this thread meanwhile."""
        own, *others = self.parties
        futures = [self._pool.submit(self._timed, p, lambda p=p: call(p)) for p in others]
        first = self._timed(own, lambda: call(own))
        return [first, *(f.result() for f in futures)]

    # --- the loop --------------------------------------------------------------------------

    def _start(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        train = torch.from_numpy(self.split.train.astype(np.int64))
        widths = self._all(lambda p: p.start_training(self.session_id, self.alignment_id, train))
        self.widths = {p.name: int(w) for p, w in zip(self.parties, widths)}
        width = self.aggregation.width(widths)
        top = mlp(width, self.config.top.hidden, self.task.output_dim, activate_output=False, seed=self.config.top.seed)
        return top, build_optimizer(top.parameters(), self.config.top)

    def _outputs(self, top: torch.nn.Module, positions: np.ndarray) -> torch.Tensor:
        outs = []
        top.eval()
        with torch.no_grad():
            for i in range(0, len(positions), self.config.eval_batch_size):
                rows = torch.from_numpy(positions[i : i + self.config.eval_batch_size].astype(np.int64))
                self.eval_rows_sent += len(rows)
                outs.append(top(self.aggregation.combine(self._all(lambda p: p.embed(rows)))))
        top.train()
        return torch.cat(outs) if outs else torch.zeros((0, self.task.output_dim))

    def evaluate(self, top: torch.nn.Module, positions: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
        scores = self.task.scores(self._outputs(top, positions))
        return self.task.metrics(self.targets[torch.from_numpy(positions)], scores), scores

    def _record_embeddings(self, audit: AuditRecord) -> None:
        rows = torch.from_numpy(np.concatenate([self.split.val, self.split.test]).astype(np.int64))
        for p in self.parties[1:]:
            audit.embeddings[p.name] = {"rows": rows, "embedding": p.embed(rows)}
        self.eval_rows_sent += len(rows)

    def run(self) -> TrainingOutcome:
        started = time.perf_counter()
        top, optimizer = self._start()
        self.top = top
        metric, mode = self.task.objective
        better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)
        best_score, best_epoch, best_top, stale = None, -1, None, 0
        history: list[dict[str, Any]] = []
        step, k = 0, len(self.parties)
        steps_per_epoch = -(-len(self.split.train) // self.config.batch_size)
        total_steps = min(self.config.max_steps or 1 << 62, steps_per_epoch * self.config.epochs)
        try:
            for epoch in range(self.config.epochs):
                epoch_start = time.perf_counter()
                grads: list[torch.Tensor | None] = [None] * k
                losses = []
                top_has_gradients = [False]

                def apply_top_update() -> None:
                    # The top's optimiser step for step t runs while the parties work on step t+1:
                    # still before the top's next forward, so the computation is unchanged.
                    if top_has_gradients[0]:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        top_has_gradients[0] = False

                for rows in epoch_batches(self.split.train, self.config.batch_size, self.config.seed, epoch):
                    zs = self._step_all(step, grads, rows, while_waiting=apply_top_update)
                    self.train_rows_sent += len(rows)
                    leaves = [z.requires_grad_(True) for z in zs]
                    loss = self.task.loss(top(self.aggregation.combine(leaves)), self.targets[rows])
                    loss.backward()
                    top_has_gradients[0] = True
                    grads = [leaf.grad for leaf in leaves]
                    if self.audit is not None:
                        for p, g in zip(self.parties[1:], grads[1:]):
                            self.audit.add_gradients(p.name, epoch, step, rows, g)
                    losses.append(loss.item())
                    step += 1
                    if step % 20 == 0 or step >= total_steps:
                        self.progress(
                            f"epoch {epoch + 1}/{self.config.epochs} step {step} loss {np.mean(losses):.4f}",
                            min(step / total_steps, 1.0),
                        )
                    if self.config.max_steps is not None and step >= self.config.max_steps:
                        break
                self._step_all(step, grads, None, while_waiting=apply_top_update)  # the flush: no new batch
                step += 1
                train_seconds = time.perf_counter() - epoch_start
                val, _ = self.evaluate(top, self.split.val)
                row = {"epoch": epoch + 1, "steps": step, "train_loss": float(np.mean(losses))}
                row |= {f"val_{m}": v for m, v in val.items()}
                row["train_seconds"] = train_seconds
                row["seconds"] = time.perf_counter() - epoch_start
                history.append(row)
                logger.info("session %s epoch %d: train loss %.4f, val %s %.4f",
                            self.session_id, epoch + 1, row["train_loss"], metric, val[metric])
                if best_score is None or better(val[metric], best_score):
                    best_score, best_epoch, stale = val[metric], epoch + 1, 0
                    best_top = copy.deepcopy(top.state_dict())
                    self._all(lambda p: p.mark_best())
                else:
                    stale += 1
                    if stale >= self.config.patience:
                        logger.info("session %s: early stop after epoch %d", self.session_id, epoch + 1)
                        break
                if self.config.max_steps is not None and step >= self.config.max_steps:
                    break
            restore = self.config.restore_best and best_top is not None
            if restore:
                top.load_state_dict(best_top)
            self.files = self._all(lambda p: p.finish(restore_best=restore))
            test, scores = self.evaluate(top, self.split.test)
            if self.audit is not None:
                self._record_embeddings(self.audit)
        finally:
            for p in self.parties:
                try:
                    p.end()
                except Exception:
                    logger.warning("could not end the training session at %s", p.name)
            self._pool.shutdown(wait=False)
        return TrainingOutcome(
            session_id=self.session_id, history=history, test_metrics=test, best_epoch=best_epoch, steps=step,
            split=self.split, test_scores=scores, widths=self.widths, audit=self.audit,
            timings={"total_seconds": time.perf_counter() - started,
                     **{f"wait_seconds_{n}": round(s, 3) for n, s in self.wait_seconds.items()}},
        )


def history_frame(history: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(history)
