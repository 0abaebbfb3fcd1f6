"""Hot routes answer before FastAPI, with the same identity checks, body limits and error answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.datastructures import State

from parties.errors import Forbidden, OutOfOrder
from parties.transport.access import identify
from parties.transport.app import create_party_app
from parties.transport.client import make_client
from parties.transport.edges import Timeouts
from parties.transport.hot_routes import HotPath, HotRequest, HotResponse, HotRoute
from parties.transport.server import ServerThread
from parties.transport.stock import Connections
from parties.transport.tls import PeerIdentity, TLSFiles
from partner.settings import PartnerSettings

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


def test_hot_routes_answer_through_asgi_on_one_kept_alive_connection(
    server: ServerThread, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every exchange, refused ones too, goes through ``HotPath.handle`` on uvicorn's own protocol."""
    asgi = _count_asgi(monkeypatch)
    with _client(pki, "bank", server.url) as client:
        for i in range(3):  # one kept-alive connection, several exchanges
            response = client.post("/things/abc/echo", content=b"p%d" % i)
            assert response.content == b"bank:bank:abc:state:p%d" % i
        assert client.post("/things/abc/echo", content=b"refuse").status_code == 409
        assert client.post("/things/abc/echo", content=b"after").status_code == 200
        closing = client.post("/things/abc/echo", content=b"bye", headers={"connection": "close"})
        assert closing.status_code == 200 and closing.headers["connection"] == "close"
    assert asgi == ["/things/abc/echo"] * 6


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


def test_work_after_the_answer_runs_before_the_next_request(server: ServerThread, pki: Path) -> None:
    AFTER.clear()
    with _client(pki, "bank", server.url) as client:
        assert client.post("/things/a/echo", content=b"after").content == b"0"
        assert client.post("/things/a/echo", content=b"after-crash").content == b"1"  # its failure is only logged
        assert client.post("/things/a/echo", content=b"after").content == b"1"
    assert AFTER == [b"after", b"after"]


def test_hot_and_cold_routes_share_identities_and_refusals(pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same certificate names the caller on a hot route and on FastAPI's; a caller who may not call gets
    403 and a closed connection, a body over the limit 413."""
    settings = _settings(pki, tmp_path)
    thread = ServerThread(_app(settings), settings.tls_files()).start()
    asgi = _count_asgi(monkeypatch)
    try:
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
        assert asgi == ["/things/abc/echo"] * 5
    finally:
        thread.stop()


def test_each_connection_keeps_its_own_caller(pki: Path, tmp_path: Path) -> None:
    """Callers on open connections side by side are each told apart (uvicorn's own protocol finds a request's
    certificate by its connection's addresses)."""
    settings = _settings(pki, tmp_path)
    thread = ServerThread(_app(settings), settings.tls_files()).start()
    try:
        with _client(pki, "bank", thread.url) as bank, _client(pki, "partner2", thread.url) as partner, \
                _client(pki, "bank2", thread.url) as bank2:
            for i in range(3):
                assert bank.post("/things/a/echo", content=b"%d" % i).content == b"bank:bank:a:state:%d" % i
                assert partner.post("/things/a/echo", content=b"x").status_code == 403
                assert bank2.post("/things/b/echo", content=b"%d" % i).content == b"bank:bank2:b:state:%d" % i
                assert partner.get("/identity").status_code == 200
    finally:
        thread.stop()


def _certificate_der(name: str, role: str) -> bytes:
    """A self-signed certificate naming a party and a role, as a verified peer's would (DER)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


def test_connections_that_cannot_be_told_apart_identify_nobody() -> None:
    """TCP never has two open connections with the same addresses; if it had, neither may borrow a certificate."""
    class Transport:
        def __init__(self, name: str) -> None:
            self.name = name
            self.closed = False

        def get_extra_info(self, key: str, default: object = None) -> object:
            cert = {"subject": ((("commonName", self.name),), (("organizationalUnitName", "bank"),))}
            der = _certificate_der(self.name, "bank")
            ssl_object = type("SSL", (), {"context": None,
                                          "getpeercert": lambda _self, binary=False: der if binary else cert})()
            return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 443),
                    "ssl_object": ssl_object}.get(key, default)

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
