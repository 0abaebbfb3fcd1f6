"""Curve25519 math for ECDH-PSI: pure functions over bytes, no protocol state.

Identifiers are hashed onto the prime-order subgroup of Curve25519 and then
blinded with X25519 scalar multiplication, which commutes:
``blind(a, blind(b, H(x))) == blind(b, blind(a, H(x)))``.

Hashing onto the curve
    ``H`` is RFC 9380 ``hash_to_curve`` with the suite
    ``edwards25519_XMD:SHA-512_ELL2_RO_``: ``expand_message_xmd`` (SHA-512)
    gives two field elements, each is mapped with Elligator 2, the two points
    are added and the cofactor is cleared. The Edwards point is then written as
    its Montgomery u-coordinate ``u = (1 + y) / (1 - y)``. A raw digest used as
    a u-coordinate would land on the quadratic twist half of the time, and the
    curve/twist bit survives blinding, leaking one bit of every ID's hash.

    libsodium 1.0.18 (what PyNaCl bundles) has no ``from_string_ro``, and its
    ``from_uniform`` picks the sign of ``x`` from an input bit rather than as
    the RFC does, so the map runs here with one batched inversion per step.
    The one square root per field element comes from libsodium through a public
    call: ``crypto_core_ed25519_add(P, B)`` decodes ``P`` from its ``y`` (or
    fails when ``y`` has no point, which is the RFC's ``is_square``), and ``x``
    of ``P`` follows from ``y(P + B)`` by the addition law.

Domain separation
    The DST is ``psi_dst(context)`` for a partnership, ``DEFAULT_DST`` when no
    context is given; a DST over 255 bytes is hashed as RFC 9380 5.3.3 says.

Received points
    ``check_points`` refuses a non-canonical encoding, a low-order point, or a
    point on the twist; ``blind`` calls it unless told the points are our own.

Identifier normalisation
    ``str(id).strip()`` then Unicode NFC, encoded as UTF-8. Case is kept:
    ``"ab12"`` and ``"AB12"`` are different customers.

Every function here is safe to run in a worker process: arguments and results
are plain bytes.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable, Sequence

from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from nacl.bindings import crypto_core_ed25519_add

from parties.tables.ids import normalize_id  # re-exported: IDs are normalised before hashing

__all__ = [
    "DEFAULT_DST",
    "DST_PREFIX",
    "POINT_BYTES",
    "P",
    "blind",
    "check_points",
    "edwards_to_montgomery",
    "expand_message_xmd",
    "generate_key",
    "hash_to_curve",
    "hash_to_edwards",
    "is_on_curve",
    "normalize_id",
    "psi_dst",
]

POINT_BYTES = 32
P = 2**255 - 19
_A = 486662
_D = -121665 * pow(121666, -1, P) % P
_Y_MASK = (1 << 255) - 1
_SQRT_M1 = pow(2, (P - 1) // 4, P)

#: Versioned prefix of every DST this project uses; ``psi_dst`` appends a partnership context.
DST_PREFIX = b"cutlayer-psi-v2"
#: The DST when no partnership context is given. No ``psi_dst(...)`` equals it: those have a ``:``.
DEFAULT_DST = DST_PREFIX
_MAX_DST = 255


def _sqrt(a: int) -> int:
    """A square root of ``a`` (a square), for constants only: one ``pow`` costs as much as three X25519s."""
    r = pow(a, (P + 3) // 8, P)
    if r * r % P != a % P:
        r = r * _SQRT_M1 % P
    if r * r % P != a % P:
        raise ValueError("not a square")
    return r


def _sgn0(a: int) -> int:
    return a & 1


_C1 = _sqrt(-486664 % P)  # RFC 9380 Appendix D.2: sqrt(-486664) with sgn0 == 0
_C1 = P - _C1 if _sgn0(_C1) else _C1
_B_Y = 4 * pow(5, -1, P) % P  # the Ed25519 base point: a known partner for decoding
_B_X = _sqrt((_B_Y * _B_Y - 1) * pow(_D * _B_Y * _B_Y + 1, -1, P))
_B_X = P - _B_X if _sgn0(_B_X) else _B_X
_B_ENC = _B_Y.to_bytes(32, "little")
_B_XDY = _B_X * _D * _B_Y % P

# u-coordinates of the points of order 1, 2, 4 and 8 on Curve25519 and of order 4 on its
# twist, canonical form; the non-canonical aliases fail the canonical check first.
_LOW_ORDER_U = frozenset(
    {
        0,
        1,
        P - 1,
        325606250916557431795983626356110631294008115727848805560023387167927233504,
        39382357235489614581723060781553021112529911719440698176882885853963445705823,
    }
)


def _short_dst(dst: bytes) -> bytes:
    if not dst:
        raise ValueError("the DST must not be empty")
    if len(dst) > _MAX_DST:
        return hashlib.sha512(b"H2C-OVERSIZE-DST-" + dst).digest()
    return dst


def psi_dst(context: str) -> bytes:
    """The DST for one partnership: ``DST_PREFIX:context`` (NFC, UTF-8), hashed when over 255 bytes."""
    if not context:
        raise ValueError("a partnership context must not be empty; use DEFAULT_DST for none")
    return _short_dst(DST_PREFIX + b":" + unicodedata.normalize("NFC", context).encode("utf-8"))


class _Xmd:
    """RFC 9380 5.3.1 ``expand_message_xmd`` with SHA-512 for one DST; the zero block is hashed once."""

    def __init__(self, dst: bytes, length: int) -> None:
        dst_prime = _short_dst(dst)
        dst_prime += len(dst_prime).to_bytes(1, "big")
        self.blocks = -(-length // 64)
        if self.blocks > 255 or length > 65535:
            raise ValueError("expand_message_xmd: requested length too long")
        self.length = length
        self._zpad = hashlib.sha512(bytes(128))
        self._tail0 = length.to_bytes(2, "big") + b"\x00" + dst_prime
        self._tails = [i.to_bytes(1, "big") + dst_prime for i in range(1, self.blocks + 1)]

    def __call__(self, msg: bytes) -> bytes:
        h = self._zpad.copy()
        h.update(msg)
        h.update(self._tail0)
        b0 = h.digest()
        b = hashlib.sha512(b0 + self._tails[0]).digest()
        out = [b]
        x0 = int.from_bytes(b0, "big")
        for tail in self._tails[1:]:
            b = hashlib.sha512((x0 ^ int.from_bytes(b, "big")).to_bytes(64, "big") + tail).digest()
            out.append(b)
        return b"".join(out)[: self.length]


def expand_message_xmd(msg: bytes, dst: bytes, length: int) -> bytes:
    """RFC 9380 ``expand_message_xmd`` with SHA-512."""
    return _Xmd(dst, length)(msg)


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """``inv0`` of every value with one ``pow`` (Montgomery's trick); ``inv0(0) == 0``."""
    prefix = []
    acc = 1
    for v in values:
        prefix.append(acc)
        if v:
            acc = acc * v % P
    inv = pow(acc, P - 2, P)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        v = values[i]
        if v:
            out[i] = inv * prefix[i] % P
            inv = inv * v % P
    return out


def _decode_y3(ys: Sequence[int]) -> list[int | None]:
    """``y(P + B)`` for the even-``x`` point ``P`` with each ``y`` (libsodium decodes), None where there is none."""
    add, b_enc, mask = crypto_core_ed25519_add, _B_ENC, _Y_MASK
    out: list[int | None] = []
    for y in ys:
        try:
            out.append(int.from_bytes(add(y.to_bytes(32, "little"), b_enc), "little") & mask)
        except RuntimeError:  # y has no point: (y^2 - 1) / (d y^2 + 1) is not a square
            out.append(None)
    return out


def _map_to_curve(us: Sequence[int]) -> list[tuple[int, int]]:
    """RFC 9380 ``map_to_curve_elligator2_edwards25519`` for every field element: affine (x, y).

    Three batched inversions for the whole batch: the first candidate's ``y``, the second's
    (for the half where the first has no point), and one shared by ``x`` and the RFC's sign.
    """
    p, a = P, _A
    dens = [(1 + 2 * u * u) % p for u in us]
    # x1 = -A / (1 + 2u^2); its Edwards y = (x1 - 1) / (x1 + 1) = (A + den) / (A - den).
    # A - den == 0 means x1 == -1, which is on the twist (A - 2 is not a square): not this branch.
    inv = _batch_inverse([(a - den) % p for den in dens])
    ys = [(a + den) * i % p if i else 0 for den, i in zip(dens, inv)]
    y3s = _decode_y3(ys)
    redo = [k for k, (y3, i) in enumerate(zip(y3s, inv)) if y3 is None or not i]  # not is_square(gx1)
    # Otherwise x2 = -x1 - A = -2Au^2 / den, with Edwards y = (2Au^2 + den) / (2Au^2 - den).
    xm_num = [p - a] * len(us)  # xM = xm_num / den
    for k in redo:
        xm_num[k] = -2 * a * us[k] * us[k] % p
    inv2 = _batch_inverse([(p - xm_num[k] - dens[k]) % p for k in redo])
    for k, i in zip(redo, inv2):
        ys[k] = (dens[k] - xm_num[k]) * i % p
    for k, y3 in zip(redo, _decode_y3([ys[k] for k in redo])):
        if y3 is None:
            raise RuntimeError("libsodium refused both Elligator 2 candidates: its point decoding changed")
        y3s[k] = y3
    # y3 (1 - d x xB y yB) = y yB + x xB gives the even root x = nx / dx, nx = y3 - y yB, dx = xB + xB d yB y y3.
    # The RFC takes the Montgomery v with sgn0(v) == is_square(gx1) and x = c1 * xM / v, so with
    # v' = c1 xM / x = c1 xm_num dx / (den nx), x is the RFC's exactly when sgn0(v') agrees.
    # One inversion of dx den nx gives both: x = nx^2 den / (...), v' = c1 xm_num dx^2 / (...).
    bx, bxdy, by = _B_X, _B_XDY, _B_Y
    nxs = [(y3 - y * by) % p for y, y3 in zip(ys, y3s)]  # type: ignore[operator]
    dxs = [(bx + bxdy * y % p * y3) % p for y, y3 in zip(ys, y3s)]  # type: ignore[operator]
    invs = _batch_inverse([dx * den % p * nx % p for dx, den, nx in zip(dxs, dens, nxs)])
    square = [True] * len(us)
    for k in redo:
        square[k] = False
    out = []
    c1 = _C1
    for k, y in enumerate(ys):
        nx, i = nxs[k], invs[k]
        if not nx:  # x == 0 only for xM == 0 (u == 0): the RFC's exceptional case maps to the identity
            out.append((0, 1))
            continue
        dx = dxs[k]
        x = nx * nx % p * dens[k] % p * i % p
        v = c1 * xm_num[k] % p * (dx * dx % p) % p * i % p
        out.append((x if (v & 1) == square[k] else p - x, y))
    return out


def _hash_projective(ids: Iterable[bytes], dst: bytes) -> list[tuple[int, int, int]]:
    """RFC 9380 ``hash_to_curve`` for every ID, as projective Edwards points (X : Y : Z)."""
    xmd = _Xmd(dst, 96)
    us = []
    for i in ids:
        uniform = xmd(i)
        us.append(int.from_bytes(uniform[:48], "big") % P)
        us.append(int.from_bytes(uniform[48:], "big") % P)
    qs = _map_to_curve(us)
    out = []
    for k in range(0, len(qs), 2):
        (x0, y0), (x1, y1) = qs[k], qs[k + 1]
        # Q0 + Q1 (complete addition, a = -1), then clear the cofactor with three doublings.
        t = _D * (x0 * x1 % P) % P * (y0 * y1 % P) % P
        X = (x0 * y1 + y0 * x1) * (1 - t) % P
        Y = (y0 * y1 + x0 * x1) * (1 + t) % P
        Z = (1 - t * t) % P
        for _ in range(3):  # dbl-2008-bbjlp with a = -1
            b = (X + Y) * (X + Y) % P
            c = X * X % P
            d = Y * Y % P
            f = d - c
            j = (f - 2 * Z * Z) % P
            X, Y, Z = (b - c - d) * j % P, -f * (c + d) % P, f * j % P
        out.append((X, Y, Z))
    return out


def hash_to_edwards(ids: Iterable[bytes], dst: bytes = DEFAULT_DST) -> list[tuple[int, int]]:
    """RFC 9380 ``edwards25519_XMD:SHA-512_ELL2_RO_`` of every ID: affine Edwards (x, y)."""
    points = _hash_projective(ids, dst)
    invs = _batch_inverse([z for _, _, z in points])
    return [(x * i % P, y * i % P) for (x, y, _), i in zip(points, invs)]


def edwards_to_montgomery(edwards_points: Iterable[bytes]) -> bytes:
    """Map encoded Ed25519 points to X25519 u-coordinates, ``u = (1+y)/(1-y)``.

    One modular inversion for the whole batch (Montgomery's trick) instead of
    one per point: the inversion dominates the cost of the conversion.
    """
    ys = [int.from_bytes(e, "little") & _Y_MASK for e in edwards_points]
    return _to_u([(y, 1) for y in ys])


def _to_u(yz: Sequence[tuple[int, int]]) -> bytes:
    """u = (Z + Y) / (Z - Y) for projective Edwards (Y : Z), concatenated little-endian."""
    dens = [(z - y) % P for y, z in yz]
    if not all(dens):
        raise ValueError("the identity point has no Montgomery u-coordinate")
    invs = _batch_inverse(dens)
    return b"".join(((z + y) * i % P).to_bytes(POINT_BYTES, "little") for (y, z), i in zip(yz, invs))


def hash_to_curve(ids: Iterable[bytes], dst: bytes = DEFAULT_DST) -> bytes:
    """Hash normalised IDs onto the prime-order subgroup; 32-byte u-coordinates, concatenated."""
    return _to_u([(y, z) for _, y, z in _hash_projective(ids, dst)])


def generate_key() -> bytes:
    """A fresh X25519 private key (raw 32 bytes) for one PSI session."""
    from cryptography.hazmat.primitives import serialization

    return X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def _split(points: bytes) -> list[int]:
    if len(points) % POINT_BYTES:
        raise ValueError(f"{len(points)} bytes is not a whole number of {POINT_BYTES}-byte points")
    return [int.from_bytes(points[i : i + POINT_BYTES], "little") for i in range(0, len(points), POINT_BYTES)]


def check_points(blob: bytes) -> None:
    """Refuse a batch of received u-coordinates unless every one is a canonical point of large order on the curve.

    Raises ``ValueError`` naming the first bad point and why. The curve/twist test is
    libsodium decoding the matching Edwards ``y``, two points a call: a Python ``pow``
    per point would cost three X25519s.
    """
    us = _split(blob)
    first_bad, reason = len(us), ""
    for k, u in enumerate(us):
        if u >> 255:
            first_bad, reason = k, "non-canonical: its top bit is set"
        elif u >= P:
            first_bad, reason = k, "non-canonical: u >= p"
        elif u in _LOW_ORDER_U:
            first_bad, reason = k, "of low order"
        else:
            continue
        break
    # Only the points before the first cheap failure can name an earlier bad index.
    head = us[:first_bad]
    # Edwards y = (u - 1) / (u + 1) has a point exactly when u is on the curve; u + 1 != 0 here.
    invs = _batch_inverse([u + 1 for u in head])
    encs = [((u - 1) * i % P).to_bytes(32, "little") for u, i in zip(head, invs)]
    for k in range(0, len(encs), 2):
        pair = encs[k : k + 2]
        try:
            crypto_core_ed25519_add(pair[0], pair[-1])
        except RuntimeError:
            for j, e in enumerate(pair):
                try:
                    crypto_core_ed25519_add(e, _B_ENC)
                except RuntimeError:
                    raise ValueError(f"point {k + j} of the batch is not on the curve (it is on the twist)") from None
    if reason:
        raise ValueError(f"point {first_bad} of the batch is {reason}")


def blind(key: bytes, points: bytes, out_bytes: int = POINT_BYTES, validate: bool = True) -> bytes:
    """Multiply every 32-byte u-coordinate in ``points`` by the scalar ``key``.

    ``out_bytes`` < 32 truncates each result (for the final, double-blinded
    values that are only compared). With ``validate`` (the default, for points
    from a peer) the batch goes through ``check_points`` first; either way a
    low-order input point raises ``ValueError``: X25519 yields the all-zero value for it.
    """
    if len(points) % POINT_BYTES:
        raise ValueError(f"{len(points)} bytes is not a whole number of {POINT_BYTES}-byte points")
    if validate:
        check_points(points)
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
