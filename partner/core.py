"""The partner, without HTTP: PSI sessions, the committed alignment, and training sessions."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from alignment.cache import hashed_points
from alignment.parallel import WorkerPool
from alignment.psi import PROTOCOL_VERSION, PsiResponder, check_id_types, check_minimum, partnership_dst
from parties.errors import AlignmentMismatch, BadMessage, Behind, DataError, OutOfOrder, UnknownSession
from parties.learning.config import LocalSteps
from parties.learning.embedding_noise import EmbeddingNoise
from parties.learning.trained_bottom import ScoringBottom
from parties.learning.training_session import PartySession
from parties.protocol.codec import Precision
from parties.protocol.control import AlignmentInfo, SessionList, SessionSummary
from parties.protocol.psi import PsiOpenRequest, PsiOpenResponse
from parties.protocol.training import ModelFiles, PrivacyReport, TrainSessionInfo
from parties.settings import PartnerSettings
from parties.storage.checkpoint import checkpoint_steps, remove_checkpoints
from parties.storage.files import atomic_write_text
from parties.tables.drift import WARN_PSI, Drift
from parties.tables.encoding import Fallbacks
from parties.tables.table import AlignedRows, PartyTable, load_alignment, save_alignment
from partner.budget import PsiBudgets

__all__ = ["PartnerCore"]

logger = logging.getLogger(__name__)

#: Longest a request waits for a computation before answering "not ready, retry".
WAIT_SECONDS = 30.0
MAX_SCORING_ALIGNMENTS = 4
ENDED = "ended"  # in a training session's folder: the session is over and never comes back


class PartnerCore:
    """A partner's alignment state: its table, its worker pool, open PSI sessions, the alignment."""

    def __init__(self, settings: PartnerSettings, table: PartyTable) -> None:
        self.settings, self.table = settings, table
        self.pool = WorkerPool(settings.workers)
        self.threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="psi")
        self._points: dict[str, Future[bytes]] = {}  # per bank: this table hashed under the partnership's DST
        self.threads.submit(self.pool.start)  # the first PSI session need not wait for the workers
        self._sessions: dict[str, PsiResponder] = {}
        self.budgets = PsiBudgets(settings.psi_budget)
        self._lock = threading.Lock()
        self.alignment: AlignedRows | None = load_alignment(settings.state_path, table)
        self._training: dict[str, PartySession] = {}
        self.scoring_alignments: dict[str, np.ndarray] = {}
        self._drifts: dict[tuple[str, str], Drift] = {}  # (model, scoring alignment) -> each column's drift
        self.models: dict[str, ScoringBottom] = {}
        # Scoring releases embeddings too: with embedding noise on, they are clipped, noised (from a secret of this
        # process's own) and counted. NoPeek shapes training only: scoring releases what the trained model computes.
        self.scoring_dp = EmbeddingNoise(settings.privacy, len(table)) if settings.privacy.embedding_noise else None

    def open_session(self, request: PsiOpenRequest, owner: str = "") -> PsiOpenResponse:
        if request.version != PROTOCOL_VERSION:
            raise BadMessage(f"PSI protocol version {request.version}; this partner speaks {PROTOCOL_VERSION}")
        check_id_types(self.table.id_type, request.id_type, "the partner", "the bank")  # before any budget or blinding
        self.budgets.charge(owner, request.count)  # before anything is blinded
        with self._lock:
            self._expire()
            if len(self._sessions) >= self.settings.max_psi_sessions:
                # A bank that abandoned its sessions (it crashed, or gave up) must still be able to align:
                # its own least recently used session makes room. Other banks' sessions are never touched.
                mine = [sid for sid, r in self._sessions.items() if r.owner == owner]
                if not mine:
                    raise OutOfOrder(f"{len(self._sessions)} PSI sessions are open; finish or abort one first")
                oldest = min(mine, key=lambda sid: self._sessions[sid].last_used)
                self._drop_psi(oldest)
                logger.info("PSI session %s closed: its owner opened another with every slot taken", oldest)
        points = self._hashed_for(owner).result()
        responder = PsiResponder(points, request.count, self.pool, self.threads, request.chunk_items, owner)
        with self._lock:
            self._sessions[responder.session_id] = responder
        logger.info("PSI session %s opened", responder.session_id)
        return PsiOpenResponse(session=responder.session_id, count=responder.own_count, chunk_items=responder.chunk_items,
                               id_type=self.table.id_type)

    def _hashed_for(self, bank: str) -> Future[bytes]:
        with self._lock:
            if bank not in self._points:
                dst = partnership_dst(bank, self.settings.name)
                self._points[bank] = self.threads.submit(
                    hashed_points, self.table.normalized_ids, self.pool, self.settings.cache_dir, dst)
            return self._points[bank]

    def session(self, session_id: str, owner: str = "") -> PsiResponder:
        """The PSI session ``session_id`` of the bank ``owner``: another bank's is as unknown as a missing one."""
        with self._lock:
            responder = self._sessions.get(session_id)
        if responder is None or responder.owner != owner:
            raise UnknownSession(f"no PSI session {session_id} (it may have expired)")
        responder.touch()
        return responder

    def abort(self, session_id: str, owner: str = "") -> None:
        self.session(session_id, owner)
        with self._lock:
            if self._drop_psi(session_id):
                logger.info("PSI session %s aborted", session_id)

    def _drop_psi(self, session_id: str) -> bool:
        responder = self._sessions.pop(session_id, None)
        if responder is not None:
            responder.close()  # blinding not yet started never starts
        return responder is not None

    def commit(
        self, session_id: str, alignment_id: str, positions: np.ndarray, purpose: str = "training", owner: str = ""
    ) -> AlignmentInfo:
        """Keep the rows the bank chose (positions in the blinded set this side sent), in its order.

        ``min_intersection`` is a commit policy: fewer rows are refused. It is not a privacy control:
        the bank has its PSI result before it commits (the budgets bound what it can learn).
        """
        responder = self.session(session_id, owner)
        if not alignment_id or len(alignment_id) > 64:
            raise BadMessage("an alignment id is 1 to 64 characters")
        rows = responder.finish(positions)
        check_minimum(len(rows), self.settings.min_intersection, "the bank")
        if purpose == "scoring":  # customers to score: kept apart from the training alignment
            with self._lock:
                self.scoring_alignments[alignment_id] = rows
                while len(self.scoring_alignments) > MAX_SCORING_ALIGNMENTS:
                    self.scoring_alignments.pop(next(iter(self.scoring_alignments)))
        elif purpose == "training":
            self.alignment = AlignedRows(alignment_id, rows)
            save_alignment(self.settings.state_path, self.table, self.alignment)
        else:
            raise BadMessage(f"unknown purpose {purpose!r}")
        with self._lock:
            self._drop_psi(session_id)
        logger.info("alignment %s committed: %d rows", alignment_id, len(rows))
        return AlignmentInfo(alignment_id=alignment_id, rows=len(rows))

    # --- training -------------------------------------------------------------------------

    def start_training(
        self, session_id: str, alignment_id: str, train_positions: torch.Tensor, owner: str = "",
        precision: Precision = "fp32", local: LocalSteps | None = None,
    ) -> TrainSessionInfo:
        """Start (or start again) a training session; ``precision``: how its step tensors travel (each step
        message names its own, so nothing about it is kept here); ``local``: the communication-efficient mode (kept
        by the session and its checkpoints)."""
        if not session_id or len(session_id) > 64:
            raise BadMessage("a session id is 1 to 64 characters")
        if self._ended(session_id):
            raise OutOfOrder(f"training session {session_id} has ended; start a new one")
        if self.alignment is None:
            raise OutOfOrder("no alignment yet: align before training")
        if alignment_id != self.alignment.alignment_id:
            raise OutOfOrder(f"alignment {alignment_id} is not this partner's current alignment")
        with self._lock:
            self._expire_training()
            existing = self._training.get(session_id)
            if existing is not None and not existing.started_with(alignment_id, train_positions):
                raise OutOfOrder(f"training session {session_id} already exists, with other rows")
            # The same start again (a retry, or the bank starting a run no party had checkpointed): the
            # session starts afresh, seeded, as the first time.
            if existing is None and len(self._training) >= self.settings.max_training_sessions:
                raise OutOfOrder(f"{len(self._training)} training sessions are live; end one first "
                                 f"(each idle one ends by itself after {self.settings.training_session_ttl:.0f}s)")
        privacy = self.settings.privacy if self.settings.privacy.active else None
        monitor = self.settings.monitor if self.settings.monitor.active else None
        session = PartySession(
            session_id, self.table, self.alignment, train_positions, self.settings.bottom, privacy, monitor,
            local,
        )
        session.owner = owner
        remove_checkpoints(self.checkpoint_dir(session_id))  # an abandoned start's: a restart must not find them
        with self._lock:
            previous = self._training.pop(session_id, None)
            self._training[session_id] = session
        if previous is not None:
            previous.close()
        return TrainSessionInfo(session=session_id, embedding_width=session.trainer.width, precision=precision,
                                local=local or LocalSteps())

    def checkpoint_dir(self, session_id: str) -> Path:
        if not session_id.isalnum():
            raise BadMessage("a session id is letters and digits")
        return self.settings.state_path / "training" / session_id

    def training(self, session_id: str, *, live: bool = True) -> PartySession:
        """The live session, or, after a restart, the session rebuilt from its latest checkpoint.

        A rebuilt session answers every call that ``live`` marks with ``Behind`` until the bank rolls
        it back: whatever happened after its checkpoint (steps, the best weights marked) is gone, and
        only a rollback of every party makes them agree again.
        """
        with self._lock:
            session = self._training.get(session_id)
            if session is None:
                session = self._from_checkpoint(session_id)
        session.last_used = time.monotonic()
        if live and session.restarted_at is not None:
            raise Behind(f"training session {session_id} restarted from its checkpoint at step "
                         f"{session.restarted_at}; roll every party back first", session.trainer.next_step)
        return session

    def _ended(self, session_id: str) -> bool:
        return (self.checkpoint_dir(session_id) / ENDED).exists()

    def _from_checkpoint(self, session_id: str) -> PartySession:
        folder = self.checkpoint_dir(session_id)
        if (folder / ENDED).exists():  # a finished session is never brought back
            raise UnknownSession(f"training session {session_id} has ended")
        steps = checkpoint_steps(folder)
        if not steps or self.alignment is None:
            raise UnknownSession(f"no training session {session_id}")
        session = PartySession.from_checkpoint(folder, steps[-1], self.table, self.alignment)
        self._training[session_id] = session
        return session

    def checkpoints(self, session_id: str) -> list[int]:
        try:
            self.training(session_id, live=False).flush_checkpoints()
        except UnknownSession:  # restarted before its first checkpoint: it holds none
            return []
        return checkpoint_steps(self.checkpoint_dir(session_id))

    def checkpoint(self, session_id: str, floor: int | None = None) -> int:
        session = self.training(session_id)
        return session.checkpoint(self.checkpoint_dir(session_id), floor)

    def restore(self, session_id: str, step: int) -> None:
        session = self.training(session_id, live=False)
        session.restore(self.checkpoint_dir(session_id), step)
        session.restarted_at = None

    def privacy(self, session_id: str) -> PrivacyReport:
        return self.training(session_id).trainer.privacy_report(session_id)

    def finish_training(self, session_id: str, restore_best: bool) -> ModelFiles:
        session = self.training(session_id)
        if restore_best:
            session.trainer.restore_best()
        files = session.save(self.settings.state_path / "models" / session_id)
        logger.info("training session %s finished; model written", session_id)
        return ModelFiles(session=session_id, files=files)

    def end_training(self, session_id: str, finished: bool = True) -> None:
        """``finished``: the session is over, for good (its checkpoints go, it can never come back);
        otherwise it is only unloaded, and stays resumable from its checkpoints."""
        folder = self.checkpoint_dir(session_id)
        with self._lock:
            session = self._training.pop(session_id, None)
        if session is not None:
            session.close()
        if finished:
            if folder.is_dir() or session is not None:
                atomic_write_text(folder / ENDED, "")  # 0600 in a 0700 folder, like every file of the party's
                remove_checkpoints(folder)
            logger.info("training session %s ended", session_id)
        elif session is not None:
            logger.info("training session %s unloaded; it stays resumable from its checkpoints", session_id)

    def _expire_training(self) -> None:
        now = time.monotonic()
        for sid, session in list(self._training.items()):
            if now - session.last_used > self.settings.training_session_ttl:
                del self._training[sid]
                session.close()
                logger.info("training session %s expired; it stays resumable from its checkpoints", sid)

    # --- sessions, for their owner and for this partner's operator ----------------------------

    def sessions(self, owner: str | None = None) -> SessionList:
        """The live sessions (every one, or ``owner``'s), after expiring the idle ones."""
        now = time.monotonic()
        with self._lock:
            self._expire()
            self._expire_training()
            out = [SessionSummary(kind="training", session=sid, owner=s.owner, state="live",
                                  idle_seconds=round(now - s.last_used, 3), step=s.trainer.next_step)
                   for sid, s in self._training.items()]
            out += [SessionSummary(kind="psi", session=sid, owner=r.owner, state="live",
                                   idle_seconds=round(now - r.last_used, 3))
                    for sid, r in self._sessions.items()]
        return SessionList(sessions=[s for s in out if owner is None or s.owner == owner])

    def end_session(self, session_id: str) -> None:
        """This partner's operator ends a session for good: a PSI session, or a training session."""
        with self._lock:
            if self._drop_psi(session_id):
                logger.info("PSI session %s ended by the operator", session_id)
                return
        if session_id not in self._training and not checkpoint_steps(self.checkpoint_dir(session_id)):
            raise UnknownSession(f"no session {session_id}")
        self.end_training(session_id, finished=True)

    # --- scoring with a trained model -------------------------------------------------------

    def load_model(self, model_id: str, files: dict[str, str], width: int) -> None:
        """Load this partner's part of a trained model, refusing files that differ from the manifest."""
        if not model_id.isalnum():
            raise BadMessage("a model id is letters and digits")
        folder = self.settings.state_path / "models" / model_id
        if not folder.is_dir():
            raise UnknownSession(f"this partner has no model {model_id}")
        try:
            model = ScoringBottom(folder, files)
        except DataError as exc:
            raise AlignmentMismatch(f"model {model_id}: {exc}") from exc
        if model.width != width:
            raise AlignmentMismatch(f"model {model_id} embeds {model.width} wide, the manifest says {width}")
        self.models[model_id] = model

    def embed_for_scoring(self, model_id: str, alignment_id: str,
                          positions: torch.Tensor) -> tuple[torch.Tensor, Fallbacks, Drift]:
        """Embeddings of the aligned rows at ``positions``, per column the values that took a policy, and per
        column the drift of all the alignment's customers from the training rows (worked out once)."""
        model = self.models.get(model_id)
        if model is None:
            raise OutOfOrder(f"model {model_id} is not loaded")
        rows = self.scoring_alignments.get(alignment_id)
        if rows is None:
            raise UnknownSession(f"no customers aligned for scoring under {alignment_id}")
        if positions.dim() != 1 or positions.numel() == 0 or int(positions.min()) < 0 or int(positions.max()) >= len(rows):
            raise BadMessage(f"positions must lie in [0, {len(rows)})")
        table_rows = rows[positions.numpy()]
        features, fallbacks = model.encoder.encode(self.table.features.iloc[table_rows])
        z = model.embed(torch.from_numpy(features))
        if self.scoring_dp is not None:
            z = self.scoring_dp.release(z, torch.from_numpy(table_rows.astype(np.int64)), state=model_id)
        if fallbacks:
            logger.info("model %s: scoring rows took fallback policies: %s", model_id, fallbacks)
        return z, fallbacks, self._drift(model_id, alignment_id, model, rows)

    def _drift(self, model_id: str, alignment_id: str, model: ScoringBottom, rows: np.ndarray) -> Drift:
        key = (model_id, alignment_id)
        with self._lock:
            drift = self._drifts.get(key)
        if drift is None:
            drift = model.encoder.drift(self.table.features.iloc[rows])
            moved = {c: v for c, v in drift.items() if v > WARN_PSI}
            if moved:
                logger.warning("model %s: the customers to score drift from the training rows: %s", model_id, moved)
            with self._lock:
                self._drifts[key] = drift
                while len(self._drifts) > MAX_SCORING_ALIGNMENTS:
                    self._drifts.pop(next(iter(self._drifts)))
        return drift

    def _expire(self) -> None:
        now = time.monotonic()
        for sid, r in list(self._sessions.items()):
            if now - r.last_used > self.settings.psi_session_ttl:
                self._drop_psi(sid)
                logger.info("PSI session %s expired", sid)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.pool.close()
        with self._lock:
            sessions, self._training = list(self._training.values()), {}
        for session in sessions:  # checkpoints already taken still reach the disk
            session.close()
