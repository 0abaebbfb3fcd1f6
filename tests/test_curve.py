"""The ECDH math: hashing onto the prime-order group, commutative blinding, normalisation."""

from __future__ import annotations

import os

import pytest
from nacl.bindings import crypto_core_ed25519_from_uniform, crypto_core_ed25519_is_valid_point

from alignment import curve

IDS = [curve.normalize_id(f"customer-{i}") for i in range(300)]


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
    for i in IDS[:50]:
        edwards = crypto_core_ed25519_from_uniform(curve._uniform_bytes(i))
        assert crypto_core_ed25519_is_valid_point(edwards)


def test_batched_conversion_matches_one_inversion_per_point() -> None:
    edwards = [crypto_core_ed25519_from_uniform(os.urandom(32)) for _ in range(64)]
    batched = curve.edwards_to_montgomery(edwards)
    for k, e in enumerate(edwards):
        y = int.from_bytes(e, "little") & ((1 << 255) - 1)
        u = (1 + y) * pow(1 - y, -1, curve.P) % curve.P
        assert batched[32 * k : 32 * (k + 1)] == u.to_bytes(32, "little")


def test_hashing_is_deterministic_and_domain_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    first = curve.hash_to_curve(IDS[:5])
    assert curve.hash_to_curve(IDS[:5]) == first
    monkeypatch.setattr(curve, "DOMAIN_SEPARATOR", b"another protocol")
    assert curve.hash_to_curve(IDS[:5]) != first


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
    with pytest.raises(ValueError, match="whole number"):
        curve.blind(curve.generate_key(), bytes(33))


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
