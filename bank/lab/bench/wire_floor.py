"""The wire alone: a bare mutual-TLS round trip of one training step's bytes, for the bench.

A split step costs the model's compute, the service paths at both ends (HTTP,
validation, the event loop) and the wire. This measures the wire alone: the
same request and answer sizes over the same kind of connection (the parties'
certificates, loopback, TCP_NODELAY), between two processes pinned to the
services' CPUs, with nothing else to do. What a split step costs beyond the
unsplit step and this floor is the services' own work on the step's path.

The echo end runs as ``python -m bank.lab.bench.wire_floor serve``, started by
``parties.transport.process.ServiceProcess`` like any service.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import statistics
import time
from pathlib import Path

from parties.storage.files import atomic_write_text
from parties.transport.process import ServiceProcess
from parties.transport.tls import TLSFiles, client_ssl_context, server_ssl_context

__all__ = ["measure_wire_floor"]


def _read_exactly(sock: ssl.SSLSocket, view: memoryview, size: int) -> bool:
    """Read ``size`` bytes into ``view``; False if the peer closed first."""
    got = 0
    while got < size:
        n = sock.recv_into(view[got:size])
        if n == 0:
            return False
        got += n
    return True


def _serve(tls_dir: Path, request: int, answer: int, ready_file: Path) -> None:
    """Answer every ``request``-byte message on one connection with ``answer`` bytes, until it closes."""
    context = server_ssl_context(TLSFiles.from_dir(tls_dir, "partner"))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        atomic_write_text(ready_file, json.dumps({"url": f"https://127.0.0.1:{listener.getsockname()[1]}"}) + "\n")
        raw, _ = listener.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with context.wrap_socket(raw, server_side=True) as conn:
        buffer, reply = memoryview(bytearray(request)), os.urandom(answer)
        while _read_exactly(conn, buffer, request):
            conn.sendall(reply)


def measure_wire_floor(
    tls_dir: Path, request: int, answer: int, cpus: tuple[int, int] | None, out: Path, trips: int = 2000
) -> float:
    """Median seconds of a ``request``-byte / ``answer``-byte round trip; ``cpus``: (this end's, the echo's)."""
    args = ["--tls-dir", str(tls_dir), "--request", str(request), "--answer", str(answer)]
    echo = ServiceProcess("bank.lab.bench.wire_floor", args + (["--cpu", str(cpus[1])] if cpus else []),
                          out / "floor.ready", out / "floor.log")
    previous = os.sched_getaffinity(0) if cpus else None
    try:
        url = echo.wait_ready()
        if cpus:
            os.sched_setaffinity(0, {cpus[0]})  # this thread only, as the bank's service is pinned
        port = int(url.rsplit(":", 1)[1])
        raw = socket.create_connection(("127.0.0.1", port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with client_ssl_context(TLSFiles.from_dir(tls_dir, "bank")).wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            message, buffer = os.urandom(request), memoryview(bytearray(answer))
            seconds = []
            for trip in range(trips + trips // 10):  # the first tenth warms up
                started = time.perf_counter()
                conn.sendall(message)
                if not _read_exactly(conn, buffer, answer):
                    raise ConnectionError("the echo end closed the connection")
                if trip >= trips // 10:
                    seconds.append(time.perf_counter() - started)
        return statistics.median(seconds)
    finally:
        if previous is not None:
            os.sched_setaffinity(0, previous)
        echo.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bank.lab.bench.wire_floor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the echo end (the bench starts it)")
    serve.add_argument("--tls-dir", type=Path, required=True)
    serve.add_argument("--request", type=int, required=True)
    serve.add_argument("--answer", type=int, required=True)
    serve.add_argument("--cpu", type=int)
    serve.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    _serve(args.tls_dir, args.request, args.answer, args.ready_file)


if __name__ == "__main__":
    main()
