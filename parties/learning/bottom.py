"""A party's bottom model in training: the step protocol's state machine, without transport.

Step ``t`` carries the gradient for step ``t-1``'s embedding (if there was
one) and the rows of batch ``t`` (absent in the final flush). The party first
applies the gradient, then embeds batch ``t`` with the updated weights, which
is exactly what the unsplit model does between two optimiser steps.

Local steps (``LocalSteps``, the communication-efficient mode): a step
carries K = ``steps`` batches of ``batch`` rows at once, and the gradient of
the previous step's K. The party applies that gradient as K updates, one per
batch, each recomputing that batch's embedding with the current weights (so
batch k's gradient meets weights that moved k times since it was computed:
the staleness this mode trades for K times fewer round trips; FedBCD, Liu et
al. 2022). With ``reuse`` = R it then makes R more updates from a cache of the
last two steps' batches, newest first, each row's cached gradient weighted by
the cosine of its embedding now and the one it answered, floored at 0 (the
instance weighting of CELU-VFL, Fu et al., VLDB 2022): more learning per round
trip, at the cost of compute alone. They run before the party embeds the next
batches: run after the answer instead (off the critical path), they left the
next embedding a round trip staler, and on bank-full the efficient mode took
twice as long to reach its target AUC. The cache is part of a checkpoint. In
exact mode (the default) none of this runs: the model is the unsplit model's,
bit for bit.

NoPeek (``PrivacyConfig.nopeek`` = α > 0, ``parties.learning.nopeek``): every
update, exact or local, also descends α·dCor(x, z) of its batch, so the
bottom's gradient is the bank's through z plus α·∇dCor. The bank's side is
untouched (it never knows). The step that ends an epoch (the flush) logs the
epoch's mean dCor. At α = 0 nothing of it is computed.

Exactly once: (session, step) is the idempotency key. A step that arrives
again with the same content (the bank retrying after a lost response) gets
the stored answer and changes nothing; with other content, or any step but
the next, it is refused. Every request is fully validated before anything
changes: a refused request leaves the weights, the optimiser and the step
counter as they were.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from parties.errors import BadMessage, Behind, ConfigError, HijackSuspected, OutOfOrder
from parties.learning import fast_path
from parties.learning.config import LocalSteps
from parties.learning.embedding_noise import EmbeddingNoise, PrivacyConfig
from parties.learning.hijack_monitor import HijackMonitor, MonitorConfig
from parties.learning.model import BottomConfig, Randomness, build_bottom, build_optimizer, ends_in_relu
from parties.learning.nopeek import NoPeek
from parties.learning.secret import Secret
from parties.observability import STEPS
from parties.protocol.training import PrivacyReport
from parties.protocol.wire import all_finite
from parties.storage.checkpoint import Checkpoint, load_model_state, model_state
from parties.tables.encoding import EncodedRows

__all__ = ["BottomTrainer", "MAX_BATCH_ROWS"]

logger = logging.getLogger(__name__)

MAX_BATCH_ROWS = 1 << 16


class BottomTrainer:
    """One training session of one party's bottom model over its encoded, aligned rows."""

    def __init__(
        self,
        features: np.ndarray | EncodedRows,
        config: BottomConfig,
        privacy: PrivacyConfig | None = None,
        monitor: MonitorConfig | None = None,
        local: LocalSteps | None = None,
        secret: Secret | None = None,
    ) -> None:
        """``secret``: this party's protective randomness (embedding noise, probe rows); default: pinned by the
        privacy or monitor settings' seed, else fresh. It is part of the state: a restore draws the same."""
        self.x = features if isinstance(features, EncodedRows) else EncodedRows.dense(features)
        pins = [c.seed for c in (privacy, monitor) if c is not None and c.seed is not None]
        self.secret = secret or Secret.of(pins[0] if pins else None)
        self.config = config
        # Initial weights a counterparty can rebuild let a bank that keeps them from moving (gradients too
        # small for the optimizer to act on) invert every embedding: a seed of None draws them from the secret.
        init = int(self.secret.numpy("initial weights").integers(1 << 62)) if config.seed is None else None
        self.model = build_bottom(self.x.layout, config, seed=init).train()  # whatever mode a factory left it in
        # A party's own model may draw random numbers (dropout): from a stream of its own, saved with its state.
        self.random = None if config.built_in else Randomness(
            config.seed if config.seed is not None else int(self.secret.numpy("model randomness").integers(1 << 62)))
        self._random_pending: torch.Tensor | None = None  # the stream before the pending embedding was computed
        self._params = list(self.model.parameters())
        # The fast path serves the plain MLP it was verified on; any other model trains on torch's public calls.
        self._verified = fast_path.serves(self.model)
        self.optimizer = build_optimizer(self._params, config)
        self.next_step = 0
        self._pending: torch.Tensor | None = None
        self._pending_index: torch.Tensor | None = None  # the rows of the pending embedding
        self._pending_clean: torch.Tensor | None = None  # with NoPeek: the pending embedding before DP noise
        self._pending_active: torch.Tensor | None = None  # where the pending embedding's output units are on
        self._relu_output = ends_in_relu(self.model)
        self._best: dict[str, Any] | None = None
        self._last: tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None
        self._lock = threading.Lock()
        self.releases = 0  # embedding rows released (training and evaluation)
        self.dp = (EmbeddingNoise(privacy, len(self.x), self.secret)
                   if privacy is not None and privacy.embedding_noise else None)
        self.nopeek = NoPeek(privacy.nopeek) if privacy is not None and privacy.nopeek > 0 else None
        self.monitor = HijackMonitor(monitor, self.secret) if monitor is not None and monitor.active else None
        if self.secret.pinned is not None and (self.dp is not None or self.monitor is not None):
            logger.warning("this partner's protective randomness is %s", self.secret.describe())
        if self.monitor is not None:
            logger.info("hijack monitor on: %s", self.monitor.describe())
        self._probe: list[tuple[int, int]] = []
        self.local = local if local is not None and not local.exact else None
        self.local_batch = None if self.local is None else self.local.batch  # None: exact mode
        if self.local is not None and self.monitor is not None and self.monitor.config.watch:
            # The rank test judges a gradient as the released embedding's weights receive it; local steps apply
            # it to an embedding recomputed with weights that have moved since, where other units are on.
            raise ConfigError("this partner's hijack monitor (the rank test) judges each gradient against the "
                              "embedding it released, and local steps or reused batches apply it to one recomputed "
                              "since: train in exact mode (local steps 1, no reuse) with this partner")
        # (rows, gradient, embedding answered) of the last two steps' batches: what reuse learns from.
        self._cache: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = deque(
            maxlen=2 * self.local.steps if self.local else 1)

    @property
    def width(self) -> int:
        return self.config.cut_width

    @property
    def n_rows(self) -> int:
        return len(self.x)

    def _check_rows(self, rows: torch.Tensor | None) -> None:
        if rows is None:
            return
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise BadMessage("rows must be a 1-D int64 tensor")
        if not 0 < rows.numel() <= MAX_BATCH_ROWS:
            raise BadMessage(f"a batch holds 1 to {MAX_BATCH_ROWS} rows, got {rows.numel()}")
        low, high = torch.aminmax(rows)
        if int(low) < 0 or int(high) >= self.n_rows:
            raise BadMessage(f"rows must lie in [0, {self.n_rows})")

    def _check_grad(self, grad: torch.Tensor | None) -> None:
        if self._pending is None:
            if grad is not None:
                raise BadMessage("a gradient arrived but no embedding is awaiting one")
            return
        if grad is None:
            raise BadMessage(f"step {self.next_step} must carry the gradient of step {self.next_step - 1}")
        assert self._pending_index is not None
        expected = (self._pending_index.numel(), self.width)
        if tuple(grad.shape) != expected:
            raise BadMessage(f"gradient shape {tuple(grad.shape)}; expected {expected}")
        if grad.dtype != torch.float32:
            raise BadMessage(f"gradient dtype {grad.dtype}; expected torch.float32")
        if not all_finite(grad):
            raise BadMessage("the gradient holds NaN or infinite values")

    def step(self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Apply ``grad`` to the pending embedding, then embed ``rows``; return the embedding."""
        with self._lock:
            if self._last is not None and step == self._last[0]:
                return self._replay(grad, rows)
            if step > self.next_step:
                raise Behind(f"step {step} arrived; expected step {self.next_step}", self.next_step)
            if step != self.next_step:
                raise OutOfOrder(f"step {step} arrived; expected step {self.next_step}")
            self._check_grad(grad)
            self._check_rows(rows)
            if rows is not None and self.local is not None and rows.numel() > self.local.steps * self.local.batch:
                raise BadMessage(f"a step holds at most {self.local.steps} batches of {self.local.batch} rows, "
                                 f"got {rows.numel()} rows")
            received = grad  # what a retry of this step must repeat
            if self.monitor is not None:
                if grad is not None:  # and what of it reaches the weights: nothing on an output unit that is off
                    applied = self.monitor.observe(step, grad, self._pending_active)
                    if self.monitor.alarm is None and self._probe:
                        applied = self.monitor.inspect(step, grad, self._probe, applied)
                        self._probe = []
                    grad = applied
                if self.monitor.alarm is not None and self.monitor.config.on_alarm == "stop":
                    raise HijackSuspected(self.monitor.alarm)
            if self._pending is not None:
                assert grad is not None and self._pending_index is not None
                if self.local_batch is None:
                    fast_path.clear_grads(self._params)
                    self._backward(self._pending, grad, self._pending_index, self._pending_clean)
                    self._optimizer_step()
                else:
                    self._local_updates(self._pending_index, grad, self._pending.detach())
                # They go together: a checkpoint saves the pending rows, and a restore rebuilds from them.
                self._pending, self._pending_index, self._pending_clean = None, None, None
                self._pending_active = None
            if rows is None and self.nopeek is not None:  # the flush: the epoch's last gradient is applied
                self._end_nopeek_epoch(step)
            out = None
            if rows is not None:
                if not self.model.training:
                    self.model.train()
                if self.random is not None:
                    self._random_pending = self.random.state
                if self.local_batch is None:
                    z = self._forward(rows)
                else:  # no graph: each local step recomputes its batch's embedding
                    with torch.no_grad():
                        z = self._forward(rows)
                clean_out = z.detach()
                if self.nopeek is not None and self.local_batch is None:
                    self._pending_clean = self.dp.clipped(z) if self.dp is not None else z
                if self.dp is not None:
                    z = self.dp.release(z, rows)
                self._pending, self._pending_index = z, rows
                # Where the bottom's output unit is on for a row (ReLU), the bank's gradient reaches the weights;
                # elsewhere it reaches nothing, however large (the monitor must not count it).
                self._pending_active = (clean_out > 0).to(z.dtype) if self._relu_output else None
                self.releases += rows.numel()
                out = z.detach()
                if self.monitor is not None:
                    self._probe = self.monitor.plan(step, rows.numel())
                    if self._probe:
                        out = self.monitor.disguise(out, self._probe)
            self.next_step = step + 1
            self._last = (step, received, rows, out)
            STEPS.inc()
            return out

    def _local_updates(self, rows: torch.Tensor, grad: torch.Tensor, answered: torch.Tensor) -> None:
        """One update per batch, in the order the bank cut them; then ``reuse`` more from the cache."""
        assert self.local is not None and self.local.batch is not None
        parts = list(zip(*(t.split(self.local.batch) for t in (rows, grad, answered))))
        for part, part_grad, _ in parts:
            self._update(part, part_grad)
        if self.local.reuse:
            self._cache.extend(parts)
            for k in range(self.local.reuse):
                part, part_grad, part_answered = self._cache[-1 - k % len(self._cache)]
                self._update(part, part_grad, part_answered)

    def _update(self, rows: torch.Tensor, grad: torch.Tensor, answered: torch.Tensor | None = None) -> None:
        """An update from ``grad``, the gradient of ``rows``' embedding; with ``answered`` (reuse), each row
        weighted by the cosine of its embedding now and ``answered``, floored at 0."""
        z = self._forward(rows)
        if self.dp is not None:  # the noise is a constant: the gradient goes through the clipping alone
            z = self.dp.clipped(z)
        if answered is not None:
            grad = grad * F.cosine_similarity(z.detach(), answered, dim=1).clamp_(min=0.0)[:, None]
        fast_path.clear_grads(self._params)
        self._backward(z, grad, rows, z)
        self._optimizer_step()

    def _forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The embedding of ``rows`` in training mode; a party's own model draws from its own stream."""
        if self.random is None:
            return fast_path.forward(self.model, self.x.take(rows))
        with self.random.drawing():
            return self.model(self.x.take(rows))

    def _optimizer_step(self) -> None:
        fast_path.optimizer_step(self.optimizer, public=not self._verified)

    def _backward(self, z: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor, clean: torch.Tensor | None) -> None:
        """Accumulate the gradient of the bank's loss through ``z`` (the embedding as released), and with NoPeek
        that of α·dCor(features of ``rows``, ``clean``), ``clean`` being ``z`` before any DP noise."""
        if self.nopeek is None:
            fast_path.backward(z, grad, public=not self._verified)
            return
        assert clean is not None
        penalty = self.nopeek.penalty(self.x.take(rows), clean)
        # Both in one pass: with DP the two share the graph up to the clipping.
        torch.autograd.backward((z, penalty), (grad, torch.ones_like(penalty)))

    def _end_nopeek_epoch(self, step: int) -> None:
        assert self.nopeek is not None
        closed = self.nopeek.end_epoch()
        if closed is not None:
            logger.info("step %d ends an epoch: NoPeek (α=%g) mean dCor(features, embedding) %.4f over %d batches",
                        step, self.nopeek.alpha, *closed)

    def privacy_report(self, session: str) -> PrivacyReport:
        """What this party's own privacy settings did so far: its ε spent, NoPeek's latest epoch's dCor."""
        with self._lock:
            report = self.dp.report(session) if self.dp is not None else PrivacyReport(session=session, enabled=False)
            if self.nopeek is not None:
                report = report.model_copy(update={
                    "nopeek": self.nopeek.alpha, "dcor": self.nopeek.epochs[-1] if self.nopeek.epochs else None})
            return report

    def _replay(self, grad: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
        step, last_grad, last_rows, out = self._last  # type: ignore[misc]

        def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

        if not (same(grad, last_grad) and same(rows, last_rows)):
            raise OutOfOrder(f"step {step} was already applied, with a different request")
        logger.info("step %d arrived again: answered from the stored response", step)
        return out

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings for evaluation: no graph kept, no state changed."""
        self._check_rows(rows)
        if self.monitor is not None and self.monitor.alarm is not None and self.monitor.config.on_alarm == "stop":
            raise HijackSuspected(self.monitor.alarm)  # nothing more leaves a session the monitor stopped
        with self._lock, torch.no_grad():
            self.model.eval()
            z = self.model(self.x.take(rows))
            self.model.train()
            if self.dp is not None:  # one state of the weights: the same noise however often it is asked
                z = self.dp.release(z, rows, state=self.next_step)
            self.releases += rows.numel()
            return z

    def mark_best(self) -> None:
        """Remember the current weights as the best so far (the bank judges by validation)."""
        with self._lock:
            if self._pending is not None:
                raise OutOfOrder("flush the pending gradient before marking the best weights")
            self._best = copy.deepcopy(self.model.state_dict())

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Everything needed to continue exactly from here, as named tensors and JSON."""
        with self._lock:
            tensors, optim_meta = model_state(self.model, self.optimizer)
            if self._pending_index is not None:
                tensors["pending.rows"] = self._pending_index.clone()
                if self.local is not None:  # what it answered: reuse weighs rows by it, whatever the weights do
                    tensors["pending.z"] = self._pending.detach().clone()
            if self._best is not None:
                tensors |= {f"best.{k}": v.clone() for k, v in self._best.items()}
            if self.random is not None:  # as it was before the pending embedding: a restore recomputes that
                pending = self._random_pending if self._pending_index is not None else None
                tensors["random"] = (pending if pending is not None else self.random.state).clone()
            last_step = None
            if self._last is not None:
                last_step = self._last[0]
                for name, value in zip(("grad", "rows", "out"), self._last[1:]):
                    if value is not None:
                        tensors[f"last.{name}"] = value.detach().clone()
            meta = {"next_step": self.next_step, "optimizer": optim_meta, "last_step": last_step,
                    "releases": self.releases}
            if self.dp is not None or self.monitor is not None:  # the party's own disk: its resume draws the same
                meta["secret"] = self.secret.to_state()
            if self.dp is not None:
                tensors["dp.releases"] = torch.from_numpy(self.dp.releases.copy())
                meta["dp_draws"] = self.dp._draws
            if self.monitor is not None:
                meta["monitor"] = {"probe": self._probe, "differences": self.monitor.differences,
                                   **self.monitor.state()}
            if self.nopeek is not None:
                meta["nopeek"] = self.nopeek.state()
            if self.local is not None:
                meta |= {"local": self.local.model_dump(), "cached": len(self._cache)}
                for i, entry in enumerate(self._cache):
                    tensors |= {f"cache.{i}.{name}": t.clone() for name, t in zip(("rows", "grad", "z"), entry)}
            return tensors, meta

    def load_state(self, checkpoint: Checkpoint, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint: the pending embedding is recomputed from its rows, bit for bit."""
        with self._lock:
            load_model_state(self.model, self.optimizer, checkpoint, meta["optimizer"])
            self.next_step, self.releases = meta["next_step"], meta["releases"]
            if "secret" in meta:
                self.secret = Secret.from_state(meta["secret"])
                for user in (self.dp, self.monitor):
                    if user is not None:
                        user.secret = self.secret
            if self.dp is not None:
                self.dp.releases = checkpoint.tensors["dp.releases"].numpy().copy()
                self.dp._draws = meta["dp_draws"]
            if self.monitor is not None and "monitor" in meta:
                self._probe = [tuple(p) for p in meta["monitor"]["probe"]]
                self.monitor.differences = list(meta["monitor"]["differences"])
                self.monitor.load_state(meta["monitor"])
            if self.nopeek is not None and "nopeek" in meta:
                self.nopeek.load_state(meta["nopeek"])
            self._cache.clear()
            for i in range(meta.get("cached", 0)):
                self._cache.append(tuple(checkpoint.tensors[f"cache.{i}.{name}"] for name in ("rows", "grad", "z")))
            best = checkpoint.section("best")
            self._best = best or None
            rows = checkpoint.tensors.get("pending.rows")
            self._pending, self._pending_index, self._pending_clean = None, None, None
            self._pending_active = None
            if self.random is not None:
                self.random.state = checkpoint.tensors["random"].clone()
                self._random_pending = self.random.state if rows is not None else None
            # Recomputing the pending embedding must not count its batch twice in the model's own statistics
            # (batch norm's running means, saved after that batch): they are put back as saved.
            saved = {k: b.clone() for k, b in self.model.named_buffers()}
            self.model.train()
            if rows is not None and self.local is not None:  # no graph: each local step recomputes its batch
                self._pending, self._pending_index = checkpoint.tensors["pending.z"], rows
                with torch.no_grad():
                    active = self._forward(rows) > 0
                self._pending_active = active.to(self._pending.dtype) if self._relu_output else None
            elif rows is not None:
                # Recompute the pending embedding's graph; its released value (and noise) is the stored one.
                self.model.train()
                z = self._forward(rows)
                clean = z
                if self.dp is not None:
                    # The graph the step built: NoPeek's clipped copy first, then the release's own clipping.
                    clean = self.dp.clipped(z) if self.nopeek is not None else None
                    released = self.dp.clipped(z)
                    z = released + (checkpoint.tensors["last.out"] - released).detach()
                    clean = released if clean is None else clean
                self._pending, self._pending_index = z, rows
                self._pending_clean = clean if self.nopeek is not None else None
                self._pending_active = (clean.detach() > 0).to(z.dtype) if self._relu_output else None
            for name, value in saved.items():  # new tensors: the recomputed graph keeps (and checks) the ones it read
                owner, _, leaf = name.rpartition(".")
                setattr(self.model.get_submodule(owner), leaf, value)
            last = checkpoint.section("last")
            self._last = None
            if meta["last_step"] is not None:
                self._last = (meta["last_step"], last.get("grad"), last.get("rows"), last.get("out"))

    def restore_best(self) -> bool:
        with self._lock:
            if self._best is None:
                return False
            self.model.load_state_dict(self._best)
            return True
