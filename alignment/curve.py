"""Curve25519 math for ECDH-PSI: pure functions over bytes, no protocol state.

Identifiers are hashed onto the prime-order subgroup of Curve25519 and then
blinded with X25519 scalar multiplication, which commutes:
``blind(a, blind(b, H(x))) == blind(b, blind(a, H(x)))``.

Hashing onto the curve
    ``u = H(x)`` must be a point of the prime-order group. A raw digest used
    as a u-coordinate lands on the quadratic twist half of the time, and the
    curve/twist bit survives blinding, so every blinded value would leak one
    bit of its ID's hash. We instead map ``SHA-512(DST || id)[:32]`` with
    libsodium's Elligator 2 map (``crypto_core_ed25519_from_uniform``, which
    also clears the cofactor) to an Edwards point, and convert it to the
    Montgomery u-coordinate ``u = (1 + y) / (1 - y)`` with one batched field
    inversion for the whole batch.

Identifier normalisation
    ``str(id).strip()`` then Unicode NFC, encoded as UTF-8. Case is kept:
    ``"ab12"`` and ``"AB12"`` are different customers.

Every function here is safe to run in a worker process: arguments and results
are plain bytes.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable

from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from nacl.bindings import crypto_core_ed25519_from_uniform

__all__ = [
    "DOMAIN_SEPARATOR",
    "POINT_BYTES",
    "P",
    "edwards_to_montgomery",
    "generate_key",
    "hash_to_curve",
    "is_on_curve",
    "normalize_id",
    "blind",
]

#: Versioned domain separator: a hash of the same ID in another protocol never collides with ours.
DOMAIN_SEPARATOR = b"cutlayer/psi/v1/curve25519-elligator2"
POINT_BYTES = 32
P = 2**255 - 19
_A = 486662
_Y_MASK = (1 << 255) - 1


def normalize_id(raw: object) -> bytes:
    """The documented normalisation rule: strip surrounding white space, Unicode NFC, UTF-8."""
    return unicodedata.normalize("NFC", str(raw).strip()).encode("utf-8")


def _uniform_bytes(id_bytes: bytes) -> bytes:
    prefix = len(DOMAIN_SEPARATOR).to_bytes(1, "big") + DOMAIN_SEPARATOR
    return hashlib.sha512(prefix + id_bytes).digest()[:32]


def edwards_to_montgomery(edwards_points: Iterable[bytes]) -> bytes:
    """Map encoded Ed25519 points to X25519 u-coordinates, ``u = (1+y)/(1-y)``.

    One modular inversion for the whole batch (Montgomery's trick) instead of
    one per point: the inversion dominates the cost of the conversion.
    """
    ys = [int.from_bytes(e, "little") & _Y_MASK for e in edwards_points]
    dens = [(1 - y) % P for y in ys]
    prefix = []
    acc = 1
    for d in dens:
        if d == 0:
            raise ValueError("the identity point has no Montgomery u-coordinate")
        prefix.append(acc)
        acc = acc * d % P
    inv = pow(acc, P - 2, P)
    out = bytearray(POINT_BYTES * len(ys))
    for i in range(len(ys) - 1, -1, -1):
        inv_d = inv * prefix[i] % P
        inv = inv * dens[i] % P
        u = (1 + ys[i]) * inv_d % P
        out[POINT_BYTES * i : POINT_BYTES * (i + 1)] = u.to_bytes(POINT_BYTES, "little")
    return bytes(out)


def hash_to_curve(ids: Iterable[bytes]) -> bytes:
    """Hash normalised IDs onto the prime-order subgroup; 32-byte u-coordinates, concatenated."""
    return edwards_to_montgomery(crypto_core_ed25519_from_uniform(_uniform_bytes(i)) for i in ids)


def generate_key() -> bytes:
    """A fresh X25519 private key (raw 32 bytes) for one PSI session."""
    from cryptography.hazmat.primitives import serialization

    return X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def blind(key: bytes, points: bytes, out_bytes: int = POINT_BYTES) -> bytes:
    """Multiply every 32-byte u-coordinate in ``points`` by the scalar ``key``.

    ``out_bytes`` < 32 truncates each result (for the final, double-blinded
    values that are only compared). A low-order input point raises
    ``ValueError``: X25519 yields the all-zero value for it.
    """
    if len(points) % POINT_BYTES:
        raise ValueError(f"{len(points)} bytes is not a whole number of {POINT_BYTES}-byte points")
    private = X25519PrivateKey.from_private_bytes(key)
    exchange = private.exchange
    from_bytes = X25519PublicKey.from_public_bytes
    view = memoryview(points)
    out = bytearray(out_bytes * (len(points) // POINT_BYTES))
    for j, i in enumerate(range(0, len(points), POINT_BYTES)):
        try:
            shared = exchange(from_bytes(bytes(view[i : i + POINT_BYTES])))
        except ValueError as exc:
            raise ValueError(f"point {j} of the batch is of low order") from exc
        out[out_bytes * j : out_bytes * (j + 1)] = shared[:out_bytes]
    return bytes(out)


def is_on_curve(u_bytes: bytes) -> bool:
    """True when ``u`` is the u-coordinate of a point on Curve25519 (not its twist)."""
    u = int.from_bytes(u_bytes, "little") & _Y_MASK
    rhs = (u * u * u + _A * u * u + u) % P
    return rhs == 0 or pow(rhs, (P - 1) // 2, P) == 1
