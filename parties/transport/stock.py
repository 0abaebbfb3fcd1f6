"""uvicorn's own HTTP protocol, and what a party's service adds to it through public interfaces only.

It touches nothing inside uvicorn: it wraps
uvicorn's protocol in an asyncio protocol (the interface asyncio defines), and
the app in an ASGI app (the scope ASGI defines). What it keeps, and how:

- **The caller's certificate** in every request's ``scope["extensions"]["tls"]``.
  Each open connection is recorded, with its certificate, under its pair of
  addresses, which ASGI puts in every scope (``client``, ``server``); the ASGI
  wrapper looks a request's connection up by them. TCP never has two open
  connections with the same pair, and the server never takes ``client`` from a
  header (``proxy_headers=False``).
- **Hot routes** go through the app's ASGI path (``PartyApp`` matches them
  before FastAPI and runs ``HotPath.handle``): the same checks and answers,
  with an ASGI task per request.
- **Refusals** (403, 413) answer ``connection: close``; uvicorn closes the
  connection after such an answer instead of reading the rest of the body.
- **Deadlines.** The TLS handshake keeps its own (``parties.transport.edges``).
  A request's head must arrive within ``header`` seconds of its first byte
  (of the connection's start, for the first one), else 408 and the connection
  closes; a body the app waits for must arrive within ``body`` seconds of the
  head (time the app spends not reading does not count), else the connection
  closes. The protocol in front sees bytes arrive; the ASGI wrapper sees a
  head parsed (the app is called), the app waiting for body, the answer sent.
  Idle time between requests is uvicorn's ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from parties.transport.edges import Timeouts, connection_tls, no_delay, peer_address

__all__ = ["Connections", "connection_key"]

logger = logging.getLogger(__name__)

Address = tuple[str, int]
Key = tuple[Address, Address]
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

#: What a request carries when its connection cannot be told apart from another: nobody, refused.
_AMBIGUOUS: dict[str, Any] = {"peercert": {"subject": ()}, "identity": None}


def _address(info: Any) -> Address | None:
    return (str(info[0]), int(info[1])) if isinstance(info, (tuple, list)) and len(info) >= 2 else None


def connection_key(transport: asyncio.BaseTransport) -> Key | None:
    """The connection's (client, server) addresses, as uvicorn puts them in the scope."""
    sock = transport.get_extra_info("socket")
    try:
        peer, local = (sock.getpeername(), sock.getsockname()) if sock is not None else (
            transport.get_extra_info("peername"), transport.get_extra_info("sockname"))
    except OSError:
        return None
    client, server = _address(peer), _address(local)
    return (client, server) if client is not None and server is not None else None


class _Connection:
    """One open connection: its transport, its caller's certificate, the deadline running on it."""

    def __init__(self, transport: asyncio.Transport, tls: dict[str, Any], timeouts: Timeouts) -> None:
        self.transport, self.tls, self.timeouts = transport, tls, timeouts
        self.loop = asyncio.get_running_loop()
        self.deadline: asyncio.TimerHandle | None = None
        self.busy = False  # a request is with the app
        self.body_done = True  # the app has had the request's whole body (or the request is over)
        self.waiting = 0  # the app's calls waiting for more of the body
        self.key: Key | None = None

    def arm(self, phase: str) -> None:
        self.disarm()
        seconds = self.timeouts.header if phase == "header" else self.timeouts.body
        self.deadline = self.loop.call_later(seconds, self._expired, phase)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _expired(self, phase: str) -> None:
        self.deadline = None
        if self.transport.is_closing() or (phase == "body" and self.body_done):
            return
        if phase == "body" and not self.waiting:  # the app is slow to read it, not the client to send it
            self.arm(phase)
            return
        seconds = self.timeouts.header if phase == "header" else self.timeouts.body
        logger.warning("closing the connection from %s: a request's %s took longer than %gs to arrive",
                       peer_address(self.transport), phase, seconds)
        if phase == "header":  # no request is with the app: nobody else will answer, so say why
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()

    # --- what the protocol in front sees ------------------------------------------------------

    def data_arrived(self) -> None:
        if not self.busy and self.deadline is None:  # a new request's first bytes: its head is due
            self.arm("header")

    # --- what the ASGI wrapper sees -----------------------------------------------------------

    def request_started(self) -> None:
        self.busy, self.body_done = True, False
        self.arm("body")

    def body_arrived(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
            self.disarm()

    def response_sent(self) -> None:
        self.busy, self.body_done = False, True
        self.disarm()


class _Tracked(asyncio.Protocol):
    """uvicorn's protocol behind one that records the connection and watches bytes arrive."""

    def __init__(self, inner: asyncio.Protocol, table: Connections) -> None:
        self.inner, self.table = inner, table
        self.connection: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connection = self.table.opened(transport)  # type: ignore[arg-type]
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.connection is not None:
            self.connection.data_arrived()
        self.inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[attr-defined]

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.connection is None:  # refused in its TLS handshake: uvicorn's protocol never saw it
            return
        self.table.closed(self.connection)
        self.inner.connection_lost(exc)


class Connections:
    """One server's open connections, by their addresses: ``protocol`` wraps uvicorn's protocol, ``app`` the app."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._open: dict[Key, _Connection] = {}

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, transport: asyncio.Transport) -> _Connection:
        no_delay(transport)
        connection = _Connection(transport, connection_tls(transport), self.timeouts)
        key = connection_key(transport)
        if key is None:  # not TCP: its requests cannot be found, so they carry no certificate and no deadline
            connection.busy = True  # which also keeps ``data_arrived`` from arming one
            return connection
        connection.arm("header")  # the first request's head is due within the header timeout
        other = self._open.get(key)
        if other is not None and not other.transport.is_closing():
            # Not for TCP; but if it happens, no request on either may borrow the other's certificate.
            logger.warning("two open connections from %s: refusing the requests of both", peer_address(transport))
            other.tls = connection.tls = _AMBIGUOUS
        self._open[key] = connection
        connection.key = key
        return connection

    def closed(self, connection: _Connection) -> None:
        connection.disarm()
        if connection.key is not None and self._open.get(connection.key) is connection:
            del self._open[connection.key]

    def protocol(self, inner: Callable[..., asyncio.Protocol]) -> Callable[..., asyncio.Protocol]:
        """A protocol factory for uvicorn: ``inner(**kwargs)`` behind a ``_Tracked``."""

        def factory(**kwargs: Any) -> asyncio.Protocol:
            return _Tracked(inner(**kwargs), self)

        return factory

    def find(self, scope: Scope) -> _Connection | None:
        client, server = scope.get("client"), scope.get("server")
        if not client or not server:
            return None
        return self._open.get((_address(client), _address(server)))  # type: ignore[arg-type]

    def app(self, app: ASGIApp) -> ASGIApp:
        """``app``, with each request's connection: its certificate in the scope, its deadlines kept."""

        async def served(scope: Scope, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            connection = self.find(scope)
            if connection is None:  # no certificate to show: ``identify`` refuses unless --insecure
                await app(scope, receive, send)
                return
            scope.setdefault("extensions", {})["tls"] = connection.tls
            connection.request_started()

            async def receive_body() -> MutableMapping[str, Any]:
                connection.waiting += 1
                try:
                    message = await receive()
                finally:
                    connection.waiting -= 1
                if not connection.body_done:
                    connection.body_arrived(message)
                return message

            async def send_answer(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    connection.response_sent()
                await send(message)

            try:
                await app(scope, receive_body, send_answer)
            finally:
                if connection.busy:
                    connection.response_sent()

        return served
