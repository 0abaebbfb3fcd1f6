"""The party-local cache of hashed IDs: keyed names, a per-DST key, encrypted contents that refuse tampering."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from alignment import cache, curve
from alignment.parallel import WorkerPool
from alignment.spool import Spool

IDS = [curve.normalize_id(f"ACC-{i:04d}") for i in range(40)]
DST = curve.psi_dst("bank|partner-a")


class CountingPool(WorkerPool):
    """An inline pool that counts how often it really hashes."""

    def __init__(self) -> None:
        super().__init__(workers=1)
        self.calls = 0

    def hash_to_curve(self, ids: Sequence[bytes], dst: bytes = curve.DEFAULT_DST, *,
                      into: Spool | None = None) -> bytes | Spool:
        self.calls += 1
        return super().hash_to_curve(ids, dst, into=into)


@pytest.fixture()
def pool() -> Iterator[CountingPool]:
    with CountingPool() as p:
        yield p


def test_second_read_comes_from_the_cache_under_a_private_key(tmp_path: Path, pool: CountingPool) -> None:
    first = cache.hashed_points(IDS, pool, tmp_path, DST)
    assert first == curve.hash_to_curve(IDS, DST)
    assert cache.hashed_points(IDS, pool, tmp_path, DST) == first
    assert pool.calls == 1
    key_file = tmp_path / cache.KEY_FILE
    assert len(key_file.read_bytes()) == 32
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    entry = cache.cache_path(tmp_path, IDS, DST, key_file.read_bytes())
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_the_name_depends_on_the_key_and_the_dst(tmp_path: Path) -> None:
    key_a, key_b = bytes(32), bytes([1]) * 32
    name = cache.cache_path(tmp_path, IDS, DST, key_a)
    assert cache.cache_path(tmp_path, IDS, DST, key_a) == name
    assert cache.cache_path(tmp_path, IDS, DST, key_b) != name
    assert cache.cache_path(tmp_path, IDS, curve.psi_dst("bank|partner-b"), key_a) != name
    assert cache.cache_path(tmp_path, IDS, curve.DEFAULT_DST, key_a) != name
    assert cache.cache_path(tmp_path, IDS[:-1], DST, key_a) != name
    # Without the key, the old unkeyed recipe (or any hash of the IDs) does not find the file.
    unkeyed = hashlib.sha256(DST + b"".join(IDS)).hexdigest()
    assert unkeyed not in name.name


def test_two_partnerships_never_share_an_entry(tmp_path: Path, pool: CountingPool) -> None:
    a = cache.hashed_points(IDS, pool, tmp_path, DST)
    b = cache.hashed_points(IDS, pool, tmp_path, curve.psi_dst("bank|partner-b"))
    assert a != b
    assert pool.calls == 2
    assert b == curve.hash_to_curve(IDS, curve.psi_dst("bank|partner-b"))


@pytest.mark.parametrize("where", ["nonce", "points"])
def test_a_tampered_file_is_ignored_and_rewritten(tmp_path: Path, pool: CountingPool, where: str) -> None:
    honest = cache.hashed_points(IDS, pool, tmp_path, DST)
    path = cache.cache_path(tmp_path, IDS, DST, cache.cache_key(tmp_path))
    blob = bytearray(path.read_bytes())
    blob[5 if where == "nonce" else cache.NONCE_BYTES + 7] ^= 1
    path.write_bytes(bytes(blob))
    assert cache.hashed_points(IDS, pool, tmp_path, DST) == honest
    assert pool.calls == 2  # recomputed, not read
    assert cache.hashed_points(IDS, pool, tmp_path, DST) == honest
    assert pool.calls == 2  # and the rewritten file is good again


def test_a_file_written_under_another_key_is_not_used(tmp_path: Path, pool: CountingPool) -> None:
    """Someone who can write the folder but lacks the key cannot plant points."""
    honest = cache.hashed_points(IDS, pool, tmp_path, DST, key=bytes(32))
    planted = cache.cache_path(tmp_path, IDS, DST, bytes(32)).read_bytes()
    path = cache.cache_path(tmp_path, IDS, DST, bytes([7]) * 32)
    path.write_bytes(planted)
    assert cache.hashed_points(IDS, pool, tmp_path, DST, key=bytes([7]) * 32) == honest
    assert pool.calls == 2


def test_the_file_holds_no_hashed_id_in_the_clear(tmp_path: Path, pool: CountingPool) -> None:
    """Someone who can read the file cannot test an ID by hashing it: the points are encrypted."""
    points = cache.hashed_points(IDS, pool, tmp_path, DST)
    blob = cache.cache_path(tmp_path, IDS, DST, cache.cache_key(tmp_path)).read_bytes()
    assert not any(points[k : k + 16] in blob for k in range(0, len(points), curve.POINT_BYTES))


def test_without_a_cache_dir_nothing_is_written(tmp_path: Path, pool: CountingPool) -> None:
    assert cache.hashed_points(IDS, pool, None) == curve.hash_to_curve(IDS)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tamper", ["swap two chunks", "cut short", "sealed whole (the format before chunks)"])
def test_a_file_is_sealed_chunk_by_chunk_and_opens_only_whole_and_in_order(
    tmp_path: Path, pool: CountingPool, monkeypatch: pytest.MonkeyPatch, tamper: str,
) -> None:
    """40 IDs in chunks of 3 points: each chunk opens only at its place, and the last only as the last."""
    monkeypatch.setattr(cache, "CHUNK_BYTES", 3 * curve.POINT_BYTES)
    honest = cache.hashed_points(IDS, pool, tmp_path, DST)
    assert cache.hashed_points(IDS, pool, tmp_path, DST) == honest and pool.calls == 1
    path = cache.cache_path(tmp_path, IDS, DST, cache.cache_key(tmp_path))
    blob = path.read_bytes()
    sealed = 3 * curve.POINT_BYTES + cache.TAG_BYTES
    assert len(blob) == cache.NONCE_BYTES + len(honest) + 14 * cache.TAG_BYTES  # ceil(40 / 3) chunks
    head, body = blob[: cache.NONCE_BYTES], blob[cache.NONCE_BYTES :]
    chunks = [body[k : k + sealed] for k in range(0, len(body), sealed)]
    if tamper == "swap two chunks":
        chunks[1], chunks[2] = chunks[2], chunks[1]
        forged = head + b"".join(chunks)
    elif tamper == "cut short":  # even where its size is taken as right, the chunks it has do not open as a whole
        forged = head + b"".join(chunks[:-1])
        monkeypatch.setattr(cache, "_sealed_size", lambda total: len(forged))
    else:
        subkey = cache._subkey(cache.cache_key(tmp_path), DST)
        forged = head + ChaCha20Poly1305(subkey).encrypt(head, bytes(honest), path.stem.encode("ascii"))
    path.write_bytes(forged)
    assert cache.hashed_points(IDS, pool, tmp_path, DST) == honest
    assert pool.calls == 2  # hashed again, not read
    monkeypatch.undo()


def test_a_large_set_is_hashed_sealed_and_opened_on_disk(
    tmp_path: Path, pool: CountingPool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From ``HASHED_ON_DISK_FROM`` IDs the hashed set is a spool (in unnamed files: nothing is left in the folder but the
    key and the sealed cache): the same points hashed, read back from the cache, and hashed again when a chunk of
    the cache does not open."""
    monkeypatch.setattr(cache, "HASHED_ON_DISK_FROM", 10)
    monkeypatch.setattr(cache, "CHUNK_BYTES", 3 * curve.POINT_BYTES)
    honest = curve.hash_to_curve(IDS, DST)
    hashed = cache.hashed_points(IDS, WorkerPool(1), tmp_path / "not yet made", DST)[:]  # made for the spool
    assert hashed == honest
    hashed = cache.hashed_points(IDS, pool, tmp_path, DST)
    assert isinstance(hashed, Spool) and hashed[:] == honest
    on_disk = os.pread(hashed._file.fileno(), len(honest), 0)  # encrypted there, as in the cache
    assert not any(honest[k : k + 16] in on_disk for k in range(0, len(honest), curve.POINT_BYTES))
    read = cache.hashed_points(IDS, pool, tmp_path, DST)
    assert isinstance(read, Spool) and read[:] == honest and pool.calls == 1
    path = cache.cache_path(tmp_path, IDS, DST, cache.cache_key(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted([cache.KEY_FILE, path.name])
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 1  # the last chunk: every chunk before it opens, then it does not
    path.write_bytes(bytes(blob))
    again = cache.hashed_points(IDS, pool, tmp_path, DST)
    assert isinstance(again, Spool) and again[:] == honest and pool.calls == 2
    assert cache.hashed_points(IDS[:9], pool, None, DST) == curve.hash_to_curve(IDS[:9], DST)  # below: in memory
