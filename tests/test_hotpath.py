"""Hot routes answer before FastAPI, with the same identity checks, body limits and error answers."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import APIRouter, FastAPI
from starlette.datastructures import State

from parties import speed
from parties.errors import Forbidden, OutOfOrder
from parties.settings import PartnerSettings
from parties.transport.access import identify
from parties.transport.app import create_party_app
from parties.transport.client import make_client
from parties.transport.edges import Timeouts
from parties.transport.hot_routes import HotPath, HotRequest, HotResponse, HotRoute
from parties.transport.server import ServerThread
from parties.transport.stock import Connections
from parties.transport.tls import PeerIdentity, TLSFiles

LIMIT = 1 << 16


AFTER: list[bytes] = []


def echo(request: HotRequest) -> HotResponse:
    if request.body == b"refuse":
        raise OutOfOrder("refused on purpose")
    if request.body == b"crash":
        raise RuntimeError("a bug")
    if request.body.startswith(b"after"):
        def after() -> None:
            if request.body == b"after-crash":
                raise RuntimeError("a bug after answering")
            AFTER.append(request.body)

        return HotResponse(b"%d" % len(AFTER), "text/plain", after=after)
    answer = f"{request.caller.role}:{request.caller.name}:{request.params['thing']}:{request.state.seen}:"
    return HotResponse(answer.encode() + request.body, "application/octet-stream")


def _app(settings: PartnerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.seen = "state"
        yield

    cold = APIRouter()

    @cold.post("/things/{thing}/cold")
    async def cold_route(thing: str) -> dict[str, str]:
        return {"thing": thing}

    hot = [HotRoute("POST", "/things/{thing}/echo", "bank", echo)]
    return create_party_app(settings, lifespan=lifespan, routers=[cold], hot_routes=hot)


def _settings(pki: Path, tmp_path: Path, **extra: object) -> PartnerSettings:
    files = TLSFiles.from_dir(pki, "partner")
    return PartnerSettings(name="partner", data=tmp_path / "unused.csv", tls_ca=files.ca, tls_cert=files.cert,
                           tls_key=files.key, state_dir=tmp_path / "state", max_body_bytes=LIMIT, **extra)


@pytest.fixture()
def server(pki: Path, tmp_path: Path) -> Iterator[ServerThread]:
    settings = _settings(pki, tmp_path)
    thread = ServerThread(_app(settings), settings.tls_files()).start()
    yield thread
    thread.stop()


def _client(pki: Path, name: str, url: str) -> httpx.Client:
    return make_client(TLSFiles.from_dir(pki, name), base_url=url)


def test_hot_route_answers_with_caller_params_and_state(server: ServerThread, pki: Path) -> None:
    with _client(pki, "bank", server.url) as client:
        response = client.post("/things/abc/echo", content=b"payload")
        assert response.status_code == 200
        assert response.content == b"bank:bank:abc:state:payload"
        assert response.headers["content-type"] == "application/octet-stream"
        # everything else still goes through FastAPI
        assert client.post("/things/abc/cold").json() == {"thing": "abc"}
        assert client.get("/things/abc/echo").status_code == 405  # not hot for GET: FastAPI answers


@pytest.mark.parametrize(
    ("caller", "body", "status", "kind"),
    [
        ("partner2", b"x", 403, "Forbidden"),  # a partner's certificate posing as the bank
        ("bank", b"refuse", 409, "OutOfOrder"),
        ("bank", b"crash", 500, "InternalError"),
        ("bank", b"x" * (LIMIT + 1), 413, "PayloadTooLarge"),
    ],
    ids=["wrong-role", "domain-error", "unexpected-error", "oversized"],
)
def test_hot_route_refusals_are_json_with_the_usual_status(
    server: ServerThread, pki: Path, caller: str, body: bytes, status: int, kind: str
) -> None:
    with _client(pki, caller, server.url) as client:
        response = client.post("/things/abc/echo", content=body)
    assert response.status_code == status
    assert response.json()["error"] == kind
    assert "Traceback" not in response.text


def test_streamed_body_over_the_limit_is_refused_without_a_declared_length(server: ServerThread, pki: Path) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            yield b"y" * (LIMIT // 2)

    with _client(pki, "bank", server.url) as client:
        response = client.post("/things/abc/echo", content=chunks())
    assert response.status_code == 413


def test_insecure_mode_needs_the_caller_header(pki: Path, tmp_path: Path) -> None:
    settings = _settings(pki, tmp_path, insecure=True)
    thread = ServerThread(_app(settings), None).start()
    try:
        with make_client(None, base_url=thread.url) as anonymous:
            assert anonymous.post("/things/a/echo", content=b"x").status_code == 403
        bank = PeerIdentity(name="bank", role="bank")
        with make_client(None, caller=bank, base_url=thread.url) as client:
            assert client.post("/things/a/echo", content=b"x").content == b"bank:bank:a:state:x"
    finally:
        thread.stop()


def _count_asgi(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every hot request that goes through ``HotPath.handle`` (ASGI), by path."""
    seen: list[str] = []
    handle = HotPath.handle

    async def counted(self: HotPath, route: HotRoute, params: dict, scope: dict, receive, send) -> None:  # noqa: ANN001
        seen.append(scope["path"])
        await handle(self, route, params, scope, receive, send)

    monkeypatch.setattr(HotPath, "handle", counted)
    return seen


