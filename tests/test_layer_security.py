"""The layer exchange against a dishonest peer, in both directions, over real mutual TLS on 127.0.0.1.

- A dishonest **bank** against a compute party (``python -m partner compute``) and a branch
  (``python -m partner branch``): every attack must end in a clear 4xx with a reason, never a 500, a hang
  or a session left corrupted (each test that tampers checks that the session still trains afterwards).
- A dishonest **compute party or branch** against the bank's ``LayerPeer``: every lie must end in a clear
  ``PeerError`` at the bank, after reading no more than the answer could honestly hold.
"""

from __future__ import annotations

import json
import pickle
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from bank.configurations import layer_peer
from bank.configurations.layer_peer import LayerPeer
from parties.errors import OutOfOrder, OverBudget, PeerError, PeerUntrusted, QuotaExceeded, UnknownSession
from parties.learning.config import OptimizerConfig
from parties.limits import BankQuotas
from parties.protocol import layers
from parties.protocol.common import fill
from parties.protocol.layers import LayerStart
from parties.protocol.wire import SAFETENSORS, encode
from parties.storage.quota import FOLDER_BYTES
from parties.tables.encoding import TabularEncoder
from parties.tables.table import PartyTable, load_party_table
from parties.transport.client import make_client
from parties.transport.server import ServerThread
from parties.transport.tls import TLSFiles
from partner import layer_service
from partner.layer_service import create_layer_app
from partner.settings import BranchSettings, ComputeSettings

ROWS = 300  # the branch's customers
LIMITS = {"max_sessions": 3, "max_width": 256, "max_parameters": 100_000, "max_batch_rows": 512,
          "max_body_bytes": 1 << 20, "max_activations": 1 << 16, "min_stats_rows": 50, "banks": ("bank", "bank2")}


# --- services and clients ---------------------------------------------------------------------------------


def _files(pki: Path, name: str) -> dict[str, Path]:
    f = TLSFiles.from_dir(pki, name)
    return {"tls_ca": f.ca, "tls_cert": f.cert, "tls_key": f.key}


def compute_service(pki: Path, state: Path, **extra: Any) -> ServerThread:
    settings = ComputeSettings(name="compute", state_dir=state, workers=1, **_files(pki, "compute"),
                               **{**LIMITS, **extra})
    return ServerThread(create_layer_app(settings), settings.tls_files()).start()


def branch_service(pki: Path, state: Path, table: PartyTable, **extra: Any) -> ServerThread:
    settings = BranchSettings(name="branch-1", data=table.path, state_dir=state, workers=1,
                              **_files(pki, "branch-1"), **{**LIMITS, **extra})
    return ServerThread(create_layer_app(settings, table), settings.tls_files()).start()


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> PartyTable:
    path = tmp_path_factory.mktemp("branch") / "branch.csv"
    pd.DataFrame({"customer_id": [f"C{i:04d}" for i in range(ROWS)],
                  "age": [20 + (i * 7) % 50 for i in range(ROWS)],
                  "balance": [float((i * 37) % 1000) for i in range(ROWS)],
                  "job": [("admin", "blue", "retired")[i % 3] for i in range(ROWS)]}).to_csv(path, index=False)
    return load_party_table(path, "customer_id", numeric=("age", "balance"), categorical=("job",))


@pytest.fixture(scope="module")
def encoder(table: PartyTable) -> dict[str, Any]:
    return TabularEncoder(table.schema).fit(table.features).to_dict()


