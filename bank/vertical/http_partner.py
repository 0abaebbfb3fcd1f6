"""The bank's proxy for a partner service: the one place that knows HTTP, retries and connections.

The coordinator sees only ``bank.vertical.party.TrainingParty`` (for PSI, the
``alignment.psi.PsiPeer`` contract; for scoring, ``bank.vertical.party.ScoringParty``).
``HttpPartner`` implements all three over mutual TLS, with the messages and
routes of ``parties.protocol``: it owns the retry policy (tenacity, one
policy), its connections (an httpx client and, for steps, a kept-alive
``StepConnection``, on which a step is sent at once and its answer read later,
so the bank computes while the partner does; ``close`` or a ``with`` block ends
them with the job), the byte
and round-trip counts, and the mapping of a partner's refusals to
``parties.errors``. ``bank.vertical.in_process_party.InProcessParty`` implements
``TrainingParty`` in the bank's own process; the same contract tests run
against both.
"""

from __future__ import annotations

import json
import re
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn, TypeVar

import httpx
from pydantic import ValidationError
import numpy as np
import torch
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_before_delay, wait_exponential

from alignment.curve import POINT_BYTES
from alignment.psi import CHUNK_ITEMS, TRUNCATED_BYTES, Committed, SessionInfo
from parties.errors import (
    AlignmentMismatch,
    BadMessage,
    Behind,
    IntersectionTooSmall,
    NotReady,
    OverBudget,
    PeerError,
    PeerUnavailable,
    PeerUntrusted,
    QuotaExceeded,
    StorageError,
    UnknownSession,
)
from parties.learning.config import LocalSteps
from parties.protocol import control, psi, scoring, training
from parties.protocol.codec import Precision
from parties.protocol.common import OCTET_STREAM, fill
from parties.protocol.wire import SAFETENSORS
from parties.tables.drift import Drift
from parties.tables.encoding import Fallbacks
from parties.tables.ids import IdType
from parties.transport.client import StepConnection, expect_server
from parties.transport.tls import handshake_failure

