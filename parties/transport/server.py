"""Run a party's app under uvicorn: mutual TLS, the caller's certificate in the ASGI scope.

uvicorn does not put the client certificate into the request scope; the
server adds it as ``scope["extensions"]["tls"]``, where
``parties.transport.access.identify`` reads the caller's name and role. It
also cuts off a client whose request head or body trickles in past its time
(uvicorn bounds only the idle time between requests). The TLS handshake comes
first, in ``parties.transport.edges``, so refused handshakes are logged.

The HTTP protocol is uvicorn's own, wrapped through public interfaces only
(``parties.transport.stock``); a training step is a plain ASGI route
(``parties.transport.hot_routes``) answered before FastAPI's stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from parties.errors import ConfigError
from parties.observability import start_metrics_server
from parties.settings import ServiceSettings
from parties.storage.files import atomic_write_text
from parties.transport.edges import Timeouts, bind_socket, tls_front
from parties.transport.stock import Connections
from parties.transport.tls import TLSFiles, is_loopback, server_ssl_context

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


def _stock_protocol() -> Callable[..., asyncio.Protocol]:
    """uvicorn's own HTTP/1.1 protocol, the one ``--http auto`` names (httptools', or h11's without it)."""
    try:
        from uvicorn.config import HTTP_PROTOCOLS
        from uvicorn.importer import import_from_string

        return import_from_string(HTTP_PROTOCOLS["auto"])  # type: ignore[no-any-return]
    except Exception as exc:  # whatever a future uvicorn changed here, say so at start, not per request
        raise ConfigError(f"uvicorn {getattr(uvicorn, '__version__', '?')} has no HTTP protocol under --http auto "
                          f"({type(exc).__name__}: {exc}); install a version pyproject.toml allows") from exc


def _timeouts_of(app: Any) -> Timeouts:
    """The party's own header and body timeouts (its settings), else the defaults."""
    settings = getattr(getattr(app, "state", None), "settings", None)
    if settings is None:
        return Timeouts()
    return Timeouts(header=settings.header_timeout, body=settings.body_timeout)


def build_server(
    app: Any, tls: TLSFiles | None, *, log_level: str = "warning", timeouts: Timeouts | None = None,
) -> uvicorn.Server:
    """A uvicorn server for ``app``; ``tls=None`` serves plain HTTP (the caller warns about it).

    ``timeouts``: default, the app's settings' ``header_timeout``/``body_timeout``. TLS is not uvicorn's:
    ``parties.transport.edges`` does each handshake, so a refused one is logged."""
    timeouts = timeouts or _timeouts_of(app)
    connections = Connections(timeouts)
    protocol: Callable[..., Any] = connections.protocol(_stock_protocol())
    if tls is not None:
        tls.check()
        protocol = tls_front(protocol, server_ssl_context(tls), timeouts.header)
    config = uvicorn.Config(
        connections.app(app),
        http=protocol,  # type: ignore[arg-type]
        log_level=log_level,
        log_config=None,  # the entry point configures logging
        access_log=False,  # access lines carry URLs and peers; our own logs say what matters
        # Parties talk directly over mutual TLS; never trust X-Forwarded-* headers. uvicorn's own protocol
        # (``parties.transport.stock``) finds a request's certificate by the scope's client address.
        proxy_headers=False,
        # A step or a chunk takes milliseconds; a peer's idle keep-alive connection must not hold a stop for long
        # (the bank retries whatever was cut, exactly once).
        timeout_graceful_shutdown=1,
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


def serve_party(app: Any, settings: ServiceSettings) -> None:
    """Serve a party's app as its settings say (TLS files, address, ready file), with its metrics if asked."""
    more = {}
    if settings.metrics_port is not None:
        port = start_metrics_server(settings.metrics_host, settings.metrics_port)
        more["metrics"] = f"http://{settings.metrics_host}:{port}/metrics"
        logger.info("Prometheus metrics on %s", more["metrics"])
    serve(app, settings.tls_files(), settings.host, settings.port, settings.ready_file, more)


def serve(app: Any, tls: TLSFiles | None, host: str, port: int, ready_file: Path | None = None,
          more: dict[str, str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; once listening, write ``{"url": ..., **more}`` to ``ready_file``."""
    _plain_http_on_loopback_only(tls, host)
    # What the service writes (state, runs, logs) is its party's alone, also where a library writes it.
    os.umask(0o077)
    # The table and the libraries are loaded and live as long as the service: kept out of every garbage
    # collection, they cost no collection time while serving and, at exit, no second or so of collecting.
    gc.freeze()
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
                atomic_write_text(ready_file, json.dumps({"url": url, **(more or {})}) + "\n")

        task = asyncio.create_task(announce())
        await server.serve(sockets=[sock])
        task.cancel()

    run_loop(main())
    # The app's shutdown has closed its pools, sessions and files: what is left is the interpreter collecting a
    # trained session's objects, seconds of it. A stopped service stops now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ServerThread:
    """A uvicorn server in a background thread, for tests, benchmarks and the walkthrough."""

    def __init__(self, app: Any, tls: TLSFiles | None, host: str = "127.0.0.1") -> None:
        self.app = app
        _plain_http_on_loopback_only(tls, host)
        self.sock = bind_socket(host, 0)
        self.server = build_server(app, tls)
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
