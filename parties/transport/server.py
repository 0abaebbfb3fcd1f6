"""Run a party's app under uvicorn: mutual TLS, the caller's certificate in the ASGI scope.

uvicorn does not put the client certificate into the request scope, so the
HTTP protocol class is extended to add it as ``scope["extensions"]["tls"]``;
``parties.transport.app`` reads the caller's name and role from there. The same class
answers the app's hot routes (``parties.transport.hot_routes``) straight from the HTTP
parser's callbacks, head and body in one write, without an ASGI task, and
cuts off a client whose request head or body trickles in past its time
(uvicorn bounds only the idle time between requests). The TLS handshake
comes before it, in ``parties.transport.edges``, so refused handshakes are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import threading
import urllib.parse
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from parties.errors import ConfigError
from parties.storage.files import atomic_write_text
from parties.transport.edges import Timeouts, bind_socket, peer_address, tls_front
from parties.transport.hot_routes import HotExchange, HotPath
from parties.transport.tls import TLSFiles, is_loopback, peer_identity, server_ssl_context

__all__ = ["ServerThread", "bind_socket", "build_server", "run_loop", "serve", "running_server"]

logger = logging.getLogger(__name__)


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when it is installed (it is with ``uvicorn[standard]``), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


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
        # uvicorn writes a response's head and body separately; without TCP_NODELAY the body
        # waits for the client's delayed ACK (~40 ms) on every kept-alive request.
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ssl_object = transport.get_extra_info("ssl_object")
        peercert = ssl_object.getpeercert() if ssl_object is not None else None
        # Read the certificate's name and role once per connection, not once per request.
        tls = {"peercert": peercert, "identity": peer_identity(peercert)}
        if peercert and tls["identity"] is None:  # from our CA, yet no party: every request will be refused
            logger.warning("TLS connection from %s: its certificate names no Cutlayer party and role (%s)",
                           peer_address(transport), peercert.get("subject"))
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


class _ThreadHTTPProtocol(PeerCertHTTPProtocol):
    """For a server in a thread of a bigger process: a polling event loop would hold the GIL
    that the process's other threads need."""

    busy_poll = False


class _Server(uvicorn.Server):
    """uvicorn's server, but a second Ctrl-C during the (bounded) shutdown does not skip the app's own.

    uvicorn treats a repeated signal as "force exit": it drops the lifespan shutdown, so the party's
    worker processes and files are not closed, and logs the cancelled lifespan as an error. People
    press Ctrl-C twice; the graceful shutdown is already bounded by ``timeout_graceful_shutdown``.
    """

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            logger.info("already shutting down (at most %ss)", self.config.timeout_graceful_shutdown)
            return
        super().handle_exit(sig, frame)


def _timeouts_of(app: Any) -> Timeouts:
    """The party's own header and body timeouts (its settings), else the defaults."""
    settings = getattr(getattr(app, "state", None), "settings", None)
    if settings is None:
        return Timeouts()
    return Timeouts(header=settings.header_timeout, body=settings.body_timeout)


def build_server(
    app: Any, tls: TLSFiles | None, *, log_level: str = "warning", own_process: bool = True,
    timeouts: Timeouts | None = None,
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``tls=None`` serves plain HTTP (the caller warns about it).

    ``own_process=False``: the server shares its process (and the GIL) with other work, so its event
    loop never busy-polls. ``timeouts``: default, the app's settings' ``header_timeout``/``body_timeout``.
    TLS is not uvicorn's: ``parties.transport.edges`` does each handshake, so a refused one is logged."""
    timeouts = timeouts or _timeouts_of(app)
    protocol = functools.partial(PeerCertHTTPProtocol if own_process else _ThreadHTTPProtocol, timeouts=timeouts)
    if tls is not None:
        tls.check()
        protocol = tls_front(protocol, server_ssl_context(tls), timeouts.header)  # type: ignore[assignment]
    config = uvicorn.Config(
        app,
        http=protocol,  # type: ignore[arg-type]
        log_level=log_level,
        log_config=None,  # the entry point configures logging
        access_log=False,  # access lines carry URLs and peers; our own logs say what matters
        proxy_headers=False,  # parties talk directly over mutual TLS; never trust X-Forwarded-* headers
        timeout_graceful_shutdown=5,
    )
    return _Server(config)


def _plain_http_on_loopback_only(tls: TLSFiles | None, host: str) -> None:
    """Plain HTTP (``--insecure``) listens on loopback only, and says so loudly at start."""
    if tls is not None:
        return
    if not is_loopback(host):
        raise ConfigError(f"--insecure serves plain HTTP: it listens on a loopback address only, not {host}")
    logger.warning("INSECURE: serving plain HTTP on %s without certificates (--insecure); callers are not "
                   "authenticated and traffic is not encrypted. Development on one machine only.", host)


def serve(app: Any, tls: TLSFiles | None, host: str, port: int, ready_file: Path | None = None) -> None:
    """Serve until SIGINT/SIGTERM; once listening, write ``{"url": ...}`` to ``ready_file``."""
    _plain_http_on_loopback_only(tls, host)
    # What the service writes (state, runs, logs) is its party's alone, also where a library writes it.
    os.umask(0o077)
    sock = bind_socket(host, port)
    server = build_server(app, tls, log_level="info")
    scheme = "https" if tls is not None else "http"
    url = f"{scheme}://{host}:{sock.getsockname()[1]}"

    # Ctrl-C reaches every process of the terminal's group. uvicorn shuts down on it and then raises it
    # again for the handler it found installed; with ours there (not Python's default, which asyncio's
    # runner would turn into a KeyboardInterrupt through the lifespan task), a stop is an orderly exit.
    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    async def main() -> None:
        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.05)
            logger.info("listening on %s", url)
            if ready_file is not None:
                atomic_write_text(ready_file, json.dumps({"url": url}) + "\n")

        task = asyncio.create_task(announce())
        await server.serve(sockets=[sock])
        task.cancel()

    run_loop(main())


class ServerThread:
    """A uvicorn server in a background thread, for tests, benchmarks and the walkthrough."""

    def __init__(self, app: Any, tls: TLSFiles | None, host: str = "127.0.0.1") -> None:
        self.app = app
        _plain_http_on_loopback_only(tls, host)
        self.sock = bind_socket(host, 0)
        self.server = build_server(app, tls, own_process=False)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{host}:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn {self.url}")

    def _run(self) -> None:
        run_loop(self.server.serve(sockets=[self.sock]))

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server {self.url} failed to start")
            deadline.wait(0.02)
            waited += 0.02
            if waited > timeout:
                raise TimeoutError(f"server {self.url} did not start in {timeout}s")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)
        self.sock.close()


@contextlib.contextmanager
def running_server(app: Any, tls: TLSFiles | None) -> Iterator[ServerThread]:
    thread = ServerThread(app, tls).start()
    try:
        yield thread
    finally:
        thread.stop()
