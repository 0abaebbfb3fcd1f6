"""Files a party writes: always whole, never half-written, and its own alone.

Every file is 0600 and every folder 0700: a party's state holds its customers'
rows, models and logs, which no other account on the machine should read.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer", "open_private_log", "private_dir"]


def private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents as 0700 folders; folders that exist are left as they are.

    ``Path.mkdir(parents=True)`` gives the parents the default mode (0755 under
    the usual umask) whatever ``mode`` says, so each level is made here.
    """
    path = Path(path)
    missing = []
    current = path
    while not current.is_dir():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():
                raise
    return path


@contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A file to write ``path``'s content to, piece by piece: a temporary file (0600), fsynced and renamed onto
    ``path`` when the block ends without an error, removed otherwise. Nothing need hold the whole content."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file (0600), fsync and rename."""
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def open_private_log(path: Path) -> BinaryIO:
    """``path`` opened to append (a service's log), 0600 even if it existed with a wider mode."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")
