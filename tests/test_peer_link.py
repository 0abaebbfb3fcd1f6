"""One peer client under both of the bank's: ``bank.peer.PeerLink`` beneath ``HttpPartner`` and ``LayerPeer``.

In process, with httpx's mock transport standing in for a peer (what the services answer for real is tested
through them in ``test_dishonest_peer.py``, ``test_layer_security.py`` and ``test_sessions.py``): the same
refusal raises the same error from either client, an answer is read no further than it could honestly go,
and every answer is counted once.
"""

from __future__ import annotations

import json

import httpx
import pytest

from bank.configurations.layer_peer import LayerPeer
from bank.peer import ERROR_BODY_LIMIT, JSON_LIMIT, PASSED_ON, PeerLink
from bank.vertical.http_partner import HttpPartner
from parties.errors import NotReady, PeerError


def _answer(status: int, body: bytes | object = b"", headers: dict[str, str] | None = None) -> httpx.Response:
    """An answer streamed as a network's is (a body given as bytes would be read already); JSON for an object."""
    if not isinstance(body, bytes):
        body, headers = json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
    return httpx.Response(status, headers=headers, content=iter([body]))


def _clients(handler) -> tuple[httpx.Client, list[PeerLink]]:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    return client, [HttpPartner("p", "http://peer", client), LayerPeer("p", "http://peer", client, "partner")]


def _calls(peer: PeerLink) -> list:
    """A retried call and a call made once, of each client."""
    if isinstance(peer, HttpPartner):
        return [peer.sessions, lambda: peer.abort("s")]
    return [lambda: peer.stats([0, 1]), peer.end if peer.session_id else lambda: peer.once("GET", "/x", "x")]


@pytest.mark.parametrize("kind", [*sorted(PASSED_ON), "Forbidden", "SomethingNew", None])
def test_a_refusal_raises_the_same_error_from_every_peer_client(kind: str | None) -> None:
    detail = "the reason " + "x" * 3000

    def handler(request: httpx.Request) -> httpx.Response:
        if kind is None:
            return _answer(503, b"<html>not JSON</html>")
        return _answer(409, {"error": kind, "detail": detail})

    client, peers = _clients(handler)
    expected = PASSED_ON.get(kind or "", PeerError)
    with client:
        for peer in peers:
            for call in _calls(peer):
                with pytest.raises(expected) as raised:
                    call()
                # The kind a caller acts on, and a peer's failure for code that handles any of them.
                assert isinstance(raised.value, expected) and isinstance(raised.value, PeerError), raised.value
                message = str(raised.value)
                if kind is None:
                    assert "HTTP 503" in message and "not JSON" in message
                else:
                    assert message.startswith("partner 'p'") and len(message) < 2200
            assert peer.retries == 0  # a refusal is an answer: never resent
            assert peer.round_trips == len(_calls(peer)) and peer.answered


def test_no_peer_client_reads_an_answer_past_what_it_could_honestly_hold() -> None:
    """A JSON answer past ``JSON_LIMIT`` (announced or streamed), or a refusal past ``ERROR_BODY_LIMIT``, is
    refused by either client without reading the rest; HttpPartner's control calls read everything before."""
    def stream(n: int):
        chunk = b" " * (1 << 20)
        for _ in range(n // len(chunk) + 1):
            yield chunk

    answers = {
        "announced": lambda: _answer(200, b"{}" + b" " * (JSON_LIMIT - 1), {"content-length": str(JSON_LIMIT + 1)}),
        "streamed": lambda: httpx.Response(200, content=stream(JSON_LIMIT + 1)),
        "long refusal": lambda: httpx.Response(409, content=stream(ERROR_BODY_LIMIT + 1)),
    }
    for name, answer in answers.items():
        client, peers = _clients(lambda request, answer=answer: answer())
        with client:
            limit = ERROR_BODY_LIMIT if name == "long refusal" else JSON_LIMIT
            for peer in peers:
                with pytest.raises(PeerError, match=f"(announced|sent more than) .*{limit}"):
                    _calls(peer)[0]()
                assert peer.bytes_received == 0  # nothing refused is counted as received


def test_every_answer_is_counted_once_and_a_silent_peer_is_retried_only_for_idempotent_calls() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) == 1:
            raise httpx.ConnectError("no route")
        return _answer(200, {"sessions": []} if request.method == "GET" else {})

    client, (partner, _) = _clients(handler)
    with client:
        assert partner.sessions().sessions == []  # retried once after the silence
        assert partner.retries == 1 and partner.round_trips == 1 and partner.bytes_received == len(b'{"sessions": []}')
        seen.clear()
        with pytest.raises(PeerError, match="did not answer"):
            partner.abort("s")  # a PSI call is never resent
        assert seen == ["DELETE"] and partner.retries == 1


def test_notready_is_asked_again_until_the_partner_is_ready() -> None:
    answers = iter([_answer(409, {"error": "NotReady", "detail": "blinding"}) for _ in range(2)]
                   + [_answer(200, b"\x01" * 32)])
    client, (partner, _) = _clients(lambda request: next(answers))
    with client:
        assert partner.get_blinded("s", 0) == b"\x01" * 32
        assert partner.round_trips == 3
    with pytest.raises(NotReady):
        PeerLink("p", "http://peer", httpx.Client(transport=httpx.MockTransport(
            lambda r: _answer(409, {"error": "NotReady"}))), "partner").once(
                "GET", "/", "x")


def test_a_compressed_answer_is_refused_not_decompressed() -> None:
    """A few hundred bytes of gzip inside gzip decode to hundreds of megabytes before any size check: the bank
    asks for answers as sent (identity) and refuses an encoded one unread, success or refusal alike."""
    import gzip

    bomb = gzip.compress(gzip.compress(b"\0" * (64 << 20)))
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("accept-encoding", ""))
        status = 200 if request.method == "GET" else 409
        return _answer(status, bomb, {"content-encoding": "gzip, gzip"})

    client, peers = _clients(handler)
    with client:
        for peer in peers:
            for call in _calls(peer):
                with pytest.raises(PeerError, match="gzip, gzip-encoded; answers are read as sent"):
                    call()
            assert peer.bytes_received == 0
    assert asked and set(asked) == {"identity"}


def test_a_refusal_nested_to_no_end_is_a_plain_refusal() -> None:
    deep = b'{"error": "OutOfOrder", "detail": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    client, peers = _clients(lambda request: _answer(409, deep))
    with client:
        for peer in peers:
            with pytest.raises(PeerError, match="HTTP 409"):
                _calls(peer)[0]()


def test_ending_a_session_survives_any_refusal_of_the_peer() -> None:
    """A compute party or branch that refuses the end of a session (whatever error it names) cannot make a
    finished run fail: the session is the peer's to drop, and the bank says so in its log."""
    for kind in sorted(PASSED_ON):
        client, (_, layers) = _clients(lambda request, kind=kind: _answer(409, {"error": kind}))
        with client:
            layers.session_id = "s1"
            layers.end()  # no exception
            assert layers.round_trips == 1
