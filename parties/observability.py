"""What a running service shows its operator beyond a text log: Prometheus metrics and JSON log lines.

**Metrics** (``prometheus-client``, this process's registry), served on a port of their own on a loopback
address (``--metrics-port``): a local Prometheus agent, or a tunnel, scrapes them; nothing about them needs a
client certificate, so they never share the party's mutual-TLS port. Every request a service answers is
counted by route template and status, with its bytes both ways and its latency; refusals by reason (the
error's kind, a refused handshake, a certificate this party does not accept); training steps applied;
checkpoint writes and their bytes; PSI IDs received and sent; open sessions. No label value is ever a
customer ID, a feature or a label: routes are templates (``/train/sessions/{session_id}/step``), not paths.

**JSON log lines** (``--log-format json``): one object per line with the time, level, logger, message,
this party's name and, where the code is inside one, the session, step and epoch it works on
(``log_context``). The messages are the same as in the text log, which never carries IDs, features or labels.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextvars import ContextVar
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from parties.errors import ConfigError

__all__ = [
    "CHECKPOINT_BYTES", "CHECKPOINTS", "PSI_IDS", "REFUSALS", "SESSIONS", "STEPS", "JsonLines", "count_exchange",
    "bind_log", "log_context", "set_log_party", "start_metrics_server",
]

REQUESTS = Counter("cutlayer_requests", "requests answered, by route template and status", ["route", "status"])
REQUEST_BYTES = Counter("cutlayer_request_bytes", "request body bytes received, by route template", ["route"])
RESPONSE_BYTES = Counter("cutlayer_response_bytes", "response body bytes sent, by route template", ["route"])
LATENCY = Histogram("cutlayer_request_seconds", "from a request's head to the end of its answer, by route template",
                    ["route"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                        10, 30, 60))
REFUSALS = Counter("cutlayer_refusals", "requests and connections refused, by reason", ["reason"])
STEPS = Counter("cutlayer_training_steps", "training steps this party applied (a retried step counts once)")
CHECKPOINTS = Counter("cutlayer_checkpoint_writes", "checkpoints written")
CHECKPOINT_BYTES = Counter("cutlayer_checkpoint_bytes", "bytes of checkpoints written")
PSI_IDS = Counter("cutlayer_psi_ids", "blinded IDs of PSI sessions: received from the peer, sent to it",
                  ["direction"])
SESSIONS = Gauge("cutlayer_sessions", "sessions open at this party, by kind", ["kind"])

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def start_metrics_server(host: str, port: int) -> int:
    """Serve ``/metrics`` on ``host:port`` (a loopback address only: plain HTTP); the port it listens on."""
    from parties.transport.tls import is_loopback

    if not is_loopback(host):
        raise ConfigError(f"--metrics-host {host}: metrics are served in plain HTTP, on a loopback address only "
                          f"(127.0.0.1, ::1, localhost); scrape them from this machine or through a tunnel")
    server, _ = start_http_server(port, addr=host)
    return int(server.server_port)


async def count_exchange(app: Callable[[Scope, Receive, Send], Awaitable[None]], route: Callable[[Scope], str],
                         scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app`` on one request, counting it: its route (``route(scope)``, asked once it is answered, when
    the router has matched it), status, bytes both ways and latency."""
    if scope["type"] != "http":
        await app(scope, receive, send)
        return
    started = time.perf_counter()
    sizes = [0, 0]
    status = [0]

    async def counted_receive() -> MutableMapping[str, Any]:
        message = await receive()
        sizes[0] += len(message.get("body", b""))
        return message

    async def counted_send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            sizes[1] += len(message.get("body", b""))
        await send(message)

    try:
        await app(scope, counted_receive, counted_send)
    finally:
        name = route(scope)
        REQUESTS.labels(name, str(status[0] or 500)).inc()
        REQUEST_BYTES.labels(name).inc(sizes[0])
        RESPONSE_BYTES.labels(name).inc(sizes[1])
        LATENCY.labels(name).observe(time.perf_counter() - started)


# --- logs -------------------------------------------------------------------------------------------------

_NO_CONTEXT: dict[str, object] = {}
_CONTEXT: ContextVar[dict[str, object]] = ContextVar("cutlayer_log_context", default=_NO_CONTEXT)
_PARTY: list[str] = []


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Log records made inside carry these fields (``session``, ``step``, ``epoch``) in JSON log lines."""
    token = _CONTEXT.set({**_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def bind_log(**fields: object) -> None:
    """Add fields to the ``log_context`` this code runs in (an epoch as it starts); outside one, nothing."""
    context = _CONTEXT.get()
    if context is not _NO_CONTEXT:
        context.update(fields)


def set_log_party(name: str) -> None:
    """The party's name, which every JSON log line carries from now on."""
    _PARTY[:] = [name]


class JsonLines(logging.Formatter):
    """A log record as one JSON object: time, level, logger, message, party, and the context's fields."""

    FIELDS = ("session", "step", "epoch", "peer", "job")

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if _PARTY:
            line["party"] = _PARTY[0]
        line.update(_CONTEXT.get())
        line.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)
