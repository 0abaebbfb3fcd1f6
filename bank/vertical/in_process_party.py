"""A party called in this process: the bank's own bottom model (and, in tests, any party's session)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from parties.errors import BadMessage, PeerError
from parties.learning.config import LocalSteps
from parties.learning.embedding_noise import PrivacyConfig
from parties.learning.hijack_monitor import MonitorConfig
from parties.learning.model import BottomConfig
from parties.learning.training_session import PartySession
from parties.protocol.training import ModelFiles, PrivacyReport
from parties.storage.checkpoint import checkpoint_steps, remove_checkpoints
from parties.tables.table import AlignedRows, PartyTable

__all__ = ["InProcessParty"]


class InProcessParty:
    """A party's training session called directly (the bank's own bottom; contract tests)."""

    def __init__(
        self,
        name: str,
        table: PartyTable,
        alignment: Callable[[], AlignedRows],
        config: BottomConfig,
        model_dir: Callable[[str], Path] | None = None,
        checkpoint_dir: Callable[[str], Path] | None = None,
        privacy: PrivacyConfig | None = None,
        monitor: MonitorConfig | None = None,
    ) -> None:
        self.name, self.table, self._alignment, self.config = name, table, alignment, config
        self._model_dir, self._checkpoint_dir = model_dir, checkpoint_dir
        self.privacy_config, self.monitor = privacy, monitor
        self.session: PartySession | None = None

    def _live(self) -> PartySession:
        if self.session is None:
            raise PeerError(f"{self.name}: no training session")
        return self.session

    def start_training(self, session_id: str, alignment_id: str, train_positions: torch.Tensor,
                       precision: str = "fp32", local: LocalSteps | None = None) -> int:
        """``precision`` is for tensors on a wire: in this process they never leave float32."""
        alignment = self._alignment()
        if alignment.alignment_id != alignment_id:
            raise BadMessage(f"{self.name} holds alignment {alignment.alignment_id}, not {alignment_id}")
        if self.session is not None:
            self.session.close()
        if self._checkpoint_dir is not None:  # an abandoned start's: a restart must not find them
            remove_checkpoints(self._checkpoint_dir(session_id))
        self.session = PartySession(
            session_id, self.table, alignment, train_positions, self.config, self.privacy_config, self.monitor,
            local,
        )
        return self.session.trainer.width

    def step(self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
        return self._live().trainer.step(step, grad, rows)

    @property
    def durable(self) -> int | None:
        return None if self.session is None else self.session.writer.durable

    def submit_step(
        self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None, checkpoint: bool = False,
        keep_from: int | None = None,
    ) -> Callable[[], torch.Tensor | None]:
        def run() -> torch.Tensor | None:
            self._live().writer.check()  # the last checkpoint failed: stop before anything more is lost
            z = self.step(step, grad, rows)
            if checkpoint:
                self._live().checkpoint(self._folder(), keep_from)
            return z

        return run

    def _folder(self) -> Path:
        if self._checkpoint_dir is None:
            raise PeerError(f"{self.name}: no checkpoint folder configured")
        return self._checkpoint_dir(self._live().session_id)

    def checkpoints(self) -> list[int]:
        self._live().flush_checkpoints()
        return checkpoint_steps(self._folder())

    def attach(self, session_id: str, width: int, precision: str = "fp32") -> None:
        if self._checkpoint_dir is None:
            raise PeerError(f"{self.name}: no checkpoint folder configured")
        folder = self._checkpoint_dir(session_id)
        steps = checkpoint_steps(folder)
        if not steps:
            raise PeerError(f"{self.name}: no checkpoint of session {session_id}")
        if self.session is not None:
            self.session.close()
        self.session = PartySession.from_checkpoint(folder, steps[-1], self.table, self._alignment())
        if self.session.trainer.width != width:
            raise PeerError(f"{self.name}: the checkpoint's width {self.session.trainer.width} is not {width}")

    def restore(self, step: int) -> None:
        self._live().restore(self._folder(), step)

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        return self._live().trainer.embed(rows)

    def mark_best(self) -> None:
        self._live().trainer.mark_best()

    def finish(self, restore_best: bool) -> ModelFiles:
        session = self._live()
        if restore_best:
            session.trainer.restore_best()
        files = session.save(self._model_dir(session.session_id)) if self._model_dir is not None else {}
        return ModelFiles(session=session.session_id, files=files)

    def privacy(self) -> PrivacyReport:
        session = self._live()
        return session.trainer.privacy_report(session.session_id)

    def end(self, finished: bool = True) -> None:
        if self.session is not None:
            self.session.close()
        self.session = None

