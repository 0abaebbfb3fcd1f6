"""The calling side of mutual TLS: clients that present our certificate and check the peer's.

Every call goes through httpx, but training steps: those go through a
``StepConnection``, the standard library's ``http.client`` on one kept-alive
connection. A step's request is sent at once and its answer read when the
bank needs it, so the bank computes its own part while the partner computes
its part, with no thread; httpx's synchronous API sends and reads in one call
(measured on loopback with 64 KB each way: httpx 0.60-0.73 ms a round trip,
``http.client`` 0.32-0.33 ms, the bare TLS socket 0.18 ms).
"""

from __future__ import annotations

import datetime as dt
import http.client
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from urllib.parse import urlsplit

import httpx
from cryptography import x509

from parties.errors import PeerError, PeerUnavailable, PeerUntrusted
from parties.protocol.common import CALLER_HEADER
from parties.protocol.control import Certificate
from parties.settings import ServiceSettings
from parties.transport import sockets
from parties.transport.tls import PeerIdentity, TLSFiles, handshake_failure
from parties.transport.trust import check_peer, party_of, trust_for

__all__ = ["EXPECT", "PartyTransport", "StepConnection", "client_for", "expect_server", "make_client",
           "party_transport", "peer_certificate", "server_identity"]


#: A request's extension naming the party it must reach (``PeerIdentity``): checked as its connection is made.
EXPECT = "cutlayer.expect"


class PartyTransport(httpx.BaseTransport):
    """httpx's transport with our certificate and trust (``parties.transport.trust.Trust``) and the TCP options of
    ``parties.transport.sockets`` (TCP_NODELAY and a loss-based congestion control: each costs a round trip per
    step otherwise).

    A new connection's peer is checked once its handshake is done, before any request goes on it: a party this
    party accepts (pins, revocation), and the one the request names (its ``EXPECT`` extension, else
    ``expect``). Connections are pooled per party expected, so a request never goes on a connection checked
    for another. When the trust's files change (a renewal, a revocation, a pin), the kept connections are left
    and the next request handshakes again under the new files; those left are closed at the change after.
    """

    def __init__(self, tls: TLSFiles | None, expect: PeerIdentity | None = None) -> None:
        self.trust = trust_for(tls) if tls is not None else None
        self.expect = expect
        self._lock = threading.Lock()
        self._generation = self.trust.generation if self.trust is not None else 0
        self._pools: dict[PeerIdentity | None, httpx.HTTPTransport] = {}
        self._retired: list[httpx.HTTPTransport] = []  # left at the last change: requests on them may still run

    def _pool(self, expect: PeerIdentity | None) -> httpx.HTTPTransport:
        if self.trust is not None:
            self.trust.refresh()
        generation = self.trust.generation if self.trust is not None else 0
        with self._lock:
            if generation != self._generation:
                for old in self._retired:  # a whole change ago: nothing runs on them any more
                    old.close()
                self._retired, self._pools, self._generation = list(self._pools.values()), {}, generation
            pool = self._pools.get(expect)
            if pool is None:
                # Plain http (--insecure): nothing to verify.
                verify = self.trust.client_context() if self.trust is not None else True
                pool = self._pools[expect] = httpx.HTTPTransport(verify=verify, socket_options=sockets.socket_options())
            return pool

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        expect = request.extensions.get(EXPECT, self.expect)
        earlier = request.extensions.get("trace")
        where = f"{request.url.host}:{request.url.port}"

        def trace(event: str, info: dict[str, object]) -> None:
            if earlier is not None:
                earlier(event, info)
            if event == "connection.start_tls.complete" and self.trust is not None:
                stream = info.get("return_value")
                identity, problem = check_peer(stream.get_extra_info("ssl_object"))  # type: ignore[union-attr]
                if identity is None:
                    raise PeerUntrusted(f"{where}: {problem}")
                if expect is not None and identity != expect:
                    raise PeerError(f"expected {expect.role} {expect.name!r} at {where}, but its certificate "
                                    f"names {identity.role} {identity.name!r}")

        request.extensions = {**request.extensions, "trace": trace}
        return self._pool(expect).handle_request(request)

    def close(self) -> None:
        with self._lock:
            for transport in [*self._retired, *self._pools.values()]:
                transport.close()
            self._retired, self._pools = [], {}


def party_transport(tls: TLSFiles | None, expect: PeerIdentity | None = None) -> PartyTransport:
    return PartyTransport(tls, expect)


