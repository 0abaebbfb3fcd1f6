"""Per-step endpoints: plain ASGI routes, answered before FastAPI's middleware stack and router.

A training step is one small request, sent thousands of times per epoch, and
the bank waits for every answer. FastAPI's middleware, router, request objects
and validation cost more per call than the step's own checks. A ``HotRoute``
is matched on its path first (``parties.transport.app.PartyApp``) and gets
exactly the same treatment as any other route: the caller is identified from
the same certificate (``parties.transport.access.identify``), the body is held
to the same limit, and domain errors become the same answers
(``parties.transport.access.refusal``). Everything else goes to the FastAPI
app unchanged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import State
from starlette.routing import compile_path

from parties.errors import CutlayerError, PayloadTooLarge
from parties.settings import ServiceSettings
from parties.transport.access import Refusal, check_declared_length, ensure_role, identify, refusal
from parties.transport.tls import PeerIdentity

__all__ = ["HotPath", "HotRequest", "HotResponse", "HotRoute"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class HotRequest:
    caller: PeerIdentity
    params: dict[str, str]
    body: bytes
    state: State  # the app's state: the party's core lives here


@dataclass(frozen=True)
class HotResponse:
    """``after``: work to run once the answer is on its way (the caller no longer waits for it)."""

    body: bytes
    content_type: str
    status: int = 200
    after: Callable[[], None] | None = None

    def run_after(self, scope: Scope) -> None:
        if self.after is None:
            return
        try:
            self.after()
        except Exception:
            logger.exception("after answering %s %s", scope["method"], scope["path"])

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", self.content_type.encode("latin-1")), (b"content-length", b"%d" % len(self.body))]


@dataclass(frozen=True)
class HotRoute:
    """``handler`` answers ``method path`` for callers whose certificate names ``role``.

    The handler is a plain function: it runs on the event loop, as a step's
    small forward and backward do (a thread hop costs more than the step).
    """

    method: str
    path: str
    role: str
    handler: Callable[[HotRequest], HotResponse]

    @property
    def pattern(self) -> re.Pattern[str]:
        return compile_path(self.path)[0]


class _Exchange:
    """One request to a hot route: checked on its head, fed its body, answered once.

    ``answer`` is set as soon as the answer is known: at once for a caller
    who may not call, or a declared length over the limit; on the chunk that
    passes the limit; otherwise by ``finish``.
    """

    def __init__(self, path: HotPath, route: HotRoute, params: dict[str, str], scope: Scope) -> None:
        self.path, self.route, self.params, self.scope = path, route, params, scope
        self.parts: list[bytes] = []
        self.size = 0
        self.answer: HotResponse | Refusal | None = None
        if scope["method"] != route.method:
            self.answer = Refusal(405, "MethodNotAllowed", f"{scope['path']} answers {route.method} only")
            return
        try:
            self.caller = ensure_role(identify(path.settings, scope), route.role)
            declared = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)
            check_declared_length(declared, path.settings.max_body_bytes)
        except CutlayerError as exc:
            self.answer = self._refusal(exc)

    def feed(self, chunk: bytes) -> None:
        if self.answer is not None or not chunk:
            return
        self.size += len(chunk)
        if self.size > self.path.settings.max_body_bytes:
            self.parts = []
            limit = self.path.settings.max_body_bytes
            self.answer = self._refusal(PayloadTooLarge(f"body is over the limit of {limit} bytes"))
            return
        self.parts.append(chunk)

    def finish(self) -> HotResponse | Refusal:
        if self.answer is None:
            body = self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)
            self.parts = []
            try:
                self.answer = self.route.handler(HotRequest(self.caller, self.params, body, self.path.state))
            except CutlayerError as exc:
                self.answer = self._refusal(exc)
            except Exception:
                logger.exception("unexpected error in %s %s", self.scope["method"], self.scope["path"])
                self.answer = Refusal(500, "InternalError", "the service failed; see its log")
        return self.answer

    def _refusal(self, exc: CutlayerError) -> Refusal:
        return refusal(self.path.settings, exc, self.scope)


class HotPath:
    """Answers the hot routes' paths (any other method gets 405); ``None`` from ``match``: the app's."""

    def __init__(self, routes: Sequence[HotRoute], settings: ServiceSettings, state: State) -> None:
        self.routes = [(r, r.pattern) for r in routes]
        self.settings, self.state = settings, state

    def match(self, scope: Scope) -> tuple[HotRoute, dict[str, str]] | None:
        if scope["type"] != "http":
            return None
        for route, pattern in self.routes:
            if m := pattern.match(scope["path"]):
                return route, m.groupdict()
        return None

    async def handle(self, route: HotRoute, params: dict[str, str], scope: Scope, receive: Receive, send: Send) -> None:
        """One request, through ASGI."""
        exchange = _Exchange(self, route, params, scope)
        more = exchange.answer is None
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away; nobody to answer
            exchange.feed(message.get("body", b""))
            more = message.get("more_body", False) and exchange.answer is None
        response = exchange.finish()
        await send({"type": "http.response.start", "status": response.status, "headers": response.headers})
        await send({"type": "http.response.body", "body": response.body})
        if isinstance(response, HotResponse):
            response.run_after(scope)
