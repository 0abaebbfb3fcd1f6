"""ECDH private set intersection on Curve25519: pure curve math, sessions, and the worker pool."""

from alignment.curve import (
    DEFAULT_DST,
    blind,
    check_points,
    generate_key,
    hash_to_curve,
    normalize_id,
    psi_dst,
)
from alignment.parallel import WorkerPool
from alignment.session import PsiPeer, PsiResponder, PsiResult, intersect, run_initiator

__all__ = [
    "DEFAULT_DST",
    "PsiPeer",
    "PsiResponder",
    "PsiResult",
    "WorkerPool",
    "blind",
    "check_points",
    "generate_key",
    "hash_to_curve",
    "intersect",
    "normalize_id",
    "psi_dst",
    "run_initiator",
]
