"""The one binary format for tensors on the wire: safetensors, with string metadata.

A message is a safetensors blob: an 8-byte header length, a JSON header
(shapes, dtypes, offsets and a ``__metadata__`` map of strings), then the raw
little-endian tensor bytes. No code and no pickle: a malformed body is a
``BadMessage``, never an exception from deep inside a parser.

Every message's metadata carries the schema version; training messages also
carry the session and the step.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _load
from safetensors.torch import save as _save

from parties.errors import BadMessage
from parties.protocol.common import SCHEMA_VERSION

__all__ = ["SAFETENSORS", "WireMessage", "all_finite", "check_nesting", "decode", "encode", "parse", "serialize"]

SAFETENSORS = "application/vnd.cutlayer.safetensors"
_MAX_HEADER = 1 << 16
#: A safetensors header nests three deep (header, tensor, shape); anything far deeper is an attack.
MAX_HEADER_DEPTH = 8
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


@dataclass(frozen=True)
class WireMessage:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def int_meta(self, key: str) -> int:
        try:
            return int(self.meta[key])
        except KeyError as exc:
            raise BadMessage(f"the message has no {key!r}") from exc
        except ValueError as exc:
            raise BadMessage(f"{key!r} is not an integer") from exc


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite: no NaN, no infinity.

    A sum is finite only if every element is (a NaN or an infinity makes it
    NaN or infinite), so a finite sum answers with one fast reduction. Only a
    sum that is not finite (a bad element, or finite values that overflow)
    pays for ``torch.isfinite``, about 15 times slower on a step's gradient.
    """
    return math.isfinite(tensor.sum().item()) or bool(torch.isfinite(tensor).all())


_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def encode(tensors: dict[str, torch.Tensor], **meta: object) -> bytes:
    """A message: the tensors and the metadata (as strings, with the schema version) in one body."""
    strings = {k: str(v) for k, v in meta.items()}
    strings["schema_version"] = str(SCHEMA_VERSION)
    return serialize(tensors, strings)


def serialize(tensors: dict[str, torch.Tensor], strings: dict[str, str]) -> bytes:
    """Tensors (made contiguous, on the CPU) and string metadata as one safetensors blob.

    The format is simple enough to write directly: an 8-byte little-endian
    header length, the JSON header padded with spaces to 8 bytes, then each
    tensor's bytes in order. Written here it costs under half of
    ``safetensors.torch.save`` (which also leaves ctypes reference cycles for
    the garbage collector), and the tests check every dtype against
    safetensors' own reader.
    """
    flat = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if sys.byteorder != "little" or any(t.dtype not in _DTYPE_NAMES for t in flat.values()):
        return _save(flat, metadata=strings)
    header: dict[str, object] = {"__metadata__": strings}
    data, offset = [], 0
    for name, tensor in flat.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        data.append(tensor.reshape(-1).view(torch.uint8).numpy())
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head, *data])


def check_nesting(header: bytes, limit: int = MAX_HEADER_DEPTH) -> None:
    """Refuse a JSON header nested deeper than ``limit``, before any recursive parser sees it.

    ``json.loads`` recurses once per level: 30,000 brackets in a 60 KB header
    end in ``RecursionError`` (an HTTP 500), not a refusal. Counting brackets
    outside strings needs no recursion, and a header with few brackets (every
    real one) skips even that.
    """
    if header.count(b"[") + header.count(b"{") <= limit:
        return
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub(b"", header)):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > limit:
                raise BadMessage(f"the message header nests deeper than {limit} levels")
        else:
            depth -= 1


def parse(blob: bytes, *, max_header: int = _MAX_HEADER) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A safetensors blob's JSON header and its tensors: bounded, nesting-checked, never unpickled.

    The one parser for messages (``decode``) and checkpoint files
    (``parties.storage.checkpoint``). Anything malformed is a ``BadMessage``.
    """
    if len(blob) < 8:
        raise BadMessage("the body is not a safetensors message")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > max_header or 8 + header_len > len(blob):
        raise BadMessage("the message header is too large or truncated")
    raw = blob[8 : 8 + header_len]
    check_nesting(raw)
    try:
        header = json.loads(raw)
        tensors = _load(blob)
    except (SafetensorError, ValueError, UnicodeDecodeError) as exc:
        raise BadMessage(f"the body is not a valid safetensors message ({exc})") from exc
    if not isinstance(header, dict):
        raise BadMessage("the message header is not a JSON object")
    return header, tensors


def decode(body: bytes, allowed: Mapping[str, torch.dtype | tuple[torch.dtype, ...]], *,
           check_finite: bool = True) -> WireMessage:
    """Parse a body, accepting only the named tensors with their dtypes (or one of several); check the schema version.

    ``check_finite=False`` is for a caller that checks finiteness itself (the
    training step does, for every path), so the hot path pays for it once.
    """
    header, tensors = parse(body)
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadMessage("message metadata must map strings to strings")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise BadMessage(f"schema version {meta.get('schema_version')!r} is not supported (expected {SCHEMA_VERSION})")
    for name, tensor in tensors.items():
        if name not in allowed:
            raise BadMessage(f"unexpected tensor {name!r}")
        expected = allowed[name]
        if tensor.dtype != expected and not (isinstance(expected, tuple) and tensor.dtype in expected):
            raise BadMessage(f"tensor {name!r} is {tensor.dtype}; expected {expected}")
        if check_finite and tensor.is_floating_point() and not all_finite(tensor):
            raise BadMessage(f"tensor {name!r} holds NaN or infinite values")
    return WireMessage(tensors, meta)
