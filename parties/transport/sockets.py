"""TCP options every party connection gets, on the calling and the answering side alike.

A training step is one request and one answer of tens of kilobytes each, then
nothing until the next step: an application-limited exchange, once per round
trip. Two kernel defaults cost whole round trips on a WAN:

- Nagle's algorithm holds a small write until the peer's (delayed) ACK: ``TCP_NODELAY``.
- BBR, the default congestion control on many hosts, paces what it sends at the
  bandwidth it has measured, and an exchange that only ever sends one message
  per round trip is measured at about one message per round trip: each message
  is spread over a whole RTT, and a step costs two RTTs instead of one (measured
  with ``python -m bank.lab bench --rtt-ms 20``: 34 ms per step, 21 ms with cubic).
  A loss-based congestion control sends what the window allows at once, so each
  socket asks for one (``TCP_CONGESTION``), the first the kernel lets this
  process choose from ``CONGESTION_PREFERENCE``; reno is always allowed. Where
  none is, the host's default stays. It must be set before the connection is
  made (``connect``; a listening socket passes it to the connections it
  accepts): BBR, once it ran on a connection, has switched the kernel's own
  pacing on for it, and a later switch of congestion control keeps the pacing
  (measured: a 74 KB request then still leaves over 4 ms).
"""

from __future__ import annotations

import functools
import logging
import socket

__all__ = ["CONGESTION_PREFERENCE", "congestion_control", "connect", "socket_options", "tune"]

logger = logging.getLogger(__name__)

#: Loss-based congestion controls, best first: cubic grows its window faster than reno after a loss.
CONGESTION_PREFERENCE = ("cubic", "reno")


@functools.cache
def congestion_control() -> str | None:
    """The first of ``CONGESTION_PREFERENCE`` this process may set on a TCP socket; ``None``: none may."""
    if not hasattr(socket, "TCP_CONGESTION"):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        for name in CONGESTION_PREFERENCE:
            try:
                probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            except OSError:
                continue
            return name
    logger.info("none of %s is allowed here: party connections keep the host's congestion control",
                ", ".join(CONGESTION_PREFERENCE))
    return None


def socket_options() -> list[tuple[int, int, int | bytes]]:
    """The options as ``(level, option, value)``, for clients that set them on each socket they open (httpx)."""
    options: list[tuple[int, int, int | bytes]] = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    name = congestion_control()
    if name is not None:
        options.append((socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode()))
    return options


def tune(sock: socket.socket) -> None:
    """Set the options on ``sock``: a TCP socket (listening, connecting or connected); others are left alone."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return
    for level, option, value in socket_options():
        sock.setsockopt(level, option, value)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """``socket.create_connection``, but with the options set before the connection is made."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            tune(sock)
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return sock
    raise error if error is not None else OSError(f"{host}:{port}: no address to connect to")
