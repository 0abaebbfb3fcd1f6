"""A party's TLS files, kept current, and who a verified peer may be (``Trust``).

Beyond what the handshake checks (a chain to a trusted CA, validity dates, the host name), a party's ``Trust``
decides who a verified peer may be:

- **pins**: a peer named in ``--tls-pin NAME=CA_FILE`` must hold a certificate signed by that CA; any other peer
  one signed by the CA that signed this party's own certificate. With one CA per organisation and a bundle of
  both as ``--tls-ca``, a CA can then speak only for its own organisation's parties. The check is the CA's
  signature, not its name: another CA, or an intermediate it makes, can take a name;
- **revocation**: a certificate on a revocation list (``--tls-crl``, signed by the CA that issued it) is refused,
  at its next request even on a connection already open, on either end; a revocation read once stays, whatever
  becomes of its list's file;
- **rotation**: the files are re-read when they change (checked at most once a second, as connections and
  requests come); a change makes new SSL contexts, which new connections take;
- **expiry**: a certificate of its own, or a CA it trusts, that ends within ``warn_days`` is warned about at
  start and on every reload, and a peer's when it first connects.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import ssl
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID

from parties.errors import ConfigError
from parties.transport.tls import ROLES, PeerIdentity, TLSFiles

__all__ = ["RELOAD_SECONDS", "Trust", "check_peer", "name_attribute", "party_of", "read_certificates", "same_name",
           "trust_for", "trust_of"]

logger = logging.getLogger(__name__)

#: How often, at most, a party looks at its TLS files for a change.
RELOAD_SECONDS = 1.0


def name_attribute(name: x509.Name, oid: x509.ObjectIdentifier) -> str | None:
    values = name.get_attributes_for_oid(oid)
    return str(values[0].value) if len(values) == 1 else None


def party_of(subject: x509.Name) -> tuple[str | None, str | None]:
    """The party (CN) and role (OU) a subject names, each ``None`` unless named exactly once."""
    return name_attribute(subject, NameOID.COMMON_NAME), name_attribute(subject, NameOID.ORGANIZATIONAL_UNIT_NAME)


def _label(name: x509.Name) -> str:
    return repr(name_attribute(name, NameOID.COMMON_NAME) or name.rfc4514_string())


def read_certificates(path: Path, what: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    except ValueError:
        raise ConfigError(f"{what} {path} holds no PEM certificate") from None


def _crls(path: Path) -> list[x509.CertificateRevocationList]:
    text = Path(path).read_bytes()
    blocks = re.findall(rb"-----BEGIN X509 CRL-----.+?-----END X509 CRL-----", text, re.DOTALL)
    if not blocks:
        raise ConfigError(f"revocation list {path} holds no PEM CRL")
    try:
        return [x509.load_pem_x509_crl(b) for b in blocks]
    except ValueError as exc:
        raise ConfigError(f"revocation list {path} is damaged ({exc})") from None


def same_name(a: x509.Name, b: x509.Name) -> bool:
    """Names as OpenSSL compares them when it looks for an issuer: case and runs of spaces do not count."""
    return " ".join(a.rfc4514_string().casefold().split()) == " ".join(b.rfc4514_string().casefold().split())


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether ``ca`` itself signed ``cert`` (its key, not a CA that took its name)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True)
class _Policy:
    """What the files said when last read: which CA may issue whose certificate, and which are revoked."""

    own: x509.Certificate
    own_ca: x509.Certificate | None  # the trusted CA that signed this party's certificate, if one did
    pins: dict[str, x509.Certificate]
    revoked: dict[x509.Name, frozenset[int]] = field(default_factory=dict)
    lists: dict[x509.Name, dt.datetime] = field(default_factory=dict)  # each CA's list: when it was issued


def _days_left(cert: x509.Certificate) -> float:
    return (cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).total_seconds() / 86400


class Trust:
    """A party's TLS files, read and kept current: its SSL contexts, and whether a verified peer may be who it
    says (module docstring). One per set of files in a process (``trust_for``).

    A change to the files makes new contexts (``generation`` counts them): a live context is never changed
    under a handshake, and a connection made before keeps the context it was made with. New connections,
    and clients that see the generation change, take the new ones.
    """

    def __init__(self, files: TLSFiles) -> None:
        files.check()
        self.files = files
        self._lock = threading.Lock()
        self._warned: set[tuple[str, int]] = set()
        self._checked = time.monotonic()
        self._signature = self._stat()
        self.policy = self._read(None)
        self._server = self._context(ssl.Purpose.CLIENT_AUTH)
        self._client = self._context(ssl.Purpose.SERVER_AUTH)
        self.generation = 0

    # --- reading the files ----------------------------------------------------------------------------------
    def _paths(self) -> list[Path]:
        f = self.files
        return [f.ca, f.cert, f.key, *([f.crl] if f.crl else []), *(p for _, p in f.pins)]

    def _stat(self) -> tuple[tuple[int, int] | None, ...]:
        out = []
        for path in self._paths():
            try:
                st = Path(path).stat()
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def _read(self, before: _Policy | None) -> _Policy:
        f = self.files
        own = read_certificates(f.cert, "certificate")[0]
        if _days_left(own) <= 0:
            raise ConfigError(f"this party's certificate {f.cert} expired on {own.not_valid_after_utc:%Y-%m-%d}: "
                              f"renew it (python -m parties pki request, then have the CA sign it)")
        cas = read_certificates(f.ca, "CA certificate")
        for i, ca in enumerate(cas):
            if any(same_name(ca.subject, other.subject) for other in cas[:i]):
                raise ConfigError(f"{f.ca}: two CA certificates named {_label(ca.subject)} (case and spaces aside); "
                                  f"a peer's CA is told by its name")
        own_ca = next((ca for ca in cas if _issued_by(own, ca)), None)  # None: every peer must be pinned
        pins: dict[str, x509.Certificate] = {}
        for name, path in f.pins:
            pinned = read_certificates(path, f"the CA pinned for {name!r}")
            if len(pinned) != 1 or pinned[0] not in cas:
                raise ConfigError(f"--tls-pin {name}={path}: give one CA certificate that is also in {f.ca}")
            pins[name] = pinned[0]
        revoked, lists = self._revocations(cas, before)
        for cert, what in ((own, f"this party's certificate {f.cert}"),
                           *((c, f"the CA {_label(c.subject)} in {f.ca}") for c in cas)):
            if (days := _days_left(cert)) < f.warn_days:
                logger.warning("%s expires in %.0f days (%s): renew it before then", what, max(days, 0),
                               f"{cert.not_valid_after_utc:%Y-%m-%d}")
        return _Policy(own, own_ca, pins, revoked, lists)

    def _revocations(self, cas: list[x509.Certificate], before: _Policy | None
                     ) -> tuple[dict[x509.Name, frozenset[int]], dict[x509.Name, dt.datetime]]:
        """Each CA's revoked serials: what the file's lists revoke, added to what was revoked before. A revocation
        is for good (until a restart): a file that is gone, or an older list, lifts none. A list dated ahead of
        this machine's clock is refused: it would pass for the newest."""
        f = self.files
        revoked: dict[x509.Name, frozenset[int]] = {}
        lists: dict[x509.Name, dt.datetime] = {}
        if f.crl is not None and Path(f.crl).exists():
            for crl in _crls(f.crl):
                issuer = next((c for c in cas if c.subject == crl.issuer), None)
                if issuer is None or not crl.is_signature_valid(issuer.public_key()):  # type: ignore[arg-type]
                    raise ConfigError(f"revocation list {f.crl}: a list by {_label(crl.issuer)} is not signed by a "
                                      f"CA in {f.ca}")
                if crl.last_update_utc > dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10):
                    raise ConfigError(f"revocation list {f.crl}: the list by {_label(crl.issuer)} is dated "
                                      f"{crl.last_update_utc:%Y-%m-%d %H:%M} UTC, ahead of this machine's clock")
                if crl.next_update_utc is not None and crl.next_update_utc < dt.datetime.now(dt.timezone.utc):
                    logger.warning("revocation list of %s in %s was due for renewal on %s: ask its CA for a new one "
                                   "(python -m parties pki revoke re-signs it)", _label(crl.issuer), f.crl,
                                   f"{crl.next_update_utc:%Y-%m-%d}")
                revoked[crl.issuer] = revoked.get(crl.issuer, frozenset()) | {r.serial_number for r in crl}
                lists[crl.issuer] = max(crl.last_update_utc, lists.get(crl.issuer, crl.last_update_utc))
        if before is not None:
            for issuer, serials in before.revoked.items():
                if dropped := serials - revoked.get(issuer, frozenset()):
                    logger.warning("revocation list of %s: %d revocations read before are not in the file now (the "
                                   "list is gone or older); they stay in force", _label(issuer), len(dropped))
                revoked[issuer] = revoked.get(issuer, frozenset()) | serials
                lists[issuer] = max(lists.get(issuer, before.lists[issuer]), before.lists[issuer])
        return revoked, lists

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=str(self.files.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(str(self.files.cert), str(self.files.key))
        except ssl.SSLError as exc:
            raise ConfigError(f"{self.files.key} is not the key of {self.files.cert} ({exc.reason})") from None
        if purpose is ssl.Purpose.CLIENT_AUTH:
            ctx.verify_mode = ssl.CERT_REQUIRED
        _TRUSTS[ctx] = self
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """The current server context: TLS 1.2+, requiring a client certificate from a trusted CA."""
        return self._server

    def client_context(self) -> ssl.SSLContext:
        """The current client context: TLS 1.2+, verifying the server against the trusted CAs."""
        return self._client

    def refresh(self) -> None:
        """Re-read the files if one changed (looked at once a second at most); a set that does not load (a
        certificate renewed before its key) is reported and the loaded one kept until the next change."""
        now = time.monotonic()
        if now - self._checked < RELOAD_SECONDS:
            return
        with self._lock:
            if now - self._checked < RELOAD_SECONDS:
                return
            self._checked = now
            signature = self._stat()
            if signature == self._signature:
                return
            self._signature = signature
            try:
                policy = self._read(self.policy)
                server, client = self._context(ssl.Purpose.CLIENT_AUTH), self._context(ssl.Purpose.SERVER_AUTH)
            except (ConfigError, ssl.SSLError, OSError, ValueError) as exc:
                logger.warning("TLS files changed but do not load (%s); the ones loaded before stay in use", exc)
                return
            self.policy, self._server, self._client = policy, server, client
            self.generation += 1
            revoked = sum(map(len, policy.revoked.values()))
            logger.info("TLS files reloaded: certificate %s (serial %x) valid until %s; %d revoked", self.files.cert,
                        policy.own.serial_number, f"{policy.own.not_valid_after_utc:%Y-%m-%d}", revoked)

    # --- peers ----------------------------------------------------------------------------------------------
    def check(self, der: bytes | None) -> tuple[PeerIdentity | None, str | None]:
        """Who a peer with this verified certificate (DER) is, or why it may not be anyone here."""
        if not der:
            return None, "it presented no certificate"
        self.refresh()
        cert = x509.load_der_x509_certificate(der)
        name, role = party_of(cert.subject)
        # Exactly one of each: with two OUs (partner and bank) or two CNs, which one is meant is the issuer's
        # mistake or a trick, and reading the first or the last would let the certificate choose.
        if not name or role not in ROLES:
            return None, (f"its certificate must name exactly one Cutlayer party (CN) and one role (OU: "
                          f"{', '.join(ROLES)}); it names {cert.subject.rfc4514_string()!r}")
        policy = self.policy
        expected = policy.pins.get(name, policy.own_ca)
        if expected is None:
            return None, (f"{role} {name!r} is not pinned (--tls-pin NAME=CA_FILE), and the CA of this party's own "
                          f"certificate is not among those it trusts")
        # Signed by that CA's own key: a name is not enough (another CA, or an intermediate it made, can take it).
        if not _issued_by(cert, expected):
            how = ("is pinned to" if name in policy.pins
                   else "is not pinned (--tls-pin NAME=CA_FILE), so it must come from")
            return None, (f"its certificate for {role} {name!r} is issued by {_label(cert.issuer)}, not signed by "
                          f"the CA {name!r} {how}: {_label(expected.subject)}")
        if cert.serial_number in policy.revoked.get(cert.issuer, ()):
            return None, f"its certificate for {role} {name!r} (serial {cert.serial_number:x}) is revoked"
        if (days := _days_left(cert)) < self.files.warn_days and (name, cert.serial_number) not in self._warned:
            self._warned.add((name, cert.serial_number))
            logger.warning("%s %r's certificate expires in %.0f days (%s)", role, name, days,
                           f"{cert.not_valid_after_utc:%Y-%m-%d}")
        return PeerIdentity(name, role), None

    def recheck(self, der: bytes, generation: int) -> tuple[int, str | None]:
        """For a connection still open, checked at ``generation``: if the files changed since, ``check`` again (a
        revocation, a pin moved, a CA dropped). The generation it now holds for, and why it no longer may."""
        self.refresh()
        if generation == self.generation:
            return generation, None
        identity, problem = self.check(der)
        return self.generation, problem


#: Every context a ``Trust`` made, to find the trust behind a connection's context.
_TRUSTS: weakref.WeakKeyDictionary[ssl.SSLContext, Trust] = weakref.WeakKeyDictionary()
_BY_FILES: dict[TLSFiles, Trust] = {}
_BY_FILES_LOCK = threading.Lock()


def trust_for(files: TLSFiles) -> Trust:
    """The one ``Trust`` of these files in this process (its contexts are reloaded together)."""
    with _BY_FILES_LOCK:
        trust = _BY_FILES.get(files)
        if trust is None:
            trust = _BY_FILES[files] = Trust(files)
        return trust


def trust_of(context: ssl.SSLContext | None) -> Trust | None:
    """The ``Trust`` that made ``context`` (a connection's ``ssl_object.context``), if one did."""
    return _TRUSTS.get(context) if context is not None else None


def check_peer(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> tuple[PeerIdentity | None, str | None]:
    """Who the peer of a TLS connection is (``Trust.check``), or why it may not be anyone here."""
    if ssl_object is None:
        return None, "the connection is not TLS"
    trust = trust_of(ssl_object.context)
    der = ssl_object.getpeercert(True)
    if trust is None:  # a context not made here: name and role alone
        cert = x509.load_der_x509_certificate(der) if der else None
        name, role = party_of(cert.subject) if cert else (None, None)
        return (PeerIdentity(name, role), None) if name and role in ROLES else (None, "no Cutlayer party")
    return trust.check(der)
