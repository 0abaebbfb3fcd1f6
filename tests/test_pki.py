"""Provisioning where each organisation keeps its own key (``cutlayer pki``), and the trust a running service
keeps: one CA or two that trust each other with pinned peers, revocation, expiry and rotation without a restart."""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from bank.config import TrainingConfig
from bank.service.operator import BankOperator, JobFailed
from data.prepare import prepare_bank_marketing
from parties.entry import main as cutlayer
from parties.errors import ConfigError
from parties.protocol.common import IDENTITY
from parties.transport import pki
from parties.transport.client import make_client
from parties.transport.tls import TLSFiles, client_ssl_context
from parties.transport.trust import RELOAD_SECONDS


@pytest.fixture()
def partition(bank_full: Path, tmp_path: Path) -> dict[str, Path]:
    return prepare_bank_marketing(tmp_path / "data", n_partners=1, rows=2000, cache=bank_full.parent, download=False)


def run(*argv: str) -> None:
    """The documented command, in this process: ``cutlayer pki ...`` (its logging set-up undone after it, so
    that the test's log capture stays in place)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert cutlayer(["pki", *map(str, argv)]) == 0
    finally:
        root.handlers[:], root.level = handlers, level


def provision(root: Path, cas: dict[str, str]) -> dict[str, TLSFiles]:
    """Each party makes its key and request in its own folder; the CA named for it signs the request.

    ``cas``: party name to CA folder name ('one' for a single CA). The bank's role is bank, the others partner."""
    for ca in set(cas.values()):
        run("ca", "--out", root / ca, "--name", f"{ca} CA")
    files = {}
    for name, ca in cas.items():
        run("request", "--name", name, "--role", "bank" if name == "bank" else "partner", "--out", root / name)
        run("sign", root / name / f"{name}.csr", "--ca", root / ca)
        files[name] = TLSFiles(root / ca / "ca.pem", root / name / f"{name}.pem", root / name / f"{name}.key")
    return files


def tls_values(files: TLSFiles, **more: object) -> dict[str, object]:
    return {"tls_ca": files.ca, "tls_cert": files.cert, "tls_key": files.key, **more}


def train_briefly(url: str, files: TLSFiles, epochs: int = 1, batch_size: int = 128, on_progress=None) -> dict:
    with BankOperator(url, files, "bank") as op:
        op.wait(op.start_alignment())
        config = TrainingConfig(epochs=epochs, batch_size=batch_size, patience=epochs)  # every epoch runs
        return op.wait(op.start_training(config), on_progress=on_progress)


