"""Issuing certificates: each organisation keeps its own key; a CA signs requests and revokes certificates.

The provisioning flow (``python -m parties pki``, ``cutlayer pki``):

1. each party makes its key and a certificate signing request where it runs (``request``): the key is written
   0600 and never leaves that folder; the request (``NAME.csr``) names the party (CN), its role (OU) and the
   host names or addresses its service answers on;
2. a CA (``ca``: one for the partnership, or one per organisation) signs the request (``sign``) and sends the
   certificate back; it can revoke one (``revoke``), which writes the CA's revocation list (``crl.pem``) for
   every party that trusts the CA to read;
3. with one CA per organisation, each party trusts a bundle of both CA certificates (``bundle``) and pins each
   peer of the other organisation to its CA (``--tls-pin NAME=CA_FILE``, ``parties.transport.tls``).

``write_dev_pki`` makes a CA and every party's key in one folder: the walkthrough's and the tests' shortcut.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from parties.errors import ConfigError
from parties.storage.files import atomic_write_bytes
from parties.transport.tls import DEFAULT_HOSTS, NAME, ROLES, TLSFiles
from parties.transport.trust import name_attribute, party_of, read_certificates, same_name

__all__ = [
    "Issued", "bundle", "describe", "make_ca", "make_request", "revoke", "sign_request",
    "write_dev_pki",
]

#: How long a certificate is valid before its start, against clocks a few minutes apart.
_SKEW = dt.timedelta(minutes=5)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _name(common_name: str, unit: str | None = None, organisation: str = "Cutlayer development PKI") -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation)]
    if unit:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    """A private key, created 0600 (never readable by others, not even for a moment), never over another."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} already exists: a key is never overwritten (move it away to make a new one)") \
            from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _check_party(name: str, role: str) -> None:
    if role not in ROLES:
        raise ConfigError(f"party {name!r}: role must be one of {', '.join(ROLES)}, got {role!r}")
    if not NAME.fullmatch(name):
        raise ConfigError(f"{name!r} is not a usable party name (letters, digits, '.', '_', '-'; at most 64)")


