"""The hot-path channel: one kept-alive mutual-TLS connection, the peer checked, failures never hidden."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from parties.errors import PeerError, PeerUnavailable
from parties.protocol.common import CALLER_HEADER
from parties.transport.client import make_channel
from parties.transport.server import ServerThread
from parties.transport.tls import PeerIdentity, TLSFiles

BANK = PeerIdentity("bank", "bank")
PARTNER = PeerIdentity("partner", "partner")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echoes the body with the connection's client port; ``/close`` asks to close the connection."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    headers = [(b"content-type", b"application/x-echo")]
    if scope["path"] == "/close":
        headers.append((b"connection", b"close"))
    caller = dict(scope["headers"]).get(CALLER_HEADER.encode(), b"")
    answer = b"%d:" % scope["client"][1] + (caller + b":" if caller else b"") + body
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture()
def server(pki: Path) -> Iterator[ServerThread]:
    thread = ServerThread(app, TLSFiles.from_dir(pki, "partner")).start()
    yield thread
    thread.stop()


def test_requests_share_one_connection_and_bodies_arrive_whole(server: ServerThread, pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK)
    big = bytes(range(256)) * 1024  # several TLS records each way
    ports = set()
    for _ in range(3):
        response = channel.post("/echo", big, "application/octet-stream")
        port, _, body = response.content.partition(b":")
        assert response.status == 201 and response.is_success and body == big
        assert response.content_type == "application/x-echo"
        ports.add(port)
    assert len(ports) == 1  # kept alive
    channel.close_connection()


def test_a_server_closing_the_connection_gets_a_new_one(server: ServerThread, pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK)
    first = channel.post("/close", b"x", "text/plain").content.partition(b":")[0]
    second = channel.post("/echo", b"y", "text/plain").content.partition(b":")[0]
    assert first != second


def test_the_wrong_peer_is_refused(server: ServerThread, pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PeerIdentity("partner2", "partner"),
                           caller=BANK)
    with pytest.raises(PeerError, match="certificate names"):
        channel.post("/echo", b"x", "text/plain")


def test_a_response_over_the_limit_is_refused(server: ServerThread, pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK)
    channel.max_response_bytes = 1000
    with pytest.raises(PeerError, match="over 1000 bytes"):
        channel.post("/echo", b"z" * 5000, "text/plain")
    assert channel.post("/echo", b"small", "text/plain").content.endswith(b":small")  # a new connection


def test_insecure_mode_uses_plain_http_and_names_the_caller() -> None:
    thread = ServerThread(app, None).start()
    try:
        channel = make_channel(None, thread.url, expect=PARTNER, caller=BANK)
        assert channel.post("/echo", b"x", "text/plain").content.endswith(b":bank:bank:x")
        channel.close_connection()
    finally:
        thread.stop()


def test_no_server_is_unavailable_not_a_crash(pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), "https://127.0.0.1:9", expect=PARTNER, caller=BANK)
    with pytest.raises(PeerUnavailable):
        channel.post("/echo", b"x", "text/plain")


def test_a_response_leaves_no_reference_cycle(server: ServerThread, pki: Path) -> None:
    """Each answer is freed when the caller drops it, not at the next GC pass (it holds a step's body)."""
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK)
    channel.post("/echo", b"warm up", "application/octet-stream")
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector finds, to look at it
    try:
        for _ in range(5):
            channel.post("/echo", bytes(70_000), "application/octet-stream")
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        channel.close_connection()
    assert "_Response" not in cyclic and "HttpResponseParser" not in cyclic


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["answer-within-the-poll", "answer-after-the-poll"])
def test_polling_for_an_answer_gets_it_early_or_late(pki: Path, delay: float) -> None:
    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(delay)
            await app(scope, receive, send)

    thread = ServerThread(slow, TLSFiles.from_dir(pki, "partner")).start()
    try:
        channel = make_channel(TLSFiles.from_dir(pki, "bank"), thread.url, expect=PARTNER, caller=BANK, poll=0.01)
        started = time.perf_counter()
        for i in range(3):
            assert channel.post("/echo", b"x%d" % i, "text/plain").content.endswith(b":x%d" % i)
        assert time.perf_counter() - started >= 3 * delay
        channel.close_connection()
    finally:
        thread.stop()


def _established_to(port: int) -> int:
    """Client-side TCP connections of this machine to 127.0.0.1:``port`` that are open (from /proc/net/tcp)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        if remote == f"0100007F:{port:04X}" and state == "01":
            count += 1
    return count


def _within(seconds: float, fn: Any) -> Any:
    """``fn()`` in a thread; fails (instead of hanging the suite) when it does not return in time."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"still blocked after {seconds}s (a lock left held?)")
    finally:
        pool.shutdown(wait=False)  # a blocked thread is abandoned, not waited for


def test_a_caller_that_fails_between_send_and_receive_does_not_wedge_the_channel(server: ServerThread,
                                                                                  pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK)
    stale = channel.send("/echo", b"first", "text/plain")  # the caller then fails and never reads the answer
    answer = _within(10, lambda: channel.post("/echo", b"second", "text/plain"))
    assert answer.content.endswith(b":second")  # on a new connection: the unread answer is not mistaken for it
    with pytest.raises(PeerUnavailable, match="dropped"):
        stale()
    assert _within(10, lambda: channel.post("/echo", b"third", "text/plain")).content.endswith(b":third")
    channel.close()


def test_an_exception_while_reading_leaves_the_channel_usable(server: ServerThread, pki: Path) -> None:
    channel = make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK)
    receive = channel.send("/echo", b"x", "text/plain")

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt  # what a signal or a bug in a callback does mid-read

    channel._await_data = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        receive()
    del channel._await_data
    assert _within(10, lambda: channel.post("/echo", b"again", "text/plain")).content.endswith(b":again")
    channel.close()


def test_a_closed_channel_releases_its_socket_and_refuses_to_send(server: ServerThread, pki: Path) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with make_channel(TLSFiles.from_dir(pki, "bank"), server.url, expect=PARTNER, caller=BANK) as channel:
        channel.post("/echo", b"x", "text/plain")
        assert _established_to(port) == 1
    assert _established_to(port) == 0
    with pytest.raises(PeerUnavailable, match="closed"):
        channel.send("/echo", b"y", "text/plain")