def test_each_party_keeps_its_key_and_one_ca_signs_every_request(tmp_path, partition, start_partner, start_bank):
    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    for f in files.values():
        assert oct(f.key.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["ca.key", "ca.pem"]  # no party's key
    assert b"PRIVATE KEY" not in (tmp_path / "partner" / "partner.csr").read_bytes()

    partner = start_partner(partition["partner"], **tls_values(files["partner"]))
    bank = start_bank(partition["bank"], {"partner": partner.url}, **tls_values(files["bank"]))
    result = train_briefly(bank.url, files["bank"])
    assert result["epochs_run"] == 1 and 0.5 < result["test"]["roc_auc"] <= 1

    with pytest.raises(ConfigError, match="never overwritten"):  # a second request keeps the first key
        pki.make_request(tmp_path / "partner", "partner", "partner")


def two_organisations(root: Path) -> tuple[dict[str, TLSFiles], Path]:
    """The bank's CA signs the bank; the telco's CA signs the partner; each trusts a bundle of both."""
    files = provision(root, {"bank": "bank-ca", "partner": "telco-ca"})
    run("bundle", root / "bank-ca" / "ca.pem", root / "telco-ca" / "ca.pem", "--out", root / "trust.pem")
    return {n: TLSFiles(root / "trust.pem", f.cert, f.key) for n, f in files.items()}, root / "trust.pem"


def test_two_organisations_each_with_its_own_ca_train_with_their_peers_pinned(
        tmp_path, partition, start_partner, start_bank, caplog):
    files, _ = two_organisations(tmp_path)
    partner = start_partner(partition["partner"],
                            **tls_values(files["partner"], tls_pin={"bank": tmp_path / "bank-ca" / "ca.pem"}))
    bank = start_bank(partition["bank"], {"partner": partner.url},
                      **tls_values(files["bank"], tls_pin={"partner": tmp_path / "telco-ca" / "ca.pem"}))
    assert train_briefly(bank.url, files["bank"])["epochs_run"] == 1

    # The telco's CA cannot speak for the bank: a certificate it signs in the bank's name is refused.
    run("request", "--name", "bank", "--role", "bank", "--out", tmp_path / "forged")
    run("sign", tmp_path / "forged" / "bank.csr", "--ca", tmp_path / "telco-ca")
    forged = TLSFiles(tmp_path / "trust.pem", tmp_path / "forged" / "bank.pem", tmp_path / "forged" / "bank.key")
    caplog.set_level(logging.WARNING, logger="parties.transport.edges")
    with make_client(forged, base_url=partner.url) as client, pytest.raises(httpx.HTTPError):
        client.get(IDENTITY)
    assert "the CA 'bank' is pinned to: 'bank-ca CA'" in caplog.text


def test_without_a_pin_a_peer_of_the_other_ca_is_refused_with_the_reason(
        tmp_path, partition, start_partner, start_bank, caplog):
    files, _ = two_organisations(tmp_path)
    partner = start_partner(partition["partner"], **tls_values(files["partner"]))  # the bank is not pinned
    bank = start_bank(partition["bank"], {"partner": partner.url},
                      **tls_values(files["bank"], tls_pin={"partner": tmp_path / "telco-ca" / "ca.pem"}))
    caplog.set_level(logging.WARNING, logger="parties.transport.edges")
    with BankOperator(bank.url, files["bank"], "bank") as op, pytest.raises(JobFailed):
        op.wait(op.start_alignment())
    assert "is not pinned (--tls-pin NAME=CA_FILE), so it must come from: 'telco-ca CA'" in caplog.text


def test_a_revoked_certificate_is_refused_at_its_next_request_even_on_an_open_connection(
        tmp_path, partition, start_partner):
    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    crl = tmp_path / "one" / "crl.pem"
    pki.revoke(tmp_path / "one", _other_certificate(tmp_path))  # a list exists, without the bank in it
    partner = start_partner(partition["partner"], **tls_values(files["partner"], tls_crl=crl))
    with make_client(files["bank"], base_url=partner.url) as client:
        assert client.get(IDENTITY).status_code == 200
        run("revoke", files["bank"].cert, "--ca", tmp_path / "one")
        time.sleep(RELOAD_SECONDS + 0.1)
        refused = client.get(IDENTITY)  # the same kept-alive connection
        assert refused.status_code == 403 and "is revoked" in refused.json()["detail"]
    with make_client(files["bank"], base_url=partner.url) as client, pytest.raises(httpx.HTTPError):
        client.get(IDENTITY)  # a new connection is closed as soon as it is made


def _other_certificate(root: Path) -> Path:
    run("request", "--name", "old", "--role", "partner", "--out", root / "old")
    run("sign", root / "old" / "old.csr", "--ca", root / "one")
    return root / "old" / "old.pem"


def test_an_expired_peer_is_refused_and_so_is_a_service_with_an_expired_certificate(
        tmp_path, partition, start_partner, caplog):
    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    partner = start_partner(partition["partner"], **tls_values(files["partner"]))
    run("request", "--name", "bank", "--role", "bank", "--out", tmp_path / "stale")
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=40)
    pki.sign_request(tmp_path / "one", tmp_path / "stale" / "bank.csr", tmp_path / "stale" / "bank.pem", days=30,
                     not_before=past)
    stale = TLSFiles(files["bank"].ca, tmp_path / "stale" / "bank.pem", tmp_path / "stale" / "bank.key")
    caplog.set_level(logging.WARNING, logger="parties.transport.edges")
    context = ssl.create_default_context(cafile=str(stale.ca))  # presents the expired certificate all the same
    context.load_cert_chain(str(stale.cert), str(stale.key))
    host, port = partner.url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port))) as raw, pytest.raises((ssl.SSLError, OSError)):
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(b"GET /identity HTTP/1.1\r\nhost: x\r\n\r\n")
            if not tls.recv(1024):  # TLS 1.3: the refusal arrives after the handshake, as a closed connection
                raise ConnectionResetError("closed")
    assert "its certificate has expired" in caplog.text
    with pytest.raises(ConfigError, match="expired on"):  # a party's own expired certificate: no start
        start_partner(partition["partner"], name="bank", **tls_values(stale))


