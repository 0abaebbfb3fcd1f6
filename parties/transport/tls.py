"""Mutual TLS between parties: a development CA, party certificates, SSL contexts, peer identity.

A party certificate says who the party is and what it does: the subject's
common name (CN) is the party's name, its organisational unit (OU) its role:
``bank``, ``partner`` or ``compute`` (a compute party, which holds a trunk and no data of its own). Every certificate serves both ends of a connection
(server and client authentication), so a party's operator calls its own
service with the party's certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from parties.errors import ConfigError
from parties.storage.files import atomic_write_bytes

__all__ = [
    "ROLES",
    "PeerIdentity",
    "Role",
    "TLSFiles",
    "client_ssl_context",
    "handshake_failure",
    "is_loopback",
    "peer_identity",
    "server_ssl_context",
    "write_dev_pki",
]

Role = Literal["bank", "partner", "compute"]
ROLES: tuple[str, ...] = get_args(Role)
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TLSFiles:
    """The three PEM files a party needs: the CA it trusts, its certificate and its key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, directory: Path, name: str) -> TLSFiles:
        """``DIR/ca.pem``, ``DIR/<name>.pem``, ``DIR/<name>.key`` as written by ``python -m parties certs``."""
        d = Path(directory)
        return cls(d / "ca.pem", d / f"{name}.pem", d / f"{name}.key")

    def check(self) -> None:
        for label, path in (("CA certificate", self.ca), ("certificate", self.cert), ("key", self.key)):
            if not Path(path).is_file():
                raise ConfigError(f"TLS {label} {path} does not exist (create one with `python -m parties certs`)")


@dataclass(frozen=True)
class PeerIdentity:
    name: str
    role: str


def _name(common_name: str, unit: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Cutlayer development PKI")]
    if unit:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _issue_ca(name: str, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue_party(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    name: str,
    role: str,
    hosts: Iterable[str],
    days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name, role))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(_san(hosts), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def write_dev_pki(
    out_dir: Path,
    parties: Mapping[str, str],
    *,
    hosts: Iterable[str] = DEFAULT_HOSTS,
    ca_name: str = "Cutlayer development CA",
    days: int = 365,
) -> dict[str, TLSFiles]:
    """Create a CA and one certificate per party (``{name: role}``) under ``out_dir``.

    For development and tests: in production each organisation keeps its own
    key, and the CA is whatever the partnership agrees on.
    """
    for name, role in parties.items():
        if role not in ROLES:
            raise ConfigError(f"party {name!r}: role must be one of {ROLES}, got {role!r}")
        if not name or "/" in name or name.startswith("."):
            raise ConfigError(f"{name!r} is not a usable party name")
    out = Path(out_dir)
    hosts = tuple(hosts)
    ca_cert, ca_key = _issue_ca(ca_name, days)
    atomic_write_bytes(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(out / "ca.key", _pem_key(ca_key))
    (out / "ca.key").chmod(0o600)
    files = {}
    for name, role in parties.items():
        cert, key = _issue_party(ca_cert, ca_key, name, role, hosts, days)
        f = TLSFiles.from_dir(out, name)
        atomic_write_bytes(f.cert, cert.public_bytes(serialization.Encoding.PEM))
        atomic_write_bytes(f.key, _pem_key(key))
        f.key.chmod(0o600)
        files[name] = f
    return files


def server_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS 1.2+ server context that requires a client certificate from the trusted CA."""
    files.check()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(files.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(files.cert), str(files.key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS 1.2+ client context: verifies the server against the CA and presents our certificate."""
    files.check()
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(files.cert), str(files.key))
    return ctx


def peer_identity(peercert: Mapping[str, Any] | None) -> PeerIdentity | None:
    """Name and role from a verified peer certificate, as ``ssl.SSLSocket.getpeercert()`` returns it."""
    if not peercert:
        return None
    names, roles = [], []
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                names.append(value)
            elif key == "organizationalUnitName":
                roles.append(value)
    # Exactly one of each: with two OUs (partner and bank) or two CNs, which one is meant is the issuer's
    # mistake or a trick, and reading the first or the last would let the certificate choose.
    if len(names) != 1 or len(roles) != 1 or not names[0] or roles[0] not in ROLES:
        return None
    return PeerIdentity(name=names[0], role=roles[0])


def handshake_failure(exc: BaseException) -> str | None:
    """What went wrong in a failed TLS handshake behind ``exc``, in a party's words; ``None`` if none did.

    A handshake that fails on a certificate is an answer, not silence: the peer
    is there, but one side does not trust the other, and retrying changes nothing.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            detail = current.verify_message or current.reason or "verification failed"
            if current.verify_code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
                return f"its certificate is not issued for this host name or address ({detail})"
            return f"its certificate is not from this partnership's CA ({detail})"
        if isinstance(current, ssl.SSLError):
            reason = (current.reason or "").upper()
            if any(alert in reason for alert in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED",
                                                 "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR")):
                return f"it refused our certificate: ours is not from the CA it trusts ({current.reason})"
        current = current.__cause__ or current.__context__
    return None
