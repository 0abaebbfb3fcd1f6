"""The ECDH math: hashing onto the prime-order group, commutative blinding, normalisation."""

from __future__ import annotations

import hashlib
import os

import pytest
from nacl.bindings import crypto_core_ed25519_from_uniform, crypto_core_ed25519_is_valid_point

from alignment import curve

IDS = [curve.normalize_id(f"customer-{i}") for i in range(300)]

# RFC 9380 Appendix J.5.1, edwards25519_XMD:SHA-512_ELL2_RO_: (msg, P.x, P.y).
RFC_DST = b"QUUX-V01-CS02-with-edwards25519_XMD:SHA-512_ELL2_RO_"
RFC_VECTORS = [
    ("", "3c3da6925a3c3c268448dcabb47ccde5439559d9599646a8260e47b1e4822fc6",
     "09a6c8561a0b22bef63124c588ce4c62ea83a3c899763af26d795302e115dc21"),
    ("abc", "608040b42285cc0d72cbb3985c6b04c935370c7361f4b7fbdb1ae7f8c1a8ecad",
     "1a8395b88338f22e435bbd301183e7f20a5f9de643f11882fb237f88268a5531"),
    ("abcdef0123456789", "6d7fabf47a2dc03fe7d47f7dddd21082c5fb8f86743cd020f3fb147d57161472",
     "53060a3d140e7fbcda641ed3cf42c88a75411e648a1add71217f70ea8ec561a6"),
    ("q128_" + "q" * 128, "5fb0b92acedd16f3bcb0ef83f5c7b7a9466b5f1e0d8d217421878ea3686f8524",
     "2eca15e355fcfa39d2982f67ddb0eea138e2994f5956ed37b7f72eea5e89d2f7"),
    ("a512_" + "a" * 512, "0efcfde5898a839b00997fbe40d2ebe950bc81181afbd5cd6b9618aa336c1e8c",
     "6dc2fc04f266c5c27f236a80b14f92ccd051ef1ff027f26a07f8c0f327d8f995"),
]


@pytest.mark.parametrize(("msg", "x", "y"), RFC_VECTORS, ids=["empty", "abc", "abcdef", "q128", "a512"])
def test_rfc9380_vectors(msg: str, x: str, y: str) -> None:
    assert curve.hash_to_edwards([msg.encode()], RFC_DST) == [(int(x, 16), int(y, 16))]


def test_rfc9380_vectors_in_one_batch_and_as_u() -> None:
    """Batching shares inversions between IDs: a batch must equal its IDs one by one."""
    msgs = [m.encode() for m, _, _ in RFC_VECTORS]
    expected = [(int(x, 16), int(y, 16)) for _, x, y in RFC_VECTORS]
    assert curve.hash_to_edwards(msgs, RFC_DST) == expected
    edwards = [(y | (x & 1) << 255).to_bytes(32, "little") for x, y in expected]
    assert curve.hash_to_curve(msgs, RFC_DST) == curve.edwards_to_montgomery(edwards)


def test_hash_to_field_matches_the_rfc() -> None:
    uniform = curve.expand_message_xmd(b"", RFC_DST, 96)
    u0, u1 = (int.from_bytes(uniform[k : k + 48], "big") % curve.P for k in (0, 48))
    assert u0 == 0x03FEF4813C8CB5F98C6EEF88FAE174E6E7D5380DE2B007799AC7EE712D203F3A
    assert u1 == 0x780BDDDD137290C8F589DC687795AAFAE35F6B674668D92BF92AE793E6A60C75


def test_oversize_dst_is_hashed_as_the_rfc_says() -> None:
    long_dst = b"x" * 256
    short = hashlib.sha512(b"H2C-OVERSIZE-DST-" + long_dst).digest()
    assert curve.expand_message_xmd(b"m", long_dst, 96) == curve.expand_message_xmd(b"m", short, 96)
    assert curve.expand_message_xmd(b"m", b"x" * 255, 96) != curve.expand_message_xmd(b"m", short, 96)
    assert curve.psi_dst("p" * 300) == hashlib.sha512(b"H2C-OVERSIZE-DST-cutlayer-psi-v2:" + b"p" * 300).digest()


def test_every_hashed_point_is_on_the_curve_not_the_twist() -> None:
    points = curve.hash_to_curve(IDS)
    assert len(points) == 32 * len(IDS)
    assert all(curve.is_on_curve(points[i : i + 32]) for i in range(0, len(points), 32))


def test_raw_digests_would_land_on_the_twist_half_the_time() -> None:
    """The failure the Elligator map avoids; also shows ``is_on_curve`` can say no."""
    on_curve = sum(curve.is_on_curve(os.urandom(32)) for _ in range(400))
    assert 120 < on_curve < 280


def test_hashed_points_lie_in_the_prime_order_subgroup() -> None:
    # libsodium's validity check includes membership of the main subgroup.
    for x, y in curve.hash_to_edwards(IDS[:50]):
        assert crypto_core_ed25519_is_valid_point((y | (x & 1) << 255).to_bytes(32, "little"))


def test_batched_conversion_matches_one_inversion_per_point() -> None:
    edwards = [crypto_core_ed25519_from_uniform(os.urandom(32)) for _ in range(64)]
    batched = curve.edwards_to_montgomery(edwards)
    for k, e in enumerate(edwards):
        y = int.from_bytes(e, "little") & ((1 << 255) - 1)
        u = (1 + y) * pow(1 - y, -1, curve.P) % curve.P
        assert batched[32 * k : 32 * (k + 1)] == u.to_bytes(32, "little")


