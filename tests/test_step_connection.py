"""The step connection: one kept-alive mutual-TLS connection, the peer checked, failures never hidden."""

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
from parties.transport.client import StepConnection
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
    if scope["path"] == "/sized":  # as a step's answer is sent: its length announced, not chunked
        headers.append((b"content-length", str(len(answer)).encode()))
    if scope["path"] == "/drip":  # a peer that sends its answer a byte at a time, each within any read timeout
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"20")]})
        for _ in range(20):
            await asyncio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/cut":  # a peer that dies mid-answer: a quarter of what it announced, then closed
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"20")]})
        await send({"type": "http.response.body", "body": b"12345", "more_body": True})
        raise RuntimeError("the process died here")
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture()
def server(pki: Path) -> Iterator[ServerThread]:
    thread = ServerThread(app, TLSFiles.from_dir(pki, "partner")).start()
    yield thread
    thread.stop()


def _connection(pki: Path, url: str, expect: PeerIdentity = PARTNER) -> StepConnection:
    return StepConnection(url, TLSFiles.from_dir(pki, "bank"), expect=expect, caller=BANK)


@pytest.mark.parametrize("path", ["/echo", "/sized"], ids=["chunked", "content-length"])
def test_requests_share_one_connection_and_bodies_arrive_whole(server: ServerThread, pki: Path, path: str) -> None:
    """Kept alive whichever way the answer is framed: an answer read to its announced end leaves the connection
    for the next step (a new TLS handshake per step cost a split step three times the unsplit one's time)."""
    with _connection(pki, server.url) as steps:
        big = bytes(range(256)) * 1024  # several TLS records each way
        ports = set()
        for _ in range(3):
            status, content = steps.post(path, big, "application/octet-stream")
            port, _, body = content.partition(b":")
            assert status == 201 and body == big
            ports.add(port)
        assert len(ports) == 1  # kept alive


def test_the_caller_computes_between_sending_and_reading(server: ServerThread, pki: Path) -> None:
    """The request is on its way when ``send`` returns: the answer is there to read, no thread needed."""
    with _connection(pki, server.url) as steps:
        receive = steps.send("/echo", b"sent", "text/plain")
        assert receive()[1].endswith(b":sent")


def test_a_server_closing_the_connection_gets_a_new_one(server: ServerThread, pki: Path) -> None:
    with _connection(pki, server.url) as steps:
        first = steps.post("/close", b"x", "text/plain")[1].partition(b":")[0]
        second = steps.post("/echo", b"y", "text/plain")[1].partition(b":")[0]
        assert first != second


def test_the_wrong_peer_is_refused(server: ServerThread, pki: Path) -> None:
    with _connection(pki, server.url, expect=PeerIdentity("partner2", "partner")) as steps:
        with pytest.raises(PeerError, match="certificate names"):
            steps.post("/echo", b"x", "text/plain")


def test_a_response_over_the_limit_is_refused(server: ServerThread, pki: Path) -> None:
    with _connection(pki, server.url) as steps:
        steps.max_response_bytes = 1000
        with pytest.raises(PeerError, match="1000"):
            steps.post("/echo", b"z" * 5000, "text/plain")
        assert steps.post("/echo", b"small", "text/plain")[1].endswith(b":small")  # a new connection


def test_insecure_mode_uses_plain_http_and_names_the_caller() -> None:
    thread = ServerThread(app, None).start()
    try:
        with StepConnection(thread.url, None, expect=PARTNER, caller=BANK) as steps:
            assert steps.post("/echo", b"x", "text/plain")[1].endswith(b":bank:bank:x")
    finally:
        thread.stop()


def test_no_server_is_unavailable_not_a_crash(pki: Path) -> None:
    with _connection(pki, "https://127.0.0.1:9") as steps, pytest.raises(PeerUnavailable):
        steps.post("/echo", b"x", "text/plain")


