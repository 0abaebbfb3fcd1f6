"""A party-local cache of its hashed ID set.

``H(id)`` does not depend on any session key, so a party whose ID list has not
changed can skip hashing on its next session. The cache lives on the party's
own disk, next to the raw IDs it is derived from; nothing in it is sent.

Names and tags are keyed
    A file's name is an HMAC-SHA256 of the normalised IDs (in order) under a
    secret key, so someone who can list the folder but not read the key cannot
    test whether an ID set, or an ID, is there by recomputing a name. The key
    (``cache.key``: 32 random bytes, mode 0600, created on first use) never
    leaves the party. The DST goes into the key derivation: one partnership's
    entries are never read for another's.

Contents are encrypted
    ``H(id)`` in the clear would let anyone who can read a file test an ID
    by hashing it (the DST is no secret). Each file is the hashed set sealed
    with ChaCha20-Poly1305 under the same key (a fresh nonce, the name as
    associated data); a file that does not open is ignored and rewritten.
    Files are written atomically, mode 0600.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from alignment import curve
from alignment.parallel import SlicePool
from parties.storage.files import atomic_write_bytes, private_dir

__all__ = ["KEY_FILE", "cache_key", "cache_path", "hashed_points"]

logger = logging.getLogger(__name__)

KEY_FILE = "cache.key"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16  # Poly1305
_LABEL = b"cutlayer-psi-cache-v2"


def cache_key(cache_dir: Path) -> bytes:
    """The party's secret cache key from ``cache_dir``, created (0600) on first use."""
    path = Path(cache_dir) / KEY_FILE
    private_dir(path.parent)
    if not path.exists():
        # Write the key in full under a temporary name (mkstemp: 0600), then link it in: a
        # second process starting at the same time keeps whichever key landed first.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{KEY_FILE}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
                logger.info("created a new PSI cache key")
            except FileExistsError:
                pass
        finally:
            Path(tmp).unlink(missing_ok=True)
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        logger.warning("the PSI cache key was readable by others; making it owner-only")
        path.chmod(0o600)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        # The cache is only a shortcut: a new key makes every entry a miss, nothing worse.
        logger.warning("replacing a PSI cache key of the wrong size")
        key = secrets.token_bytes(KEY_BYTES)
        atomic_write_bytes(path, key)
    return key


def _subkey(key: bytes, dst: bytes) -> bytes:
    return hmac.digest(key, _LABEL + len(dst).to_bytes(2, "big") + dst, "sha256")


def _name(subkey: bytes, ids: Sequence[bytes]) -> str:
    h = hmac.new(subkey, b"name", hashlib.sha256)
    h.update(len(ids).to_bytes(8, "little"))
    for i in ids:
        h.update(len(i).to_bytes(4, "little"))
        h.update(i)
    return h.hexdigest()


def _seal(subkey: bytes, name: str, data: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(subkey).encrypt(nonce, data, name.encode("ascii"))


def _open(subkey: bytes, name: str, blob: bytes) -> bytes:
    return ChaCha20Poly1305(subkey).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], name.encode("ascii"))


def cache_path(cache_dir: Path, ids: Sequence[bytes], dst: bytes, key: bytes) -> Path:
    """Where the hashed set of ``ids`` under ``dst`` lives: the name depends on the key and the DST."""
    return Path(cache_dir) / f"{_name(_subkey(key, dst), ids)}.u25519"


def hashed_points(
    ids: Sequence[bytes],
    pool: SlicePool,
    cache_dir: Path | None,
    dst: bytes = curve.DEFAULT_DST,
    key: bytes | None = None,
) -> bytes:
    """``H(id)`` for every normalised ID under ``dst``, from ``cache_dir`` when it holds them.

    ``key`` is the cache key; by default the one in ``cache_dir`` (see ``cache_key``).
    """
    if cache_dir is None:
        return pool.hash_to_curve(ids, dst)
    subkey = _subkey(key if key is not None else cache_key(cache_dir), dst)
    name = _name(subkey, ids)
    path = Path(cache_dir) / f"{name}.u25519"
    expected = NONCE_BYTES + len(ids) * curve.POINT_BYTES + TAG_BYTES
    try:
        blob = path.read_bytes()
        if len(blob) != expected:
            logger.warning("ignoring a cached hashed set of the wrong size")
        else:
            data = _open(subkey, name, blob)
            logger.info("hashed ID set read from the cache")
            return data
    except FileNotFoundError:
        pass
    except InvalidTag:
        logger.warning("ignoring a cached hashed set that does not open with this party's key")
    data = pool.hash_to_curve(ids, dst)
    atomic_write_bytes(path, _seal(subkey, name, data))
    return data