def make_client(
    tls: TLSFiles | None,
    *,
    caller: PeerIdentity | None = None,
    timeout: float = 60.0,
    base_url: str = "",
    expect: PeerIdentity | None = None,
) -> httpx.Client:
    """An httpx client for party-to-party calls; ``tls=None`` is plain HTTP (``--insecure`` only). ``expect``: the
    party every call must reach (a request may name its own in its ``EXPECT`` extension)."""
    headers = {}
    if tls is None and caller is not None:
        headers[CALLER_HEADER] = f"{caller.role}:{caller.name}"
    return httpx.Client(
        base_url=base_url,
        transport=party_transport(tls, expect),
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=10.0),
        trust_env=False,  # party traffic never goes through a proxy from the environment
    )


def client_for(settings: ServiceSettings, *, timeout: float = 60.0, base_url: str = "") -> httpx.Client:
    """A client that calls as ``settings``' party, with its TLS files."""
    return make_client(
        settings.tls_files(),
        caller=PeerIdentity(settings.name, settings.role),
        timeout=timeout,
        base_url=base_url,
    )


def server_identity(response: httpx.Response) -> PeerIdentity | None:
    """Who answered: the party of the server certificate of the connection ``response`` came on, if this party
    trusts it to be that party (pins, revocation: ``parties.transport.tls.Trust``); ``None`` on plain HTTP."""
    stream = response.extensions.get("network_stream")
    ssl_object = stream.get_extra_info("ssl_object") if stream is not None else None
    if ssl_object is None:
        return None
    identity, problem = check_peer(ssl_object)
    if identity is None:
        raise PeerUntrusted(f"{response.url.host}:{response.url.port}: {problem}")
    return identity


def peer_certificate(response: httpx.Response) -> Certificate | None:
    """The server certificate of the connection ``response`` came on: whom it names, its issuer, its end."""
    stream = response.extensions.get("network_stream")
    ssl_object = stream.get_extra_info("ssl_object") if stream is not None else None
    der = ssl_object.getpeercert(True) if ssl_object is not None else None
    if not der:
        return None
    cert = x509.load_der_x509_certificate(der)
    name, role = party_of(cert.subject)
    ends = cert.not_valid_after_utc
    return Certificate(name=name, role=role, issuer=cert.issuer.rfc4514_string(), expires=ends.isoformat(),
                       days_left=round((ends - dt.datetime.now(dt.timezone.utc)).total_seconds() / 86400, 1))


def expect_server(response: httpx.Response, name: str, role: str) -> None:
    """Refuse to go on unless the server's certificate names the party we meant to reach."""
    identity = server_identity(response)
    if identity is None:
        return  # plain HTTP (--insecure): nothing to check
    if (identity.name, identity.role) != (name, role):
        raise PeerError(
            f"expected {role} {name!r} at {response.url.host}:{response.url.port}, "
            f"but its certificate names {identity.role} {identity.name!r}"
        )


class _Connection(http.client.HTTPConnection):
    """``http.client``'s connection, connecting with the party options: TCP (``sockets.connect``), then TLS with
    our certificate, and only to the peer ``expect`` names."""

    def __init__(self, host: str, port: int, timeout: float, tls: TLSFiles | None, expect: PeerIdentity) -> None:
        super().__init__(host, port, timeout=timeout)
        self.trust = trust_for(tls) if tls is not None else None
        self.expect = expect
        self.peer: tuple[bytes, int] | None = None  # the connected peer's certificate (DER), the trust's generation

    def connect(self) -> None:
        sock: socket.socket = sockets.connect(self.host, self.port, self.timeout)  # type: ignore[arg-type]
        try:
            if self.trust is not None:
                self.trust.refresh()
                sock = self.trust.client_context().wrap_socket(sock, server_hostname=self.host)
                identity, problem = check_peer(sock)  # type: ignore[arg-type]
                if identity is None:
                    raise PeerUntrusted(f"{self.host}:{self.port}: {problem}")
                if identity != self.expect:
                    raise PeerError(f"expected {self.expect.role} {self.expect.name!r} at {self.host}:{self.port}, "
                                    f"but its certificate names {identity}")
                self.peer = (sock.getpeercert(True), self.trust.generation)  # type: ignore[attr-defined]
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def check_still_trusted(self) -> None:
        """Before a request on a kept connection: if this party's files changed since it connected, its peer is
        checked again (a revocation, a pin moved, a CA dropped), and refused before anything is sent to it."""
        if self.trust is None or self.sock is None or self.peer is None:
            return
        der, generation = self.peer
        generation, problem = self.trust.recheck(der, generation)
        if problem is not None:
            self.close()
            raise PeerUntrusted(f"{self.host}:{self.port}: {problem}")
        self.peer = (der, generation)


