"""The UCI Bank Marketing dataset: cache first, else the official archive, always checksummed."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import zipfile
from pathlib import Path

import httpx

from parties.errors import DatasetUnavailable
from parties.storage.files import atomic_write_bytes

__all__ = [
    "BANK_FULL_SHA256",
    "BANK_MARKETING_URL",
    "cache_dir",
    "download_bank_marketing",
    "locate_bank_full",
]

logger = logging.getLogger(__name__)

BANK_MARKETING_URL = "https://archive.ics.uci.edu/static/public/222/bank+marketing.zip"
BANK_FULL_NAME = "bank-full.csv"
BANK_FULL_SHA256 = "d1513ec63b385506f7cfce9f2c5caa9fe99e7ba4e8c3fa264b3aaf0f849ed32d"

#: The help of every ``--cache-dir`` flag.
CACHE_HELP = "where bank-full.csv is cached (default: $CUTLAYER_DATA_DIR, else ~/.cache/cutlayer/data)"


def cache_dir() -> Path:
    """``$CUTLAYER_DATA_DIR``, else ``~/.cache/cutlayer/data``."""
    env = os.environ.get("CUTLAYER_DATA_DIR")
    return Path(env) if env else Path.home() / ".cache" / "cutlayer" / "data"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _find_in_zip(blob: bytes, name: str) -> bytes | None:
    """``name`` inside a zip, looking into nested zips (the UCI archive nests ``bank.zip``)."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        for info in zf.infolist():
            if Path(info.filename).name == name:
                return zf.read(info)
        for info in zf.infolist():
            if info.filename.endswith(".zip"):
                found = _find_in_zip(zf.read(info), name)
                if found is not None:
                    return found
    return None


def download_bank_marketing(dest: Path, url: str = BANK_MARKETING_URL, timeout: float = 60.0) -> Path:
    """Download the official archive, extract ``bank-full.csv``, verify it and write it to ``dest``."""
    logger.info("downloading %s", url)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=True) as client:
            response = client.get(url)
            response.raise_for_status()
    except httpx.HTTPError as exc:
        raise DatasetUnavailable(
            f"could not download the UCI Bank Marketing archive from {url} ({exc}). "
            f"If this machine is offline, copy {BANK_FULL_NAME} into {dest.parent} "
            f"(or point CUTLAYER_DATA_DIR at a folder holding it)."
        ) from exc
    try:
        csv = _find_in_zip(response.content, BANK_FULL_NAME)
    except zipfile.BadZipFile as exc:
        raise DatasetUnavailable(f"{url} did not return a zip archive") from exc
    if csv is None:
        raise DatasetUnavailable(f"{url} holds no {BANK_FULL_NAME}")
    if _sha256(csv) != BANK_FULL_SHA256:
        raise DatasetUnavailable(f"{BANK_FULL_NAME} from {url} fails its SHA-256 check; not saved")
    atomic_write_bytes(dest, csv)
    return dest


def locate_bank_full(directory: Path | None = None, *, download: bool = True, url: str = BANK_MARKETING_URL) -> Path:
    """Path to a verified ``bank-full.csv``: the cache folder first, else a download into it."""
    folder = Path(directory) if directory is not None else cache_dir()
    path = folder / BANK_FULL_NAME
    if path.exists():
        if _sha256(path.read_bytes()) != BANK_FULL_SHA256:
            raise DatasetUnavailable(
                f"{path} fails its SHA-256 check (expected {BANK_FULL_SHA256}); delete it to download it again"
            )
        return path
    if not download:
        raise DatasetUnavailable(f"{path} does not exist and downloading is off: drop --no-download, or put "
                                 f"{BANK_FULL_NAME} there (or in the folder $CUTLAYER_DATA_DIR names)")
    return download_bank_marketing(path, url=url)
