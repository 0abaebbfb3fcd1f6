"""Customer IDs: the one normalisation rule every party applies before hashing or matching."""

from __future__ import annotations

import unicodedata

__all__ = ["normalize_id"]


def normalize_id(raw: object) -> bytes:
    """The documented normalisation rule: strip surrounding white space, Unicode NFC, UTF-8."""
    return unicodedata.normalize("NFC", str(raw).strip()).encode("utf-8")
