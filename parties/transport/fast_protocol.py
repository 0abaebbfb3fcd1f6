"""uvicorn's HTTP protocol, extended from the inside: hot routes answered from the parser's callbacks.

A training step is one small request, sent thousands of times per epoch. This
protocol answers the app's hot routes (``parties.transport.hot_routes``)
straight from httptools' callbacks, head and body in one write, without an
ASGI task, and cuts off a client whose request head or body trickles in past
its time (uvicorn bounds only the idle time between requests). It also puts
the caller's certificate into every request's scope, as
``scope["extensions"]["tls"]``.

It subclasses uvicorn's ``HttpToolsProtocol`` and works with its per-request
state (``cycle``, ``pipeline``, ``flow``, part of ``on_headers_complete``):
``parties.transport.server`` imports this module only for the uvicorn and
httptools versions it was verified against (``server.VERIFIED``), with
``CUTLAYER_FAST_PATH`` on. Anywhere else the server runs uvicorn's own protocol
(``parties.transport.stock``), with the same answers.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import Any

import httptools
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from parties.transport.edges import Timeouts, connection_tls, no_delay, peer_address
from parties.transport.hot_routes import HotExchange, HotPath

__all__ = ["PeerCertHTTPProtocol", "ThreadHTTPProtocol"]

logger = logging.getLogger(__name__)


class _NoEvent:
    def set(self) -> None:
        pass


class _HotCycle:
    """What uvicorn's protocol reads of a request in progress, for a hot exchange."""

    message_event = _NoEvent()  # uvicorn sets it when the connection is lost

    def __init__(self, exchange: HotExchange, keep_alive: bool) -> None:
        self.exchange, self.keep_alive = exchange, keep_alive
        self.response_complete = self.disconnected = False


class _BusyPoll:
    """Keeps an event loop polling its sockets, never sleeping in them, until a deadline.

    After answering a training step, the next one is due within a
    millisecond. A loop that sleeps in ``epoll_wait`` lets its CPU idle, and
    an idle virtual CPU takes tens of microseconds to wake when the request
    arrives; a task that only yields keeps the loop polling, and every
    connection is still served as usual meanwhile.
    """

    def __init__(self) -> None:
        self.until = 0.0
        self.task: asyncio.Task[None] | None = None

    def extend(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self.until = loop.time() + seconds
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run(loop))

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while loop.time() < self.until:
            await asyncio.sleep(0)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class PeerCertHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol, plus the verified client certificate in every request's scope,
    and the app's hot routes answered without ASGI."""

    busy_poll = True  # after answering a step, poll for the next (``_BusyPoll``)

    def __init__(self, *args: Any, timeouts: Timeouts | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timeouts = timeouts or Timeouts()
        self._deadline: asyncio.TimerHandle | None = None
        # Here, not in connection_made: a connection refused before it is made (its TLS handshake failed)
        # is still lost, and connection_lost cancels the poll.
        self._poll = _BusyPoll()
        self._made = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._made = True
        self._arm("header")  # the first request's head is due within the header timeout
        no_delay(transport)
        tls = connection_tls(transport)
        inner = self.app
        hot = getattr(inner, "hot", None)
        self._hot: HotPath | None = hot if isinstance(hot, HotPath) else None
        self._tls = tls

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            scope.setdefault("extensions", {})["tls"] = tls
            await inner(scope, receive, send)

        self.app = app

    def connection_lost(self, exc: Exception | None) -> None:
        self._poll.cancel()
        self._disarm()
        if self._made:  # uvicorn's protocol has nothing to tear down for a connection it never saw
            super().connection_lost(exc)

    # --- how long a request may take to arrive --------------------------------------------

    def _arm(self, phase: str) -> None:
        self._disarm()
        seconds = self._timeouts.header if phase == "header" else self._timeouts.body
        self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if phase == "body" and self.flow.read_paused:  # the app is slow to read it, not the client to send it
            self._arm(phase)
            return
        seconds = self._timeouts.header if phase == "header" else self._timeouts.body
        logger.warning("closing the connection from %s: a request's %s took longer than %gs to arrive",
                       peer_address(self.transport), phase, seconds)
        if self.cycle is None or self.cycle.response_complete:  # nobody else is answering: say why
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # the first request's clock runs from the connection
            self._arm("header")

    # --- hot routes, from the parser's callbacks ------------------------------------------

    def on_headers_complete(self) -> None:
        self._arm("body")
        if not self._begin_hot():
            super().on_headers_complete()

    def _begin_hot(self) -> bool:
        """Start a hot exchange for this request, unless it is not one or must queue behind another."""
        idle = self.cycle is None or self.cycle.response_complete
        if self._hot is None or not idle or self.pipeline or self.limit_concurrency is not None:
            return False
        if self.parser.should_upgrade():
            return False
        path = httptools.parse_url(self.url).path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        self.scope["method"] = self.parser.get_method().decode("ascii")
        self.scope["path"] = self.root_path + path
        self.scope["extensions"] = {"tls": self._tls}
        exchange = self._hot.begin(self.scope)
        if exchange is None:
            return False
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        self.cycle = _HotCycle(exchange, keep_alive)  # type: ignore[assignment]
        if exchange.answer is not None:
            self._answer_hot()  # refused on its head: answer now and close; the body is never read
        elif self.expect_100_continue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return True

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if isinstance(cycle, _HotCycle):
            if not cycle.response_complete:
                cycle.exchange.feed(body)
                if cycle.exchange.answer is not None:
                    self._answer_hot()
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        cycle = self.cycle
        if isinstance(cycle, _HotCycle):
            if not cycle.response_complete:
                self._answer_hot()
            return
        super().on_message_complete()

    def _answer_hot(self) -> None:
        cycle = self.cycle
        assert isinstance(cycle, _HotCycle)
        response = cycle.exchange.finish()
        cycle.response_complete = True
        cycle.keep_alive = cycle.keep_alive and not response.closes  # a refused body is not read on
        if not self.transport.is_closing():
            self.transport.write(response.http(self.server_state.default_headers, close=not cycle.keep_alive))
            if not cycle.keep_alive:
                self.transport.close()
            self.on_response_complete()
        response.run_after(cycle.exchange.scope)
        poll = self._hot.settings.step_poll_seconds if self.busy_poll and self._hot is not None else 0.0
        if poll > 0 and not self.transport.is_closing():
            self._poll.extend(poll)


class ThreadHTTPProtocol(PeerCertHTTPProtocol):
    """For a server in a thread of a bigger process: a polling event loop would hold the GIL
    that the process's other threads need."""

    busy_poll = False
