"""The calling side of mutual TLS: an httpx client that presents our certificate and checks the peer's."""

from __future__ import annotations

import httpx

from parties.errors import PeerError
from parties.protocol.common import CALLER_HEADER
from parties.settings import ServiceSettings
from parties.transport import sockets
from parties.transport.channel import Channel
from parties.transport.tls import PeerIdentity, TLSFiles, client_ssl_context, peer_identity

__all__ = ["client_for", "expect_server", "make_channel", "make_client", "server_identity"]


def make_client(
    tls: TLSFiles | None,
    *,
    caller: PeerIdentity | None = None,
    timeout: float = 60.0,
    base_url: str = "",
) -> httpx.Client:
    """An httpx client for party-to-party calls; ``tls=None`` is plain HTTP (``--insecure`` only)."""
    headers = {}
    if tls is None and caller is not None:
        headers[CALLER_HEADER] = f"{caller.role}:{caller.name}"
    # TCP_NODELAY and a loss-based congestion control: each costs a round trip per step otherwise
    # (``parties.transport.sockets``).
    transport = httpx.HTTPTransport(
        verify=client_ssl_context(tls) if tls is not None else True,  # plain http: nothing to verify
        socket_options=sockets.socket_options(),
    )
    return httpx.Client(
        base_url=base_url,
        transport=transport,
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
    """Who answered: the name and role in the server certificate of the connection ``response`` came on."""
    stream = response.extensions.get("network_stream")
    ssl_object = stream.get_extra_info("ssl_object") if stream is not None else None
    if ssl_object is None:
        return None
    return peer_identity(ssl_object.getpeercert())


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


def make_channel(
    tls: TLSFiles | None, url: str, *, expect: PeerIdentity, caller: PeerIdentity, timeout: float = 600.0,
    poll: float = 0.0,
) -> Channel:
    """A hot-path channel to ``url`` that presents our certificate and insists on ``expect``'s."""
    headers = {CALLER_HEADER: f"{caller.role}:{caller.name}"} if tls is None else {}
    context = client_ssl_context(tls) if tls is not None else None
    return Channel(url, context, expect=expect, headers=headers, timeout=timeout, poll=poll)
