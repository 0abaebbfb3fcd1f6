"""The bank's proxy for a partner service: PSI, training and scoring calls over mutual TLS.

The coordinator sees only ``bank.vertical.party.TrainingParty`` (for PSI, the ``alignment.psi.PsiPeer``
contract; for scoring, ``bank.vertical.party.ScoringParty``). ``HttpPartner`` implements all three with the
messages and routes of ``parties.protocol``. What every peer client shares (bounded reads, counts, the
refusal map, the retry and first-contact rule) is its base, ``bank.peer.PeerLink``; here are the partner's
calls and, for steps, a kept-alive ``StepConnection`` on which a step is sent at once and its answer read
later, so the bank computes while the partner does (``close`` or a ``with`` block ends it with the job).
``bank.vertical.in_process_party.InProcessParty`` implements ``TrainingParty`` in the bank's own process; the
same contract tests run against both.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import httpx
import numpy as np
import torch
from pydantic import ValidationError

from alignment.curve import POINT_BYTES
from alignment.psi import CHUNK_ITEMS, TRUNCATED_BYTES, Committed, SessionInfo
from bank.peer import HEADER_ROOM, JSON_LIMIT, PeerLink
from parties.errors import NotReady, PeerError, PeerUnavailable, PeerUntrusted
from parties.learning.config import LocalSteps
from parties.protocol import control, psi, scoring, training
from parties.protocol.codec import Precision
from parties.protocol.common import OCTET_STREAM, fill
from parties.protocol.wire import SAFETENSORS
from parties.tables.drift import Drift
from parties.tables.encoding import Fallbacks
from parties.tables.ids import IdType
from parties.transport.client import StepConnection

__all__ = ["HttpPartner"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: What a PSI call's answer may hold beside a chunk: the session's description.
PSI_ANSWER_LIMIT = 1 << 16


class HttpPartner(PeerLink):
    """A partner service reached over (mutual-TLS) HTTP: a ``bank.peer.PeerLink`` with the partner's calls."""

    def __init__(
        self,
        name: str,
        url: str,
        client: httpx.Client,
        *,
        steps: StepConnection | None = None,
        wait_deadline: float = 600.0,
        retry_deadline: float = 60.0,
        known: bool = False,
    ) -> None:
        """``client`` carries every call but steps (and steps too without ``steps``); the caller owns the
        client, this proxy owns ``steps`` (the step connection) and closes it in ``close``. ``known``: the
        partner answered this bank before (its alignment)."""
        super().__init__(name, url, client, "partner", retry_deadline=retry_deadline, known=known)
        self.steps = steps
        self.wait_deadline = wait_deadline
        self.step_bytes = 0  # of training steps alone (requests and answers, once each, retries aside)
        self.session_id = ""
        self.width = 0
        self._chunk_items = CHUNK_ITEMS  # the PSI chunk size agreed at the last open
        self.durable: int | None = None  # the newest step the partner says it has on disk
        self.precision: Precision = "fp32"  # how this session's step tensors travel (agreed at its start)

    def close(self) -> None:
        """Close this proxy's step connection for good: the job is over."""
        if self.steps is not None:
            self.steps.close()

    def __enter__(self) -> HttpPartner:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _tensor_limit(self, rows: int) -> int:
        """The most an answer of ``rows`` embeddings may hold (float32 at most, with a scale per row for int8)."""
        return HEADER_ROOM + 4 * rows * (self.width + 1)

    def _get_when_ready(self, path: str, what: str, limit: int) -> bytes:
        """GET ``path``, asked again while the partner is not ready: at once, then after a pause that doubles from
        5 ms to 200 ms (a partner that is never ready costs the bank a request every 200 ms, not a busy loop)."""
        deadline = time.monotonic() + self.wait_deadline
        pause = 0.0
        while True:
            try:
                return self.once("GET", path, what, limit)
            except NotReady:
                if time.monotonic() > deadline:
                    raise PeerError(f"partner {self.name!r} was not ready with {what} in {self.wait_deadline:.0f}s")
                time.sleep(pause)
                pause = min(0.2, max(0.005, pause * 2))

    def open(self, own_count: int, chunk_items: int, id_type: IdType = "text") -> SessionInfo:
        body = psi.PsiOpenRequest(count=own_count, chunk_items=chunk_items, id_type=id_type).model_dump()
        content = self.once("POST", psi.SESSIONS, "opening a PSI session", PSI_ANSWER_LIMIT, json=body)
        try:  # every partner logs its sessions: an answer without the hash of its record is refused
            info = psi.PsiOpenResponse.model_validate_json(content)
        except (ValueError, ValidationError) as exc:
            raise PeerError(f"partner {self.name!r} answered the PSI open without a valid session-log record hash "
                            f"(or otherwise malformed): {str(exc)[:300]}") from exc
        self._chunk_items = chunk_items  # what was agreed bounds every chunk read (run_initiator checks the answer)
        return SessionInfo(info.session, info.count, info.chunk_items, info.id_type, info.log_head)

    def _put(self, path: str, data: bytes, what: str) -> None:
        self.once("PUT", path, what, PSI_ANSWER_LIMIT, content=data, headers={"content-type": OCTET_STREAM})

    def put_blinded(self, session_id: str, index: int, data: bytes) -> None:
        self._put(fill(psi.BLINDED, session_id=session_id, index=index), data, "blinded IDs")

    def get_blinded(self, session_id: str, index: int) -> bytes:
        return self._get_when_ready(fill(psi.BLINDED, session_id=session_id, index=index), "its blinded IDs",
                                    self._chunk_items * POINT_BYTES)

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        return self._get_when_ready(fill(psi.REBLINDED, session_id=session_id, index=index), "the re-blinded IDs",
                                    self._chunk_items * TRUNCATED_BYTES)

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, purpose: str = "training",
               log_head: str | None = None) -> Committed:
        headers = {"content-type": OCTET_STREAM, psi.ALIGNMENT_HEADER: alignment_id, psi.PURPOSE_HEADER: purpose}
        if log_head is not None:
            headers[psi.LOG_HEAD_HEADER] = log_head
        content = self.once("POST", fill(psi.COMMIT, session_id=session_id), "the alignment", PSI_ANSWER_LIMIT,
                            content=psi.encode_positions(positions), headers=headers)
        info = self.decoded(lambda: control.AlignmentInfo.model_validate_json(content), "the alignment")
        if info.log_head is None or not re.fullmatch(psi.LOG_HEAD, info.log_head):
            raise PeerError(f"partner {self.name!r} confirmed the commit without the hash of its session-log record "
                            "of it: every partner logs its sessions")
        return Committed(info.rows, info.log_head)

    def abort(self, session_id: str) -> None:
        self.once("DELETE", fill(psi.SESSION, session_id=session_id), "aborting the session", PSI_ANSWER_LIMIT)

    # --- training -------------------------------------------------------------------------

    def _send_once(self, path: str, what: str, body: bytes, limit: int) -> Callable[[], bytes]:
        """Send ``body`` now; the returned function waits for the answer (of at most ``limit`` bytes)."""
        if self.steps is None:
            content = self.once("POST", path, what, limit, content=body, headers={"content-type": SAFETENSORS})
            return lambda: content
        try:
            receive = self.steps.send(path, body, SAFETENSORS, limit)
        except PeerUntrusted as exc:
            raise PeerUntrusted(f"partner {self.name!r}: {exc}") from exc

        def finish() -> bytes:
            status, content = receive()
            return self.answer(status, len(body), content, what)

        return finish

    def _control(self, method: str, path: str, what: str, **kwargs: object) -> bytes:
        """An idempotent control call (a JSON answer), retried while the partner may be restarting."""
        return self.call(method, path, what, JSON_LIMIT, **kwargs)

    def _send(self, path: str, what: str, body: bytes, limit: int) -> Callable[[], bytes]:
        """Send an idempotent message now; the returned function waits for the answer, sending the
        message again under the retry policy if the partner does not answer.

        Safe because the partner answers a repeated (session, step) from its
        stored response without applying anything twice.
        """
        try:
            first: Callable[[], bytes] | None = self._send_once(path, what, body, limit)
        except PeerUnavailable:
            first = None

        def result() -> bytes:
            if first is not None:
                try:
                    return first()
                except PeerUnavailable:
                    pass
            self.retries += 1
            logger.warning("partner %s did not answer (%s); sending it again", self.name, what)
            return self.retried(what, lambda: self._send_once(path, what, body, limit)())

        return result

    def _decoded(self, decode: Callable[[bytes], T], content: bytes, what: str) -> T:
        return self.decoded(lambda: decode(content), what)

    def _checked_embedding(self, z: torch.Tensor | None, rows: int, what: str) -> torch.Tensor:
        if z is None or tuple(z.shape) != (rows, self.width):
            shape = None if z is None else tuple(z.shape)
            raise PeerError(f"partner {self.name!r} sent {what} of shape {shape}; expected {(rows, self.width)}")
        return z

    @property
    def _session(self) -> dict[str, str]:
        return {"session_id": self.session_id}

    def start_training(self, session_id: str, alignment_id: str, train_positions: torch.Tensor,
                       precision: Precision = "fp32", local: LocalSteps | None = None) -> int:
        local = local or LocalSteps()
        content = self._control(
            "POST", training.SESSIONS, "starting training",
            content=training.StartRequest(session_id, alignment_id, train_positions, precision, local).encode(),
            headers={"content-type": SAFETENSORS},
        )
        info = self.decoded(lambda: training.TrainSessionInfo.model_validate_json(content), "starting training")
        if info.precision != precision:
            raise PeerError(f"partner {self.name!r} answered in precision {info.precision!r}, not {precision!r}")
        if info.local != local:
            raise PeerError(f"partner {self.name!r} accepted local steps {info.local}, not {local}")
        self.session_id, self.width, self.durable = session_id, info.embedding_width, None
        self.precision = precision
        return info.embedding_width

    def step(self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
        return self.submit_step(step, grad, rows)()

    def submit_step(
        self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None, checkpoint: bool = False,
        keep_from: int | None = None,
    ) -> Callable[[], torch.Tensor | None]:
        request = training.StepRequest(self.session_id, step, grad, rows, checkpoint, keep_from, self.precision)
        what = f"step {step}"
        body = request.encode()
        finish = self._send(fill(training.STEP, **self._session), what, body,
                            self._tensor_limit(0 if rows is None else rows.numel()))

        def result() -> torch.Tensor | None:
            content = finish()
            self.step_bytes += len(body) + len(content)
            reply = self._decoded(lambda body: training.StepReply.decode(body, self.precision), content, what)
            if reply.durable is not None:
                self.durable = reply.durable
            return None if rows is None else self._checked_embedding(reply.embedding, rows.numel(),
                                                                      f"the embedding of step {step}")

        return result

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        what = "an evaluation embedding"
        content = self._send(fill(training.EMBED, **self._session), what,
                             training.EmbedRequest(self.session_id, rows).encode(), self._tensor_limit(rows.numel()))()
        return self._checked_embedding(self._decoded(training.EmbedReply.decode, content, what).embedding,
                                       rows.numel(), what)

    def mark_best(self) -> None:
        self._control("POST", fill(training.BEST, **self._session), "marking the best weights")

    def attach(self, session_id: str, width: int, precision: Precision = "fp32") -> None:
        self.session_id, self.width, self.precision = session_id, width, precision

    # --- scoring with a trained model -------------------------------------------------------

    def load_model(self, model_id: str, files: dict[str, str], width: int) -> None:
        body = scoring.LoadModelRequest(files=files, embedding_width=width).model_dump()
        self._control("POST", fill(scoring.LOAD, model_id=model_id), f"loading model {model_id}", json=body)
        self.width = width

    def embed_for_scoring(self, model_id: str, alignment_id: str,
                          positions: torch.Tensor) -> tuple[torch.Tensor, Fallbacks, Drift]:
        """The partner's embeddings of the rows at ``positions``, its count of values that took a policy, and
        its columns' drift on the customers it holds."""
        what = "scoring embeddings"
        content = self._send(fill(scoring.EMBED, model_id=model_id), what,
                             scoring.ScoringRequest(alignment_id, positions).encode(),
                             self._tensor_limit(positions.numel()))()
        reply = self._decoded(scoring.ScoringReply.decode, content, what)
        z = self._checked_embedding(reply.embedding, positions.numel(), what)
        if any(n > positions.numel() for counts in reply.fallbacks.values() for n in counts.values()):
            raise PeerError(f"partner {self.name!r} counted more fallbacks than rows it embedded")
        return z, reply.fallbacks, reply.drift

    def privacy(self) -> training.PrivacyReport:
        content = self._control("GET", fill(training.PRIVACY, **self._session), "its privacy spend")
        return self.decoded(lambda: training.PrivacyReport.model_validate_json(content), "its privacy spend")

    def checkpoints(self) -> list[int]:
        content = self._control("GET", fill(training.CHECKPOINTS, **self._session), "listing checkpoints")
        return self.decoded(lambda: training.CheckpointList.model_validate_json(content), "listing checkpoints").steps

    def restore(self, step: int) -> None:
        body = training.RestoreRequest(step=step).model_dump()
        self._control("POST", fill(training.RESTORE, **self._session), f"restoring step {step}", json=body)
        self.durable = step

    def finish(self, restore_best: bool) -> training.ModelFiles:
        body = training.FinishRequest(restore_best=restore_best).model_dump()
        content = self._control("POST", fill(training.FINISH, **self._session), "finishing training", json=body)
        return self.decoded(lambda: training.ModelFiles.model_validate_json(content), "finishing training")

    def end(self, finished: bool = True) -> None:
        if self.session_id:
            self.end_session(self.session_id, finished)

    def end_session(self, session_id: str, finished: bool = True) -> None:
        """End one of this bank's sessions at the partner (``finished=False``: only unload it)."""
        call = self._control if finished else self.once
        call("DELETE", fill(training.SESSION, session_id=session_id), "ending training",
             params={"finished": str(finished).lower()})

    def sessions(self) -> control.SessionList:
        """This bank's live sessions at the partner."""
        content = self._control("GET", training.SESSIONS, "listing sessions")
        return self.decoded(lambda: control.SessionList.model_validate_json(content), "listing sessions")
