"""HTTP/1.1 framing for the per-step hot path, written once for both ends.

The bank's channel (``parties.transport.channel``) writes a step's request
and the partner's hot route (``parties.transport.hot_routes``) writes its
answer, each as one buffer with a single ``sendall``. Parsing is httptools'
(the C parser uvicorn uses) on both ends; everything else goes through httpx
and FastAPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus

__all__ = ["Header", "host_headers", "request_head", "response"]

Header = tuple[bytes, bytes]


def host_headers(host: str, port: int, extra: dict[str, str] | None = None) -> bytes:
    """The header lines every request on a connection carries: ``Host`` and any fixed extras."""
    host = host if ":" not in host else f"[{host}]"  # an IPv6 literal
    lines = [f"Host: {host}:{port}\r\n", *(f"{k}: {v}\r\n" for k, v in (extra or {}).items())]
    return "".join(lines).encode("latin-1")


def request_head(method: str, path: str, fixed: bytes, content_type: str, length: int) -> bytes:
    """A request's head, up to and including the blank line; ``fixed`` from ``host_headers``."""
    return b"%s %s HTTP/1.1\r\n%scontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        method.encode("ascii"), path.encode("ascii"), fixed, content_type.encode("latin-1"), length)


def response(status: int, headers: Sequence[Header], body: bytes, *, close: bool = False) -> bytes:
    """A whole response, head and body, to write at once; ``close`` adds ``connection: close``."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode("latin-1"))]
    lines += [b"%s: %s\r\n" % kv for kv in headers]
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join([*lines, body])
