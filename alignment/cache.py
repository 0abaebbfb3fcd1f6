"""A party-local cache of its hashed ID set.

``H(id)`` does not depend on any session key, so a party whose ID list has not
changed can skip hashing on its next session. The cache lives on the party's
own disk, next to the raw IDs it is derived from; nothing in it is sent.
Entries are keyed by a digest of the normalised IDs (in order) and the
protocol's domain separator, and are written atomically.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

from alignment import curve
from alignment.parallel import WorkerPool
from parties.files import atomic_write_bytes

__all__ = ["hashed_points"]

logger = logging.getLogger(__name__)


def _key(ids: Sequence[bytes]) -> str:
    h = hashlib.sha256(curve.DOMAIN_SEPARATOR)
    h.update(len(ids).to_bytes(8, "little"))
    for i in ids:
        h.update(len(i).to_bytes(4, "little"))
        h.update(i)
    return h.hexdigest()


def hashed_points(ids: Sequence[bytes], pool: WorkerPool, cache_dir: Path | None) -> bytes:
    """``H(id)`` for every normalised ID, from ``cache_dir`` when it holds them."""
    if cache_dir is None:
        return pool.hash_to_curve(ids)
    path = Path(cache_dir) / f"{_key(ids)}.u25519"
    expected = len(ids) * curve.POINT_BYTES
    try:
        data = path.read_bytes()
        if len(data) == expected:
            logger.info("hashed ID set read from the cache")
            return data
        logger.warning("ignoring a cached hashed set of the wrong size")
    except FileNotFoundError:
        pass
    data = pool.hash_to_curve(ids)
    atomic_write_bytes(path, data)
    return data
