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
    with ChaCha20-Poly1305 under the same key, 1 MiB at a time (a fresh
    random nonce per file, counted up per chunk; the name, the chunk's number
    and whether it is the last as associated data, so chunks cannot be
    reordered, dropped or cut short): sealing or opening needs one chunk of
    memory, not a copy of the set. A file that does not open is ignored and
    rewritten. Files are written atomically, mode 0600.

Large sets stay on disk
    From ``HASHED_ON_DISK_FROM`` IDs the hashed set itself is a ``Spool`` (an unnamed
    file in the cache folder, encrypted under a key of its own held in memory),
    hashed, sealed and opened a slice at a time: 32 bytes an ID of disk, not of
    memory.
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
from alignment.spool import Spool
from parties.storage.files import atomic_write_bytes, atomic_writer, private_dir

__all__ = ["HASHED_ON_DISK_FROM", "KEY_FILE", "cache_key", "cache_path", "hashed_points"]

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


CHUNK_BYTES = 1 << 20  # of points per sealed chunk


def _chunks(total: int) -> int:
    return max(1, -(-total // CHUNK_BYTES))


def _sealed_size(total: int) -> int:
    return NONCE_BYTES + total + _chunks(total) * TAG_BYTES


def _nonce(base: bytes, index: int) -> bytes:
    counter = int.from_bytes(base[4:], "little") ^ index
    return base[:4] + counter.to_bytes(8, "little")


def _aad(name: str, index: int, last: bool) -> bytes:
    return name.encode("ascii") + index.to_bytes(8, "little") + bytes([last])


def _seal_to(path: Path, subkey: bytes, name: str, data: bytes | bytearray | Spool) -> None:
    aead, base = ChaCha20Poly1305(subkey), secrets.token_bytes(NONCE_BYTES)
    n = _chunks(len(data))
    with atomic_writer(path) as f:
        f.write(base)
        for i in range(n):
            f.write(aead.encrypt(_nonce(base, i), data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES], _aad(name, i, i == n - 1)))


def _open_from(path: Path, subkey: bytes, name: str, total: int, into: Spool | None) -> bytearray | Spool:
    """The points sealed in ``path`` (``InvalidTag`` if any chunk does not open as the one expected there), in
    memory or appended to ``into``."""
    aead, n = ChaCha20Poly1305(subkey), _chunks(total)
    out = bytearray(total if into is None else 0)
    with path.open("rb") as f:
        base = f.read(NONCE_BYTES)
        for i in range(n):
            start = i * CHUNK_BYTES
            size = min(CHUNK_BYTES, total - start)
            chunk = aead.decrypt(_nonce(base, i), f.read(size + TAG_BYTES), _aad(name, i, i == n - 1))
            if into is None:
                out[start : start + size] = chunk
            else:
                into.write(chunk)
    return out if into is None else into


def cache_path(cache_dir: Path, ids: Sequence[bytes], dst: bytes, key: bytes) -> Path:
    """Where the hashed set of ``ids`` under ``dst`` lives: the name depends on the key and the DST."""
    return Path(cache_dir) / f"{_name(_subkey(key, dst), ids)}.u25519"


#: From this many IDs, a party's hashed set is kept on disk (a ``Spool``, 32 bytes an ID), not in memory: past
#: what shuffling it on disk holds for a while (``alignment.spool.permuted_on_disk``: 4 bytes an ID and ~45 MB).
HASHED_ON_DISK_FROM = 1 << 22


def hashed_points(
    ids: Sequence[bytes],
    pool: SlicePool,
    cache_dir: Path | None,
    dst: bytes = curve.DEFAULT_DST,
    key: bytes | None = None,
) -> bytes | bytearray | Spool:
    """``H(id)`` for every normalised ID under ``dst``, from ``cache_dir`` when it holds them.

    ``key`` is the cache key; by default the one in ``cache_dir`` (see ``cache_key``). From
    ``HASHED_ON_DISK_FROM`` IDs the points are a sealed ``Spool`` in ``cache_dir`` (None: the system's
    temporary folder), read by slice like the bytes they stand for; its file is gone when the last holder lets
    it go (or closes it).
    """
    if cache_dir is not None:
        private_dir(Path(cache_dir))  # where the spool goes, beside the cache
    spool = Spool(curve.POINT_BYTES, cache_dir, sealed=True) if len(ids) >= HASHED_ON_DISK_FROM else None
    try:
        if cache_dir is None:
            return pool.hash_to_curve(ids, dst, into=spool)
        subkey = _subkey(key if key is not None else cache_key(cache_dir), dst)
        name = _name(subkey, ids)
        path = Path(cache_dir) / f"{name}.u25519"
        total = len(ids) * curve.POINT_BYTES
        try:
            if path.stat().st_size != _sealed_size(total):
                logger.warning("ignoring a cached hashed set of another size or format; hashing again")
            else:
                data = _open_from(path, subkey, name, total, spool)
                logger.info("hashed ID set read from the cache")
                return data
        except FileNotFoundError:
            pass
        except InvalidTag:
            logger.warning("ignoring a cached hashed set that does not open (another key, or an older format); "
                           "hashing again")
            if spool is not None:  # what opened before the chunk that did not
                spool.close()
                spool = Spool(curve.POINT_BYTES, cache_dir, sealed=True)
        data = pool.hash_to_curve(ids, dst, into=spool)
        _seal_to(path, subkey, name, data)
        return data
    except BaseException:
        if spool is not None:
            spool.close()
        raise
