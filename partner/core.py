"""The partner, without HTTP: each bank's alignments, training sessions and trained models.

Every call names the bank that makes it (its certificate name): what the partner holds for one bank
(``partner.banks.BankSpace``) is unknown to every other. PSI is ``partner.alignments``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from alignment.parallel import make_pool
from parties.errors import AlignmentMismatch, BadMessage, Behind, DataError, OutOfOrder, UnknownSession
from parties.learning.config import LocalSteps
from parties.learning.embedding_noise import EmbeddingNoise
from parties.learning.trained_bottom import ScoringBottom
from parties.learning.training_session import PartySession
from parties.protocol.codec import Precision
from parties.protocol.control import AlignmentInfo, SessionList, SessionSummary
from parties.protocol.training import ModelFiles, PrivacyReport, TrainSessionInfo
from partner.settings import PartnerSettings
from parties.storage.checkpoint import checkpoint_steps, remove_checkpoints
from parties.storage.files import atomic_write_text
from parties.tables.drift import WARN_PSI, Drift
from parties.tables.encoding import Fallbacks
from parties.tables.table import AlignedRows, PartyTable
from partner.alignments import MAX_SCORING_ALIGNMENTS, PsiDesk
from partner.banks import ENDED, Banks, BankSpace

__all__ = ["PartnerCore"]

logger = logging.getLogger(__name__)

#: Longest a request waits for a computation before answering "not ready, retry".
WAIT_SECONDS = 30.0


def _report_pool_start(started: Future[None]) -> None:
    if not started.cancelled() and started.exception() is not None:
        logger.warning("PSI workers could not start (each PSI session will try again): %s", started.exception())


class PartnerCore:
    """A partner's state: its table, its worker pool, and one space per bank it serves."""

    def __init__(self, settings: PartnerSettings, table: PartyTable) -> None:
        self.settings, self.table = settings, table
        self.pool = make_pool(settings.workers, settings.ray_address)
        self.threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="psi")
        # The first PSI session need not wait for the workers; a pool that cannot start says why in this log now,
        # not only at the first session.
        self.threads.submit(self.pool.start).add_done_callback(_report_pool_start)
        self.banks = Banks(settings.state_path, table, settings.quotas, settings.name)
        self.psi = PsiDesk(settings, table, self.banks, self.pool, self.threads)
        self._lock = threading.Lock()
        # Scoring releases embeddings too: with embedding noise on, they are clipped, noised (from a secret of this
        # process's own) and counted. NoPeek shapes training only: scoring releases what the trained model computes.
        self.scoring_dp = EmbeddingNoise(settings.privacy, len(table)) if settings.privacy.embedding_noise else None
        self.banks.sweep()

    def alignment_of(self, bank: str) -> AlignedRows | None:
        """``bank``'s training alignment at this partner, if it has committed one."""
        return self.banks[bank].alignment

    # --- training -------------------------------------------------------------------------

    def start_training(
        self, bank: str, session_id: str, alignment_id: str, train_positions: torch.Tensor,
        precision: Precision = "fp32", local: LocalSteps | None = None,
    ) -> TrainSessionInfo:
        """Start (or start again) ``bank``'s training session; ``precision``: how its step tensors travel (each
        step message names its own, so nothing about it is kept here); ``local``: the communication-efficient
        mode (kept by the session and its checkpoints)."""
        space = self.banks[bank]
        folder = space.training_dir(session_id)
        if space.ended(session_id):
            raise OutOfOrder(f"training session {session_id} has ended; start a new one")
        if space.alignment is None:
            raise OutOfOrder("no alignment yet: align before training")
        if alignment_id != space.alignment.alignment_id:
            raise OutOfOrder(f"alignment {alignment_id} is not this partner's current alignment with {bank}")
        self.banks.sweep()
        with self._lock:
            self._expire_training()
            existing = space.training.get(session_id)
            if existing is not None and not existing.started_with(alignment_id, train_positions):
                raise OutOfOrder(f"training session {session_id} already exists, with other rows")
            # The same start again (a retry, or the bank starting a run no party had checkpointed): the
            # session starts afresh, seeded, as the first time.
            if existing is None and len(space.training) >= self.settings.max_training_sessions:
                raise OutOfOrder(f"{bank} has {len(space.training)} live training sessions here; end one first "
                                 f"(each idle one ends by itself after {self.settings.training_session_ttl:.0f}s)")
        privacy = self.settings.privacy if self.settings.privacy.active else None
        monitor = self.settings.monitor if self.settings.monitor.active else None
        session = PartySession(
            session_id, self.table, space.alignment, train_positions, self.settings.bottom, privacy, monitor, local,
        )
        self._own(session, bank)
        remove_checkpoints(folder)  # an abandoned start's: a restart must not find them
        with self._lock:
            previous = space.training.pop(session_id, None)
            space.training[session_id] = session
        if previous is not None:
            previous.close()
        return TrainSessionInfo(session=session_id, embedding_width=session.trainer.width, precision=precision,
                                local=local or LocalSteps())

    def _own(self, session: PartySession, bank: str) -> None:
        session.owner = bank
        session.writer.quota = lambda nbytes: self.banks.reserve(bank, nbytes)

    def training(self, bank: str, session_id: str, *, live: bool = True) -> PartySession:
        """``bank``'s live session, or, after a restart, the session rebuilt from its latest checkpoint.

        A rebuilt session answers every call that ``live`` marks with ``Behind`` until the bank rolls
        it back: whatever happened after its checkpoint (steps, the best weights marked) is gone, and
        only a rollback of every party makes them agree again.
        """
        space = self.banks[bank]
        with self._lock:
            session = space.training.get(session_id)
            if session is None:
                session = self._from_checkpoint(space, session_id)
        session.last_used = time.monotonic()
        if live and session.restarted_at is not None:
            raise Behind(f"training session {session_id} restarted from its checkpoint at step "
                         f"{session.restarted_at}; roll every party back first", session.trainer.next_step)
        return session

    def _from_checkpoint(self, space: BankSpace, session_id: str) -> PartySession:
        folder = space.training_dir(session_id)
        if (folder / ENDED).exists():  # a finished session is never brought back
            raise UnknownSession(f"training session {session_id} has ended")
        steps = checkpoint_steps(folder)
        if not steps or space.alignment is None:
            raise UnknownSession(f"no training session {session_id}")
        session = PartySession.from_checkpoint(folder, steps[-1], self.table, space.alignment)
        self._own(session, space.name)
        space.training[session_id] = session
        return session

    def checkpoint_dir(self, bank: str, session_id: str) -> Path:
        return self.banks[bank].training_dir(session_id)

    def checkpoints(self, bank: str, session_id: str) -> list[int]:
        try:
            self.training(bank, session_id, live=False).flush_checkpoints()
        except UnknownSession:  # restarted before its first checkpoint: it holds none
            return []
        return checkpoint_steps(self.checkpoint_dir(bank, session_id))

    def checkpoint(self, bank: str, session_id: str, floor: int | None = None) -> int:
        return self.training(bank, session_id).checkpoint(self.checkpoint_dir(bank, session_id), floor)

    def restore(self, bank: str, session_id: str, step: int) -> None:
        session = self.training(bank, session_id, live=False)
        session.restore(self.checkpoint_dir(bank, session_id), step)
        session.restarted_at = None

    def privacy(self, bank: str, session_id: str) -> PrivacyReport:
        return self.training(bank, session_id).trainer.privacy_report(session_id)

    def finish_training(self, bank: str, session_id: str, restore_best: bool) -> ModelFiles:
        session = self.training(bank, session_id)
        if restore_best:
            session.trainer.restore_best()
        folder = self.banks[bank].model_dir(session_id)
        files = session.save(folder, quota=lambda nbytes: self.banks.reserve(bank, nbytes))
        logger.info("training session %s of %s finished; model written", session_id, bank)
        return ModelFiles(session=session_id, files=files)

    def end_training(self, bank: str, session_id: str, finished: bool = True) -> None:
        """``finished``: the session is over, for good (its checkpoints go, it can never come back);
        otherwise it is only unloaded, and stays resumable from its checkpoints."""
        space = self.banks[bank]
        folder = space.training_dir(session_id)
        with self._lock:
            session = space.training.pop(session_id, None)
        if session is not None:
            session.close()
        if finished:
            if folder.is_dir():  # it has checkpoints to come back from: mark it, so it never does
                atomic_write_text(folder / ENDED, "")  # 0600 in a 0700 folder, like every file of the party's
                remove_checkpoints(folder)
            logger.info("training session %s of %s ended", session_id, bank)
        elif session is not None:
            logger.info("training session %s of %s unloaded; it stays resumable from its checkpoints", session_id, bank)

    def _expire_training(self) -> None:
        now = time.monotonic()
        for space in self.banks.spaces():
            for sid, session in list(space.training.items()):
                if now - session.last_used > self.settings.training_session_ttl:
                    del space.training[sid]
                    session.close()
                    logger.info("training session %s of %s expired; it stays resumable from its checkpoints",
                                sid, space.name)

    # --- sessions, for their bank and for this partner's operator ----------------------------

    def sessions(self, bank: str | None = None) -> SessionList:
        """The live sessions (every bank's, or ``bank``'s), after expiring the idle ones."""
        now = time.monotonic()
        self.psi.expire()
        out = []
        with self._lock:
            self._expire_training()
            for space in self.banks.spaces():
                if bank is not None and space.name != bank:
                    continue
                out += [SessionSummary(kind="training", session=sid, owner=space.name, state="live",
                                       idle_seconds=round(now - s.last_used, 3), step=s.trainer.next_step)
                        for sid, s in space.training.items()]
                out += [SessionSummary(kind="psi", session=sid, owner=space.name, state="live",
                                       idle_seconds=round(now - r.last_used, 3))
                        for sid, r in space.psi.items()]
        return SessionList(sessions=out)

    def end_session(self, bank: str, session_id: str) -> None:
        """This partner's operator ends ``bank``'s session for good: a PSI session, or a training session."""
        if self.psi.end(bank, session_id):
            logger.info("PSI session %s of %s ended by the operator", session_id, bank)
            return
        space = self.banks[bank]
        if session_id not in space.training and not checkpoint_steps(space.training_dir(session_id)):
            raise UnknownSession(f"{bank} has no session {session_id}")
        self.end_training(bank, session_id, finished=True)

    def alignments(self) -> list[AlignmentInfo]:
        """Each bank's training alignment, for this partner's operator."""
        return [AlignmentInfo(alignment_id=s.alignment.alignment_id, rows=len(s.alignment), bank=s.name)
                for s in self.banks.spaces() if s.alignment is not None]

    # --- scoring with a trained model -------------------------------------------------------

    def load_model(self, bank: str, model_id: str, files: dict[str, str], width: int) -> None:
        """Load ``bank``'s part of a trained model, refusing files that differ from the manifest."""
        space = self.banks[bank]
        folder = space.model_dir(model_id)
        if not folder.is_dir():
            raise UnknownSession(f"this partner has no model {model_id}")
        try:
            model = ScoringBottom(folder, files)
        except DataError as exc:  # said with file names only: the bank is told no path of this partner's disk
            logger.warning("model %s of %s refused: %s", model_id, bank, exc)
            detail = str(exc).replace(f"{folder}{os.sep}", "").replace(str(folder), "its folder")
            raise AlignmentMismatch(f"model {model_id}: {detail}") from exc
        if model.width != width:
            raise AlignmentMismatch(f"model {model_id} embeds {model.width} wide, the manifest says {width}")
        with self._lock:
            space.models[model_id] = model
            while len(space.models) > MAX_SCORING_ALIGNMENTS:  # loaded models: memory, per bank
                space.models.pop(next(iter(space.models)))

    def embed_for_scoring(self, bank: str, model_id: str, alignment_id: str,
                          positions: torch.Tensor) -> tuple[torch.Tensor, Fallbacks, Drift]:
        """Embeddings of the aligned rows at ``positions``, per column the values that took a policy, and per
        column the drift of all the alignment's customers from the training rows (worked out once)."""
        space = self.banks[bank]
        model = space.models.get(model_id)
        if model is None:
            raise OutOfOrder(f"model {model_id} is not loaded")
        rows = space.scoring_alignments.get(alignment_id)
        if rows is None:
            raise UnknownSession(f"no customers aligned for scoring under {alignment_id}")
        if positions.dim() != 1 or positions.numel() == 0 or int(positions.min()) < 0 or int(positions.max()) >= len(rows):
            raise BadMessage(f"positions must lie in [0, {len(rows)})")
        table_rows = rows[positions.numpy()]
        features, fallbacks = model.encoder.encode(self.table.features.iloc[table_rows])
        z = model.embed(torch.from_numpy(features))
        if self.scoring_dp is not None:
            z = self.scoring_dp.release(z, torch.from_numpy(table_rows.astype(np.int64)), state=f"{bank}/{model_id}")
        if fallbacks:
            logger.info("model %s: scoring rows took fallback policies: %s", model_id, fallbacks)
        return z, fallbacks, self._drift(space, model_id, alignment_id, model, rows)

    def _drift(self, space: BankSpace, model_id: str, alignment_id: str, model: ScoringBottom,
               rows: np.ndarray) -> Drift:
        key = (model_id, alignment_id)
        with self._lock:
            drift = space.drifts.get(key)
        if drift is None:
            drift = model.encoder.drift(self.table.features.iloc[rows])
            moved = {c: v for c, v in drift.items() if v > WARN_PSI}
            if moved:
                logger.warning("model %s: the customers to score drift from the training rows: %s", model_id, moved)
            with self._lock:
                space.drifts[key] = drift
                while len(space.drifts) > MAX_SCORING_ALIGNMENTS:
                    space.drifts.pop(next(iter(space.drifts)))
        return drift

    def close(self) -> None:
        self.psi.close()
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
        with self._lock:
            sessions = [s for space in self.banks.spaces() for s in space.training.values()]
            for space in self.banks.spaces():
                space.training.clear()
        for session in sessions:  # checkpoints already taken still reach the disk
            session.close()