def test_this_pass_runs_the_protocol_its_switch_names(
    server: ServerThread, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI runs the tests with ``CUTLAYER_FAST_PATH`` on and off: each pass must serve with the protocol it names.

    The fast protocol answers hot routes from the parser's callbacks; uvicorn's own sends them through ASGI."""
    gate = server.server.speed
    assert gate.active is speed.switched_on(), (
        f"{gate}: with the switch on, uvicorn {uvicorn.__version__} must be a verified version; verify "
        "parties/transport/fast_protocol.py on it (test_hotpath, test_service_edges) and add it to server.VERIFIED")
    asgi = _count_asgi(monkeypatch)
    with _client(pki, "bank", server.url) as client:
        for i in range(3):  # one kept-alive connection, several exchanges
            response = client.post("/things/abc/echo", content=b"p%d" % i)
            assert response.content == b"bank:bank:abc:state:p%d" % i
        assert client.post("/things/abc/echo", content=b"refuse").status_code == 409
        assert client.post("/things/abc/echo", content=b"after").status_code == 200
        closing = client.post("/things/abc/echo", content=b"bye", headers={"connection": "close"})
        assert closing.status_code == 200 and closing.headers["connection"] == "close"
    assert len(asgi) == (0 if gate.active else 6)


def test_the_asgi_path_gives_the_same_answers(pki: Path, tmp_path: Path) -> None:
    """``HotPath.handle``: the same exchange for any ASGI server, body in chunks."""
    settings = _settings(pki, tmp_path)
    hot = HotPath([HotRoute("POST", "/things/{thing}/echo", "bank", echo)], settings, State({"seen": "state"}))
    bank = {"peercert": {"subject": ()}, "identity": PeerIdentity(name="bank", role="bank")}

    def run(chunks: list[bytes], method: str = "POST") -> tuple[int, bytes]:
        scope = {"type": "http", "method": method, "path": "/things/t/echo", "headers": [], "extensions": {"tls": bank}}
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        sent: list[dict] = []

        async def receive() -> dict:
            return messages.pop(0)

        async def send(message: dict) -> None:
            sent.append(message)

        route, params = hot.match(scope)  # type: ignore[misc]
        asyncio.run(hot.handle(route, params, scope, receive, send))
        return sent[0]["status"], sent[1]["body"]

    assert run([b"pa", b"yload"]) == (200, b"bank:bank:t:state:payload")
    assert run([b"x" * (LIMIT // 2)] * 3)[0] == 413
    assert run([b"refuse"])[0] == 409
    assert run([b"x"], method="PUT")[0] == 405


def test_busy_polling_keeps_serving_and_ends_at_its_deadline() -> None:
    from parties.transport.fast_protocol import _BusyPoll

    async def scenario() -> tuple[float, float, bool]:
        loop = asyncio.get_running_loop()
        poll = _BusyPoll()
        poll.extend(0.02)
        first = poll.task
        fired = loop.create_future()
        started = loop.time()
        loop.call_later(0.005, lambda: fired.set_result(loop.time() - started))
        late = await fired  # other work is served while the loop polls
        poll.extend(0.02)  # a new step: the same task polls on
        same = poll.task is first
        assert first is not None
        await first
        return late, loop.time() - started, same

    late, polled, same = asyncio.run(scenario())
    assert 0.005 <= late < 0.015
    assert polled >= 0.025  # 5 ms in, extended by 20 ms
    assert same


def test_work_after_the_answer_runs_before_the_next_request(server: ServerThread, pki: Path) -> None:
    AFTER.clear()
    with _client(pki, "bank", server.url) as client:
        assert client.post("/things/a/echo", content=b"after").content == b"0"
        assert client.post("/things/a/echo", content=b"after-crash").content == b"1"  # its failure is only logged
        assert client.post("/things/a/echo", content=b"after").content == b"1"
    assert AFTER == [b"after", b"after"]


@pytest.mark.parametrize(
    ("extra", "seconds"),
    [({}, 0.0), ({"cpus": (0,)}, 0.002), ({"cpus": (0,), "step_poll_ms": 0}, 0.0), ({"step_poll_ms": 5}, 0.005)],
    ids=["shared-cpus", "own-cpus", "own-cpus-off", "explicit"],
)
def test_services_poll_for_steps_only_on_cpus_of_their_own(
    pki: Path, tmp_path: Path, extra: dict[str, object], seconds: float
) -> None:
    assert _settings(pki, tmp_path, **extra).step_poll_seconds == seconds


# --- uvicorn's own protocol, wherever the fast one may not run -------------------------------------


@pytest.mark.parametrize("why", ["unverified-uvicorn", "unverified-httptools", "switched-off"])
def test_an_unverified_server_serves_with_uvicorns_own_protocol(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """A newer uvicorn must not meet this project's subclass of its internals: its own protocol serves, with
    the same identities, answers and refusals, and the fast protocol's module is never imported."""
    import httptools

    monkeypatch.setenv(speed.ENV_VAR, "0" if why == "switched-off" else "1")
    if why == "unverified-uvicorn":
        monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    elif why == "unverified-httptools":
        monkeypatch.setattr(httptools, "__version__", "0.99.1")
    monkeypatch.setitem(sys.modules, "parties.transport.fast_protocol", None)  # importing it would fail
    settings = _settings(pki, tmp_path)
    thread = ServerThread(_app(settings), settings.tls_files()).start()
    asgi = _count_asgi(monkeypatch)
    try:
        gate = thread.server.speed
        assert not gate.active
        assert {"unverified-uvicorn": "uvicorn 0.99.0 not verified", "unverified-httptools": "httptools 0.99.1 not "
                "verified", "switched-off": "CUTLAYER_FAST_PATH='0'"}[why] in gate.reason
        with _client(pki, "bank", thread.url) as client:
            for i in range(3):
                assert client.post("/things/abc/echo", content=b"p%d" % i).content == b"bank:bank:abc:state:p%d" % i
            assert client.post("/things/abc/cold").json() == {"thing": "abc"}
            assert client.get("/identity").status_code == 200
        with _client(pki, "partner2", thread.url) as client:
            refused = client.post("/things/abc/echo", content=b"x")
            assert refused.status_code == 403 and refused.json()["error"] == "Forbidden"
            assert refused.headers["connection"] == "close"
        with _client(pki, "bank", thread.url) as client:
            assert client.post("/things/abc/echo", content=b"x" * (LIMIT + 1)).status_code == 413
        assert asgi == ["/things/abc/echo"] * 5  # the hot routes went through ASGI
    finally:
        thread.stop()


@pytest.mark.parametrize("switch", ["1", "0"], ids=["fast-protocol", "uvicorns-protocol"])
def test_each_connection_keeps_its_own_caller(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str
) -> None:
    """Callers on open connections side by side are each told apart (uvicorn's own protocol finds a request's
    certificate by its connection's addresses)."""
    monkeypatch.setenv(speed.ENV_VAR, switch)
    settings = _settings(pki, tmp_path)
    thread = ServerThread(_app(settings), settings.tls_files()).start()
    try:
        assert thread.server.speed.active is (switch == "1")
        with _client(pki, "bank", thread.url) as bank, _client(pki, "partner2", thread.url) as partner, \
                _client(pki, "bank2", thread.url) as bank2:
            for i in range(3):
                assert bank.post("/things/a/echo", content=b"%d" % i).content == b"bank:bank:a:state:%d" % i
                assert partner.post("/things/a/echo", content=b"x").status_code == 403
                assert bank2.post("/things/b/echo", content=b"%d" % i).content == b"bank:bank2:b:state:%d" % i
                assert partner.get("/identity").status_code == 200
    finally:
        thread.stop()


def test_connections_that_cannot_be_told_apart_identify_nobody() -> None:
    """TCP never has two open connections with the same addresses; if it had, neither may borrow a certificate."""
    class Transport:
        def __init__(self, name: str) -> None:
            self.name = name
            self.closed = False

        def get_extra_info(self, key: str, default: object = None) -> object:
            cert = {"subject": ((("commonName", self.name),), (("organizationalUnitName", "bank"),))}
            return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 443),
                    "ssl_object": type("SSL", (), {"getpeercert": lambda _self: cert})()}.get(key, default)

        def is_closing(self) -> bool:
            return self.closed

    async def scenario() -> list[object]:
        connections = Connections(Timeouts())
        scope = {"client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 443)}
        first = connections.opened(Transport("bank"))  # type: ignore[arg-type]
        found = [connections.find(scope).tls["identity"]]  # type: ignore[union-attr]
        second = connections.opened(Transport("bank2"))  # type: ignore[arg-type]
        found += [c.tls["identity"] for c in (first, second)]
        found.append(connections.find(scope))
        for c in (first, second):
            c.disarm()
        return found

    one, first, second, found = asyncio.run(scenario())
    assert one == PeerIdentity(name="bank", role="bank")
    assert first is None and second is None
    with pytest.raises(Forbidden, match="names no Cutlayer party"):
        identify(type("Settings", (), {"insecure": False})(), {"extensions": {"tls": found.tls}})  # type: ignore
