"""The hijack monitor of a partner that holds no labels: the rank test, and the older copy probes.

Feature-space hijacking (FSHA; Pasquini, Ateniese and Bernaschi, CCS 2021) has the bank return, instead of
the task's gradient, the gradient of an adversarial loss on each embedding row.

**The rank test** (``watch``) reads what arrives and changes nothing. The task's gradient with respect to a
row's embedding is Jᵢᵀ δᵢ: δᵢ, the loss's derivative with respect to the model's outputs for that row (one
number for a binary or regression task, one per class for a multiclass one), carried back through the top's
Jacobian Jᵢ. So a batch's task gradients lie close to ``task_rank`` directions, however the labels fall, and
those directions turn only as fast as the bank's top learns. An adversarial loss on the embedding itself
moves all of the embedding's directions; confined to ``task_rank`` of them, it must move them around from
step to step to reshape the embeddings. The test judges the gradient as the partner's weights receive it:
where the bottom's output unit was off for a row (a ReLU at 0) nothing reaches the weights, so those entries
are left out, and a bank cannot pad its gradient there ("ballast") to pass. Every training step the monitor
fits the entries that reach the weights with ``task_rank`` directions (a low-rank fit over those entries
only, ``task_fit``). Over the last ``window`` steps it takes (1) the **mean** share of their energy the fit
leaves, and (2) how far the fitted directions **wander** over the last ``drift_window`` steps (all it has
read, until there are that many): 1 − the share of their mean projector on its top ``task_rank`` directions
(0 when every step's directions are the same; ``1 − task_rank / d`` when they are spread evenly over the
embedding's d). A mean, not a median, so that bursts in under half a window count; the wander of many
steps, not the turn from one step to the next, because an honest task's direction jitters from batch to
batch around one that moves only as the bank's top learns (measured: honest banks' wander 0.06-0.08 over
their first 20 steps, under 0.08 over any 200), while a hijack confined to one direction must take it all
over the embedding. When either exceeds its limit (``limit``, ``drift_limit``)
the monitor stops applying gradients and says why (``on_alarm="warn"``: it logs and goes on). It sends
nothing and adds no byte; with no alarm, training is bit for bit what it is without it. Noise a bank adds
to hide a hijack only adds off-task energy. What it cannot see: a hijack mixed into a large enough share of
honest gradient, and one shaped to stay under its limits (off-task energy just under the limit, a main
direction that stays in one place over each window); a bank gradient defense that adds noise in every
direction (isotropic, max-norm, Marvell) looks like a hijack to it. The study (``bank.lab.studies.hijack``)
measures all of these.

**Projecting** (``project``): the partner applies only the fit, what a task's gradient would have sent
over the entries that reach the weights, and drops the rest. A bank shaped to stay under the limits hides
its hijack in the off-task share they leave it (the study's rank-aware bank reconstructs with it, and
fails without it); projected, that share never reaches the weights, and what does is one direction per
step (``task_rank`` of them) that can wander only so far. The price: an honest bank's own off-task share
(a median 1-2% of the energy) is dropped too, so training is no longer bit for bit the unmonitored one's.

**The copy probes** (``probe_every``): on a probe step the partner copies a few rows' embeddings over other
rows of the batch; an adversarial loss on the embedding alone returns identical gradients for the copies,
an honest task loss cannot. The copies are fakes whose gradients are never applied, so training changes,
and a bank that knows the test defeats it: it can spot exact duplicates and answer them honestly, or add
noise keyed on the row's position.

Published detectors (SplitGuard, Gradients Scrutinizer) need the client to hold labels; these need none.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from parties.errors import BadMessage
from parties.learning.config import MonitorConfig
from parties.learning.secret import Secret

__all__ = ["HijackMonitor", "MonitorConfig"]

logger = logging.getLogger(__name__)


class HijackMonitor:
    def __init__(self, config: MonitorConfig, secret: Secret | None = None) -> None:
        """``secret``: which rows are probes (default: the config's pin, else a fresh secret)."""
        self.config = config
        self.secret = secret or Secret.of(config.seed)
        self.differences: list[float] = []  # copy probes: each copied pair's relative difference
        # The rank test: the last window's off-task shares and task directions (each d × task_rank).
        self.shares: deque[float] = deque(maxlen=config.window)
        self.directions: deque[np.ndarray] = deque(maxlen=config.drift_window)
        self.observed = 0  # gradients the rank test has read
        self.alarm: str | None = None
        self.alarm_step: int | None = None

    def _raise(self, step: int, message: str) -> None:
        self.alarm, self.alarm_step = message, step
        logger.log(logging.ERROR if self.config.on_alarm == "stop" else logging.WARNING, "step %d: %s", step, message)

    def describe(self) -> str:
        c, parts = self.config, []
        if c.watch:
            parts.append(f"the rank test (task rank {c.task_rank}, {c.window}-step window, off-task share limit "
                         f"{c.limit:g}, wander limit {c.drift_limit:g} over {c.drift_window} steps, on alarm: {c.on_alarm}"
                         + (", applying only each gradient's task part)" if c.project else ")"))
        if c.probe_every:
            parts.append(f"copy probes every {c.probe_every} steps ({c.pairs} pairs)")
        return " and ".join(parts)

    @staticmethod
    def task_fit(grad: torch.Tensor, active: torch.Tensor | None, rank: int,
                 iterations: int = 10) -> tuple[float, np.ndarray | None]:
        """How far ``grad`` is from a task's gradient, over the entries that reach the weights.

        Returns the share of the energy of ``grad ⊙ active`` that its best fit by ``rank`` directions leaves,
        and those directions (orthonormal columns, d × ``rank``; None for a zero gradient). With every unit on
        (or ``active`` None) that is the energy outside the top ``rank`` singular directions, from the d × d
        Gram matrix in float64; otherwise a fit over the live entries only, by alternating least squares
        started from those singular directions (each row's coefficients, then each unit's directions)."""
        share, directions, _ = HijackMonitor._fit(grad, active, rank, iterations)
        return share, directions

    @staticmethod
    def _fit(grad: torch.Tensor, active: torch.Tensor | None, rank: int,
             iterations: int = 10) -> tuple[float, np.ndarray | None, np.ndarray | None]:
        """``task_fit``'s share and directions, and the fit itself (what a task's gradient would have sent)."""
        g = grad.detach().double().numpy()
        live = None if active is None else active.detach().double().numpy()
        if live is not None and live.all():
            live = None
        if live is not None:
            g = g * live
        total = float(np.square(g).sum())
        if total <= 0:
            return 0.0, None, None
        energy, vectors = np.linalg.eigh(g.T @ g)
        v = vectors[:, -rank:]
        if live is None:
            return max(0.0, 1.0 - float(energy[-rank:].sum()) / total), v, (g @ v) @ v.T
        for _ in range(iterations):
            u = HijackMonitor._solve(np.einsum("bd,dk,dl->bkl", live, v, v), g @ v)
            v = HijackMonitor._solve(np.einsum("bd,bk,bl->dkl", live, u, u), g.T @ u)
        fitted = live * (u @ v.T)
        left = float(np.square(g - fitted).sum())
        return min(1.0, left / total), np.linalg.qr(v)[0], fitted

    @staticmethod
    def _solve(gram: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Each row's least squares ``gram[i] x = b[i]``, with a ridge that keeps empty rows at 0."""
        ridge = 1e-12 * (np.trace(gram, axis1=1, axis2=2).max() + 1e-300)
        if gram.shape[-1] == 1:  # one direction (a binary or regression task): a division, 10x faster
            return b / (gram[..., 0] + ridge)
        return np.linalg.solve(gram + ridge * np.eye(gram.shape[-1]), b[..., None])[..., 0]

    def observe(self, step: int, grad: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """The rank test: read the gradient the bank returned for ``step``'s embedding. ``active``: where the
        bottom's output units were on for each row (1) or off (0, a ReLU at 0); what the bank puts on units
        that were off never reaches the weights, so the test leaves it out. Returns the gradient to apply:
        ``grad`` itself, or with ``project`` its task part (the fit)."""
        if not self.config.watch or (self.alarm is not None and not self.config.project):
            return grad
        rank = self.config.task_rank
        share, directions, fitted = self._fit(grad, active, rank)
        if directions is None or fitted is None:  # nothing reaches the weights: nothing to judge, or to apply
            return torch.zeros_like(grad) if self.config.project else grad
        applied = torch.from_numpy(fitted).to(grad.dtype) if self.config.project else grad
        if not torch.isfinite(applied).all():
            raise BadMessage("the gradient's task part overflows float32: no task sends gradients this large")
        if self.alarm is not None:  # judged already (on_alarm="warn"): still only the task part reaches the weights
            return applied
        self.shares.append(share)
        self.directions.append(directions)
        self.observed += 1
        window = self.config.window
        if len(self.shares) < window:
            return applied
        if (share := float(np.mean(self.shares))) > self.config.limit:
            self._raise(step, (
                f"hijack suspected: over the last {window} steps a mean {share:.1%} of the energy of the bank's "
                f"gradients that reaches this partner's weights lay outside the {rank} direction(s) a task's "
                f"gradient can take (limit {self.config.limit:.0%}); an honest task loss cannot do that. "
                f"{self._consequence}"))
        elif (spread := self.wander(self.directions)) > self.config.drift_limit:
            self._raise(step, (
                f"hijack suspected: over the last {len(self.directions)} steps the direction(s) of the bank's gradients wandered "
                f"{spread:.1%} from where they stayed on average (limit {self.config.drift_limit:.0%}); a task's "
                f"gradient moves only as fast as the bank's model learns. {self._consequence}"))
        return applied

    @staticmethod
    def wander(directions: deque[np.ndarray] | list[np.ndarray]) -> float:
        """1 − the share of the mean projector of ``directions`` (each d × k, orthonormal columns) on its top k
        directions: 0 when they are all one subspace, larger the more they spread."""
        stacked = np.concatenate(list(directions), axis=1)  # d × (n·k)
        rank = directions[0].shape[1]
        energy = np.linalg.eigvalsh(stacked @ stacked.T)  # the mean projector, times n
        return max(0.0, 1.0 - float(energy[-rank:].sum()) / (len(directions) * rank))

    @property
    def _consequence(self) -> str:
        return ("No further gradient is applied." if self.config.on_alarm == "stop" else
                "Training goes on (on_alarm=warn).")

    def state(self) -> dict:
        """The rank test's state, as JSON, for a checkpoint."""
        return {"shares": list(self.shares), "directions": [d.tolist() for d in self.directions],
                "observed": self.observed,
                "alarm": self.alarm, "alarm_step": self.alarm_step}

    def load_state(self, meta: dict) -> None:
        self.shares = deque(meta.get("shares", []), maxlen=self.config.window)
        kept = meta.get("directions") or []
        if kept and not isinstance(kept[0][0], list):  # an older checkpoint kept only the last step's
            kept = [kept]
        self.directions = deque((np.array(d, dtype=np.float64) for d in kept), maxlen=self.config.drift_window)
        self.observed = meta.get("observed", 0)
        self.alarm, self.alarm_step = meta.get("alarm"), meta.get("alarm_step")

    def plan(self, step: int, batch: int) -> list[tuple[int, int]]:
        """The (source, copy) positions for this step; empty unless it is a probe step."""
        every = self.config.probe_every
        if not every or step % every != every - 1 or batch < 2 * self.config.pairs:
            return []
        order = self.secret.numpy("probe", step).permutation(batch)[: 2 * self.config.pairs]
        return [(int(order[2 * k]), int(order[2 * k + 1])) for k in range(self.config.pairs)]

    @staticmethod
    def disguise(z: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
        out = z.clone()
        for source, copy in pairs:
            out[copy] = out[source]
        return out

    def inspect(self, step: int, grad: torch.Tensor, pairs: list[tuple[int, int]],
                applied: torch.Tensor | None = None) -> torch.Tensor:
        """Record how alike the copied pairs' gradients are in ``grad``; return the gradient to apply
        (``applied``, default ``grad``) with the fakes zeroed."""
        for source, copy in pairs:
            a, b = grad[source], grad[copy]
            scale = float(a.norm() + b.norm())
            self.differences.append(float((a - b).norm()) / scale if scale > 0 else 0.0)
        if len(self.differences) >= self.config.min_pairs:
            median = float(np.median(self.differences))
            if median < self.config.threshold:
                self._raise(step, (
                    f"hijack suspected: the bank returned identical gradients for identical embeddings at "
                    f"different rows (median relative difference {median:.2e} over {len(self.differences)} "
                    "probes); an honest task loss cannot do that. No further gradient is applied."
                ))
        cleaned = (grad if applied is None else applied).clone()
        cleaned[[copy for _, copy in pairs]] = 0.0
        return cleaned
