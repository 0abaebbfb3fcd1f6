"""A lean keep-alive HTTPS channel for the per-step hot path.

Training sends one request per step, so client overhead is paid thousands of
times per epoch, and on a busy machine every line of Python on that path runs
with cold caches. This channel keeps one connection open with the same
mutual-TLS context and peer-certificate check as the httpx client, writes a
request in one ``sendall`` and parses the response with httptools (the C
parser uvicorn uses) instead of ``http.client``'s Python header parser.
Everything that is not a training step keeps using httpx.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

import httptools

from parties.errors import PeerError, PeerUnavailable, PeerUntrusted
from parties.protocol import http
from parties.transport import sockets
from parties.transport.tls import PeerIdentity, handshake_failure, peer_identity

__all__ = ["Channel", "ChannelResponse"]


@dataclass(frozen=True)
class ChannelResponse:
    status: int
    content: bytes
    content_type: str

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300


class _Response:
    """httptools callbacks: collect one response."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.keep_alive = False
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # only meaningful while the message is parsed

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def release(self) -> None:
        """Drop the parser. It refers back to this object, and the cycle would hold the body until a GC pass."""
        del self.parser


class Channel:
    """One kept-alive connection to ``url``; reconnects (and re-checks the peer) when it drops."""

    def __init__(
        self,
        url: str,
        context: ssl.SSLContext | None,
        *,
        expect: PeerIdentity | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 600.0,
        max_response_bytes: int = 64 << 20,
        poll: float = 0.0,
    ) -> None:
        """``poll``: seconds to poll for a response before sleeping on the socket (see ``_await_data``)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise PeerError(f"{url!r} is not an http(s) URL")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        self.https = parts.scheme == "https"
        self.context, self.expect, self.timeout = context, expect, timeout
        self.max_response_bytes, self.poll = max_response_bytes, poll
        self._head = http.host_headers(self.host, self.port, headers)
        self._sock: socket.socket | None = None
        self._buffer = bytearray(1 << 18)
        self._lock = threading.Lock()  # held for a send or a receive, never between them
        self._pending: object | None = None  # the exchange whose answer is unread
        self._closed = False

    def _connect(self) -> socket.socket:
        sock = sockets.connect(self.host, self.port, self.timeout)  # TCP_NODELAY, a loss-based congestion control
        try:
            if self.https:
                assert self.context is not None
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
                if self.expect is not None:
                    identity = peer_identity(sock.getpeercert())  # type: ignore[attr-defined]
                    if identity != self.expect:
                        raise PeerError(f"expected {self.expect.role} {self.expect.name!r} at {self.host}:{self.port}, "
                                        f"but its certificate names {identity}")
        except BaseException:
            sock.close()
            raise
        return sock

    def send(self, path: str, body: bytes, content_type: str) -> Callable[[], ChannelResponse]:
        """Send a POST now; the returned function waits for its response.

        Between the two the caller is free to compute: the request is already
        on its way, so no thread is needed to overlap the two. One request is
        in flight at a time: sending again before the last answer was read
        (the caller failed in between) drops that connection and its unread
        answer, and the stale receive function then raises ``PeerUnavailable``.
        A connection that fails is closed and the error raised; a request is
        never silently resent. No lock is held between the two calls.
        """
        head = http.request_head("POST", path, self._head, content_type, len(body))
        with self._lock:
            if self._closed:
                raise PeerUnavailable(f"the channel to {self.host}:{self.port} is closed")
            if self._pending is not None:
                self.close_connection()  # its answer was never read: the connection is mid-response
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(head + body)
            except OSError as exc:
                self.close_connection()
                untrusted = handshake_failure(exc)
                if untrusted:
                    raise PeerUntrusted(f"{self.host}:{self.port} answered, but {untrusted}") from exc
                raise PeerUnavailable(f"{self.host}:{self.port} did not answer: {exc}") from exc
            except BaseException:
                self.close_connection()
                raise
            exchange = self._pending = object()

        def receive() -> ChannelResponse:
            with self._lock:
                if self._pending is not exchange or self._sock is None:
                    raise PeerUnavailable(f"{self.host}:{self.port}: the answer was dropped (the channel was "
                                          "closed or used again before it was read)")
                self._pending = None
                return self._read(self._sock)

        return receive

    def _read(self, sock: socket.socket) -> ChannelResponse:
        response = _Response()
        try:
            self._await_data(sock)
            view = memoryview(self._buffer)
            while not response.complete:
                n = sock.recv_into(self._buffer)
                if n == 0:
                    raise ConnectionResetError("the connection closed before the whole response arrived")
                response.parser.feed_data(view[:n])
                if response.size > self.max_response_bytes:
                    self.close_connection()
                    raise PeerError(f"{self.host}:{self.port} sent a response over {self.max_response_bytes} bytes")
            if not response.keep_alive:
                self.close_connection()
            content_type = response.headers.get(b"content-type", b"").decode("latin-1")
            return ChannelResponse(response.parser.get_status_code(), b"".join(response.body), content_type)
        except (OSError, httptools.HttpParserError) as exc:
            self.close_connection()
            raise PeerUnavailable(f"{self.host}:{self.port} did not answer: {exc}") from exc
        except BaseException:
            self.close_connection()  # interrupted mid-response: the connection cannot be reused
            raise
        finally:
            response.release()

    def _await_data(self, sock: socket.socket) -> None:
        """Poll ``sock`` for up to ``self.poll`` seconds before the caller blocks on it.

        A thread that sleeps on a socket lets its CPU idle, and an idle virtual
        CPU takes tens of microseconds to wake when the answer arrives; a
        step's answer is usually due well within a millisecond. After the
        budget, the caller's blocking read waits as usual (with its timeout).
        """
        if self.poll <= 0 or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return
        deadline = time.perf_counter() + self.poll
        while not select.select([sock], [], [], 0)[0] and time.perf_counter() < deadline:
            pass

    def post(self, path: str, body: bytes, content_type: str) -> ChannelResponse:
        return self.send(path, body, content_type)()

    def close_connection(self) -> None:
        """Drop the current connection (the next send opens a new one)."""
        self._pending = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the channel for good: its connection now, and any later send is refused."""
        with self._lock:
            self._closed = True
            self.close_connection()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
