"""The bank's view of the other parties: proxies with one contract, over HTTP or in process.

For alignment the coordinator sees the ``PsiPeer`` contract (``alignment.in_process``
has the in-process implementation); for training it sees ``TrainingParty``,
implemented here by ``HttpPartner`` (a partner service) and in
``bank.in_process`` by ``InProcessParty`` (the bank's own bottom model, or any
party's session called directly). The same contract tests run against both.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import httpx
import numpy as np
import torch
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_before_delay, wait_exponential

from alignment.curve import POINT_BYTES
from alignment.psi import CHUNK_ITEMS, TRUNCATED_BYTES, SessionInfo
from parties.errors import (
    AlignmentMismatch,
    Behind,
    IntersectionTooSmall,
    NotReady,
    OverBudget,
    PeerError,
    PeerUnavailable,
    PeerUntrusted,
    StorageError,
    UnknownSession,
)
from parties.protocol.messages import (
    ALIGNMENT_HEADER,
    OCTET_STREAM,
    PURPOSE_HEADER,
    AlignmentInfo,
    CheckpointList,
    FinishRequest,
    LoadModelRequest,
    ModelFiles,
    PrivacyReport,
    PsiOpenRequest,
    PsiOpenResponse,
    RestoreRequest,
    SessionList,
    TrainSessionInfo,
)
from parties.protocol.wire import SAFETENSORS, WireMessage, decode, encode
from parties.tables.encoding import Fallbacks, parse_fallbacks
from parties.transport.channel import Channel
from parties.transport.client import expect_server
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
              "UnknownSession": UnknownSession, "StorageError": StorageError}


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
        channel: Channel | None = None,
        wait_deadline: float = 600.0,
        retry_deadline: float = 60.0,
    ) -> None:
        self.name, self.url, self.client, self.channel = name, url.rstrip("/"), client, channel
        self.wait_deadline = wait_deadline
        self.retry_deadline = retry_deadline  # how long a silent partner is retried before giving up
        self.retries = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.round_trips = 0
        self.session_id = ""
        self.width = 0
        self._chunk_items = CHUNK_ITEMS  # the PSI chunk size agreed at the last open
        self.durable: int | None = None  # the newest step the partner says it has on disk

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
        self.bytes_sent += len(response.request.content or b"")
        self.bytes_received += len(response.content)
        self.round_trips += 1
        if not response.is_success:
            self._refused(response.status_code, response.content, what)
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
        self.bytes_received += len(body)
        self.round_trips += 1
        if not response.is_success:
            self._refused(response.status_code, bytes(body), what)
        return bytes(body)

    def _get_when_ready(self, path: str, what: str, limit: int) -> bytes:
        deadline = time.monotonic() + self.wait_deadline
        while True:
            try:
                return self._get_bounded(path, what, limit)
            except NotReady:
                if time.monotonic() > deadline:
                    raise PeerError(f"partner {self.name!r} was not ready with {what} in {self.wait_deadline:.0f}s")

    def open(self, own_count: int, chunk_items: int) -> SessionInfo:
        body = PsiOpenRequest(count=own_count, chunk_items=chunk_items).model_dump()
        response = self._call("POST", "/psi/sessions", "opening a PSI session", json=body)
        expect_server(response, self.name, "partner")
        info = PsiOpenResponse.model_validate(response.json())
        self._chunk_items = chunk_items  # what was agreed bounds every chunk read (run_initiator checks the answer)
        return SessionInfo(info.session, info.count, info.chunk_items)

    def _put(self, path: str, data: bytes, what: str) -> None:
        self._call("PUT", path, what, content=data, headers={"content-type": OCTET_STREAM})

    def put_blinded(self, session_id: str, index: int, data: bytes) -> None:
        self._put(f"/psi/sessions/{session_id}/blinded/{index}", data, "blinded IDs")

    def get_blinded(self, session_id: str, index: int) -> bytes:
        return self._get_when_ready(f"/psi/sessions/{session_id}/blinded/{index}", "its blinded IDs",
                                    self._chunk_items * POINT_BYTES)

    def get_reblinded(self, session_id: str, index: int) -> bytes:
        return self._get_when_ready(f"/psi/sessions/{session_id}/reblinded/{index}", "the re-blinded IDs",
                                    self._chunk_items * TRUNCATED_BYTES)

    def commit(self, session_id: str, alignment_id: str, positions: np.ndarray, purpose: str = "training") -> int:
        response = self._call(
            "POST",
            f"/psi/sessions/{session_id}/commit",
            "the alignment",
            content=positions.astype("<u4").tobytes(),
            headers={"content-type": OCTET_STREAM, ALIGNMENT_HEADER: alignment_id, PURPOSE_HEADER: purpose},
        )
        return AlignmentInfo.model_validate(response.json()).rows

    def abort(self, session_id: str) -> None:
        self._call("DELETE", f"/psi/sessions/{session_id}", "aborting the session")

    # --- training -------------------------------------------------------------------------

    def _send_once(self, path: str, what: str, body: bytes) -> Callable[[], bytes]:
        """Send ``body`` now; the returned function waits for the answer."""
        if self.channel is None:
            content = self._call("POST", path, what, content=body, headers={"content-type": SAFETENSORS}).content
            return lambda: content
        receive = self.channel.send(path, body, SAFETENSORS)

        def finish() -> bytes:
            response = receive()
            self.round_trips += 1
            self.bytes_sent += len(body)
            self.bytes_received += len(response.content)
            if not response.is_success:
                self._refused(response.status, response.content, what)
            return response.content

        return finish

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        """``call`` under the retry policy, until ``retry_deadline``; then a message that names the partner."""
        def note(state: RetryCallState) -> None:
            self.retries += 1
            logger.warning("partner %s did not answer (%s); retrying in %.2fs", self.name, what,
                           state.next_action.sleep if state.next_action else 0.0)

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

    def _send_tensors(
        self, path: str, what: str, tensors: dict[str, torch.Tensor], **meta: object
    ) -> Callable[[], bytes]:
        """Send an idempotent message now; the returned function waits for the answer, sending the
        message again under the retry policy if the partner does not answer.

        Safe because the partner answers a repeated (session, step) from its
        stored response without applying anything twice.
        """
        body = encode(tensors, **meta)
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

    def _post_tensors(self, path: str, what: str, tensors: dict[str, torch.Tensor], **meta: object) -> bytes:
        return self._send_tensors(path, what, tensors, **meta)()

    def _embedding(self, content: bytes, rows: int, what: str) -> torch.Tensor:
        return self._checked_embedding(decode(content, {"embedding": torch.float32}), rows, what)

    def _checked_embedding(self, message: WireMessage, rows: int, what: str) -> torch.Tensor:
        z = message.get("embedding")
        if z is None or tuple(z.shape) != (rows, self.width):
            shape = None if z is None else tuple(z.shape)
            raise PeerError(f"partner {self.name!r} sent {what} of shape {shape}; expected {(rows, self.width)}")
        return z

    def start_training(self, session_id: str, alignment_id: str, train_positions: torch.Tensor) -> int:
        response = self._control(
            "POST", "/train/sessions", "starting training",
            content=encode({"train_rows": train_positions}, session=session_id, alignment=alignment_id),
            headers={"content-type": SAFETENSORS},
        )
        expect_server(response, self.name, "partner")
        info = TrainSessionInfo.model_validate(response.json())
        self.session_id, self.width, self.durable = session_id, info.embedding_width, None
        return info.embedding_width

    def step(self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
        return self.submit_step(step, grad, rows)()

    def submit_step(
        self, step: int, grad: torch.Tensor | None, rows: torch.Tensor | None, checkpoint: bool = False,
        keep_from: int | None = None,
    ) -> Callable[[], torch.Tensor | None]:
        tensors = {k: v for k, v in (("grad", grad), ("rows", rows)) if v is not None}
        meta: dict[str, object] = {"session": self.session_id, "step": step}
        if checkpoint:
            meta |= {"checkpoint": 1} | ({} if keep_from is None else {"keep_from": keep_from})
        finish = self._send_tensors(f"/train/sessions/{self.session_id}/step", f"step {step}", tensors, **meta)

        def result() -> torch.Tensor | None:
            message = decode(finish(), {"embedding": torch.float32})
            if "durable" in message.meta:
                self.durable = message.int_meta("durable")
            return None if rows is None else self._checked_embedding(message, rows.numel(),
                                                                      f"the embedding of step {step}")

        return result

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        response = self._post_tensors(
            f"/train/sessions/{self.session_id}/embed", "an evaluation embedding", {"rows": rows},
            session=self.session_id,
        )
        return self._embedding(response, rows.numel(), "an evaluation embedding")

    def mark_best(self) -> None:
        self._control("POST", f"/train/sessions/{self.session_id}/best", "marking the best weights")

    def attach(self, session_id: str, width: int) -> None:
        self.session_id, self.width = session_id, width

    # --- scoring with a trained model -------------------------------------------------------

    def load_model(self, model_id: str, files: dict[str, str], width: int) -> None:
        body = LoadModelRequest(files=files, embedding_width=width).model_dump()
        self._control("POST", f"/models/{model_id}/load", f"loading model {model_id}", json=body)
        self.width = width

    def embed_for_scoring(self, model_id: str, alignment_id: str, positions: torch.Tensor) -> tuple[torch.Tensor, Fallbacks]:
        """The partner's embeddings of the rows at ``positions``, and its count of values that took a policy."""
        content = self._post_tensors(f"/models/{model_id}/embed", "scoring embeddings", {"rows": positions},
                                     alignment=alignment_id)
        message = decode(content, {"embedding": torch.float32})
        z = self._checked_embedding(message, positions.numel(), "scoring embeddings")
        try:
            fallbacks = parse_fallbacks(message.meta.get("fallbacks", ""))
        except ValueError as exc:
            raise PeerError(f"partner {self.name!r} sent unusable fallback counts: {exc}") from exc
        if any(n > positions.numel() for counts in fallbacks.values() for n in counts.values()):
            raise PeerError(f"partner {self.name!r} counted more fallbacks than rows it embedded")
        return z, fallbacks

    def privacy(self) -> PrivacyReport:
        response = self._control("GET", f"/train/sessions/{self.session_id}/privacy", "its privacy spend")
        return PrivacyReport.model_validate(response.json())

    def checkpoints(self) -> list[int]:
        response = self._control("GET", f"/train/sessions/{self.session_id}/checkpoints", "listing checkpoints")
        return CheckpointList.model_validate(response.json()).steps

    def restore(self, step: int) -> None:
        body = RestoreRequest(step=step).model_dump()
        self._control("POST", f"/train/sessions/{self.session_id}/restore", f"restoring step {step}", json=body)
        self.durable = step

    def finish(self, restore_best: bool) -> ModelFiles:
        body = FinishRequest(restore_best=restore_best).model_dump()
        response = self._control("POST", f"/train/sessions/{self.session_id}/finish", "finishing training",
                                 json=body)
        return ModelFiles.model_validate(response.json())

    def end(self, finished: bool = True) -> None:
        if self.session_id:
            self.end_session(self.session_id, finished)

    def end_session(self, session_id: str, finished: bool = True) -> None:
        """End one of this bank's sessions at the partner (``finished=False``: only unload it)."""
        call = self._control if finished else self._call
        call("DELETE", f"/train/sessions/{session_id}", "ending training", params={"finished": str(finished).lower()})

    def sessions(self) -> SessionList:
        """This bank's live sessions at the partner."""
        return SessionList.model_validate(self._control("GET", "/train/sessions", "listing sessions").json())