def test_a_certificate_renewed_under_a_running_training_is_served_without_a_restart(
        tmp_path, partition, start_partner, start_bank, caplog):
    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    partner = start_partner(partition["partner"], **tls_values(files["partner"]))
    bank = start_bank(partition["bank"], {"partner": partner.url}, **tls_values(files["bank"]))
    old_serial = x509.load_pem_x509_certificate(files["partner"].cert.read_bytes()).serial_number
    renewed = threading.Event()

    def renew(job) -> None:  # at the training's first progress: a new key and certificate, put in place
        if renewed.is_set() or job.kind != "training" or not job.fraction:
            return
        run("request", "--name", "partner", "--role", "partner", "--out", tmp_path / "renewal")
        run("sign", tmp_path / "renewal" / "partner.csr", "--ca", tmp_path / "one")
        for suffix in (".key", ".pem"):  # two renames: between them the pair does not load and is kept waiting
            shutil.copy(tmp_path / "renewal" / f"partner{suffix}", tmp_path / f"next{suffix}")
            os.replace(tmp_path / f"next{suffix}", files["partner"].cert.with_suffix(suffix))
        renewed.set()
        deadline = time.monotonic() + 10  # the training goes on meanwhile; its next step makes the partner look
        while "TLS files reloaded" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)

    caplog.set_level(logging.INFO, logger="parties.transport.trust")
    result = train_briefly(bank.url, files["bank"], epochs=30, batch_size=32, on_progress=renew)
    finished = time.time()
    assert renewed.is_set() and result["epochs_run"] == 30
    reloads = [r for r in caplog.records if "TLS files reloaded" in r.getMessage()]
    assert reloads and reloads[0].created < finished  # while the training ran
    new_serial = _served_serial(partner.url, files["bank"])
    assert new_serial != old_serial
    assert new_serial == x509.load_pem_x509_certificate(files["partner"].cert.read_bytes()).serial_number


def _served_serial(url: str, files: TLSFiles) -> int:
    host, port = url.removeprefix("https://").split(":")
    context = client_ssl_context(files)
    with socket.create_connection((host, int(port))) as raw, context.wrap_socket(raw, server_hostname=host) as tls:
        assert isinstance(tls, ssl.SSLSocket)
        return x509.load_der_x509_certificate(tls.getpeercert(True)).serial_number


# --- what a dishonest counterparty tries ---------------------------------------------------------------------

