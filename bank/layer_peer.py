"""The bank's end of the layer exchange (``parties.protocol.layers``): a compute party or a branch over mutual TLS.

Every call is idempotent (the service answers a repeated step from its cache), so a call that gets no
answer is sent again under the one retry policy (``bank.http_partner.retry_policy``). Whatever the
peer answers is checked: shapes, dtypes, finiteness, and who answered (the certificate's name and role).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TypeVar

import httpx
import torch

from bank.http_partner import ERROR_BODY_LIMIT, retry_policy
from parties.errors import BadMessage, OutOfOrder, PeerError, PeerUnavailable, PeerUntrusted, UnknownSession
from parties.protocol import layers
from parties.protocol.common import fill
from parties.protocol.wire import SAFETENSORS, WireMessage, all_finite, decode, encode, parse
from parties.transport.client import expect_server
from parties.transport.tls import handshake_failure

__all__ = ["LayerPeer"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: The most a weights answer may hold (a branch's bottom and its optimizer's moments).
WEIGHTS_LIMIT = 256 << 20


class LayerPeer:
    """A compute party (``role="compute"``) or a branch (``role="partner"``) holding layers for this bank."""

    def __init__(self, name: str, url: str, client: httpx.Client, role: str, *, retry_deadline: float = 60.0) -> None:
        self.name, self.url, self.client, self.role = name, url.rstrip("/"), client, role
        self.retry_deadline = retry_deadline
        self.session_id = ""
        self.info: layers.LayerInfo | None = None
        self.bytes_sent = self.bytes_received = self.round_trips = self.retries = 0

    # --- transport ------------------------------------------------------------------------------------------
    def _once(self, method: str, path: str, what: str, **kwargs: object) -> httpx.Response:
        try:
            response = self.client.request(method, f"{self.url}{path}", **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            untrusted = handshake_failure(exc)
            if untrusted:
                raise PeerUntrusted(f"{self.role} {self.name!r} at {self.url} answered ({what}), but {untrusted}") from exc
            raise PeerUnavailable(f"{self.role} {self.name!r} at {self.url} did not answer ({what}): {exc}") from exc
        expect_server(response, self.name, self.role)
        self.round_trips += 1
        self.bytes_sent += len(response.request.content or b"")
        self.bytes_received += len(response.content)
        if not response.is_success:
            self._refused(response, what)
        return response

    def _refused(self, response: httpx.Response, what: str) -> None:
        try:
            body = json.loads(response.content[:ERROR_BODY_LIMIT])
            kind, detail = str(body.get("error")), str(body.get("detail"))
        except (ValueError, AttributeError):
            kind, detail = "", response.content[:200].decode(errors="replace")
        error = {"UnknownSession": UnknownSession, "OutOfOrder": OutOfOrder}.get(kind, PeerError)
        raise error(f"{self.role} {self.name!r} refused {what} (HTTP {response.status_code}): {detail}")

    def _call(self, method: str, path: str, what: str, **kwargs: object) -> httpx.Response:
        def note(state: object) -> None:
            self.retries += 1
            logger.warning("%s %s did not answer (%s); sending it again", self.role, self.name, what)

        try:
            return retry_policy(self.retry_deadline, note)(lambda: self._once(method, path, what, **kwargs))
        except PeerUnavailable as exc:
            raise PeerUnavailable(f"{self.role} {self.name!r} at {self.url} did not answer ({what}) for "
                                  f"{self.retry_deadline:.0f}s: {exc.__cause__ or exc}") from exc

    def _tensors(self, template: str, what: str, tensors: dict[str, torch.Tensor], step: int,
                 answer: dict[str, object]) -> WireMessage:
        body = encode(tensors, session=self.session_id, step=step)
        path = fill(template, session_id=self.session_id)
        content = self._call("POST", path, what, content=body, headers={"content-type": SAFETENSORS}).content
        return self._decoded(lambda: decode(content, answer), what)  # type: ignore[arg-type]

    def _decoded(self, parse_answer: Callable[[], T], what: str) -> T:
        try:
            return parse_answer()
        except (BadMessage, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise PeerError(f"{self.role} {self.name!r} sent an unusable answer ({what}): {exc}") from exc

    def _shaped(self, t: torch.Tensor | None, shape: tuple[int, ...], what: str) -> torch.Tensor:
        if t is None or tuple(t.shape) != shape:
            raise PeerError(f"{self.role} {self.name!r} sent {what} of shape "
                            f"{None if t is None else tuple(t.shape)}; expected {shape}")
        return t

    # --- the exchange ---------------------------------------------------------------------------------------
    def start(self, start: layers.LayerStart) -> layers.LayerInfo:
        self.session_id = start.session
        response = self._call("POST", layers.SESSIONS, "start", json=start.model_dump(mode="json"))
        info = self._decoded(lambda: layers.LayerInfo.model_validate_json(response.content), "start")  # type: ignore[arg-type]
        if (info.session, info.kind, info.out_width) != (start.session, start.kind, start.out_width):
            raise PeerError(f"{self.role} {self.name!r} started {info.kind} session {info.session!r} of width "
                            f"{info.out_width}, not the {start.kind} session asked for")
        self.info = info
        return info

    @property
    def out_width(self) -> int:
        assert self.info is not None, "start the session first"
        return self.info.out_width

    def forward(self, step: int, x: torch.Tensor) -> torch.Tensor:
        m = self._tensors(layers.FORWARD, f"forward of step {step}", {"x": x}, step, {"output": torch.float32})
        return self._shaped(m.get("output"), (len(x), self.out_width), f"the output of step {step}")

    def backward(self, step: int, grad: torch.Tensor) -> torch.Tensor | None:
        m = self._tensors(layers.BACKWARD, f"backward of step {step}", {"grad": grad}, step, {"grad": torch.float32})
        if self.info is not None and self.info.kind == "trunk":
            return self._shaped(m.get("grad"), (len(grad), self.info.in_width), f"the input gradient of step {step}")
        return None

    def train(self, step: int, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        m = self._tensors(layers.TRAIN, f"step {step}", {"x": x, "labels": labels}, step, {"grad": torch.float32})
        grad = self._shaped(m.get("grad"), tuple(x.shape), f"the gradient of step {step}")
        try:
            return grad, float(m.meta["loss"])
        except (KeyError, ValueError) as exc:
            raise PeerError(f"{self.role} {self.name!r} sent no loss for step {step}") from exc

    def predict(self, x: torch.Tensor, batch: int = 8192) -> torch.Tensor:
        parts = []
        for i in range(0, len(x), batch):
            chunk = x[i: i + batch]
            m = self._tensors(layers.PREDICT, "predict", {"x": chunk}, 0, {"output": torch.float32})
            parts.append(self._shaped(m.get("output"), (len(chunk), self.out_width), "a prediction"))
        return torch.cat(parts) if parts else torch.zeros(0, self.out_width)

    def checkpoint(self, step: int) -> None:
        self._call("POST", fill(layers.CHECKPOINT, session_id=self.session_id, step=step), f"checkpoint {step}")

    def restore(self, step: int) -> None:
        self._call("POST", fill(layers.RESTORE, session_id=self.session_id, step=step), f"restore {step}")

    def weights(self, optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        path = fill(layers.WEIGHTS, session_id=self.session_id)
        content = self._call("GET", path, "weights", params={"optimizer": str(optimizer).lower()}).content
        if len(content) > WEIGHTS_LIMIT:
            raise PeerError(f"{self.role} {self.name!r} sent {len(content)} bytes of weights")
        header, tensors = self._decoded(lambda: parse(content), "weights")
        if not all(t.dtype == torch.float32 and all_finite(t) for t in tensors.values()):
            raise PeerError(f"{self.role} {self.name!r} sent weights that are not finite float32")
        meta = header.get("__metadata__") or {}
        try:
            state = json.loads(meta.get("state", "{}"))  # type: ignore[union-attr]
        except (AttributeError, json.JSONDecodeError) as exc:
            raise PeerError(f"{self.role} {self.name!r} sent weights without their state") from exc
        return tensors, state

    def load_weights(self, tensors: dict[str, torch.Tensor], state: dict[str, object]) -> None:
        body = encode(tensors, session=self.session_id, step=0, state=json.dumps(state))
        self._call("PUT", fill(layers.WEIGHTS, session_id=self.session_id), "new weights", content=body,
                   headers={"content-type": SAFETENSORS})

    def stats(self, positions: list[int]) -> layers.StatsReply:
        response = self._call("POST", layers.STATS, "column statistics",
                              json=layers.StatsRequest(positions=positions).model_dump(mode="json"))
        return self._decoded(lambda: layers.StatsReply.model_validate_json(response.content), "column statistics")  # type: ignore[arg-type]

    def end(self) -> None:
        if self.session_id:
            try:
                self._once("DELETE", fill(layers.SESSION, session_id=self.session_id), "end")
            except (PeerError, UnknownSession) as exc:
                logger.warning("ending %s %s's session: %s", self.role, self.name, exc)
