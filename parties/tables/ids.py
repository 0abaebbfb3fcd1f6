"""Customer IDs: their declared type, the one canonical form every party hashes, and what formats a column mixes.

Two files of the same customers often write the same ID differently: ``12`` and ``12.0`` (a column a
spreadsheet once read as numbers), ``00101`` and ``101`` (zero padding), `` 151 `` (white space).
Matched as text they are different customers, and alignment would silently find fewer rows. So a
party's schema declares what its IDs are:

* ``integer``: each ID is an integer, written however: ``12``, ``12.0``, ``+12``, ``0012`` and ``1.2e1``
  are all 12, canonically ``"12"``. An ID that is not a whole number (``12.5``, ``n/a``) is refused.
* ``text``: each ID is text, kept as written but for surrounding white space and Unicode NFC:
  ``00101`` and ``101`` are two customers.

Both sides of a PSI session state their type when the session opens; different types are refused,
never matched. A column whose IDs are written in more than one way is reported per format (counts
only, never an ID) when the table loads.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # the settings read IdType for --help: no pandas for that
    import pandas as pd

__all__ = ["ID_TYPES", "IdType", "canonical_ids", "id_formats", "infer_id_type", "normalize_id"]

IdType = Literal["integer", "text"]
ID_TYPES: tuple[IdType, ...] = ("integer", "text")

_PLAIN = re.compile(r"[1-9][0-9]*|0")
_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")

#: The ways one ID can be written, in the order a report lists them.
FORMATS = ("plain integer", "zero-padded integer", "integer with a sign", "integer with a decimal point",
           "integer in exponent notation", "number with a fraction", "text", "with surrounding white space")


def normalize_id(raw: object) -> bytes:
    """A text ID's canonical bytes: surrounding white space stripped, Unicode NFC, UTF-8."""
    return unicodedata.normalize("NFC", str(raw).strip()).encode("utf-8")


def _integer(text: str) -> int | None:
    """The integer ``text`` writes (already stripped), or ``None`` if it writes no whole number."""
    if _DIGITS.fullmatch(text):
        return int(text)
    if not _NUMBER.fullmatch(text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite() or value != value.to_integral_value():
        return None
    return int(value)


def _format(raw: str) -> str:
    text = raw.strip()
    if _PLAIN.fullmatch(text):
        return "plain integer"
    if _DIGITS.fullmatch(text):
        return "zero-padded integer"
    if _NUMBER.fullmatch(text):
        if _integer(text) is None:
            return "number with a fraction"
        if "e" in text.lower():
            return "integer in exponent notation"
        if "." in text:
            return "integer with a decimal point"
        return "integer with a sign"
    return "text"


def id_formats(raw: pd.Series) -> dict[str, int]:
    """How many IDs are written in each format (``FORMATS``), each ID counted once: one with white space around
    it counts as that, whatever it writes inside."""
    stripped = raw.str.strip()
    spaced = (raw != stripped).to_numpy(dtype=bool)
    plain = stripped.str.fullmatch(_PLAIN.pattern).to_numpy(dtype=bool) & ~spaced
    digits = stripped.str.fullmatch(_DIGITS.pattern).to_numpy(dtype=bool) & ~spaced
    number = stripped.str.fullmatch(_NUMBER.pattern).to_numpy(dtype=bool) | spaced
    counts: Counter[str] = Counter({"plain integer": int(plain.sum()), "zero-padded integer": int((digits & ~plain).sum()),
                                    "text": int((~number).sum()), "with surrounding white space": int(spaced.sum())})
    for value in stripped[number & ~digits & ~spaced]:  # signs, points, exponents: rare, so told apart one by one
        counts[_format(value)] += 1
    return {f: counts[f] for f in FORMATS if counts[f]}


def infer_id_type(raw: pd.Series) -> IdType:
    """``integer`` when every ID writes a whole number, else ``text``."""
    stripped = raw.str.strip()
    digits = stripped.str.fullmatch(_DIGITS.pattern).to_numpy(dtype=bool)
    return "integer" if all(_integer(v) is not None for v in stripped[~digits]) else "text"


class IdError(ValueError):
    """IDs that are not of their declared type: how many, the first one's position, and what was wrong."""

    def __init__(self, count: int, first: int, what: str) -> None:
        super().__init__(f"{count} {what} (first at position {first})")
        self.count, self.first, self.what = count, first, what


def canonical_ids(raw: pd.Series, id_type: IdType) -> list[bytes]:
    """Every ID's canonical bytes under ``id_type``; ``IdError`` for IDs that are not of that type."""
    stripped = raw.str.strip()
    if id_type == "text":
        return stripped.str.normalize("NFC").str.encode("utf-8").tolist()
    plain = stripped.str.fullmatch(_PLAIN.pattern).to_numpy(dtype=bool)
    out = stripped.str.encode("ascii", errors="replace").tolist() if plain.all() else stripped.tolist()
    if plain.all():  # nearly every clean column: nothing to parse
        return out
    bad: list[int] = []
    fractions = 0
    for pos in np.flatnonzero(~plain):
        number = _integer(out[pos])
        if number is None:
            bad.append(int(pos))
            fractions += _NUMBER.fullmatch(out[pos]) is not None
        else:
            out[pos] = str(number)
    if bad:
        what = ("IDs that are numbers with a fraction, not integers" if fractions == len(bad) else
                "IDs that are not integers" + (f" ({fractions} with a fraction)" if fractions else ""))
        raise IdError(len(bad), bad[0], what)
    return [v.encode("ascii") for v in out]