def test_a_caller_that_fails_between_send_and_receive_does_not_wedge_the_connection(server: ServerThread,
                                                                                     pki: Path) -> None:
    with _connection(pki, server.url) as steps:
        stale = steps.send("/echo", b"first", "text/plain")  # the caller then fails and never reads the answer
        assert steps.post("/echo", b"second", "text/plain")[1].endswith(b":second")  # not the unread answer
        with pytest.raises(PeerUnavailable, match="dropped"):
            stale()
        assert steps.post("/echo", b"third", "text/plain")[1].endswith(b":third")


def test_an_exception_while_reading_leaves_the_connection_usable(server: ServerThread, pki: Path) -> None:
    with _connection(pki, server.url) as steps:
        receive = steps.send("/echo", b"x", "text/plain")
        getresponse = steps.connection.getresponse

        def interrupted(*args: object) -> None:
            raise KeyboardInterrupt  # what a signal or a bug in a callback does mid-read

        steps.connection.getresponse = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            receive()
        steps.connection.getresponse = getresponse  # type: ignore[method-assign]
        assert steps.post("/echo", b"again", "text/plain")[1].endswith(b":again")


def _established_to(port: int) -> int:
    """Client-side TCP connections of this machine to 127.0.0.1:``port`` that are open (from /proc/net/tcp)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[2] == f"0100007F:{port:04X}" and fields[3] == "01":
            count += 1
    return count


def test_a_closed_connection_releases_its_socket_and_refuses_to_send(server: ServerThread, pki: Path) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with _connection(pki, server.url) as steps:
        steps.post("/echo", b"x", "text/plain")
        assert _established_to(port) == 1
    assert _established_to(port) == 0
    with pytest.raises(PeerUnavailable, match="closed"):
        steps.send("/echo", b"y", "text/plain")


def test_an_answer_is_freed_when_dropped(server: ServerThread, pki: Path) -> None:
    """Each answer (a step's body) is freed when the caller drops it, not at the next GC pass."""
    with _connection(pki, server.url) as steps:
        steps.post("/echo", b"warm up", "application/octet-stream")
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                steps.post("/echo", bytes(70_000), "application/octet-stream")
            gc.collect()
            cyclic = [o for o in gc.garbage if isinstance(o, bytes) and len(o) >= 70_000]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert cyclic == []


def test_an_answer_is_held_to_the_size_asked_and_to_the_timeout_in_all(server: ServerThread, pki: Path) -> None:
    """A step's answer larger than the step can have is refused; one dripped a byte at a time (each read well
    within the timeout) is refused once the timeout has passed in all, not waited on for ever."""
    with _connection(pki, server.url) as steps:
        with pytest.raises(PeerError, match="announced 25 bytes for a step's answer; at most 10"):
            steps.send("/sized", b"more than ten bytes", "text/plain", 10)()
        with pytest.raises(PeerError, match="over 10 bytes"):  # not announced (chunked): counted as it comes
            steps.send("/echo", b"more than ten bytes", "text/plain", 10)()
    steps = StepConnection(server.url, TLSFiles.from_dir(pki, "bank"), expect=PARTNER, caller=BANK, timeout=1.0)
    with steps:
        started = time.monotonic()
        with pytest.raises(PeerError, match="did not finish a step's answer in 1s"):
            steps.post("/drip", b"", "text/plain")
        assert time.monotonic() - started < 2.5  # the drip would take 4 s


def test_an_answer_cut_short_is_the_peer_unavailable_not_a_short_body(server: ServerThread, pki: Path) -> None:
    """A partner killed while it answers: the bank must see a peer that went away (and retry), never five
    bytes taken for the whole answer (then refused as a malformed message, which ends the training)."""
    with _connection(pki, server.url) as steps:
        with pytest.raises(PeerUnavailable, match="did not answer"):
            steps.post("/cut", b"", "text/plain")
        assert steps.post("/sized", b"after", "text/plain")[1].endswith(b":after")  # a new connection serves
