"""ECDH private set intersection on Curve25519: pure curve math, sessions, and the worker pool."""

from alignment.curve import blind, generate_key, hash_to_curve, normalize_id
from alignment.parallel import WorkerPool
from alignment.session import PsiPeer, PsiResponder, PsiResult, intersect, run_initiator

__all__ = [
    "PsiPeer",
    "PsiResponder",
    "PsiResult",
    "WorkerPool",
    "blind",
    "generate_key",
    "hash_to_curve",
    "intersect",
    "normalize_id",
    "run_initiator",
]
