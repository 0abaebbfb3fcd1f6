"""The coordinator's checkpoints and rollback: where training stands on disk, and how it gets back there.

Every party checkpoints the same steps. After a party restarted (it answers
"behind"), the coordinator rolls every party back to the newest step all of
them hold; when there is none, the seeded run starts again, which reproduces
the run that was lost. After the bank restarted, it finds its parties again
from its own checkpoints.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bank.config import TrainingConfig
from bank.epochs import EpochBook
from bank.vertical.state import LoopState
from parties.errors import ConfigError
from parties.storage.checkpoint import (
    CheckpointWriter,
    checkpoint_steps,
    load_model_state,
    model_state,
    read_checkpoint,
)

if TYPE_CHECKING:
    from bank.audit_record import AuditRecord
    from bank.vertical.local_steps import LocalTop
    from bank.vertical.party import TrainingParty

__all__ = ["Recovery"]

logger = logging.getLogger(__name__)


#: The cause of the rollback a resume starts with (after the bank stopped, or the operator stopped the job).
RESUMING = "resuming after the bank stopped"


class Recovery:
    """The part of the coordinator that checkpoints and rolls back: a mixin over the coordinator's
    own state, declared here."""

    config: TrainingConfig
    parties: list[TrainingParty]
    session_id: str
    checkpoint_dir: Path | None
    writer: CheckpointWriter
    top: torch.nn.Module | None
    local_top: LocalTop
    widths: dict[str, int]
    rollbacks: int
    audit: AuditRecord | None

    def _start(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def _build_top(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def _book(self) -> EpochBook:
        raise NotImplementedError

    def _is_checkpoint(self, step: int, flush: bool) -> bool:
        every = self.config.checkpoint_every
        return self.checkpoint_dir is not None and (flush or bool(every and (step + 1) % every == 0))

    def _floor(self) -> int | None:
        """The newest step every party (and the loop's own state) has on disk: retention keeps it."""
        held = [self.writer.durable, *(p.durable for p in self.parties)]
        return None if None in held else min(held)  # type: ignore[type-var]

    def _save(self, loop: LoopState, optimizer: torch.optim.Optimizer) -> None:
        assert self.top is not None and self.checkpoint_dir is not None
        tensors, optim_meta = model_state(self.top, optimizer, prefix="top")
        tensors |= {f"grads.{i}": g for i, g in enumerate(loop.grads) if g is not None}
        if loop.book.best_state is not None:
            tensors |= {f"best_top.{k}": v for k, v in loop.book.best_state.items()}
        for i, (rows, zs) in enumerate(self.local_top.cache):
            tensors |= {f"cache.{i}.rows": rows.clone()} | {f"cache.{i}.z{k}": z.clone() for k, z in enumerate(zs)}
        meta = {"loop": loop.meta(), "optimizer": optim_meta, "session": self.session_id, "widths": self.widths,
                "cached": len(self.local_top.cache)}
        self.writer.submit(self.checkpoint_dir, loop.step - 1, tensors, meta, self._floor())

    def _checkpoint_steps(self) -> list[int]:
        """The bank's own checkpoints, once every write it started is on disk."""
        if self.checkpoint_dir is None:
            return []
        self.writer.flush()
        return checkpoint_steps(self.checkpoint_dir)

    def _rollback(self, loop: LoopState, optimizer: torch.optim.Optimizer, cause: Exception | str) -> LoopState:
        """Every party back to the latest step all of them have checkpointed."""
        assert self.top is not None and self.checkpoint_dir is not None
        common = set(self._checkpoint_steps())
        for p in self.parties:
            common &= set(p.checkpoints())
        if not common:
            return self._restart(optimizer, cause)
        step = max(common)
        logger.warning("session %s: %s; rolling every party back to step %d", self.session_id, cause, step)
        what = "resuming from" if cause == RESUMING else "a party restarted; rolling every party back to"
        self.progress(f"{what} step {step}, the newest all of them checkpointed", None, event=True)
        for p in self.parties:
            p.restore(step)
        checkpoint = read_checkpoint(self.checkpoint_dir, step)
        self.writer.reset(step)
        load_model_state(self.top, optimizer, checkpoint, checkpoint.meta["optimizer"], prefix="top")
        self.local_top.cache.clear()
        for i in range(checkpoint.meta.get("cached", 0)):
            cached = checkpoint.section(f"cache.{i}")
            self.local_top.cache.append((cached["rows"], [cached[f"z{k}"] for k in range(len(self.parties))]))
        grads = checkpoint.section("grads")
        restored = LoopState.from_meta(checkpoint.meta["loop"], [grads.get(str(i)) for i in range(len(self.parties))],
                                       self._book(), checkpoint.section("best_top") or None)
        if self.audit is not None:  # the steps from here on are replayed, and recorded again
            self.audit.truncate(restored.step)
        self.rollbacks += 1
        return restored

    def _restart(self, optimizer: torch.optim.Optimizer, cause: Exception | str) -> LoopState:
        """No step is checkpointed by every party: every party starts the session again. Everything is
        seeded, so the run that follows is the run that was lost."""
        assert self.top is not None
        logger.warning("session %s: %s; no step is checkpointed by every party: starting again from the start",
                       self.session_id, cause)
        self.progress("a party restarted before any common checkpoint; starting the session again", None, event=True)
        self.local_top.cache.clear()
        top, fresh = self._start()
        self.top.load_state_dict(top.state_dict())
        optimizer.load_state_dict(fresh.state_dict())
        self.writer.reset(None)
        if self.audit is not None:
            self.audit.truncate(0)
        self.rollbacks += 1
        return LoopState(grads=[None] * len(self.parties), book=self._book())

    def _reattach(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """After the bank restarted: find the session's parties again, from the bank's own checkpoints."""
        steps = self._checkpoint_steps()
        if not steps:
            raise ConfigError(f"session {self.session_id} has no checkpoint to resume from")
        assert self.checkpoint_dir is not None
        self.widths = read_checkpoint(self.checkpoint_dir, steps[-1]).meta["widths"]
        for p in self.parties:
            p.attach(self.session_id, self.widths[p.name], self.config.wire_precision)
        return self._build_top()

    def _last_consistent(self) -> str:
        """Say where a resume starts. The bank checkpoints a step once every party has taken its own
        snapshot of it; a party's write may still have been in flight when it died, so a resume goes
        back to the latest step that every party holds on disk."""
        steps = self._checkpoint_steps()
        if not steps:
            return "no step is checkpointed by every party yet"
        floor = self._floor()
        common = "" if floor is None else f" (step {floor} at the last report)"
        return (f"the bank has checkpointed step {steps[-1]} (session {self.session_id}); a resume goes back to "
                f"the latest step every party holds{common}")
