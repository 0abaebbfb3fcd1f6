"""The training coordinator: the bank's top model, the step loop over every party, evaluation.

The bank decides the split of the aligned rows and the order of batches and
shares only row positions, never labels. Each step, every party embeds the
batch concurrently (the bank's own bottom runs while it waits for the
partners); the bank aggregates, computes the loss, updates its top model and
keeps each party's embedding gradient to send with the next step.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bank.audit_record import AuditRecord
from bank.config import TrainingConfig
from bank.epochs import EpochBook
from bank.scoring.subsets import partial_subsets
from bank.task import Task
from bank.vertical.aggregation import get_aggregation
from bank.vertical.defenses import GradientDefense, bank_secret, randomized_response
from bank.vertical.local_steps import LocalTop
from bank.vertical.party import TrainingParty
from bank.vertical.recovery import RESUMING, Recovery
from bank.vertical.schedule import Split, epoch_batches, split_rows
from bank.vertical.state import LoopState
from parties.errors import Behind, CutlayerError, PeerError, PeerUnavailable, StorageError, UnknownSession
from parties.learning import fast_path
from parties.learning.model import build_optimizer, build_top, load_factory
from parties.learning.secret import Secret
from parties.observability import bind_log, log_context
from parties.storage.checkpoint import CheckpointWriter

__all__ = ["Coordinator", "Split", "TrainingOutcome", "epoch_batches", "split_rows"]

logger = logging.getLogger(__name__)
#: How many times one run rolls back (or restarts) for a party that restarted before it stops: a party that
#: answers ``Behind`` or ``UnknownSession`` again and again is not restarting, and would hold the run for ever.
MAX_ROLLBACKS = 10

#: The share of a training job's progress the training steps take; finishing (best weights, model
#: files, the test rows) takes the rest, so a bar reaches its end only when the job has.
TRAINING_SHARE = 0.95

ProgressFn = Callable[..., None]  # (message, fraction, event=False): parties.transport.jobs.Progress


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


class Coordinator(Recovery):
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
        checkpoint_dir: Path | None = None,
        secret: Secret | None = None,
    ) -> None:
        """``secret``: the bank's protective randomness (default: ``bank.vertical.defenses.bank_secret``)."""
        self.task, self.targets, self.parties = task, targets, list(parties)
        self.alignment_id = alignment_id
        self.session_id = session_id or uuid.uuid4().hex
        self.progress = progress or (lambda _msg, _frac=None, **_more: None)
        self.aggregation = get_aggregation(config.aggregation)
        self.checkpoint_dir = checkpoint_dir  # None: no checkpoints, no rollback
        self.secret = secret or bank_secret(config, checkpoint_dir, self.session_id)
        self.split = split_rows(len(targets), targets, task, config, secret=self.secret)
        # Settings left to adapt to the table (the task, the batch size) are set here, once, and said.
        config, self.chosen = config.resolved(task.kind, len(self.split.train))
        self.config = config
        for setting, value in self.chosen.items():
            logger.info("session %s: %s = %s", self.session_id, setting, value)
        task.fit_target_scale(targets[torch.from_numpy(self.split.train)])
        # What the loss sees: the true labels, or (label DP) the training labels flipped once, here.
        self.train_targets = targets
        if config.label_dp_epsilon is not None:
            self.train_targets = randomized_response(targets, self.split.train, config.label_dp_epsilon, self.secret)
        self.defense = GradientDefense(config.gradient_defense, noise=config.gradient_noise, power=config.marvell_power,
                                       batch=config.batch, secret=self.secret,
                                       persistence=config.marvell_persistence, rows=len(targets))
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.parties) - 1), thread_name_prefix="party")
        self.wait_seconds = {p.name: 0.0 for p in self.parties}
        self.top: torch.nn.Module | None = None
        self.train_rows_sent = 0  # rows embedded for training (each also gets a gradient back)
        self.eval_rows_sent = 0  # rows embedded for evaluation
        self.audit = AuditRecord() if config.audit else None
        self.local_top = LocalTop(config.local_steps, config.reuse_steps, self._loss)  # local steps (exact: unused)
        self.writer = CheckpointWriter()
        self.rollbacks = 0
        # Every party's embedding of every aligned row from the final weights, when heads for customers only
        # some partners hold will be trained on them (two or more partners); the bank's to keep, like any
        # evaluation embedding.
        self.embeddings: dict[str, torch.Tensor] | None = None

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
        checkpoint: bool = False,
    ) -> list[Any]:
        """One step at every party: send to the partners, compute here meanwhile, then collect.

        The partners' requests are on the wire while the bank runs
        ``while_waiting`` and its own bottom, without a thread: on a small
        model a thread hop costs as much as the overlap gains.
        ``while_waiting`` may fill in ``grads[0]``, the bank's own gradient.
        """
        own, *others = self.parties
        self.writer.check()  # the bank's last write failed: stop before anything more is lost
        started = time.perf_counter()
        floor = self._floor() if checkpoint else None
        pending = [p.submit_step(step, g, rows, checkpoint, floor) for p, g in zip(others, grads[1:])]
        while_waiting()
        first = self._timed(own, own.submit_step(step, grads[0], rows, checkpoint, floor))
        results, failures = [first], []
        for p, finish in zip(others, pending):
            try:  # collect every answer, even after one failed: no request is left in flight
                results.append(finish())
            except CutlayerError as exc:
                failures.append(exc)
            self.wait_seconds[p.name] += time.perf_counter() - started  # from sending to its answer
        if failures:
            raise failures[0]
        return results

    def _all(self, call: Callable[[TrainingParty], Any]) -> list[Any]:
        """``call`` on every party: the partners in threads, the bank's own in this thread meanwhile.

        Every call has ended before this returns or raises (the first failure): none is left
        running into a rollback.
        """
        own, *others = self.parties
        futures = [self._pool.submit(self._timed, p, lambda p=p: call(p)) for p in others]
        try:
            first = self._timed(own, lambda: call(own))
        finally:
            wait(futures)
        return [first, *(f.result() for f in futures)]

    # --- the loop --------------------------------------------------------------------------

    def _start(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        # The bank's own modules are imported before any party opens a session a failure would leave behind.
        for name, role in ((self.config.top.factory, "top"), (self.config.bank_bottom.factory, "bottom")):
            if name is not None:
                load_factory(name, role)
        train = torch.from_numpy(self.split.train.astype(np.int64))
        precision, local = self.config.wire_precision, self.config.local
        widths = self._all(lambda p: p.start_training(self.session_id, self.alignment_id, train, precision, local))
        self.widths = {p.name: int(w) for p, w in zip(self.parties, widths)}
        return self._build_top()

    def _book(self) -> EpochBook:
        """An empty epoch book with the run's patience and the task's objective."""
        return EpochBook(self.config.patience, self.task.objective)

    def _build_top(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        width = self.aggregation.width([self.widths[p.name] for p in self.parties])
        top = build_top(width, self.config.top, self.task.output_dim)
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

    def _embed_all(self) -> dict[str, torch.Tensor]:
        """Every party's embedding of every aligned row, in evaluation mode."""
        n, size = len(self.targets), self.config.eval_batch_size
        parts: dict[str, list[torch.Tensor]] = {p.name: [] for p in self.parties}
        for start in range(0, n, size):
            rows = torch.arange(start, min(start + size, n))
            for p, z in zip(self.parties, self._all(lambda p: p.embed(rows))):
                parts[p.name].append(z)
            self.eval_rows_sent += len(rows)
        return {name: torch.cat(zs) for name, zs in parts.items()}

    def _record_embeddings(self, audit: AuditRecord) -> None:
        rows = torch.from_numpy(np.concatenate([self.split.val, self.split.test]).astype(np.int64))
        for p in self.parties[1:]:
            audit.embeddings[p.name] = {"rows": rows, "embedding": p.embed(rows)}
        self.eval_rows_sent += len(rows)

    def _loss(self, top: torch.nn.Module, leaves: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        outputs = fast_path.forward(top, self.aggregation.combine(leaves))
        return self.task.loss(outputs, self.train_targets.index_select(0, rows))

    # --- the loop --------------------------------------------------------------------------

    def run(self, resume: bool = False) -> TrainingOutcome:
        """Train from the start, or (``resume``) from the latest step every party has checkpointed."""
        with log_context(session=self.session_id):  # what it logs carries the session (JSON log lines)
            return self._run(resume)

    def _run(self, resume: bool) -> TrainingOutcome:
        started = time.perf_counter()
        if resume and self._checkpoint_steps():
            top, optimizer = self._reattach()
            self.top = top
            loop = self._rollback(LoopState(grads=[], book=self._book()), optimizer, RESUMING)
            if self.audit is not None:  # what crossed before the bank stopped was in the memory it lost
                self.audit.first_step = loop.step
        else:  # a session the bank stopped before its first checkpoint starts again, the same way
            if resume:
                logger.warning("session %s: the bank has no checkpoint of it; starting it again", self.session_id)
            top, optimizer = self._start()
            self.top = top
            loop = LoopState(grads=[None] * len(self.parties), book=self._book())
        finished = False
        try:
            while True:
                # A party that restarted answers any call with Behind, up to the test evaluation: the
                # weights it finished with must be the ones every party agrees on.
                try:
                    self._train(loop, optimizer)
                    test, scores = self._finish(loop)
                    break
                except (Behind, UnknownSession) as exc:  # a party restarted: behind, or before its first checkpoint
                    if self.checkpoint_dir is None:
                        raise
                    if self.rollbacks >= MAX_ROLLBACKS:  # restarts are rare: a party that is always behind is not
                        raise PeerError(f"{exc}. The run rolled back {self.rollbacks} times, the most one run does: "
                                        f"training stopped; {self._last_consistent()}") from exc
                    loop = self._rollback(loop, optimizer, exc)
                except PeerUnavailable as exc:
                    raise PeerUnavailable(f"{exc}. Training stopped; {self._last_consistent()}") from exc
                except StorageError as exc:  # a party's disk: stop now, the whole checkpoints stay for a resume
                    who = "" if str(exc).startswith("partner ") else f"the bank {self.parties[0].name!r} "
                    raise StorageError(f"{who}{exc}. Training stopped; {self._last_consistent()}") from exc
            finished = True
        finally:
            if finished and hasattr(self.progress, "finishing"):  # a job's reporter: a stop is refused from here on
                self.progress.finishing()
            for p in self.parties:
                try:
                    p.end(finished=finished)
                except CutlayerError as exc:
                    logger.warning("could not end the training session at %s: %s", p.name, exc)
            self._pool.shutdown(wait=False)
            self.writer.close()
        return TrainingOutcome(
            session_id=self.session_id, history=loop.book.history, test_metrics=test, best_epoch=loop.book.best_epoch,
            steps=loop.step, split=self.split, test_scores=scores, widths=self.widths, audit=self.audit,
            timings={"total_seconds": time.perf_counter() - started, "rollbacks": self.rollbacks,
                     **{f"wait_seconds_{n}": round(s, 3) for n, s in self.wait_seconds.items()}},
        )

    def _curve_point(self, row: dict[str, Any]) -> dict[str, float]:
        """An epoch's figures for the operator's live curve, with the bytes and round trips of each partner so far."""
        point = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        for p in self.parties[1:]:
            if hasattr(p, "round_trips"):  # a partner behind HTTP
                point[f"bytes_{p.name}"] = float(p.bytes_sent + p.bytes_received)
                point[f"round_trips_{p.name}"] = float(p.round_trips)
        return point

    def _finish(self, loop: LoopState) -> tuple[dict[str, float], np.ndarray]:
        """Every party writes its model (the best epoch's, if asked); the test rows are scored."""
        assert self.top is not None
        self.progress("finishing: the best epoch's weights, the model files, the test rows", TRAINING_SHARE)
        restore = self.config.restore_best and loop.book.best_state is not None
        if restore:
            self.top.load_state_dict(loop.book.best_state)
        self.files = self._all(lambda p: p.finish(restore_best=restore))
        self.writer.flush()  # a failed checkpoint write fails the run, not just the next resume
        self.writer.check()
        test, scores = self.evaluate(self.top, self.split.test)
        if partial_subsets([p.name for p in self.parties]):
            self.progress("embedding the aligned rows for the heads of partial subsets", TRAINING_SHARE)
            self.embeddings = self._embed_all()
        if self.audit is not None:
            self._record_embeddings(self.audit)
        return test, scores

    def _train(self, loop: LoopState, optimizer: torch.optim.Optimizer) -> None:
        """Train from ``loop``'s position to the end; ``loop`` always says where training stands."""
        top = self.top
        assert top is not None
        metric = loop.book.metric
        local = self.config.local_steps  # batches per exchange (1: exact)
        steps_per_epoch = -(-len(self.split.train) // (self.config.batch * local))
        # Each epoch ends with a flush step, which ``loop.step`` counts as well.
        total_steps = min(self.config.max_steps or 1 << 62, (steps_per_epoch + 1) * self.config.epochs)
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, own leaf) of a step not yet finished
        top_params = list(top.parameters())
        public = not fast_path.serves(top)  # the bank's own top trains on torch's public calls
        unsaved = False  # a checkpoint is due for the last step
        reuse_due = False  # local steps: the last exchange's reuse updates of the top have not run yet

        def finish_step() -> None:
            # The partners' gradients left first (see below). The rest of step t's backward (the top's
            # parameters, the bank's own embedding) and the top's optimiser step run while the partners
            # work on step t+1: still before the top's next forward, so the computation is unchanged.
            # So does a checkpoint of step t: ``loop`` still describes step t until t+1's answers arrive.
            # Local steps' reuse updates of the top run here too, off the critical path, before the next
            # exchange's updates and before a checkpoint of this one.
            nonlocal unsaved, reuse_due
            if reuse_due:
                self.local_top.replay(top, optimizer)
                reuse_due = False
            if deferred:
                loss, own = deferred.pop()
                fast_path.backward(loss, inputs=[*top_params, own], public=public)
                loop.grads[0] = own.grad
                fast_path.optimizer_step(optimizer, public=public)
                fast_path.clear_grads(top_params)
            if unsaved:
                self._save(loop, optimizer)
                unsaved = False

        while loop.epoch < self.config.epochs and not loop.done:
            bind_log(epoch=loop.epoch + 1)
            epoch_start = time.perf_counter()
            batches = epoch_batches(self.split.train, self.config.batch, self.config.seed, loop.epoch)
            capped = self.config.max_steps is not None
            while loop.batch < len(batches) and not (capped and loop.step >= self.config.max_steps):
                group = batches[loop.batch : loop.batch + local]
                rows = group[0] if local == 1 else torch.cat(group)
                checkpoint = self._is_checkpoint(loop.step, flush=False)
                zs = self._step_all(loop.step, loop.grads, rows, while_waiting=finish_step, checkpoint=checkpoint)
                self.train_rows_sent += len(rows)
                if local == 1:
                    leaves = [z.requires_grad_(True) for z in zs]
                    loss = self._loss(top, leaves, rows)
                    # Only the partners' gradients are on the critical path: compute them alone, send them
                    # with the next step, and finish the backward while the partners work.
                    theirs = (fast_path.grad(loss, leaves[1:], retain_graph=True, public=public)
                              if len(leaves) > 1 else ())
                    deferred.append((loss, leaves[0]))
                    loop.losses.append(loss.item())
                    mine = None  # finish_step fills it in
                else:
                    (mine, *theirs), mean_loss = self.local_top.exchange(top, optimizer, zs, group)
                    loop.losses.append(mean_loss)
                    reuse_due = self.config.reuse_steps > 0
                # Marvell hides the labels the loss saw: after label DP, if on.
                labels = self.train_targets.index_select(0, rows) if self.defense.needs_labels else None
                loop.grads = [mine] + [self.defense(g, labels, loop.step, k, rows) for k, g in enumerate(theirs, start=1)]
                if self.audit is not None:
                    for p, g in zip(self.parties[1:], loop.grads[1:]):
                        self.audit.record(p.name, loop.epoch, loop.step, rows, g)
                loop.step += 1
                loop.batch += len(group)
                unsaved = checkpoint
                if loop.step % 20 == 0 or loop.step >= total_steps:
                    self.progress(
                        f"epoch {loop.epoch + 1}/{self.config.epochs} step {loop.step} loss {np.mean(loop.losses):.4f}",
                        TRAINING_SHARE * min(loop.step / total_steps, 1.0),
                    )
            if not loop.flushed:
                checkpoint = self._is_checkpoint(loop.step, flush=True)
                self._step_all(loop.step, loop.grads, None, while_waiting=finish_step, checkpoint=checkpoint)
                loop.step += 1
                loop.grads = [None] * len(self.parties)
                loop.flushed = True
                if checkpoint:
                    self._save(loop, optimizer)
            train_seconds = time.perf_counter() - epoch_start
            val, _ = self.evaluate(top, self.split.val)
            row = {"epoch": loop.epoch + 1, "steps": loop.step, "train_loss": float(np.mean(loop.losses))}
            row |= {f"val_{m}": v for m, v in val.items()}
            if self.config.track_test:
                row |= {f"test_{m}": v for m, v in self.evaluate(top, self.split.test)[0].items()}
            row["train_seconds"] = train_seconds
            for k, p in enumerate(self.parties[1:], start=1):  # each partner's NoPeek dCor, as it reports it
                report = p.privacy()
                if report.dcor is not None:
                    row[f"dcor_{p.name}"] = report.dcor
                if (kl := self.defense.pop_worst_kl(k)) is not None:  # Marvell's bound, on the epoch's worst batch
                    row[f"marvell_kl_{p.name}"] = kl
            row["seconds"] = time.perf_counter() - epoch_start
            logger.info("session %s epoch %d: train loss %.4f, val %s %.4f",
                        self.session_id, loop.epoch + 1, row["train_loss"], metric, val[metric])
            if loop.book.record(val[metric], row, state=top.state_dict):
                self._all(lambda p: p.mark_best())
            elif loop.book.stop:
                logger.info("session %s: early stop after epoch %d", self.session_id, loop.epoch + 1)
                loop.done = True
            if self.config.max_steps is not None and loop.step >= self.config.max_steps:
                loop.done = True
            self.progress(f"epoch {loop.epoch + 1}: train loss {row['train_loss']:.4f}, val {metric} {val[metric]:.4f}",
                          TRAINING_SHARE * min(loop.step / total_steps, 1.0), point=self._curve_point(row))
            loop.next_epoch()