def _ca(name: str | x509.Name, path_length: int | None, signer=None):
    """A CA certificate and key made by hand (``pki ca`` never makes one without a path length of 0)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = name if isinstance(name, x509.Name) else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = signer or (None, key)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(issuer_cert.subject if issuer_cert else subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .sign(issuer_key, hashes.SHA256()))
    return cert, key


def _pem(*certs) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def test_another_organisations_ca_cannot_take_the_name_of_mine(tmp_path, partition, start_partner, caplog):
    """An intermediate the telco's CA makes under the bank CA's very name, and a CA named like it but for
    case: neither speaks for the bank."""
    from cryptography.hazmat.primitives import serialization

    from parties.transport.trust import Trust

    files = provision(tmp_path, {"bank": "bank-ca", "partner": "bank-ca"})
    telco_ca, telco_key = _ca("Telco root", None)  # no path length: it may make intermediates
    bank_ca = x509.load_pem_x509_certificate((tmp_path / "bank-ca" / "ca.pem").read_bytes())
    impostor, impostor_key = _ca(bank_ca.subject, 0, signer=(telco_ca, telco_key))  # the bank CA's very name
    (tmp_path / "trust.pem").write_bytes(_pem(bank_ca, telco_ca))
    run("request", "--name", "bank", "--role", "bank", "--out", tmp_path / "forged")
    csr = x509.load_pem_x509_csr((tmp_path / "forged" / "bank.csr").read_bytes())
    from cryptography.hazmat.primitives import hashes
    now = dt.datetime.now(dt.timezone.utc)
    leaf = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(impostor.subject)
            .public_key(csr.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=5))
            .add_extension(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, critical=False)
            .sign(impostor_key, hashes.SHA256()))
    (tmp_path / "forged" / "chain.pem").write_bytes(_pem(leaf, impostor))
    partner = start_partner(partition["partner"], **tls_values(files["partner"], tls_ca=tmp_path / "trust.pem"))
    caplog.set_level(logging.WARNING, logger="parties.transport.edges")
    context = ssl.create_default_context(cafile=str(tmp_path / "trust.pem"))
    context.load_cert_chain(str(tmp_path / "forged" / "chain.pem"), str(tmp_path / "forged" / "bank.key"))
    host, port = partner.url.removeprefix("https://").split(":")
    with socket.create_connection((host, int(port))) as raw, pytest.raises((ssl.SSLError, OSError)):
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(b"GET /identity HTTP/1.1\r\nhost: x\r\n\r\n")
            if not tls.recv(1024):
                raise ConnectionResetError("closed")
    assert "refused" in caplog.text
    # Whatever OpenSSL makes of the chain, the party's own check refuses a certificate that only names its CA.
    trust = Trust(TLSFiles(tmp_path / "trust.pem", files["partner"].cert, files["partner"].key))
    identity, problem = trust.check(leaf.public_bytes(serialization.Encoding.DER))
    assert identity is None and "is issued by 'bank-ca CA', not signed by the CA 'bank'" in problem

    lookalike, _ = _ca(x509.Name([x509.NameAttribute(a.oid, str(a.value).upper()) for a in bank_ca.subject]), 0)
    (tmp_path / "lookalike.pem").write_bytes(_pem(bank_ca, lookalike))
    with pytest.raises(ConfigError, match="two CA certificates named"):
        start_partner(partition["partner"], **tls_values(files["partner"], tls_ca=tmp_path / "lookalike.pem"))


def test_the_bank_sends_nothing_to_a_partner_whose_certificate_was_revoked(tmp_path, partition, start_partner):
    from prometheus_client import REGISTRY

    from parties.errors import PeerUntrusted
    from parties.transport.client import StepConnection
    from parties.transport.tls import PeerIdentity

    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    pki.revoke(tmp_path / "one", _other_certificate(tmp_path))
    bank = TLSFiles(files["bank"].ca, files["bank"].cert, files["bank"].key, crl=tmp_path / "one" / "crl.pem")
    partner = start_partner(partition["partner"], **tls_values(files["partner"]))
    served = lambda: REGISTRY.get_sample_value("cutlayer_requests_total", {"route": IDENTITY, "status": "200"}) or 0  # noqa: E731
    steps = StepConnection(partner.url, bank, expect=PeerIdentity("partner", "partner"),
                           caller=PeerIdentity("bank", "bank"))
    with make_client(bank, base_url=partner.url, expect=PeerIdentity("partner", "partner")) as client:
        assert client.get(IDENTITY).status_code == 200
        assert steps.send(IDENTITY, b"", "application/octet-stream")()[0] == 405  # a kept connection
        before = served()
        run("revoke", files["partner"].cert, "--ca", tmp_path / "one")
        time.sleep(RELOAD_SECONDS + 0.1)
        with pytest.raises(PeerUntrusted, match="revoked"):
            steps.send(IDENTITY, b"BLINDED-IDS", "application/octet-stream")
        with pytest.raises(PeerUntrusted, match="revoked"):
            client.get(IDENTITY)  # the kept connection is left; the new one is checked before the request goes
        assert served() == before


def test_the_banks_operator_talks_only_to_the_bank_service(tmp_path, partition, start_partner):
    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    partner = start_partner(partition["partner"], **tls_values(files["partner"]))  # at the URL the operator gave
    with BankOperator(partner.url, files["bank"], "bank") as op, pytest.raises(Exception, match="expected bank 'bank'"):
        op.sessions()


def revoked(trust, cert: x509.Certificate) -> bool:
    trust.refresh()
    return cert.serial_number in trust.policy.revoked.get(cert.issuer, ())


def test_a_revocation_stays_when_its_list_goes_or_an_older_one_comes(tmp_path):
    from parties.transport.trust import Trust

    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    crl = tmp_path / "one" / "crl.pem"
    pki.revoke(tmp_path / "one", _other_certificate(tmp_path))
    older = crl.read_bytes()  # a list from before the partner's revocation
    time.sleep(1.1)  # a list's time has whole seconds
    pki.revoke(tmp_path / "one", files["partner"].cert)
    newer = crl.read_bytes()
    trust = Trust(TLSFiles(files["bank"].ca, files["bank"].cert, files["bank"].key, crl=crl))
    partner = x509.load_pem_x509_certificate(files["partner"].cert.read_bytes())
    assert revoked(trust, partner)
    for change in (crl.unlink, lambda: crl.write_bytes(older)):  # the list gone; an older list in its place
        change()
        time.sleep(RELOAD_SECONDS + 0.1)
        assert revoked(trust, partner)
    crl.write_bytes(newer)
    assert newer != older


def test_the_ca_signs_hosts_only_and_never_over_a_file(tmp_path):
    run("ca", "--out", tmp_path / "ca", "--name", "One CA")
    run("request", "--name", "partner", "--role", "partner", "--out", tmp_path / "p", "--host", "telco.example")
    (tmp_path / "p" / "partner.csr").rename(tmp_path / "ca" / "ca.csr")  # a request named like the CA's file
    issued = pki.sign_request(tmp_path / "ca", tmp_path / "ca" / "ca.csr")
    assert issued.path.name == "partner.pem" and "for telco.example" in pki.describe(issued.certificate)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca" / "ca.pem").read_bytes())
    assert ca.subject != issued.certificate.subject  # the CA's own certificate is where it was
    with pytest.raises(ConfigError, match="never written over"):
        pki.sign_request(tmp_path / "ca", tmp_path / "ca" / "ca.csr")
    run("request", "--name", "wild", "--role", "partner", "--out", tmp_path / "w", "--host", "*.example")
    with pytest.raises(ConfigError, match="no wildcard"):
        pki.sign_request(tmp_path / "ca", tmp_path / "w" / "wild.csr")


def test_a_pin_moved_while_connected_refuses_the_open_connection_at_its_next_request(
        tmp_path, partition, start_partner):
    files, _ = two_organisations(tmp_path)
    pin = tmp_path / "bank-pin.pem"
    pin.write_bytes((tmp_path / "bank-ca" / "ca.pem").read_bytes())
    partner = start_partner(partition["partner"], **tls_values(files["partner"], tls_pin={"bank": pin}))
    bank = TLSFiles(files["bank"].ca, files["bank"].cert, files["bank"].key,
                    pins=(("partner", tmp_path / "telco-ca" / "ca.pem"),))
    with make_client(bank, base_url=partner.url) as client:
        assert client.get(IDENTITY).status_code == 200
        pin.write_bytes((tmp_path / "telco-ca" / "ca.pem").read_bytes())  # the bank is now the telco CA's to sign
        time.sleep(RELOAD_SECONDS + 0.1)
        refused = client.get(IDENTITY)  # the same kept-alive connection
        assert refused.status_code == 403 and "no longer accepted" in refused.json()["detail"]


def test_a_request_never_goes_on_a_connection_checked_for_another_party(tmp_path, partition, start_partner):
    from parties.errors import PeerError
    from parties.transport.client import EXPECT
    from parties.transport.tls import PeerIdentity

    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    partner = start_partner(partition["partner"], **tls_values(files["partner"]))
    with make_client(files["bank"], base_url=partner.url) as client:
        assert client.get(IDENTITY, extensions={EXPECT: PeerIdentity("partner", "partner")}).status_code == 200
        with pytest.raises(PeerError, match="expected partner 'partner2'"):  # same address, another party meant
            client.get(IDENTITY, extensions={EXPECT: PeerIdentity("partner2", "partner")})


def test_a_revocation_list_dated_ahead_of_the_clock_is_refused(tmp_path):
    from cryptography.hazmat.primitives import hashes, serialization

    from parties.transport.trust import Trust

    files = provision(tmp_path, {"bank": "one", "partner": "one"})
    ca = x509.load_pem_x509_certificate((tmp_path / "one" / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((tmp_path / "one" / "ca.key").read_bytes(), None)
    ahead = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=30)
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject).last_update(ahead)
           .next_update(ahead + dt.timedelta(days=30)).sign(key, hashes.SHA256()))
    (tmp_path / "crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ConfigError, match="ahead of this machine's clock"):
        Trust(TLSFiles(files["bank"].ca, files["bank"].cert, files["bank"].key, crl=tmp_path / "crl.pem"))
