"""Who may call and how much they may send: shared by FastAPI routes and hot routes alike."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.datastructures import Headers

from parties.errors import BadMessage, ComputeUnavailable, CutlayerError, Forbidden, PayloadTooLarge
from parties.observability import REFUSALS
from parties.protocol.common import CALLER_HEADER
from parties.settings import ServiceSettings
from parties.transport.tls import ROLES, PeerIdentity

__all__ = [
    "CLOSING_STATUSES", "Refusal", "check_declared_length", "ensure_role", "identify", "peer_detail", "read_limited",
    "refusal",
]

logger = logging.getLogger("parties.transport.app")

#: Refusals after which the connection closes: a caller who may not call, or a body over the limit.
#: Keeping the connection would mean reading (and dropping) the rest of the body, however large:
#: uvicorn drained 5.6 GB from one client in 8 s after answering 413.
CLOSING_STATUSES = frozenset({403, 413})


def identify(settings: ServiceSettings, scope: Mapping[str, Any]) -> PeerIdentity:
    """Who is calling: from the verified client certificate (or, with --insecure only, a header)."""
    tls = scope.get("extensions", {}).get("tls") or {}
    if tls.get("peercert"):
        identity = tls.get("identity")
        if identity is None:
            raise Forbidden("the client certificate names no Cutlayer party this service accepts")
        trust = tls.get("trust")
        if trust is not None:  # the files changed since it connected (a revocation, a pin): checked again
            tls["generation"], problem = trust.recheck(tls["der"], tls["generation"])
            if problem is not None:
                raise Forbidden(f"the client certificate is no longer accepted: {problem}")
        return identity
    if settings.insecure:
        role, _, name = Headers(scope=scope).get(CALLER_HEADER, "").partition(":")
        if role in ROLES and name:
            return PeerIdentity(name=name, role=role)
        raise Forbidden(f"--insecure mode: say who calls in the {CALLER_HEADER} header as ROLE:NAME")
    raise Forbidden("a client certificate is required")


def peer_detail(settings: ServiceSettings, exc: CutlayerError) -> str:
    """A refusal's reason as the caller reads it: this party's folders named ``<state>``, not spelled out (a
    failed write's message carries a path the peer has no business knowing)."""
    text = str(exc)
    for folder in sorted({str(settings.state_path.resolve()), str(settings.state_path)}, key=len, reverse=True):
        text = text.replace(folder, "<state>")
    return text


class Refusal:
    """An answer that refuses a request: its status, its JSON body (``error``, ``detail``) and its headers."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, kind: str, detail: str) -> None:
        self.status = status
        self.body = json.dumps({"error": kind, "detail": detail}).encode()
        self.headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(self.body))]
        if status in CLOSING_STATUSES:  # uvicorn closes the connection once answered, instead of reading on
            self.headers.append((b"connection", b"close"))


def refusal(settings: ServiceSettings, exc: CutlayerError, scope: Mapping[str, Any]) -> Refusal:
    """The one translation of a domain error into an answer, for FastAPI routes and hot routes alike: logged
    (a caller who may not call at warning level, with its address), the reason without this party's paths."""
    method, path = scope.get("method", "?"), scope.get("path", "?")
    REFUSALS.labels(type(exc).__name__).inc()
    if exc.status_code == 403:  # someone who may not call: worth an operator's attention
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "?"
        logger.warning("%s %s from %s refused: %s", method, path, peer, exc)
    elif isinstance(exc, ComputeUnavailable):  # this party's own cluster: its operator's business, not the peer's
        logger.warning("%s %s refused: %s", method, path, exc)
        return Refusal(exc.status_code, type(exc).__name__, "this party's own compute is unavailable; its operator "
                       "has the reason in its service log: retry once it is mended")
    else:
        logger.info("%s %s refused: %s", method, path, type(exc).__name__)
    return Refusal(exc.status_code, type(exc).__name__, peer_detail(settings, exc))


def ensure_role(identity: PeerIdentity, role: str) -> PeerIdentity:
    if identity.role != role:
        raise Forbidden(f"this endpoint is for the {role}; the caller is a {identity.role}")
    return identity


def check_declared_length(declared: str | None, limit: int) -> None:
    """Refuse a body whose Content-Length is over ``limit`` before reading any of it."""
    if declared is None:
        return
    try:
        length = int(declared)
    except ValueError as exc:
        raise BadMessage("content-length is not a number") from exc
    if length > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit}")


async def read_limited(chunks: AsyncIterator[bytes], declared: str | None, limit: int) -> bytes:
    """A body from its chunks, refused with 413 as soon as it (or its declared length) passes ``limit``."""
    check_declared_length(declared, limit)
    parts, size = [], 0
    async for part in chunks:
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)