__all__ = ["HttpPartner", "retry_policy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def retry_policy(deadline: float, before_sleep: Callable[[RetryCallState], None] | None = None) -> Retrying:
    """The one retry policy for calls to a party that may be restarting.

    Only ``PeerUnavailable`` (no answer at all) is retried: every call the
    policy wraps is idempotent, so sending it again is safe. Backoff doubles
    from 50 ms to 2 s; no attempt starts after ``deadline`` seconds.
    """
    return Retrying(
        retry=retry_if_exception_type(PeerUnavailable),
        stop=stop_before_delay(deadline),
        wait=wait_exponential(multiplier=0.05, min=0.05, max=2.0),
        before_sleep=before_sleep,
        reraise=True,
    )


_PASSED_ON = {"IntersectionTooSmall": IntersectionTooSmall, "AlignmentMismatch": AlignmentMismatch, "OverBudget": OverBudget,
              "UnknownSession": UnknownSession, "StorageError": StorageError, "QuotaExceeded": QuotaExceeded}


#: The most a refusal's body may hold: the error and its reason.
ERROR_BODY_LIMIT = 1 << 16


class HttpPartner:
    """A partner service reached over (mutual-TLS) HTTP."""

    def __init__(
        self,
        name: str,
        url: str,
        client: httpx.Client,
        *,
        steps: StepConnection | None = None,
        wait_deadline: float = 600.0,
        retry_deadline: float = 60.0,
    ) -> None:
        """``client`` carries every call but steps (and steps too without ``steps``); the caller owns the
        client, this proxy owns ``steps`` (the step connection) and closes it in ``close``."""
        self.name, self.url, self.client, self.steps = name, url.rstrip("/"), client, steps
        self.wait_deadline = wait_deadline
        self.retry_deadline = retry_deadline  # how long a silent partner is retried before giving up
        self.retries = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.round_trips = 0
        self.step_bytes = 0  # of training steps alone (requests and answers, once each, retries aside)
        self.session_id = ""
        self.width = 0
        self._chunk_items = CHUNK_ITEMS  # the PSI chunk size agreed at the last open
        self.durable: int | None = None  # the newest step the partner says it has on disk
        # Told each retry of a silent partner, in words for the operator (the job's progress line).
        self.on_retry: Callable[[str], None] | None = None
        self._retry_told = 0  # the last ten seconds of an outage the operator was told of
        self.precision: Precision = "fp32"  # how this session's step tensors travel (agreed at its start)

    def close(self) -> None:
        """Close this proxy's step connection for good: the job is over."""
        if self.steps is not None:
            self.steps.close()

    def __enter__(self) -> HttpPartner:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _answered(self, status: int, sent: int, content: bytes, what: str) -> bytes:
        """Every answer, whichever connection brought it: counted once, and a refusal raised as its error."""
        self.round_trips += 1
        self.bytes_sent += sent
        self.bytes_received += len(content)
        if not 200 <= status < 300:
            self._refused(status, content, what)
        return content

    def _unreachable(self, exc: httpx.HTTPError, what: str) -> PeerError:
        untrusted = handshake_failure(exc)
        if untrusted:
            return PeerUntrusted(f"partner {self.name!r} at {self.url} answered ({what}), but {untrusted}")
        return PeerUnavailable(f"partner {self.name!r} at {self.url} did not answer ({what}): {exc}")

    def _call(self, method: str, path: str, what: str, **kwargs: object) -> httpx.Response:
        try:
            response = self.client.request(method, f"{self.url}{path}", **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            raise self._unreachable(exc, what) from exc
        expect_server(response, self.name, "partner")  # a refusal from another service is not the partner's
        self._answered(response.status_code, len(response.request.content or b""), response.content, what)
        return response

    def _refused(self, status: int, content: bytes, what: str) -> NoReturn:
        try:
            body = json.loads(content)
            kind, detail = str(body.get("error")), str(body.get("detail"))
        except (ValueError, AttributeError):
            kind, detail = "", content[:200].decode(errors="replace")
        if kind == "NotReady":
            raise NotReady(detail)
        if kind == "Behind":
            raise Behind(f"partner {self.name!r} is behind: {detail}")
        error = _PASSED_ON.get(kind, PeerError)
        raise error(f"partner {self.name!r} refused {what} (HTTP {status}): {detail}")

    def _get_bounded(self, path: str, what: str, limit: int) -> bytes:
        """GET ``path`` reading at most ``limit`` bytes of body (an error's body: 64 KiB), whatever the peer
        announces or sends: a partner cannot make the bank read more than was agreed."""
        body = bytearray()
        try:
            with self.client.stream("GET", f"{self.url}{path}") as response:
                cap = limit if response.is_success else ERROR_BODY_LIMIT
                declared = response.headers.get("content-length", "0")
                if not declared.isdigit() or int(declared) > cap:
                    raise PeerError(f"partner {self.name!r} announced {declared} bytes for {what}; at most {cap} "
                                    "were agreed")
                for part in response.iter_bytes():
                    body += part
                    if len(body) > cap:
                        raise PeerError(f"partner {self.name!r} sent more than the {cap} bytes agreed for {what}")
        except httpx.HTTPError as exc:
            raise self._unreachable(exc, what) from exc
        return self._answered(response.status_code, 0, bytes(body), what)

    def _get_when_ready(self, path: str, what: str, limit: int) -> bytes:
        deadline = time.monotonic() + self.wait_deadline
        while True:
            try:
                return self._get_bounded(path, what, limit)
            except NotReady:
                if time.monotonic() > deadline:
                    raise PeerError(f"partner {self.name!r} was not ready with {what} in {self.wait_deadline:.0f}s")

    def open(self, own_count: int, chunk_items: int, id_type: IdType = "text") -> SessionInfo:
        body = psi.PsiOpenRequest(count=own_count, chunk_items=chunk_items, id_type=id_type).model_dump()
        response = self._call("POST", psi.SESSIONS, "opening a PSI session", json=body)
        expect_server(response, self.name, "partner")
        try:  # every partner logs its sessions: an answer without the hash of its record is refused
            info = psi.PsiOpenResponse.model_validate(response.json())
        except (ValueError, ValidationError) as exc:
            raise PeerError(f"partner {self.name!r} answered the PSI open without a valid session-log record hash "
                            f"(or otherwise malformed): {str(exc)[:300]}") from exc
        self._chunk_items = chunk_items  # what was agreed bounds every chunk read (run_initiator checks the answer)
        return SessionInfo(info.session, info.count, info.chunk_items, info.id_type, info.log_head)

    def _put(self, path: str, data: bytes, what: str) -> None:
        self._call("PUT", path, what, content=data, headers={"content-type": OCTET_STREAM})

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
        response = self._call("POST", fill(psi.COMMIT, session_id=session_id), "the alignment",
                              content=psi.encode_positions(positions), headers=headers)
        info = control.AlignmentInfo.model_validate(response.json())
        if info.log_head is None or not re.fullmatch(psi.LOG_HEAD, info.log_head):
            raise PeerError(f"partner {self.name!r} confirmed the commit without the hash of its session-log record "
                            "of it: every partner logs its sessions")
        return Committed(info.rows, info.log_head)

    def abort(self, session_id: str) -> None:
        self._call("DELETE", fill(psi.SESSION, session_id=session_id), "aborting the session")

    # --- training -------------------------------------------------------------------------

    def _send_once(self, path: str, what: str, body: bytes) -> Callable[[], bytes]:
        """Send ``body`` now; the returned function waits for the answer."""
        if self.steps is None:
            content = self._call("POST", path, what, content=body, headers={"content-type": SAFETENSORS}).content
            return lambda: content
        try:
            receive = self.steps.send(path, body, SAFETENSORS)
        except PeerUntrusted as exc:
            raise PeerUntrusted(f"partner {self.name!r}: {exc}") from exc

        def finish() -> bytes:
            status, content = receive()
            return self._answered(status, len(body), content, what)

        return finish

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        """``call`` under the retry policy, until ``retry_deadline``; then a message that names the partner."""
        def note(state: RetryCallState) -> None:
            self.retries += 1
            logger.warning("partner %s did not answer (%s); retrying in %.2fs", self.name, what,
                           state.next_action.sleep if state.next_action else 0.0)
            # Told at the first retry of an outage, then every 10 s: the operator sees it, and not 20 lines of it.
            if self.on_retry is not None and (state.attempt_number == 1 or
                                              state.seconds_since_start // 10 > self._retry_told):
                self._retry_told = int(state.seconds_since_start // 10)
                self.on_retry(f"partner {self.name!r} is not answering ({what}): retrying for up to "
                              f"{self.retry_deadline:.0f} s, {state.seconds_since_start:.0f} s so far")

        try:
            return retry_policy(self.retry_deadline, note)(call)
        except PeerUnavailable as exc:
            last = exc.__cause__ or exc  # the transport's own words, once
            raise PeerUnavailable(
                f"partner {self.name!r} at {self.url} did not answer ({what}) for {self.retry_deadline:.0f}s: {last}"
            ) from exc

    def _control(self, method: str, path: str, what: str, **kwargs: object) -> httpx.Response:
        """An idempotent control call, retried while the partner may be restarting."""
        return self._retried(what, lambda: self._call(method, path, what, **kwargs))

    def _send(self, path: str, what: str, body: bytes) -> Callable[[], bytes]:
        """Send an idempotent message now; the returned function waits for the answer, sending the
        message again under the retry policy if the partner does not answer.

        Safe because the partner answers a repeated (session, step) from its
        stored response without applying anything twice.
        """
        try:
            first: Callable[[], bytes] | None = self._send_once(path, what, body)
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
            return self._retried(what, lambda: self._send_once(path, what, body)())

        return result

    def _decoded(self, decode: Callable[[bytes], T], content: bytes, what: str) -> T:
        try:
            return decode(content)
        except BadMessage as exc:
            raise PeerError(f"partner {self.name!r} sent an unusable answer ({what}): {exc}") from exc

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
        response = self._control(
            "POST", training.SESSIONS, "starting training",
            content=training.StartRequest(session_id, alignment_id, train_positions, precision, local).encode(),
            headers={"content-type": SAFETENSORS},
        )
        expect_server(response, self.name, "partner")
        info = training.TrainSessionInfo.model_validate(response.json())
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
        finish = self._send(fill(training.STEP, **self._session), what, body)

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
                             training.EmbedRequest(self.session_id, rows).encode())()
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
                             scoring.ScoringRequest(alignment_id, positions).encode())()
        reply = self._decoded(scoring.ScoringReply.decode, content, what)
        z = self._checked_embedding(reply.embedding, positions.numel(), what)
        if any(n > positions.numel() for counts in reply.fallbacks.values() for n in counts.values()):
            raise PeerError(f"partner {self.name!r} counted more fallbacks than rows it embedded")
        return z, reply.fallbacks, reply.drift

    def privacy(self) -> training.PrivacyReport:
        response = self._control("GET", fill(training.PRIVACY, **self._session), "its privacy spend")
        return training.PrivacyReport.model_validate(response.json())

    def checkpoints(self) -> list[int]:
        response = self._control("GET", fill(training.CHECKPOINTS, **self._session), "listing checkpoints")
        return training.CheckpointList.model_validate(response.json()).steps

    def restore(self, step: int) -> None:
        body = training.RestoreRequest(step=step).model_dump()
        self._control("POST", fill(training.RESTORE, **self._session), f"restoring step {step}", json=body)
        self.durable = step

    def finish(self, restore_best: bool) -> training.ModelFiles:
        body = training.FinishRequest(restore_best=restore_best).model_dump()
        response = self._control("POST", fill(training.FINISH, **self._session), "finishing training", json=body)
        return training.ModelFiles.model_validate(response.json())

    def end(self, finished: bool = True) -> None:
        if self.session_id:
            self.end_session(self.session_id, finished)

    def end_session(self, session_id: str, finished: bool = True) -> None:
        """End one of this bank's sessions at the partner (``finished=False``: only unload it)."""
        call = self._control if finished else self._call
        call("DELETE", fill(training.SESSION, session_id=session_id), "ending training",
             params={"finished": str(finished).lower()})

    def sessions(self) -> control.SessionList:
        """This bank's live sessions at the partner."""
        return control.SessionList.model_validate(self._control("GET", training.SESSIONS, "listing sessions").json())