def _ca_certificate(key: ec.EllipticCurvePrivateKey, subject: x509.Name, days: int) -> x509.Certificate:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _party_certificate(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, subject: x509.Name,
                       public_key: ec.EllipticCurvePublicKey, san: x509.SubjectAlternativeName, *,
                       not_before: dt.datetime, not_after: dt.datetime) -> x509.Certificate:
    return (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


# --- reading ------------------------------------------------------------------------------------------------

def _read_certificate(path: Path) -> x509.Certificate:
    certs = read_certificates(path, "certificate")
    if len(certs) != 1:
        raise ConfigError(f"{path} holds {len(certs)} certificates; give a file with one")
    return certs[0]


def _read_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = _read_certificate(Path(ca_dir) / "ca.pem")
    try:
        key = serialization.load_pem_private_key((Path(ca_dir) / "ca.key").read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError(f"{Path(ca_dir) / 'ca.key'} does not exist: sign where the CA's key is") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{Path(ca_dir) / 'ca.key'} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ConfigError(f"{ca_dir}: ca.key is not the key of ca.pem")
    return cert, key


def describe(cert: x509.Certificate) -> str:
    """One line an operator reads: who, what, issued by whom, serial, valid until when."""
    cn, ou = party_of(cert.subject)
    is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    who = f"CA {cn!r}" if is_ca else f"{ou} {cn!r}"
    issuer = name_attribute(cert.issuer, NameOID.COMMON_NAME)
    left = round((cert.not_valid_after_utc - _now()).total_seconds() / 86400)
    try:
        hosts = ", for " + ", ".join(str(h.value) for h in
                                     cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        hosts = ""
    return (f"{who}{hosts}, issued by {issuer!r}, serial {cert.serial_number:x}, valid until "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC ({left} days)")


# --- the flow -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Issued:
    path: Path
    certificate: x509.Certificate


def make_request(out_dir: Path, name: str, role: str, *, hosts: Iterable[str] = DEFAULT_HOSTS,
                 organisation: str = "Cutlayer party") -> tuple[Path, Path]:
    """A party's own key (``NAME.key``, 0600) and its signing request (``NAME.csr``) in ``out_dir``."""
    _check_party(name, role)
    hosts = tuple(hosts)
    if not hosts:
        raise ConfigError("give the host names or addresses this party's service answers on (--host)")
    out = Path(out_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(_name(name, role, organisation))
           .add_extension(_san(hosts), critical=False)
           .sign(key, hashes.SHA256()))
    key_path, csr_path = out / f"{name}.key", out / f"{name}.csr"
    _write_private(key_path, _pem_key(key))
    atomic_write_bytes(csr_path, csr.public_bytes(serialization.Encoding.PEM))
    return key_path, csr_path


def make_ca(out_dir: Path, name: str, *, days: int = 1825, organisation: str | None = None) -> Path:
    """A CA: ``ca.pem`` to hand to every party that trusts it, ``ca.key`` (0600) to keep."""
    if days < 1:
        raise ConfigError("--days must be at least 1")
    out = Path(out_dir)
    if (out / "ca.pem").exists():
        raise ConfigError(f"{out / 'ca.pem'} already exists: a CA is never overwritten")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _ca_certificate(key, _name(name, organisation=organisation or name), days)
    _write_private(out / "ca.key", _pem_key(key))
    atomic_write_bytes(out / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return out / "ca.pem"


def sign_request(ca_dir: Path, csr_path: Path, out: Path | None = None, *, days: int = 365,
                 not_before: dt.datetime | None = None) -> Issued:
    """The CA in ``ca_dir`` signs the request in ``csr_path``: the certificate goes to ``out`` (default: the
    party's name, ``NAME.pem``, beside the request), never over an existing file.

    The request must be signed by its own key, name exactly one party (CN) and one role (OU), and name its
    hosts; the CA copies those and nothing else (no extension of the request is trusted).
    """
    ca_cert, ca_key = _read_ca(ca_dir)
    try:
        csr = x509.load_pem_x509_csr(Path(csr_path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{csr_path} does not exist") from None
    except ValueError as exc:
        raise ConfigError(f"{csr_path} is not a PEM certificate signing request ({exc})") from None
    if not csr.is_signature_valid:
        raise ConfigError(f"{csr_path}: the request is not signed by the key it names")
    name, role = party_of(csr.subject)
    if name is None or role is None:
        raise ConfigError(f"{csr_path}: the request must name exactly one party (CN) and one role (OU)")
    _check_party(name, role)
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ConfigError(f"{csr_path}: the request's key is not an elliptic-curve key")
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ConfigError(f"{csr_path}: the request names no host (make it with `pki request --host ...`)") from None
    for entry in san:  # host names and addresses, each one host: no wildcard, no URI, no other kind of name
        if not isinstance(entry, (x509.DNSName, x509.IPAddress)) or "*" in str(entry.value):
            raise ConfigError(f"{csr_path}: the request names {entry.value!r} as a host; a party certificate names "
                              "host names (no wildcard) and IP addresses only")
    if days < 1:
        raise ConfigError("--days must be at least 1")
    start = not_before or _now() - _SKEW
    end = min(start + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    organisation = name_attribute(csr.subject, NameOID.ORGANIZATION_NAME) or "Cutlayer party"
    out = Path(out) if out is not None else Path(csr_path).parent / f"{name}.pem"
    if out.exists():
        raise ConfigError(f"{out} already exists: a certificate is never written over a file (move it away, or "
                          f"give --out)")
    cert = _party_certificate(ca_cert, ca_key, _name(name, role, organisation), public_key, san,
                              not_before=start, not_after=end)
    atomic_write_bytes(out, cert.public_bytes(serialization.Encoding.PEM))
    return Issued(out, cert)


def revoke(ca_dir: Path, certificate: Path, *, days: int = 30) -> tuple[Path, int]:
    """Add ``certificate`` to the CA's revocation list (``ca_dir/crl.pem``, re-signed, valid ``days``).

    Returns the list's path and how many certificates it revokes. Hand the list to every party that trusts
    the CA (``--tls-crl``): a service re-reads it when it changes and refuses the certificate from then on.
    """
    ca_cert, ca_key = _read_ca(ca_dir)
    cert = _read_certificate(certificate)
    if cert.issuer != ca_cert.subject:
        raise ConfigError(f"{certificate} was not issued by this CA ({ca_dir})")
    crl_path = Path(ca_dir) / "crl.pem"
    revoked: dict[int, dt.datetime] = {}
    if crl_path.exists():
        for entry in x509.load_pem_x509_crl(crl_path.read_bytes()):
            revoked[entry.serial_number] = entry.revocation_date_utc
    revoked.setdefault(cert.serial_number, _now())
    now = _now()
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - _SKEW).next_update(now + dt.timedelta(days=days)))
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    crl = builder.sign(ca_key, hashes.SHA256())
    atomic_write_bytes(crl_path, crl.public_bytes(serialization.Encoding.PEM))
    return crl_path, len(revoked)


def bundle(out: Path, ca_files: Iterable[Path]) -> list[x509.Certificate]:
    """The CA certificates a party trusts, in one file (its ``--tls-ca``): each a CA, no two with one name
    (a peer's CA is told by its name, and two of a name could speak for each other)."""
    certs: list[x509.Certificate] = []
    for path in ca_files:
        for cert in read_certificates(path, "CA certificate"):
            if not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                raise ConfigError(f"{path}: {describe(cert)} is not a CA certificate")
            if any(same_name(c.subject, cert.subject) for c in certs):
                raise ConfigError(f"{path}: two CA certificates are named {cert.subject.rfc4514_string()!r}")
            certs.append(cert)
    if len(certs) < 1:
        raise ConfigError("give at least one CA certificate")
    atomic_write_bytes(Path(out), b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs))
    return certs


def write_dev_pki(
    out_dir: Path,
    parties: Mapping[str, str],
    *,
    hosts: Iterable[str] = DEFAULT_HOSTS,
    ca_name: str = "Cutlayer development CA",
    days: int = 365,
) -> dict[str, TLSFiles]:
    """Create a CA and one certificate per party (``{name: role}``) under ``out_dir``.

    For development and tests: in production each organisation keeps its own key (``make_request``) and a CA
    signs its request (``sign_request``).
    """
    for name, role in parties.items():
        _check_party(name, role)
    out = Path(out_dir)
    hosts = tuple(hosts)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, _name(ca_name), days)
    atomic_write_bytes(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    atomic_write_bytes(out / "ca.key", _pem_key(ca_key))
    (out / "ca.key").chmod(0o600)
    files = {}
    now = _now()
    for name, role in parties.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _party_certificate(ca_cert, ca_key, _name(name, role), key.public_key(), _san(hosts),
                                  not_before=now - _SKEW, not_after=now + dt.timedelta(days=days))
        f = TLSFiles.from_dir(out, name)
        atomic_write_bytes(f.cert, cert.public_bytes(serialization.Encoding.PEM))
        atomic_write_bytes(f.key, _pem_key(key))
        f.key.chmod(0o600)
        files[name] = f
    return files

