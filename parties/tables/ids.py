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
from collections.abc import Iterable, Iterator, Sequence
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

if TYPE_CHECKING:  # the settings read IdType for --help: no pandas or Arrow for that
    import pandas as pd
    import pyarrow as pa

__all__ = ["ID_TYPES", "IdColumn", "IdType", "canonical_ids", "id_formats", "infer_id_type", "normalize_id"]

IdType = Literal["integer", "text"]
ID_TYPES: tuple[IdType, ...] = ("integer", "text")

_PLAIN = re.compile(r"[1-9][0-9]*|0")
_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")

#: The ways one ID can be written, in the order a report lists them.
FORMATS = ("plain integer", "zero-padded integer", "integer with a sign", "integer with a decimal point",
           "integer in exponent notation", "number with a fraction", "text", "with surrounding white space")


class IdColumn(Sequence[bytes]):
    """A party's canonical IDs in row order, held as an Arrow binary column (in chunks, as the file was read).

    A few bytes per ID rather than a Python object each (about 50 bytes more): at 10^7 customers the
    difference is half a gigabyte. Text is viewed as binary without a copy, so IDs already written in
    canonical form share the table's own buffers. Reads as a sequence of ``bytes``; a slice is a list of
    just its IDs (what a PSI worker is sent), and iterating makes Python objects a block at a time.
    """

    BLOCK = 1 << 16

    def __init__(self, values: pa.Array | pa.ChunkedArray) -> None:
        import pyarrow as pa

        if not isinstance(values, pa.ChunkedArray):
            values = pa.chunked_array([values], values.type)
        if pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type):
            self._values = values.cast(pa.large_binary())  # string to binary: the same buffers
        else:
            self._values = values.cast(pa.binary())

    @classmethod
    def of(cls, ids: Iterable[bytes]) -> IdColumn:
        import pyarrow as pa

        return ids if isinstance(ids, IdColumn) else cls(pa.array(list(ids), pa.large_binary()))

    @property
    def arrow(self) -> pa.ChunkedArray:
        """The column itself (``binary`` or ``large_binary``, chunked), for vectorised work."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._values.slice(start, max(0, stop - start)).to_pylist()
        n = len(self)
        if not -n <= index < n:
            raise IndexError("ID index out of range")
        return self._values[index].as_py()

    def __iter__(self) -> Iterator[bytes]:
        for start in range(0, len(self), self.BLOCK):
            yield from self[start : start + self.BLOCK]

    def take(self, rows: np.ndarray) -> list[bytes]:
        """The IDs of ``rows``, in that order."""
        import pyarrow as pa

        return self._values.take(pa.array(np.asarray(rows, dtype=np.int64))).to_pylist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdColumn):
            import pyarrow as pa

            mine, theirs = self._values, other._values
            if mine.type != theirs.type:
                mine, theirs = mine.cast(pa.large_binary()), theirs.cast(pa.large_binary())
            return mine.equals(theirs)
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking: compared by value, never a dict key

    def __repr__(self) -> str:
        return f"IdColumn({len(self)} IDs)"


def _arrow_text(values: pd.Series) -> pa.ChunkedArray:
    """A text column's Arrow data, without a copy where the column is Arrow-backed."""
    import pyarrow as pa

    array = pa.array(values, from_pandas=True)
    return array if isinstance(array, pa.ChunkedArray) else pa.chunked_array([array], array.type)


def _same_or(written: pa.ChunkedArray, canonical: pa.ChunkedArray) -> IdColumn:
    """``canonical``, or the IDs as ``written`` (sharing the table's buffers) when every one is already canonical."""
    import pyarrow.compute as pc

    same = len(written) == 0 or bool(pc.all(pc.equal(written, canonical)).as_py())
    return IdColumn(written if same else canonical)


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


def canonical_ids(raw: pd.Series, id_type: IdType) -> IdColumn:
    """Every ID's canonical bytes under ``id_type``; ``IdError`` for IDs that are not of that type.

    Computed column-wise in Arrow (no Python object per ID) but for integer IDs not written plainly.
    """
    stripped = raw.str.strip()
    if id_type == "text":
        import pyarrow.compute as pc

        return _same_or(_arrow_text(raw), pc.utf8_normalize(_arrow_text(stripped), "NFC"))
    plain = stripped.str.fullmatch(_PLAIN.pattern).to_numpy(dtype=bool)
    if plain.all():  # nearly every clean column: nothing to parse
        return _same_or(_arrow_text(raw), _arrow_text(stripped))
    out = stripped.tolist()
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
    import pyarrow as pa

    return IdColumn(pa.array(out, pa.string()))
