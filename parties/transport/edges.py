"""A connection's edges, before HTTP: the listening socket, the TLS handshake, who is calling, how long a request
may take.

uvicorn hands TLS to the event loop's server, and the loop drops a refused
handshake silently (asyncio logs it only in debug mode): an operator never
learns that a stranger, or a partner with last year's certificate, knocked.
``TLSHandshake`` runs the handshake itself with the public ``loop.start_tls``,
logs a refusal with the peer's address and the reason, and hands a completed
connection to the HTTP protocol. The handshake is bounded by the header
timeout, like the request head that follows it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parties.errors import ConfigError
from parties.observability import REFUSALS
from parties.transport import sockets
from parties.transport.trust import check_peer, trust_of

__all__ = [
    "TLSHandshake", "Timeouts", "bind_socket", "connection_tls", "handshake_refusal", "no_delay", "peer_address",
    "tls_front",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """Seconds a client has for the TLS handshake and a request's head (``header``), and for its body."""

    header: float = 30.0
    body: float = 60.0


def peer_address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "an unknown peer"


def connection_tls(transport: asyncio.BaseTransport) -> dict[str, Any]:
    """The caller's verified certificate and the party it names, as each request's ``scope["extensions"]["tls"]``.

    Read once per connection, not once per request; ``parties.transport.access.identify`` reads it.
    """
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return {}
    identity, problem = check_peer(ssl_object)
    tls: dict[str, Any] = {"peercert": ssl_object.getpeercert(), "identity": identity}
    if identity is None:  # verified by a CA we trust, yet not a party we accept (its name, its CA, revoked)
        REFUSALS.labels("certificate").inc()
        logger.warning("TLS connection from %s refused: %s", peer_address(transport), problem)
        transport.close()  # nothing it sends is read
    else:
        trust = trust_of(ssl_object.context)
        tls.update(trust=trust, der=ssl_object.getpeercert(True), generation=trust.generation if trust else 0)
    return tls


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Send small writes at once: uvicorn writes a response's head and body separately, and without
    TCP_NODELAY the body waits for the client's delayed ACK (~40 ms) on every kept-alive request.
    Also a loss-based congestion control, as the client asks for its side (``parties.transport.sockets``)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sockets.tune(sock)


def handshake_refusal(exc: BaseException) -> str:
    """Why this server refused a client's handshake, in an operator's words."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "the handshake did not finish in time"
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
        return f"its certificate has expired ({exc.verify_message})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its certificate is not from this partnership's CA ({exc.verify_message or exc.reason})"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or "").upper()
        if "CERTIFICATE_VERIFY_FAILED" in reason:
            return f"its certificate is not from this partnership's CA ({exc.reason})"
        if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in reason or "NO_CERTIFICATE" in reason:
            return f"it presented no client certificate ({exc.reason})"
        if "HTTP_REQUEST" in reason or "WRONG_VERSION_NUMBER" in reason:
            return f"it does not speak TLS (plain HTTP to an HTTPS service?) ({exc.reason})"
        if "ALERT" in reason:
            return f"it refused this server's certificate ({exc.reason})"
        return f"TLS error {exc.reason or exc}"
    if isinstance(exc, (ConnectionError, EOFError)):
        return f"it went away during the handshake ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


class TLSHandshake(asyncio.Protocol):
    """Completes a server-side TLS handshake, then gives the connection to ``protocol()``.

    Until the handshake is done, nothing is read for HTTP; once it is, the HTTP
    protocol sees a TLS transport exactly as if the server had done TLS itself.
    uvloop starts reading right after ``connection_made`` even if it paused, so
    a fast client's hello can arrive before ``start_tls`` takes the transport
    over: it is kept and handed to the TLS protocol, through its own
    ``BufferedProtocol`` interface, before that protocol starts.
    """

    def __init__(self, protocol: Callable[[], asyncio.Protocol], context: ssl.SSLContext, timeout: float) -> None:
        self._protocol, self._context, self._timeout = protocol, context, timeout
        self._task: asyncio.Task[None] | None = None
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._transport = transport
        transport.pause_reading()
        self._task = asyncio.get_running_loop().create_task(self._handshake(transport))

    def data_received(self, data: bytes) -> None:  # only before start_tls took the transport over
        self._early.append(data)
        self._transport.pause_reading()

    async def _handshake(self, transport: asyncio.Transport) -> None:
        peer = peer_address(transport)
        protocol = self._protocol()
        loop = asyncio.get_running_loop()
        # Runs after start_tls has made its TLS protocol the transport's, before that protocol starts.
        loop.call_soon(self._replay, transport)
        try:
            context = self._context
            if (trust := trust_of(context)) is not None:
                trust.refresh()  # a renewed certificate, CA bundle or revocation list, before this handshake
                context = trust.server_context()
            secure = await loop.start_tls(
                transport, protocol, context, server_side=True, ssl_handshake_timeout=self._timeout
            )
        except (OSError, asyncio.TimeoutError, EOFError, RuntimeError) as exc:  # RuntimeError: closed meanwhile
            REFUSALS.labels("handshake").inc()
            logger.warning("refused a TLS connection from %s: %s", peer, handshake_refusal(exc))
            transport.close()
            return
        if secure is None:  # only for a transport closed meanwhile
            transport.close()
            return
        protocol.connection_made(secure)

    def _replay(self, transport: asyncio.Transport) -> None:
        early, self._early = self._early, []
        if early:
            logger.debug("replaying %d early bytes into the TLS handshake", sum(map(len, early)))
        tls = transport.get_protocol()
        for data in early:
            if not hasattr(tls, "buffer_updated"):
                tls.data_received(data)
                continue
            while data:  # the protocol's buffer may be smaller than the data
                view = memoryview(tls.get_buffer(len(data)))
                part, data = data[: len(view)], data[len(view) :]
                view[: len(part)] = part
                tls.buffer_updated(len(part))

    def connection_lost(self, exc: Exception | None) -> None:
        # Only before the handshake began: start_tls makes its own protocol the transport's.
        if self._task is not None and not self._task.done():
            self._task.cancel()


def tls_front(protocol: Callable[..., asyncio.Protocol], context: ssl.SSLContext, timeout: float) -> Callable[..., Any]:
    """A protocol factory for uvicorn: each connection's handshake first, then ``protocol(**kwargs)``."""

    def factory(**kwargs: Any) -> TLSHandshake:
        return TLSHandshake(lambda: protocol(**kwargs), context, timeout)

    return factory


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready socket; port 0 lets the OS pick a free one.

    A port that is taken, an address not on this machine or a port that needs
    privileges is a :class:`ConfigError` that says which flag to change.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sockets.tune(sock)  # accepted connections start with its options (``no_delay`` sets them again)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(_bind_failure(host, port, exc)) from exc
    sock.set_inheritable(True)
    return sock


def _bind_failure(host: str, port: int, exc: OSError) -> str:
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: port {port} is already in use; choose another with --port (--port 0 takes any free port)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine; check --host"
    if exc.errno == errno.EACCES:
        return f"{where}: ports below 1024 need privileges; choose another with --port"
    return f"{where}: {exc.strerror or exc}"
