"""End to end: bank and partner services on 127.0.0.1 with real mutual TLS, aligning by PSI."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pandas as pd
import pytest

from alignment.parallel import WorkerPool
from bank.service.aligner import align_with_partners
from bank.vertical.http_partner import HttpPartner
from bank.service.operator import BankOperator, JobFailed
from data.prepare import prepare_bank_marketing
from parties.errors import PeerError
from parties.tables.table import load_party_table
from parties.transport.client import make_client
from parties.transport.tls import PeerIdentity, TLSFiles


@pytest.fixture()
def partition(bank_full: Path, tmp_path: Path) -> dict[str, Path]:
    return prepare_bank_marketing(tmp_path / "data", n_partners=2, rows=3000, cache=bank_full.parent, download=False)


def ids(path: Path) -> list[str]:
    return pd.read_csv(path, dtype=str)["customer_id"].tolist()


def aligned_ids(server, path: Path) -> list[str]:
    """The IDs a service aligned, in its order: the bank's own alignment, or a partner's with the bank."""
    core = server.app.state.core
    alignment = core.alignment if server.app.state.settings.role == "bank" else core.alignment_of("bank")
    assert alignment is not None
    all_ids = ids(path)
    return [all_ids[i] for i in alignment.rows]


def operator(pki: Path, url: str, name: str = "bank") -> BankOperator:
    return BankOperator(url, TLSFiles.from_dir(pki, name), name)


def test_alignment_over_mutual_tls_matches_the_ground_truth(pki, partition, start_partner, start_bank) -> None:
    partner = start_partner(partition["partner1"], name="partner")
    bank = start_bank(partition["bank"], {"partner": partner.url})
    with operator(pki, bank.url) as op:
        result = op.wait(op.start_alignment())
    truth = set(ids(partition["bank"])) & set(ids(partition["partner1"]))
    assert result["rows"] == len(truth) > 2000
    bank_side, partner_side = aligned_ids(bank, partition["bank"]), aligned_ids(partner, partition["partner1"])
    assert set(bank_side) == truth
    assert bank_side == partner_side
    assert bank.app.state.core.alignment.alignment_id == partner.app.state.core.alignment_of("bank").alignment_id


def test_two_partners_share_one_order_over_the_three_way_intersection(pki, partition, start_partner, start_bank) -> None:
    p1 = start_partner(partition["partner1"], name="partner")
    p2 = start_partner(partition["partner2"], name="partner2")
    bank = start_bank(partition["bank"], {"partner": p1.url, "partner2": p2.url})
    with operator(pki, bank.url) as op:
        result = op.wait(op.start_alignment())
    truth = set(ids(partition["bank"])) & set(ids(partition["partner1"])) & set(ids(partition["partner2"]))
    b = aligned_ids(bank, partition["bank"])
    assert set(b) == truth and result["rows"] == len(truth)
    assert b == aligned_ids(p1, partition["partner1"]) == aligned_ids(p2, partition["partner2"])
    assert result["pairwise"]["partner"] >= len(truth) and result["pairwise"]["partner2"] >= len(truth)


def _client(files: TLSFiles | None, ca: Path) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(ca))
    if files is not None:
        ctx.load_cert_chain(str(files.cert), str(files.key))
    return httpx.Client(verify=ctx, timeout=10)


@pytest.mark.parametrize("who", ["foreign-ca", "no-certificate"])
def test_the_handshake_refuses_strangers(pki, rogue_pki, partition, start_partner, who) -> None:
    partner = start_partner(partition["partner1"])
    files = TLSFiles.from_dir(rogue_pki, "bank") if who == "foreign-ca" else None
    with _client(files, pki / "ca.pem") as client, pytest.raises(httpx.TransportError):
        client.get(f"{partner.url}/health")
    with _client(TLSFiles.from_dir(pki, "bank"), pki / "ca.pem") as client:  # the real bank gets in
        assert client.get(f"{partner.url}/health").status_code == 200


def _certificate(pki: Path, out: Path, subject: list[tuple[str, str]]) -> TLSFiles:
    """A certificate from the partnership's own CA with the subject given (``[("CN", "bank"), ("OU", ...)]``)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    oids = {"CN": NameOID.COMMON_NAME, "OU": NameOID.ORGANIZATIONAL_UNIT_NAME}
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(oids[k], v) for k, v in subject]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    out.mkdir(parents=True, exist_ok=True)
    (out / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return TLSFiles(ca=pki / "ca.pem", cert=out / "cert.pem", key=out / "key.pem")


@pytest.mark.parametrize("subject", [
    [("CN", "bank"), ("OU", "partner"), ("OU", "bank")],  # the attack: the last OU used to win
    [("CN", "bank"), ("OU", "bank"), ("OU", "partner")],
    [("CN", "bank"), ("CN", "bank2"), ("OU", "bank")],
    [("CN", "bank")],
    [("CN", "bank"), ("OU", "auditor")],
], ids=["OU-partner-then-bank", "OU-bank-then-partner", "two-CNs", "no-OU", "unknown-OU"])
def test_a_certificate_must_name_exactly_one_party_and_one_known_role(
        pki, partition, start_partner, tmp_path, caplog, subject) -> None:
    """From the partnership's own CA, yet ambiguous or unknown: refused at the connection, before any request."""
    partner = start_partner(partition["partner1"])
    files = _certificate(pki, tmp_path / "odd", subject)
    with caplog.at_level("WARNING"), _client(files, pki / "ca.pem") as client, pytest.raises(httpx.TransportError):
        client.post(f"{partner.url}/psi/sessions", json={})
    assert "refused: its certificate must name exactly one Cutlayer party (CN) and one role" in caplog.text
    good = _certificate(pki, tmp_path / "good", [("OU", "bank"), ("CN", "bank")])
    with _client(good, pki / "ca.pem") as client:  # the same CA, one CN and one OU: in
        assert client.get(f"{partner.url}/health").status_code == 200


def test_the_client_refuses_a_server_from_another_ca(pki, rogue_pki, partition, start_partner) -> None:
    partner = start_partner(partition["partner1"])
    with _client(TLSFiles.from_dir(pki, "bank"), rogue_pki / "ca.pem") as client, pytest.raises(httpx.ConnectError):
        client.get(f"{partner.url}/health")


@pytest.mark.parametrize(
    ("target", "caller", "method", "path"),
    [
        ("bank", "partner", "POST", "/alignments"),
        ("bank", "bank2", "POST", "/alignments"),  # another bank is not this bank's operator
        ("bank", "partner", "GET", "/jobs/x"),
        ("partner", "partner2", "POST", "/psi/sessions"),  # a partner cannot run PSI with a partner
        ("partner", "bank", "GET", "/admin/alignments"),  # the bank cannot use the partner's operator endpoints
    ],
    ids=["partner-on-bank", "other-bank-on-bank", "partner-reads-jobs", "partner-on-psi", "bank-on-partner-admin"],
)
def test_endpoints_check_the_callers_role(pki, partition, start_partner, start_bank, target, caller, method, path) -> None:
    partner = start_partner(partition["partner1"])
    bank = start_bank(partition["bank"], {"partner": partner.url})
    url = (bank if target == "bank" else partner).url
    with make_client(TLSFiles.from_dir(pki, caller)) as client:
        response = client.request(method, f"{url}{path}", json={"count": 1, "chunk_items": 1})
    assert response.status_code == 403
    assert response.json()["error"] == "Forbidden"


def test_the_bank_checks_whom_it_reached(pki, partition, start_partner, start_bank) -> None:
    partner = start_partner(partition["partner1"], name="partner")
    bank = start_bank(partition["bank"], {"partner2": partner.url})  # wrong name for that address
    with operator(pki, bank.url) as op, pytest.raises(JobFailed, match="certificate names partner 'partner'"):
        op.wait(op.start_alignment())
    assert bank.app.state.core.alignment is None


class Recorder:
    """Keeps every body that crosses between the bank and the partner: each request (an httpx hook) and each
    answer as the bank's client read it off the wire (``PeerLink.once``; a hook must not read an answer first)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def request(self, request: httpx.Request) -> None:
        self.bodies.append(request.content)

    def partner(self, name: str, url: str, client: httpx.Client) -> HttpPartner:
        bodies = self.bodies

        class Recorded(HttpPartner):
            def once(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                content = super().once(*args, **kwargs)
                bodies.append(content)
                return content

        return Recorded(name, url, client)


def test_only_blinded_values_cross_the_wire(pki, partition, start_partner) -> None:
    from alignment import curve

    partner = start_partner(partition["partner1"])
    table = load_party_table(partition["bank"], "customer_id", "y")
    recorder = Recorder()
    client = make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank"))
    client.event_hooks = {"request": [recorder.request]}
    with client, WorkerPool(1) as pool:
        alignment, _ = align_with_partners(table, {"partner": recorder.partner("partner", partner.url, client)}, pool)
    wire = b"".join(recorder.bodies)
    partner_ids = ids(partition["partner1"])
    hashed = curve.hash_to_curve([curve.normalize_id(i) for i in table.ids[:300]])
    for raw in list(table.ids[:300]) + partner_ids[:300]:
        assert raw.encode() not in wire
    for k in range(300):
        assert hashed[32 * k : 32 * k + 8] not in wire
    per_id = len(wire) / (len(table) + len(partner_ids))
    # 32 + 12 bytes per bank ID, 32 per partner ID, 4 per committed row, and a few JSON messages.
    expected = (44 * len(table) + 32 * len(partner_ids) + 4 * len(alignment)) / (len(table) + len(partner_ids))
    assert expected <= per_id < expected + 0.5
    assert len(alignment) > 0


def test_an_empty_intersection_is_a_clear_error_and_keeps_nothing(pki, write_csv, start_partner, start_bank) -> None:
    partner = start_partner(write_csv("p.csv", customer_id=["a", "b"], x=["1", "2"]))
    bank = start_bank(write_csv("b.csv", customer_id=["c", "d"], z=["1", "2"], y=["no", "yes"]), {"partner": partner.url})
    with operator(pki, bank.url) as op, pytest.raises(JobFailed, match="intersection with partner 'partner' is empty"):
        op.wait(op.start_alignment())
    assert bank.app.state.core.alignment is None
    assert partner.app.state.core.alignment_of("bank") is None
    assert partner.app.state.core.banks["bank"].psi == {}  # the bank aborted the session


@pytest.mark.parametrize("where", ["bank", "partner"])
def test_an_intersection_under_the_minimum_is_refused(pki, write_csv, start_partner, start_bank, where) -> None:
    common = [f"id{i}" for i in range(5)]
    limits = {"bank": {}, "partner": {}}
    limits[where] = {"min_intersection": 10}
    partner = start_partner(write_csv("p.csv", customer_id=common + ["p"], x=list("123456")), **limits["partner"])
    bank = start_bank(
        write_csv("b.csv", customer_id=common + ["b"], z=list("123456"), y=["no", "yes"] * 3),
        {"partner": partner.url}, **limits["bank"],
    )
    with operator(pki, bank.url) as op, pytest.raises(JobFailed, match="5 customers, under the minimum of 10"):
        op.wait(op.start_alignment())
    assert bank.app.state.core.alignment is None
    assert partner.app.state.core.alignment_of("bank") is None


def test_a_partner_dropping_mid_protocol_leaves_no_alignment(pki, partition, start_partner) -> None:
    partner = start_partner(partition["partner1"])
    table = load_party_table(partition["bank"], "customer_id", "y")

    def drop_after_first_upload(response: httpx.Response) -> None:
        if response.request.method == "PUT":
            partner.stop()

    client = make_client(TLSFiles.from_dir(pki, "bank"), caller=PeerIdentity("bank", "bank"))
    client.event_hooks = {"response": [drop_after_first_upload]}
    with client, WorkerPool(1) as pool, pytest.raises(PeerError, match="did not answer"):
        align_with_partners(
            table, {"partner": HttpPartner("partner", partner.url, client)}, pool, cache_dir=None
        )
    assert partner.app.state.core.alignment_of("bank") is None


def test_invalid_psi_messages_get_4xx_with_a_reason(pki, partition, start_partner) -> None:
    partner = start_partner(partition["partner1"], max_body_bytes=4096)
    with make_client(TLSFiles.from_dir(pki, "bank")) as client:
        opened = client.post(f"{partner.url}/psi/sessions", json={"count": 3, "chunk_items": 2}).json()
        base = f"{partner.url}/psi/sessions/{opened['session']}"
        cases = [
            (client.put(f"{base}/blinded/0", content=b"x" * 63), 400, "expected 64"),
            (client.put(f"{base}/blinded/1", content=b"x" * 64), 409, "expected chunk 0"),
            (client.put(f"{base}/blinded/0", content=b"x" * 5000), 413, "over the limit"),
            (client.put(f"{partner.url}/psi/sessions/nope/blinded/0", content=b"x" * 64), 404, "no PSI session"),
            (client.post(f"{partner.url}/psi/sessions", json={"count": -1, "chunk_items": 2}), 422, "count"),
            (client.post(f"{partner.url}/psi/sessions", json={"count": 1, "chunk_items": 2, "schema_version": 9}), 422, "schema_version"),
            (client.get(f"{base}/reblinded/0"), 409, "not complete"),
        ]
        for response, status, reason in cases:
            assert response.status_code == status, response.text
            assert reason in response.json()["detail"]
        # Low-order points are refused when the partner re-blinds them.
        assert client.put(f"{base}/blinded/0", content=bytes(64)).status_code == 204
        assert client.put(f"{base}/blinded/1", content=bytes(32)).status_code == 204
        refused = client.get(f"{base}/reblinded/0")
        assert refused.status_code == 400 and "low order" in refused.json()["detail"]


def test_insecure_mode_works_but_only_with_a_declared_caller(write_csv, start_partner, start_bank, tmp_path) -> None:
    from bank.service.app import create_app as create_bank_app
    from bank.settings import BankSettings
    from partner.settings import PartnerSettings
    from parties.transport.server import running_server
    from partner.service import create_app as create_partner_app

    p_settings = PartnerSettings(name="partner", data=write_csv("p.csv", customer_id=["a", "b", "c"], x=list("123")), insecure=True, workers=1, state_dir=tmp_path / "p")
    with running_server(create_partner_app(p_settings), None) as partner:
        b_settings = BankSettings(
            name="bank", data=write_csv("b.csv", customer_id=["b", "c", "d"], z=list("123"), y=list("011")),
            insecure=True, partners={"partner": partner.url}, workers=1, state_dir=tmp_path / "b",
        )
        with running_server(create_bank_app(b_settings), None) as bank:
            with BankOperator(bank.url, None) as op:
                assert op.wait(op.start_alignment())["rows"] == 2
            anonymous = httpx.post(f"{bank.url}/alignments", json={})
            assert anonymous.status_code == 403 and "ROLE:NAME" in anonymous.json()["detail"]