@pytest.fixture(scope="module")
def compute(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    server = compute_service(pki, tmp_path_factory.mktemp("compute-state"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def branch(pki: Path, table: PartyTable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    server = branch_service(pki, tmp_path_factory.mktemp("branch-state"), table)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_sessions_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts on services that hold no session (the module's services are shared)."""
    yield
    for name in ("compute", "branch"):
        if name in request.fixturenames:
            request.getfixturevalue(name).app.state.host.sessions.clear()


@pytest.fixture()
def own_clients(pki: Path) -> Iterator[dict[str, httpx.Client]]:
    """Clients for a test's own service: closed before it stops (a kept-alive connection would hold the stop)."""
    made = {name: make_client(TLSFiles.from_dir(pki, name), timeout=30) for name in ("bank", "bank2")}
    yield made
    for c in made.values():
        c.close()


@pytest.fixture(scope="module")
def clients(pki: Path, rogue_pki: Path) -> Iterator[dict[str, httpx.Client]]:
    made = {name: make_client(TLSFiles.from_dir(pki, name), timeout=30)
            for name in ("bank", "bank2", "compute2", "branch-2")}
    # A rogue bank: it trusts the real CA (so it reaches the service) but presents a certificate of its own CA.
    rogue = TLSFiles.from_dir(rogue_pki, "bank")
    made["rogue"] = make_client(TLSFiles(TLSFiles.from_dir(pki, "bank").ca, rogue.cert, rogue.key), timeout=30)
    yield made
    for c in made.values():
        c.close()


def trunk(session: str = "t1", **kw: Any) -> LayerStart:
    return LayerStart(session=session, kind="trunk", in_width=4, hidden=(8,), out_width=3, **kw)


def server_start(session: str = "v1", **kw: Any) -> LayerStart:
    return LayerStart(session=session, kind="server", in_width=4, hidden=(8,), out_width=1, **kw)


def bottom(encoder: dict[str, Any], session: str = "b1", **kw: Any) -> LayerStart:
    return LayerStart(session=session, kind="bottom", hidden=(8,), out_width=4, encoder=encoder, **kw)


def peer(server: ServerThread, client: httpx.Client, *, name: str = "compute", role: str = "compute",
         **kw: Any) -> LayerPeer:
    return LayerPeer(name, server.url, client, role, retry_deadline=kw.pop("retry_deadline", 2.0), **kw)


def x(rows: int = 5, width: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


def post(client: httpx.Client, server: ServerThread, template: str, body: bytes, session: str = "t1",
         method: str = "POST") -> httpx.Response:
    return client.request(method, server.url + fill(template, session_id=session), content=body,
                          headers={"content-type": SAFETENSORS})


def refused(response: httpx.Response, status: int, reason: str) -> None:
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert reason in response.json()["detail"], response.json()


def trains(p: LayerPeer, step: int, rows: int = 5) -> None:
    """The session still does a whole step, and its output is finite: nothing an attack did stuck."""
    if p.info is not None and p.info.kind == "bottom":
        out = p.forward(step, torch.arange(rows, dtype=torch.int64))
        p.backward(step, torch.ones_like(out))
    else:
        out = p.forward(step, x(rows))
        p.backward(step, torch.ones_like(out))
    assert torch.isfinite(out).all()


# === a dishonest bank against a compute party and a branch ===============================================


# --- who may call ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("caller", ["compute2", "branch-2"])
@pytest.mark.parametrize("route", [layers.SESSIONS, layers.STATS, layers.FORWARD, layers.WEIGHTS])
def test_only_a_bank_may_call_a_layer_service(compute, branch, clients, caller, route) -> None:
    for server in (compute, branch):
        method = "PUT" if route == layers.WEIGHTS else "POST"
        response = post(clients[caller], server, route, b"{}", method=method)
        refused(response, 403, "this endpoint is for the bank")


def test_a_certificate_of_another_ca_is_refused_in_the_handshake(compute, branch, clients) -> None:
    for server in (compute, branch):
        # The server refuses the rogue certificate; the rogue's own client may see first that the server's is not
        # from its CA and send nothing: no request is answered either way.
        with pytest.raises((httpx.TransportError, PeerUntrusted)):
            clients["rogue"].post(server.url + layers.SESSIONS, json=trunk().model_dump(mode="json"))


# --- a bank that sets a bottom reads its rows: which banks a branch serves is the boundary ----------------------


def test_a_bank_that_sets_a_bottom_reads_the_branchs_rows(branch, clients, encoder, table) -> None:
    """Not an attack the service can refuse: relay and SplitFed hand the bottom's weights to the branch, so a
    bank picks an encoder of mean 0 and scale 1, a bottom of one identity layer, and predicts every row."""
    plain = {**encoder, "means": {"age": 0.0, "balance": 0.0}, "scales": {"age": 1.0, "balance": 1.0}}
    p = peer(branch, clients["bank"], name="branch-1", role="partner")
    p.start(LayerStart(session="reader", kind="bottom", hidden=(), out_width=5, encoder=plain))
    # This table holds no negative value; a bias shift would carry one past the ReLU.
    p.load_weights({"model.0.weight": torch.eye(5), "model.0.bias": torch.zeros(5)}, {})
    rows = p.predict(torch.arange(ROWS, dtype=torch.int64))
    assert torch.equal(rows[:, 0].double(), torch.tensor(table.features["age"].to_numpy(), dtype=torch.float64))
    assert torch.equal(rows[:, 1].double(), torch.tensor(table.features["balance"].to_numpy(), dtype=torch.float64))


def test_a_branch_that_names_its_bank_refuses_every_other(pki, table, tmp_path, encoder, own_clients) -> None:
    server = branch_service(pki, tmp_path, table, banks=("bank",))
    try:
        for route, body in ((layers.SESSIONS, bottom(encoder).model_dump(mode="json")),
                            (layers.STATS, {"positions": list(range(60))})):
            refused(own_clients["bank2"].post(server.url + route, json=body), 403,
                    "this service holds no layers for bank 'bank2'")
        p = peer(server, own_clients["bank"], name="branch-1", role="partner")
        assert p.stats(list(range(60))).rows == 60 and p.start(bottom(encoder)).rows == ROWS
    finally:
        for c in own_clients.values():
            c.close()
        server.stop()


# --- another bank's session --------------------------------------------------------------------------------


def test_another_bank_can_neither_see_nor_steer_nor_squat_a_session(compute, clients) -> None:
    mine, theirs = peer(compute, clients["bank"]), peer(compute, clients["bank2"])
    mine.start(trunk("shared-id"))
    trains(mine, 1)
    mine.checkpoint(1)
    theirs.session_id, theirs.layer_start, theirs.info = "shared-id", mine.layer_start, mine.info
    for attempt in (lambda: theirs.forward(2, x()), lambda: theirs.backward(2, x(5, 3)),
                    lambda: theirs.predict(x()), lambda: theirs.checkpoint(1), lambda: theirs.restore(1),
                    lambda: theirs.load_weights({}, {})):
        with pytest.raises(UnknownSession):  # not even told that the session exists
            attempt()
    theirs.end()
    response = post(clients["bank2"], compute, layers.WEIGHTS, b"", session="shared-id", method="GET")
    refused(response, 404, "no layer session 'shared-id'")
    # Starting a session of the same ID gives the other bank a session of its own: nothing of the first changes.
    before = mine.predict(x())
    assert theirs.start(trunk("shared-id", seed=7)).step == 0
    trains(theirs, 1)
    assert mine.info is not None and torch.equal(mine.predict(x()), before)
    trains(mine, 2)
    host = compute.app.state.host
    assert len(host.sessions) == 2 and {s.owner for s in host.sessions.values()} == {"bank", "bank2"}


def test_concurrent_starts_never_pass_max_sessions(pki, tmp_path, own_clients, monkeypatch) -> None:
    class SlowToBuild(layer_service.LayerSession):  # widens the window between the count and the insert
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.2)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(layer_service, "LayerSession", SlowToBuild)
    server = compute_service(pki, tmp_path, max_sessions=2)
    try:
        def one(i: int) -> int:
            r = own_clients["bank"].post(server.url + layers.SESSIONS, json=trunk(f"race-{i}").model_dump(mode="json"))
            return r.status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(16)))
        assert codes.count(200) == 2 and set(codes) == {200, 429}, codes
        assert len(server.app.state.host.sessions) == 2
    finally:
        own_clients["bank"].close()
        server.stop()


# --- sessions do not live for ever ---------------------------------------------------------------------------


def test_max_sessions_is_a_clear_429_per_bank_and_idle_sessions_expire_but_resume(pki, tmp_path, own_clients) -> None:
    server, clients = compute_service(pki, tmp_path, max_sessions=2, session_ttl=1.0), own_clients
    try:
        idle, busy = peer(server, clients["bank"]), peer(server, clients["bank"])
        idle.start(trunk("idle"))
        trains(idle, 1)
        idle.checkpoint(1)
        busy.start(trunk("busy"))
        third = peer(server, clients["bank"])
        with pytest.raises(OverBudget, match="HTTP 429.*bank holds 2 sessions here, the most one bank may"):
            third.start(trunk("third"))
        other = peer(server, clients["bank2"])  # another bank's slots are its own
        assert other.start(trunk("other")).step == 0
        other.end()
        for step in range(1, 5):  # the busy session is used all along: it never expires
            time.sleep(0.35)
            trains(busy, step)
        third.start(trunk("third"))  # the idle one made room
        with pytest.raises(UnknownSession):
            idle.forward(2, x())
        # Expired, not ended: its checkpoints stay on disk and the bank resumes from them.
        busy.end()
        assert idle.start(trunk("idle", resume_step=1)).step == 1
        trains(idle, 2)
    finally:
        for c in clients.values():
            c.close()
        server.stop()


def test_a_banks_checkpoints_at_a_compute_party_are_bounded_per_bank(pki, tmp_path, own_clients) -> None:
    """Every checkpoint of a layer session is kept (a bank resumes at any of them): a quota per bank bounds them."""
    server = compute_service(pki, tmp_path, quotas=BankQuotas(disk_per_bank=8_000))
    try:
        mine, theirs = peer(server, own_clients["bank"]), peer(server, own_clients["bank2"])
        mine.start(trunk("filling"))
        with pytest.raises(QuotaExceeded, match=r"HTTP 507.*bank 'bank' keeps .* at compute 'compute'.*"
                                                r"its quota of 0.0 MB \(8,000 bytes, --disk-quota-per-bank\)"):
            for step in range(1, 100):
                trains(mine, step)
                mine.checkpoint(step)
        assert step > 2  # some fitted; the one over the quota was not written
        used = sum(p.stat().st_size for p in (tmp_path / "layers" / "bank").rglob("*") if p.is_file())
        assert used <= 8_000
        theirs.start(trunk("other"))  # another bank's quota is its own
        trains(theirs, 1)
        theirs.checkpoint(1)
    finally:
        for c in own_clients.values():
            c.close()
        server.stop()


def test_session_folders_count_against_the_banks_quota(pki, tmp_path, own_clients) -> None:
    """The second review started and ended 20,000 sessions at a compute party: a folder each, none refused."""
    server = compute_service(pki, tmp_path, quotas=BankQuotas(disk_per_bank=3 * FOLDER_BYTES))
    try:
        mine = peer(server, own_clients["bank"])
        with pytest.raises(QuotaExceeded, match="HTTP 507"):
            for i in range(100):
                mine.start(trunk(f"s{i}"))
                mine.end()
        assert i == 3 and len(list((tmp_path / "layers" / "bank").iterdir())) == 3  # three folders fit, not four
    finally:
        for c in own_clients.values():
            c.close()
        server.stop()


# --- models and bodies too large -------------------------------------------------------------------------


def _start_json(server: ServerThread, client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    # Sent as text: JSON has no infinity, but Python writes (and pydantic reads) the token Infinity.
    text = json.dumps(body)
    return client.post(server.url + layers.SESSIONS, content=text, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("change", "status", "reason"), [
    ({"hidden": [257]}, 400, "a layer of width 257 is wider than this service holds (256)"),
    ({"in_width": 1 << 17}, 422, "in_width: Input should be less than or equal to 65536"),
    ({"in_width": 256, "hidden": [256, 256]}, 400, "parameters are more than this service holds (100000)"),
    ({"hidden": [4] * 17}, 422, "hidden: Tuple should have at most 16 items"),
    ({"hidden": [0]}, 422, "hidden widths must be at least 1"),
    ({"out_width": 0}, 422, "out_width: Input should be greater than or equal to 1"),
    ({"seed": 1 << 64}, 422, "seed: Input should be less than 18446744073709551616"),
    ({"seed": -(1 << 63) - 1}, 422, "seed: Input should be greater than or equal to"),
    ({"optimizer": {"optimizer": "adam", "learning_rate": float("inf")}}, 422, "learning_rate (inf) and weight_decay"),
    ({"optimizer": {"optimizer": "sgd", "weight_decay": "1e400"}}, 422, "learning_rate (0.005) and weight_decay (inf)"),
    ({"resume_step": -1}, 422, "resume_step"),
    ({"session": "../escape"}, 422, "session: String should match pattern"),
    ({"session": "a/b"}, 422, "session: String should match pattern"),
    ({"session": ".."}, 422, "session: String should match pattern"),
    ({"kind": "server", "out_width": 3}, 422, "out_width must be 1"),
], ids=["wide", "huge-in-width", "too-many-parameters", "deep", "zero-width", "zero-out", "huge-seed",
        "negative-seed", "infinite-lr", "infinite-decay", "negative-resume", "traversal", "slash", "dotdot",
        "server-width"])
def test_a_model_the_service_will_not_hold_is_refused_with_a_reason(compute, clients, change, status, reason) -> None:
    body = {**trunk().model_dump(mode="json"), **change}
    refused(_start_json(compute, clients["bank"], body), status, reason)
    assert not compute.app.state.host.sessions


def test_a_too_wide_encoder_is_refused_before_the_branch_encodes_a_row(branch, clients, encoder, monkeypatch) -> None:
    encoded: list[int] = []
    real = TabularEncoder.encode
    monkeypatch.setattr(TabularEncoder, "encode", lambda self, frame: encoded.append(1) or real(self, frame))
    wide = {**encoder, "categories": {"job": [f"v{i}" for i in range(5000)]}}
    refused(_start_json(branch, clients["bank"], bottom(wide).model_dump(mode="json")), 400,
            "the shared encoder is 5002 columns wide; this service holds layers of at most 256")
    assert not encoded


@pytest.mark.parametrize(("change", "reason"), [
    ({"categories": {}}, "the shared encoder lacks the categories of 'job'"),
    ({"categories": {"job": "admin"}}, "the categories of 'job' are not a list of distinct strings"),
    ({"categories": {"job": ["admin", "admin"]}}, "the categories of 'job' are not a list of distinct strings"),
    ({"categories": "x"}, "the shared encoder is not readable"),
    ({"means": {"age": "x", "balance": 1.0}}, "the mean and scale of 'age' must be finite numbers"),
    ({"scales": {"age": 0.0, "balance": 1.0}}, "the mean and scale of 'age' must be finite numbers"),
    ({"means": {"balance": 1.0}}, "the mean and scale of 'age' must be finite numbers"),
    ({"numeric": "age"}, "the shared encoder is not readable (its columns must be lists of names)"),
    ({"numeric": [["age"]]}, "the shared encoder is not readable (its columns must be lists of names)"),
    ({"numeric": ["age"]}, "the shared encoder's columns (numeric ['age'], categorical ['job']) are not"),
    # Bins would widen every row past what the width check counts: a configuration's bottom takes z-scores.
    ({"bins": 256, "edges": {"age": list(range(257)), "balance": list(range(257))}},
     "the shared encoder has quantile bins"),
    ({"bins": 2, "edges": {"age": [0, 10**400], "balance": [0, 1]}}, "the shared encoder is not readable"),
], ids=["no-categories", "categories-string", "duplicate-categories", "categories-not-a-map", "mean-string",
        "zero-scale", "no-mean", "numeric-string", "numeric-nested", "other-columns", "bins", "huge-edge"])
def test_a_malformed_encoder_is_a_clear_refusal(branch, clients, encoder, change, reason) -> None:
    body = bottom({**encoder, **change}).model_dump(mode="json")
    response = _start_json(branch, clients["bank"], body)
    assert response.status_code in (400, 422), response.text
    assert reason in response.json()["detail"], response.json()


def test_a_compute_party_refuses_a_bottom_and_statistics(compute, clients, encoder) -> None:
    refused(_start_json(compute, clients["bank"], bottom(encoder).model_dump(mode="json")), 400,
            "a compute party holds no rows")
    refused(clients["bank"].post(compute.url + layers.STATS, json={"positions": list(range(100))}), 400,
            "a compute party holds no rows")


@pytest.mark.parametrize("route", [layers.SESSIONS, layers.STATS])
def test_a_json_body_over_the_limit_is_a_413(branch, clients, encoder, route) -> None:
    if route == layers.SESSIONS:  # an encoder padded with a key the service would otherwise ignore
        body = json.dumps(bottom({**encoder, "padding": "x" * (2 << 20)}).model_dump(mode="json")).encode()
    else:
        body = json.dumps({"positions": [0] * (1 << 20)}).encode()
    response = clients["bank"].post(branch.url + route, content=body, headers={"content-type": "application/json"})
    refused(response, 413, "over the limit of 1048576")
    assert not branch.app.state.host.sessions


def test_a_tensor_body_over_the_limit_is_a_413(compute, clients) -> None:
    peer(compute, clients["bank"]).start(trunk())
    refused(post(clients["bank"], compute, layers.FORWARD, encode({"x": x(70_000)}, step=1)), 413,
            "over the limit of 1048576")


def test_one_call_holds_no_more_activations_than_the_service_allows(compute, clients) -> None:
    # 512 rows are within max_batch_rows, but 512 x (4 + 256 + 256 + 3) activations are past max_activations.
    p = peer(compute, clients["bank"])
    p.start(LayerStart(session="wide", kind="trunk", in_width=4, hidden=(256, 256), out_width=3))
    with pytest.raises(PeerError, match=r"HTTP 400.*a call to this session carries 1 to 126 rows, not 512"):
        p.forward(1, x(512))
    trains(p, 1, rows=126)


# --- wrong tensors -------------------------------------------------------------------------------------------


def _step(tensors: dict[str, torch.Tensor], step: object = 1) -> bytes:
    return encode(tensors, session="t1", step=step)


@pytest.mark.parametrize(("route", "tensors", "reason"), [
    (layers.FORWARD, {"x": torch.tensor(1.0)}, "activations must be (rows, 4), not ()"),
    (layers.FORWARD, {"x": torch.zeros(5, 4, dtype=torch.int64)}, "activations must be finite float32"),
    (layers.FORWARD, {"x": torch.zeros(5, 4, dtype=torch.float64)}, "tensor 'x' is torch.float64"),
    (layers.FORWARD, {"x": torch.zeros(5, 5)}, "activations must be (rows, 4), not (5, 5)"),
    (layers.FORWARD, {"x": torch.zeros(0, 4)}, "carries 1 to"),
    (layers.FORWARD, {"x": torch.full((5, 4), float("nan"))}, "tensor 'x' holds NaN or infinite values"),
    (layers.FORWARD, {"x": torch.full((5, 4), float("inf"))}, "tensor 'x' holds NaN or infinite values"),
    (layers.FORWARD, {"x": x(), "y": x()}, "unexpected tensor 'y'"),
    (layers.FORWARD, {}, "the message lacks ['x']"),
    (layers.BACKWARD, {"grad": torch.tensor(1.0)}, "no forward of step 1 awaits its gradient"),
    (layers.PREDICT, {"x": torch.tensor([1.0])}, "activations must be (rows, 4), not (1,)"),
], ids=["scalar", "int64", "float64", "wrong-width", "no-rows", "nan", "inf", "extra", "missing",
        "backward-scalar", "predict-1d"])
def test_a_trunk_refuses_wrong_tensors(compute, clients, route, tensors, reason) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    response = post(clients["bank"], compute, route, _step(tensors))
    assert response.status_code in (400, 409), response.text
    assert reason in response.json()["detail"], response.json()
    trains(p, 1)


@pytest.mark.parametrize(("tensors", "reason"), [
    ({"grad": torch.tensor(1.0)}, "the gradient must be finite float32 of shape (5, 3)"),
    ({"grad": torch.ones(5, 4)}, "the gradient must be finite float32 of shape (5, 3)"),
    ({"grad": torch.full((5, 3), float("nan"))}, "tensor 'grad' holds NaN or infinite values"),
    ({"grad": torch.ones(5, 3, dtype=torch.int64)}, "tensor 'grad' is torch.int64"),
], ids=["scalar", "wrong-shape", "nan", "int64"])
def test_a_trunk_refuses_a_wrong_gradient(compute, clients, tensors, reason) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    p.forward(1, x())
    refused(post(clients["bank"], compute, layers.BACKWARD, _step(tensors)), 400, reason)
    p.backward(1, torch.ones(5, 3))  # the forward still awaits its (right) gradient
    trains(p, 2)


@pytest.mark.parametrize(("tensors", "reason"), [
    ({"x": x(), "labels": torch.tensor(1.0)}, "labels: one target per row (5), not shape ()"),
    ({"x": torch.tensor(1.0), "labels": torch.ones(5)}, "activations must be (rows, 4), not ()"),
    ({"x": x(), "labels": torch.full((5,), 0.5)}, "labels: binary targets are 0 or 1"),
    ({"x": x(), "labels": torch.full((5,), float("nan"))}, "tensor 'labels' holds NaN or infinite values"),
], ids=["scalar-labels", "scalar-x", "half-labels", "nan-labels"])
def test_a_server_refuses_wrong_tensors(compute, clients, tensors, reason) -> None:
    p = peer(compute, clients["bank"])
    p.start(server_start("t1"))
    refused(post(clients["bank"], compute, layers.TRAIN, _step(tensors)), 400, reason)
    grad, loss = p.train(1, x(), torch.ones(5))
    assert grad.shape == (5, 4) and loss == loss


@pytest.mark.parametrize(("positions", "reason"), [
    (torch.tensor([0, ROWS]), f"row positions must lie in [0, {ROWS})"),
    (torch.tensor([-1, 0]), f"row positions must lie in [0, {ROWS})"),
    (torch.tensor([[0, 1]]), "positions must be a 1-d int64 tensor"),
    (torch.tensor(3), "positions must be a 1-d int64 tensor"),
    (torch.tensor([0.0, 1.0]), "positions must be a 1-d int64 tensor"),
    (torch.zeros(0, dtype=torch.int64), "carries 1 to"),
    (torch.tensor([1 << 62]), f"row positions must lie in [0, {ROWS})"),
], ids=["past-end", "negative", "2d", "scalar", "float", "empty", "huge"])
def test_a_branch_refuses_positions_outside_its_table(branch, clients, encoder, positions, reason) -> None:
    p = peer(branch, clients["bank"], name="branch-1", role="partner")
    p.start(bottom(encoder, "t1"))
    for route in (layers.FORWARD, layers.PREDICT):
        refused(post(clients["bank"], branch, route, _step({"x": positions})), 400, reason)
    trains(p, 1)


# --- malformed bodies ---------------------------------------------------------------------------------------


def _raw(header: dict[str, Any] | bytes, data: bytes = b"", declared: int | None = None) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if declared is None else declared) + head + data


_META = {"schema_version": "1", "session": "t1", "step": "1"}


@pytest.mark.parametrize(("body", "reason"), [
    (pickle.dumps({"x": [1.0] * 20}), "the message header is too large or truncated"),
    (b"abc", "the body is not a safetensors message"),
    (_raw({"__metadata__": _META}, declared=1 << 40), "the message header is too large or truncated"),
    (_raw({"__metadata__": _META, "pad": "x" * 70_000}), "the message header is too large or truncated"),
    (_raw(b"{not json"), "not a valid safetensors message"),
    (_raw({"__metadata__": _META, "x": {"dtype": "F32", "shape": [5, 4], "data_offsets": [0, 80]}}, b"\0" * 8),
     "not a valid safetensors message"),
    (_raw({"__metadata__": _META, "x": {"dtype": "F32", "shape": [1 << 40, 4], "data_offsets": [0, 80]}},
          b"\0" * 80), "not a valid safetensors message"),
    (encode({"x": x()}, session="t1", step="one"), "'step' is not an integer"),
    (encode({"x": x()}, session="t1", step="9" * 5000), "'step' is not an integer"),
    (encode({"x": x()}, session="t1"), "the message has no 'step'"),
    (_raw({"__metadata__": {**_META, "step": 1}}), "not a valid safetensors message"),
    (_raw({"__metadata__": {"session": "t1", "step": "1"}}), "schema version None is not supported"),
], ids=["pickle", "short", "header-length-lies", "huge-header", "header-not-json", "truncated-data",
        "shape-lies", "step-word", "step-huge", "no-step", "step-not-string", "no-schema-version"])
def test_a_malformed_message_is_a_400(compute, clients, body, reason) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    for route in (layers.FORWARD, layers.PREDICT):
        refused(post(clients["bank"], compute, route, body), 400, reason)
    trains(p, 1)


# --- weights and optimizer state (relay, SplitFed) -----------------------------------------------------------


def _weights_body(tensors: dict[str, torch.Tensor], state: object) -> bytes:
    return encode(tensors, session="t1", step=0, state=json.dumps(state))


def _tampered(p: LayerPeer, attack: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    weights, state = p.weights(optimizer=True)
    weights, state = dict(weights), json.loads(json.dumps(state))
    groups = state["optimizer"]["param_groups"]
    if attack == "extra-name":
        weights["junk.0"] = torch.zeros(3)
    elif attack == "missing-name":
        del weights["model.0.bias"]
    elif attack == "wrong-shape":
        weights["model.0.weight"] = torch.zeros(8, 6)
    elif attack == "float64":
        weights["model.0.weight"] = weights["model.0.weight"].double()
    elif attack == "nan":
        weights["model.0.weight"] = torch.full_like(weights["model.0.weight"], float("nan"))
    elif attack == "lr":
        groups[0]["lr"] = 1e6
    elif attack == "maximize":
        groups[0]["maximize"] = True
    elif attack == "amsgrad":
        groups[0]["amsgrad"] = True
    elif attack == "swapped-params":
        groups[0]["params"] = [1, 0, 2, 3]
    elif attack == "scalar-moment":
        weights["optim.0.exp_avg"] = torch.tensor(1.0)
    elif attack == "missing-moment":
        del weights["optim.1.exp_avg_sq"]
    elif attack == "unknown-state":
        weights["optim.0.momentum_buffer"] = torch.zeros_like(weights["model.0.weight"])
    elif attack == "negative-second-moment":
        weights["optim.0.exp_avg_sq"] = -torch.ones_like(weights["optim.0.exp_avg_sq"])
    elif attack == "zero-step":
        weights["optim.2.step"] = torch.tensor(0.0)
    elif attack == "fractional-step":
        weights["optim.2.step"] = torch.tensor(1.5)
    elif attack == "other-param-index":
        weights["optim.7.exp_avg"] = torch.zeros(3)
    elif attack == "junk-scalars":
        state["optimizer"]["scalars"] = {"0": {"step": "soon", "exp_avg": [1, 2]}}
    elif attack == "groups-not-list":
        state["optimizer"]["param_groups"] = "all"
    elif attack == "no-optimizer-meta":
        del state["optimizer"]
    elif attack == "state-not-object":
        state = ["optimizer"]  # type: ignore[assignment]
    return weights, state


WEIGHT_ATTACKS = {
    "extra-name": "the weights name tensors this session does not hold: ['junk.0']",
    "missing-name": "the weights must name exactly",
    "wrong-shape": "weight 'model.0.weight' must be finite float32 of shape (8, 5)",
    "float64": "weights must be finite float32",
    "nan": "weights must be finite float32",
    "lr": "the optimizer's hyper-parameters are this session's own",
    "maximize": "the optimizer's hyper-parameters are this session's own",
    "amsgrad": "the optimizer's hyper-parameters are this session's own",
    "swapped-params": "the optimizer's hyper-parameters are this session's own",
    "scalar-moment": "optimizer state '0.exp_avg' does not fit this model",
    "missing-moment": "optimizer state for parameter 1 must be all of ['exp_avg', 'exp_avg_sq', 'step'] or none",
    "unknown-state": "optimizer state '0.momentum_buffer' does not fit this model",
    "negative-second-moment": "optimizer state '0.exp_avg_sq' does not fit this model",
    "zero-step": "optimizer state '2.step' does not fit this model",
    "fractional-step": "optimizer state '2.step' does not fit this model",
    "other-param-index": "optimizer state '7.exp_avg' does not fit this model",
    "junk-scalars": "the optimizer state holds values that are not tensors",
    "groups-not-list": "the optimizer's hyper-parameters are this session's own",
    "no-optimizer-meta": "the optimizer state comes without its description",
    "state-not-object": "the weights' state is not a JSON object",
}


@pytest.mark.parametrize("attack", list(WEIGHT_ATTACKS))
def test_weights_a_branch_does_not_hold_are_refused_and_change_nothing(branch, clients, encoder, attack) -> None:
    p = peer(branch, clients["bank"], name="branch-1", role="partner")
    p.start(bottom(encoder, "t1"))
    trains(p, 1)
    before = p.weights(optimizer=True)
    weights, state = _tampered(p, attack)
    refused(post(clients["bank"], branch, layers.WEIGHTS, _weights_body(weights, state), method="PUT"), 400,
            WEIGHT_ATTACKS[attack])
    after = p.weights(optimizer=True)
    assert after[1] == before[1] and all(torch.equal(after[0][k], v) for k, v in before[0].items())
    trains(p, 2)


def test_honest_weights_with_their_optimizer_still_move_between_sessions(branch, clients, encoder) -> None:
    a = peer(branch, clients["bank"], name="branch-1", role="partner")
    b = peer(branch, clients["bank"], name="branch-1", role="partner")
    a.start(bottom(encoder, "relay-a"))
    b.start(bottom(encoder, "relay-b", seed=3))
    for step in (1, 2):
        trains(a, step)
    b.load_weights(*a.weights(optimizer=True))
    trains(a, 3)
    trains(b, 1)
    wa, wb = a.weights(optimizer=True), b.weights(optimizer=True)
    assert all(torch.equal(wa[0][k], wb[0][k]) for k in wa[0])  # the same state, the same update
    b.load_weights(*a.weights(optimizer=False))  # SplitFed: the averaged model, no optimizer state


# --- checkpoints and restores ---------------------------------------------------------------------------------


def test_a_restore_of_a_step_never_written_is_a_clear_refusal(compute, clients) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    trains(p, 1)
    p.checkpoint(1)
    for step in (2, 10**30):
        with pytest.raises(OutOfOrder, match=f"HTTP 409.*this session has no checkpoint of step {step}$"):
            p.restore(step)
    response = clients["bank"].post(compute.url + "/layers/sessions/t1/restore/-1")
    refused(response, 409, "this session has no checkpoint of step -1")
    for bad in ("..%2F..%2Fcompute", "..", "t1%2F..%2F..%2Fx"):
        response = clients["bank"].post(f"{compute.url}/layers/sessions/{bad}/restore/1")
        assert response.status_code == 404, response.text
    p.restore(1)
    trains(p, 2)


@pytest.mark.parametrize("change", [{"hidden": (16,)}, {"kind": "server", "out_width": 1},
                                    {"optimizer": OptimizerConfig(optimizer="sgd")},
                                    {"optimizer": OptimizerConfig(learning_rate=0.5)}],
                         ids=["other-width", "other-kind", "other-optimizer", "other-lr"])
def test_resuming_into_another_model_is_refused(compute, clients, change) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    trains(p, 1)
    p.checkpoint(1)
    other = trunk().model_copy(update={"resume_step": 1, **change})
    refused(_start_json(compute, clients["bank"], other.model_dump(mode="json")), 409,
            "the checkpoint of step 1 was written by another model")
    assert p.start(trunk(resume_step=1)).step == 1
    trains(p, 2)


def test_a_checkpoint_is_of_the_last_step_only(compute, clients) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    for step in (-1, 1, 2):
        with pytest.raises(OutOfOrder, match=r"a checkpoint is of the last step applied \(0\)"):
            p.checkpoint(step)
    p.forward(1, x())
    with pytest.raises(OutOfOrder, match="while step 1 awaits its gradient"):
        p.checkpoint(0)


# --- replay cache ---------------------------------------------------------------------------------------------


def test_the_replay_cache_answers_retries_only(compute, clients) -> None:
    p = peer(compute, clients["bank"])
    p.start(trunk())
    with pytest.raises(OutOfOrder, match="no forward of step 1 awaits its gradient"):
        p.backward(1, torch.ones(5, 3))
    with pytest.raises(OutOfOrder, match="step 2 is out of order: the next step is 1"):
        p.forward(2, x())
    out = p.forward(1, x())
    assert torch.equal(p.forward(1, x()), out)  # a retry: the same answer
    with pytest.raises(OutOfOrder, match="step 1 was already forwarded with other inputs"):
        p.forward(1, x(seed=1))
    grad = p.backward(1, torch.ones(5, 3))
    weights = p.predict(x(seed=9))
    # A forward of step 1 after its backward, and the backward again: retries, answered from the cache.
    assert torch.equal(p.forward(1, x()), out)
    assert grad is not None and torch.equal(p.backward(1, torch.ones(5, 3)), grad)
    with pytest.raises(OutOfOrder, match="step 1 was already backwarded with other inputs"):
        p.backward(1, torch.full((5, 3), 2.0))
    with pytest.raises(OutOfOrder, match="no forward of step 2 awaits its gradient"):
        p.backward(2, torch.ones(5, 3))
    assert torch.equal(p.predict(x(seed=9)), weights)  # no retry applied an update twice
    with pytest.raises(OutOfOrder, match="a trunk session trains with forward and backward"):
        p.train(2, x(), torch.ones(5))
    v = peer(compute, clients["bank"])
    v.start(server_start())
    with pytest.raises(OutOfOrder, match="a server session trains with `train`"):
        v.forward(1, x())


# --- statistics of a branch's rows ------------------------------------------------------------------------------


def test_statistics_of_too_few_rows_are_refused(branch, clients, table) -> None:
    p = peer(branch, clients["bank"], name="branch-1", role="partner")
    for positions in ([7], list(range(49)), [7] * 60, list(range(40)) + [7] * 10):
        with pytest.raises(PeerError, match="HTTP 400.*at least 50 distinct rows"):
            p.stats(positions)
    with pytest.raises(PeerError, match="HTTP 400.*positions name a row more than once"):
        p.stats(list(range(60)) + [7])
    for positions in ([-1] + list(range(60)), list(range(60)) + [ROWS]):
        with pytest.raises(PeerError, match=rf"HTTP 400.*positions must be a non-empty list in \[0, {ROWS}\)"):
            p.stats(positions)
    reply = p.stats(list(range(50)))
    assert reply.rows == 50 and reply.numeric["age"][0] == 50
    assert sum(table.features["age"].iloc[:50]) == reply.numeric["age"][1]


# === a dishonest compute party or branch against the bank's LayerPeer ======================================


def _fake(routes: Callable[[FastAPI], None]) -> FastAPI:
    app = FastAPI()
    routes(app)
    return app


def _info(start: dict[str, Any], **lie: Any) -> dict[str, Any]:
    parameters = 4 * 8 + 8 + 8 * start["out_width"] + start["out_width"]
    return {"session": start["session"], "kind": start["kind"], "in_width": start["in_width"],
            "out_width": start["out_width"], "parameters": parameters, "step": 0, **lie}


def _answering(start_lie: dict[str, Any] | None = None, **answers: Callable[[Request], Any]) -> FastAPI:
    def routes(app: FastAPI) -> None:
        @app.post(layers.SESSIONS)
        async def start(request: Request) -> dict[str, Any]:
            return _info(await request.json(), **(start_lie or {}))

        for route, answer in (("forward", answers.get("forward")), ("backward", answers.get("backward")),
                              ("train", answers.get("train")), ("predict", answers.get("predict"))):
            if answer is not None:
                app.post(f"/layers/sessions/{{session_id}}/{route}")(answer)
        if "weights" in answers:
            app.get(layers.WEIGHTS)(answers["weights"])
        if "stats" in answers:
            app.post(layers.STATS)(answers["stats"])

    return _fake(routes)


def _tensor_answer(tensors: dict[str, torch.Tensor], **meta: Any) -> Callable[[Request], Any]:
    async def answer(request: Request) -> Response:
        meta.setdefault("step", 1)
        return Response(encode(tensors, session="t1", **meta), media_type=SAFETENSORS)

    return answer


@pytest.fixture()
def fake_peer(pki: Path) -> Iterator[Callable[..., LayerPeer]]:
    servers: list[ServerThread] = []
    client = make_client(TLSFiles.from_dir(pki, "bank"), timeout=30)

    def serve(app: FastAPI, cert: str = "compute", *, name: str = "compute", role: str = "compute",
              files: TLSFiles | None = None) -> LayerPeer:
        server = ServerThread(app, files or TLSFiles.from_dir(pki, cert)).start()
        servers.append(server)
        return LayerPeer(name, server.url, client, role, retry_deadline=1.0)

    yield serve
    client.close()  # first: a connection kept alive holds a server's stop for its graceful timeout
    for s in servers:
        s.stop()


@pytest.mark.parametrize(("answers", "call", "refusal"), [
    ({"forward": _tensor_answer({"output": torch.zeros(5, 4)})}, "forward",
     r"the output of step 1 of shape \(5, 4\); expected \(5, 3\)"),
    ({"forward": _tensor_answer({"output": torch.zeros(6, 3)})}, "forward", r"of shape \(6, 3\); expected \(5, 3\)"),
    ({"forward": _tensor_answer({"output": torch.full((5, 3), float("nan"))})}, "forward",
     "tensor 'output' holds NaN or infinite values"),
    ({"forward": _tensor_answer({"output": torch.zeros(5, 3, dtype=torch.float64)})}, "forward",
     "tensor 'output' is torch.float64"),
    ({"forward": _tensor_answer({})}, "forward", r"the output of step 1 of shape None"),
    ({"forward": _tensor_answer({"output": torch.zeros(5, 3)}, step=7)}, "forward",
     "answered step 7 of session 't1' to step 1 of session 't1'"),
    ({"backward": _tensor_answer({"grad": torch.zeros(5, 5)})}, "backward",
     r"the input gradient of step 1 of shape \(5, 5\); expected \(5, 4\)"),
    ({"train": _tensor_answer({"grad": torch.zeros(5, 4)}, loss="nan")}, "train", "sent no finite loss for step 1"),
    ({"train": _tensor_answer({"grad": torch.zeros(5, 4)}, loss="inf")}, "train", "sent no finite loss for step 1"),
    ({"train": _tensor_answer({"grad": torch.zeros(5, 4)})}, "train", "sent no finite loss for step 1"),
    ({"predict": _tensor_answer({"output": torch.zeros(4, 3)}, step=0)}, "predict",
     r"a prediction of shape \(4, 3\); expected \(5, 3\)"),
], ids=["wrong-width", "wrong-rows", "nan", "float64", "missing", "other-step", "trunk-grad", "nan-loss",
        "inf-loss", "no-loss", "predict-rows"])
def test_the_bank_refuses_a_wrong_answer(fake_peer, answers, call, refusal) -> None:
    p = fake_peer(_answering(**answers))
    p.start(server_start("t1") if call == "train" else trunk("t1"))
    act = {"forward": lambda: p.forward(1, x()), "backward": lambda: p.backward(1, torch.ones(5, 3)),
           "train": lambda: p.train(1, x(), torch.ones(5)), "predict": lambda: p.predict(x())}[call]
    with pytest.raises(PeerError, match=refusal):
        act()


@pytest.mark.parametrize(("lie", "refusal"), [
    ({"kind": "server"}, "started server session 't1' with"),
    ({"out_width": 4}, "out_width 4, 67 parameters"),
    ({"in_width": 5}, "with in_width 5, out_width 3"),
    ({"parameters": 10**9}, "out_width 3, 1000000000 parameters, at step 0; the bank asked for trunk session 't1' "
                            "with in_width 4, out_width 3, 67 parameters, at step 0"),
    ({"step": 9}, "at step 9;"),
    ({"session": "other"}, "started trunk session 'other'"),
    ({"in_width": "wide"}, "sent an unusable answer"),
], ids=["kind", "out-width", "in-width", "parameters", "step", "session", "junk"])
def test_the_bank_refuses_a_layer_info_that_lies(fake_peer, lie, refusal) -> None:
    p = fake_peer(_answering(lie))
    with pytest.raises(PeerError, match=refusal):
        p.start(trunk("t1"))
    assert p.info is None


@pytest.mark.parametrize(("cert", "name", "role", "error", "refusal"), [
    ("compute2", "compute", "compute", PeerError, "its certificate names compute 'compute2'"),
    ("branch-1", "compute", "compute", PeerError, "its certificate names partner 'branch-1'"),
    ("compute", "branch-1", "partner", PeerError, "its certificate names compute 'compute'"),
    ("rogue", "compute", "compute", PeerUntrusted, "not from this partnership's CA"),
], ids=["other-name", "other-role", "compute-as-branch", "rogue-ca"])
def test_the_bank_talks_only_to_the_party_it_meant(fake_peer, rogue_pki, cert, name, role, error, refusal) -> None:
    files = TLSFiles.from_dir(rogue_pki, "compute") if cert == "rogue" else None
    p = fake_peer(_answering(), cert if cert != "rogue" else "compute", name=name, role=role, files=files)
    with pytest.raises(error, match=refusal):
        p.start(trunk("t1"))


def _flood(size: int, status: int = 200, declare: bool = True) -> Callable[[Request], Any]:
    async def answer(request: Request) -> Response:
        chunk = b"x" * (1 << 20)

        async def body() -> Any:
            for _ in range(size // len(chunk)):
                yield chunk

        headers = {"content-length": str(size)} if declare else {}
        return StreamingResponse(body(), status_code=status, headers=headers, media_type=SAFETENSORS)

    return answer


@pytest.mark.parametrize(("declare", "status"), [(True, 200), (False, 200), (True, 400), (False, 500)],
                         ids=["declared", "chunked", "declared-error", "chunked-error"])
def test_the_bank_reads_no_more_than_an_answer_can_hold(fake_peer, declare, status) -> None:
    p = fake_peer(_answering(forward=_flood(64 << 20, status, declare)))
    p.start(trunk("t1"))
    with pytest.raises(PeerError, match="more than"):
        p.forward(1, x())
    assert p.bytes_received < 4 << 20


def test_the_bank_reads_no_more_weights_than_it_allows(fake_peer, monkeypatch) -> None:
    monkeypatch.setattr(layer_peer, "WEIGHTS_LIMIT", 2 << 20)
    p = fake_peer(_answering(weights=_flood(64 << 20, declare=False)), "branch-1", name="branch-1", role="partner")
    p.start(trunk("t1"))
    with pytest.raises(PeerError, match="more than 2097152 bytes"):
        p.weights(optimizer=True)
    assert p.bytes_received < 4 << 20


def test_a_huge_error_body_is_cut_to_a_reason(fake_peer) -> None:
    async def refuse(request: Request) -> Response:
        return Response(json.dumps({"error": "OutOfOrder", "detail": "y" * (8 << 20)}), status_code=409)

    p = fake_peer(_answering(forward=refuse))
    p.start(trunk("t1"))
    with pytest.raises(PeerError) as caught:
        p.forward(1, x())
    assert len(str(caught.value)) < 1 << 17 and p.bytes_received < 1 << 20


def _weights_answer(tensors: dict[str, torch.Tensor], state: object = None) -> Callable[[Request], Any]:
    async def answer(request: Request) -> Response:
        return Response(encode(tensors, session="t1", step=0, state=json.dumps(state if state is not None else {})),
                        media_type=SAFETENSORS)

    return answer


_GOOD = {"model.0.weight": torch.zeros(8, 4), "model.0.bias": torch.zeros(8),
         "model.2.weight": torch.zeros(3, 8), "model.2.bias": torch.zeros(3)}


@pytest.mark.parametrize(("tensors", "state", "refusal"), [
    ({**_GOOD, "model.0.weight": torch.zeros(8, 5)}, None, r"'model.0.weight' of shape \(8, 5\); expected \(8, 4\)"),
    ({k: v for k, v in _GOOD.items() if k != "model.2.bias"}, None, "weights named"),
    ({**_GOOD, "model.4.weight": torch.zeros(1)}, None, "weights named"),
    ({**_GOOD, "optim.9.exp_avg": torch.zeros(1)}, None, "optimizer state 'optim.9.exp_avg'"),
    (_GOOD, [1, 2], "weights without their state"),
    ({**_GOOD, "model.0.bias": torch.full((8,), float("nan"))}, None, "not finite float32"),
], ids=["wrong-shape", "missing", "extra", "optim-index", "state-list", "nan"])
def test_the_bank_refuses_weights_it_did_not_ask_for(fake_peer, tensors, state, refusal) -> None:
    p = fake_peer(_answering(weights=_weights_answer(tensors, state)), "branch-1", name="branch-1", role="partner")
    p.start(trunk("t1"))
    with pytest.raises(PeerError, match=refusal):
        p.weights(optimizer=True)


def test_honest_weights_pass_the_banks_checks(fake_peer) -> None:
    p = fake_peer(_answering(weights=_weights_answer(_GOOD)), "branch-1", name="branch-1", role="partner")
    p.start(trunk("t1"))
    tensors, state = p.weights(optimizer=False)
    assert set(tensors) == set(_GOOD) and state == {}


def _stats_answer(reply: dict[str, Any]) -> Callable[[Request], Any]:
    async def answer(request: Request) -> Response:
        return Response(json.dumps(reply), media_type="application/json")

    return answer


@pytest.mark.parametrize(("reply", "refusal"), [
    ({"rows": 49, "numeric": {"age": [49, 1.0, 1.0]}, "categorical": {}}, "statistics of 49 rows; 50 were asked"),
    ({"rows": 50, "numeric": {"age": [51, 1.0, 1.0]}, "categorical": {}}, "column 'age'"),
    ({"rows": 50, "numeric": {"age": [50, float("nan"), 1.0]}, "categorical": {}}, "column 'age'"),
    ({"rows": 50, "numeric": {"age": [50, 1e308 * 10, 1.0]}, "categorical": {}}, "column 'age'"),
    ({"rows": 50, "numeric": {"age": [50, 1.0, -1.0]}, "categorical": {}}, "column 'age'"),
    ({"rows": 50, "numeric": {"age": [50, 100.0, 1.0]}, "categorical": {}}, "column 'age'"),
    ({"rows": 50, "numeric": {}, "categorical": {"job": [str(i) for i in range(51)]}}, "column 'job'"),
], ids=["rows", "count", "nan", "inf", "negative-squares", "impossible-variance", "more-values-than-rows"])
def test_the_bank_refuses_statistics_that_cannot_be_true(fake_peer, reply, refusal) -> None:
    p = fake_peer(_answering(stats=_stats_answer(reply)), "branch-1", name="branch-1", role="partner")
    with pytest.raises(PeerError, match=refusal):
        p.stats(list(range(50)))


def test_a_peer_that_trickles_its_answer_is_cut_off(fake_peer) -> None:
    async def trickle(request: Request) -> Response:
        async def body() -> Any:
            for _ in range(100):
                yield b"x"
                import asyncio

                await asyncio.sleep(0.1)

        return StreamingResponse(body(), media_type=SAFETENSORS)

    p = fake_peer(_answering(forward=trickle))
    p.answer_deadline = 1.0
    p.start(trunk("t1"))
    began = time.monotonic()
    with pytest.raises(PeerError, match="did not finish its answer"):
        p.forward(1, x())
    assert time.monotonic() - began < 5


def test_the_services_run_a_whole_honest_exchange(compute, branch, clients, encoder, table) -> None:
    """The defences refuse attacks, not the protocol: U-shaped, vanilla and a branch's bottom, end to end."""
    t, v = peer(compute, clients["bank"]), peer(compute, clients["bank"])
    b = peer(branch, clients["bank"], name="branch-1", role="partner")
    assert t.start(trunk("honest-trunk")).parameters == 4 * 8 + 8 + 8 * 3 + 3
    v.start(server_start("honest-server"))
    info = b.start(bottom(encoder, "honest-bottom"))
    assert info.rows == ROWS and info.ids_sha256 == layers.ids_sha256(table.ids)
    for step in (1, 2, 3):
        trains(t, step)
        v.train(step, x(seed=step), torch.ones(5))
        trains(b, step)
    for p in (t, v, b):
        p.checkpoint(3)
        p.restore(3)
    assert b.predict(torch.arange(ROWS, dtype=torch.int64), batch=128).shape == (ROWS, 4)
    for p in (t, v, b):
        p.end()
    assert not compute.app.state.host.sessions and not branch.app.state.host.sessions
