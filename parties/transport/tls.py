"""Mutual TLS between parties: who a party is in its certificate, its TLS files, and why a handshake failed.

A party certificate says who the party is and what it does: the subject's common name (CN) is the party's name,
its organisational unit (OU) its role: ``bank``, ``partner`` or ``compute`` (a compute party, which holds a trunk
and no data of its own). Every certificate serves both ends of a connection (server and client authentication),
so a party's operator calls its own service with the party's certificate. ``parties.transport.pki`` issues them;
``parties.transport.trust`` keeps a party's files current and decides who a verified peer may be (pins,
revocation, renewal, expiry).
"""

from __future__ import annotations

import ipaddress
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from parties.errors import ConfigError

__all__ = [
    "DEFAULT_HOSTS",
    "NAME",
    "ROLES",
    "PeerIdentity",
    "Role",
    "TLSFiles",
    "client_ssl_context",
    "handshake_failure",
    "is_loopback",
    "server_ssl_context",
]

Role = Literal["bank", "partner", "compute"]
ROLES: tuple[str, ...] = get_args(Role)
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
#: A party's name, as its certificate's CN and its folders spell it.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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
    """A party's TLS files: the CA certificates it trusts (one, or a bundle), its certificate and key; the
    revocation lists it reads (``crl``, if the file exists) and the peers it pins to a CA (``pins``)."""

    ca: Path
    cert: Path
    key: Path
    crl: Path | None = None
    pins: tuple[tuple[str, Path], ...] = ()
    warn_days: int = 30

    @classmethod
    def from_dir(cls, directory: Path, name: str, **more: Any) -> TLSFiles:
        """``DIR/ca.pem``, ``DIR/<name>.pem``, ``DIR/<name>.key`` and, when there is one, ``DIR/crl.pem``."""
        d = Path(directory)
        return cls(d / "ca.pem", d / f"{name}.pem", d / f"{name}.key", **{"crl": d / "crl.pem", **more})

    def check(self) -> None:
        for label, path in (("CA certificate", self.ca), ("certificate", self.cert), ("key", self.key)):
            if not Path(path).is_file():
                raise ConfigError(f"TLS {label} {path} does not exist (make one with `python -m parties pki`, "
                                  f"or a development set with `python -m parties certs`)")


@dataclass(frozen=True)
class PeerIdentity:
    name: str
    role: str


def server_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS 1.2+ server context that requires a client certificate from a trusted CA (the files' current one)."""
    from parties.transport.trust import trust_for

    return trust_for(files).server_context()


def client_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS 1.2+ client context: verifies the server against the trusted CAs and presents our certificate."""
    from parties.transport.trust import trust_for

    return trust_for(files).client_context()


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
            if current.verify_code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
                return f"its certificate has expired ({detail})"
            return f"its certificate is not from this partnership's CA ({detail})"
        if isinstance(current, ssl.SSLError):
            reason = (current.reason or "").upper()
            if any(alert in reason for alert in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED",
                                                 "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR")):
                return f"it refused our certificate: ours is not from the CA it trusts ({current.reason})"
        current = current.__cause__ or current.__context__
    return None
