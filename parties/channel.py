"""A lean keep-alive HTTPS channel for the per-step hot path.

Training sends one request per step, so client overhead is paid thousands of
times per epoch. The standard library's ``http.client`` costs about half of
what httpx does per request; this wraps one kept-alive connection of it with
the same mutual-TLS context and the same peer-certificate check. Everything
that is not a training step keeps using httpx.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from parties.errors import PeerError, PeerUnavailable
from parties.tls import PeerIdentity, peer_identity

__all__ = ["Channel", "ChannelResponse"]


@dataclass(frozen=True)
class ChannelResponse:
    status: int
    content: bytes
    content_type: str

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300


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
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise PeerError(f"{url!r} is not an http(s) URL")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        self.https = parts.scheme == "https"
        self.context, self.expect, self.timeout = context, expect, timeout
        self.headers = dict(headers or {})
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        if self.https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=self.context
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.https and self.expect is not None:
            identity = peer_identity(conn.sock.getpeercert())  # type: ignore[union-attr]
            if identity != self.expect:
                conn.close()
                raise PeerError(f"expected {self.expect.role} {self.expect.name!r} at {self.host}:{self.port}, "
                                f"but its certificate names {identity}")
        return conn

    def send(self, path: str, body: bytes, content_type: str) -> Callable[[], ChannelResponse]:
        """Send a POST now; the returned function waits for its response.

        Between the two the caller is free to compute: the request is already
        on its way, so no thread is needed to overlap the two. One request is
        in flight at a time. A connection that fails is closed and the error
        raised; a request is never silently resent.
        """
        self._lock.acquire()
        try:
            if self._conn is None:
                self._conn = self._connect()
            headers = {**self.headers, "content-type": content_type, "content-length": str(len(body))}
            self._conn.request("POST", path, body=body, headers=headers)
        except (OSError, http.client.HTTPException) as exc:
            self._fail()
            raise PeerUnavailable(f"{self.host}:{self.port} did not answer: {exc}") from exc
        except BaseException:
            self._fail()
            raise

        def receive() -> ChannelResponse:
            try:
                assert self._conn is not None
                response = self._conn.getresponse()
                content = response.read()
                return ChannelResponse(response.status, content, response.getheader("content-type", ""))
            except (OSError, http.client.HTTPException) as exc:
                self.close_connection()
                raise PeerUnavailable(f"{self.host}:{self.port} did not answer: {exc}") from exc
            finally:
                self._lock.release()

        return receive

    def post(self, path: str, body: bytes, content_type: str) -> ChannelResponse:
        return self.send(path, body, content_type)()

    def _fail(self) -> None:
        self.close_connection()
        self._lock.release()

    def close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
