"""Per-step endpoints as plain ASGI, answered before FastAPI's middleware stack and router.

A training step is one small request, sent thousands of times per epoch, and
the bank waits for every answer. FastAPI's middleware, router and request
objects cost more per call than the step's own checks (measured: about a
tenth of a step's round trip). A ``HotRoute`` is matched on its path first
and gets exactly the same treatment as any other route: the caller is
identified from the same certificate (``parties.access.identify``), the body is
held to the same limit, and domain errors become the same JSON answers with
the same status codes. Everything else goes to the FastAPI app unchanged.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import State
from starlette.requests import ClientDisconnect
from starlette.routing import compile_path

from parties.access import ensure_role, identify, read_limited
from parties.errors import CutlayerError
from parties.settings import ServiceSettings
from parties.tls import PeerIdentity

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
    body: bytes
    content_type: str
    status: int = 200


@dataclass(frozen=True)
class HotRoute:
    """``handler`` answers ``method path`` for callers whose certificate names ``role``."""

    method: str
    path: str
    role: str
    handler: Callable[[HotRequest], Awaitable[HotResponse]]

    @property
    def pattern(self) -> re.Pattern[str]:
        return compile_path(self.path)[0]


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
        if scope["method"] != route.method:
            await _answer(send, _error(405, "MethodNotAllowed", f"{scope['path']} answers {route.method} only"))
            return
        try:
            caller = ensure_role(identify(self.settings, scope), route.role)
            declared = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)
            body = await read_limited(_chunks(receive), declared, self.settings.max_body_bytes)
            response = await route.handler(HotRequest(caller, params, body, self.state))
        except ClientDisconnect:
            return  # the client went away; nobody to answer
        except CutlayerError as exc:
            logger.info("%s %s refused: %s", scope["method"], scope["path"], type(exc).__name__)
            response = _error(exc.status_code, type(exc).__name__, str(exc))
        except Exception:
            logger.exception("unexpected error in %s %s", scope["method"], scope["path"])
            response = _error(500, "InternalError", "the service failed; see its log")
        await _answer(send, response)


async def _answer(send: Send, response: HotResponse) -> None:
    headers = [(b"content-type", response.content_type.encode()), (b"content-length", b"%d" % len(response.body))]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


def _error(status: int, kind: str, detail: str) -> HotResponse:
    return HotResponse(json.dumps({"error": kind, "detail": detail}).encode(), "application/json", status)


async def _chunks(receive: Receive) -> AsyncIterator[bytes]:
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield message.get("body", b"")
        more = message.get("more_body", False)