class StepConnection:
    """One kept-alive connection to ``url`` for training steps; it reconnects (and re-checks the peer) when it drops.

    ``send`` puts a POST on its way and returns a function that reads its
    answer: between the two the caller is free to compute. One request is in
    flight at a time; sending again before the last answer was read (the
    caller failed in between) drops that connection and its answer. A failed
    exchange closes the connection and raises ``PeerUnavailable`` (or
    ``PeerUntrusted``); nothing is ever resent here.
    """

    def __init__(self, url: str, tls: TLSFiles | None, *, expect: PeerIdentity, caller: PeerIdentity,
                 timeout: float = 600.0, max_response_bytes: int = 64 << 20) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise PeerError(f"{url!r} is not an http(s) URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self.where = f"{parts.hostname}:{port}"
        self.connection = _Connection(parts.hostname, port, timeout, tls if parts.scheme == "https" else None, expect)
        self.headers = {CALLER_HEADER: f"{caller.role}:{caller.name}"} if tls is None else {}
        self.max_response_bytes = max_response_bytes
        self.timeout = timeout
        self._pending: object | None = None  # the exchange whose answer is unread
        self._closed = False

    def send(self, path: str, body: bytes, content_type: str,
             limit: int | None = None) -> Callable[[], tuple[int, bytes]]:
        """POST ``body`` now; the returned function waits for the answer: ``(status, body)``, of at most ``limit``
        bytes (and ``max_response_bytes``), arriving in full within the connection's timeout."""
        if self._closed:
            raise PeerUnavailable(f"the step connection to {self.where} is closed")
        if self._pending is not None:
            self.connection.close()  # its answer was never read: the connection is mid-response
        self._pending = None
        self.connection.check_still_trusted()
        try:
            self.connection.request("POST", path, body, {**self.headers, "content-type": content_type})
        except (OSError, http.client.HTTPException) as exc:
            raise self._failed(exc) from exc
        except BaseException:
            self.connection.close()
            raise
        exchange = self._pending = object()

        def receive() -> tuple[int, bytes]:
            if self._pending is not exchange:
                raise PeerUnavailable(f"{self.where}: the answer was dropped (the connection was closed or used "
                                      "again before it was read)")
            self._pending = None
            most = min(limit, self.max_response_bytes) if limit is not None else self.max_response_bytes
            try:
                response = self.connection.getresponse()
                declared = response.getheader("content-length", "")
                if declared.isdigit() and int(declared) > most:
                    raise PeerError(f"{self.where} announced {declared} bytes for a step's answer; at most {most} "
                                    "are read")
                content = self._read(response, most)
                if response.will_close or not response.isclosed():  # closing, or more than it announced
                    self.connection.close()
                return response.status, content
            except (OSError, http.client.HTTPException) as exc:
                raise self._failed(exc) from exc
            except BaseException:
                self.connection.close()  # interrupted mid-answer: the connection cannot be reused
                raise

        return receive

    def _read(self, response: http.client.HTTPResponse, most: int) -> bytes:
        """The body as it arrives (``read1``: whatever came), refused past ``most`` bytes or past the connection's
        timeout in all: a peer that drips its answer a byte at a time is not waited on for ever."""
        deadline = time.monotonic() + self.timeout
        parts, size = [], 0
        while part := response.read1(min(1 << 20, most + 1 - size)):
            size += len(part)
            if size > most:
                raise PeerError(f"{self.where} sent a step's answer over {most} bytes")
            if time.monotonic() > deadline:
                raise PeerError(f"{self.where} did not finish a step's answer in {self.timeout:.0f}s")
            parts.append(part)
        if response.length:  # read1 ends quietly when the peer closes mid-answer: a cut body, not an answer
            raise http.client.IncompleteRead(b"", response.length)  # what came is dropped, not carried along
        response.read(0)  # marks a fully read answer done (read1 does not), so the connection is kept for the next
        return b"".join(parts)

    def _failed(self, exc: OSError | http.client.HTTPException) -> PeerError:
        """Close the connection; the error to raise for ``exc``."""
        self.connection.close()
        untrusted = handshake_failure(exc)
        if untrusted:
            return PeerUntrusted(f"{self.where} answered, but {untrusted}")
        return PeerUnavailable(f"{self.where} did not answer: {exc}")

    def post(self, path: str, body: bytes, content_type: str) -> tuple[int, bytes]:
        return self.send(path, body, content_type)()

    def close(self) -> None:
        """Close the connection for good: a later ``send`` is refused."""
        self._closed = True
        self._pending = None
        self.connection.close()

    def __enter__(self) -> StepConnection:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