def test_hashing_is_deterministic_and_domain_separated() -> None:
    first = curve.hash_to_curve(IDS[:5])
    assert curve.hash_to_curve(IDS[:5]) == first
    assert curve.hash_to_curve(IDS[:5], curve.DEFAULT_DST) == first
    bank_a = curve.hash_to_curve(IDS[:5], curve.psi_dst("bank|partner-a"))
    bank_b = curve.hash_to_curve(IDS[:5], curve.psi_dst("bank|partner-b"))
    assert len({first, bank_a, bank_b}) == 3
    assert curve.psi_dst("bank|partner-a").startswith(b"cutlayer-psi-v2:")
    assert curve.psi_dst("caf\u00e9") == curve.psi_dst("cafe\u0301")  # both parties NFC the context
    with pytest.raises(ValueError, match="empty"):
        curve.psi_dst("")


def test_blinding_commutes() -> None:
    a, b = curve.generate_key(), curve.generate_key()
    points = curve.hash_to_curve(IDS[:40])
    ab = curve.blind(b, curve.blind(a, points))
    ba = curve.blind(a, curve.blind(b, points))
    assert ab == ba
    assert curve.blind(a, points) != curve.blind(b, points)


def test_truncation_keeps_the_prefix() -> None:
    a = curve.generate_key()
    points = curve.hash_to_curve(IDS[:10])
    full, short = curve.blind(a, points), curve.blind(a, points, 12)
    assert [full[i : i + 12] for i in range(0, len(full), 32)] == [short[i : i + 12] for i in range(0, len(short), 12)]


def test_a_low_order_point_is_refused() -> None:
    with pytest.raises(ValueError, match="low order"):
        curve.blind(curve.generate_key(), bytes(32))
    with pytest.raises(ValueError, match="low order"):
        curve.blind(curve.generate_key(), bytes(32), validate=False)  # X25519 gives all-zero
    with pytest.raises(ValueError, match="whole number"):
        curve.blind(curve.generate_key(), bytes(33))


def _u(value: int) -> bytes:
    return value.to_bytes(32, "little")


def _twist_point() -> bytes:
    u = 2
    while curve.is_on_curve(_u(u)):
        u += 1
    return _u(u)


ORDER_8 = 325606250916557431795983626356110631294008115727848805560023387167927233504
BAD_POINTS = {
    "twist": (_twist_point(), "not on the curve"),
    "p-plus-9": (_u(curve.P + 9), "non-canonical: u >= p"),
    "top-bit": (_u(9 | 1 << 255), "non-canonical: its top bit is set"),
    "order-8": (_u(ORDER_8), "of low order"),
    "order-4-on-twist": (_u(curve.P - 1), "of low order"),
    "one": (_u(1), "of low order"),
}


@pytest.mark.parametrize(("bad", "why"), BAD_POINTS.values(), ids=BAD_POINTS.keys())
@pytest.mark.parametrize("where", [0, 7, 10], ids=["first", "odd-index", "last"])
def test_check_points_names_the_first_bad_point(bad: bytes, why: str, where: int) -> None:
    honest = curve.hash_to_curve(IDS[:11])
    blob = honest[: 32 * where] + bad + honest[32 * (where + 1) :]
    with pytest.raises(ValueError, match=f"point {where} of the batch is {why}"):
        curve.check_points(blob)
    with pytest.raises(ValueError, match=f"point {where} "):
        curve.blind(curve.generate_key(), blob)


def test_the_earliest_of_two_bad_points_is_named() -> None:
    honest = curve.hash_to_curve(IDS[:6])
    twist, low = BAD_POINTS["twist"][0], BAD_POINTS["order-8"][0]
    with pytest.raises(ValueError, match="point 1 of the batch is not on the curve"):
        curve.check_points(honest[:32] + twist + honest[64:128] + low + honest[160:])
    with pytest.raises(ValueError, match="point 2 of the batch is of low order"):
        curve.check_points(honest[:64] + low + twist + honest[128:])


def test_honest_and_blinded_points_pass_the_check() -> None:
    points = curve.hash_to_curve(IDS)
    curve.check_points(points)
    once = curve.blind(curve.generate_key(), points)
    curve.check_points(once)
    curve.check_points(b"")
    # Without validation, X25519 happily multiplies a twist point: the check is what stops it.
    curve.blind(curve.generate_key(), BAD_POINTS["twist"][0], validate=False)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("  C001 ", "C001", True),
        ("C001\t", "C001", True),
        ("caf\u00e9", "cafe\u0301", True),  # NFC: precomposed == combining accent
        ("c001", "C001", False),  # IDs are case-sensitive
        ("0012", "12", False),  # leading zeros matter
    ],
    ids=["spaces", "tab", "nfc", "case", "leading-zeros"],
)
def test_normalisation_rule(a: str, b: str, same: bool) -> None:
    assert (curve.normalize_id(a) == curve.normalize_id(b)) is same


def test_hashes_of_many_ids_are_those_every_deployed_party_computes() -> None:
    """Known answers over 4,099 IDs (both Elligator branches, an empty and a non-ASCII ID): a faster hash must give
    these bytes, or two parties on different versions would silently share no customer."""
    ids = [curve.normalize_id(f"kat-{i}") for i in range(4096)] + [b"", b"0", "é".encode()]
    assert hashlib.sha256(curve.hash_to_curve(ids)).hexdigest() == (
        "2eb793ef5a33b1a7ec8164a566c4b23c0ca5137cdedd1e9271e81e0c690c1510")
    assert hashlib.sha256(curve.hash_to_curve(ids, curve.psi_dst("bank/telco"))).hexdigest() == (
        "c4dc57f9f21e98ddb9e51a86db5a5800d4f27c1990ee090f3362e9a34c937d01")
