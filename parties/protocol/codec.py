"""How a training step's float tensors travel: exactly (float32, the default) or compressed.

The bank chooses the precision for a training session (``TrainingConfig.wire_precision``),
the partner accepts it when the session starts, and every step message says
which it carries, so an answer always matches its request, also after a
restart. Compressed precisions trade bytes for exactness:

- ``fp32``: the tensor as is; split training equals the unsplit model bit for bit.
- ``fp16``, ``bf16``: half the bytes; each value rounded to the nearest half.
- ``int8``: a quarter of the bytes plus one byte per row: each row is scaled
  by a power of two, its exponent ``e`` chosen so that the row's largest
  magnitude lands in (63.5, 127], and rounded. Decoding is ``code * 2**e``,
  exact in float32; the rounding error is at most 1/127 of the row's largest
  value. A power of two rather than a float scale keeps the bytes per row at
  17 of fp32's 64 for a 16-wide cut.

Either end decodes to float32 before using a tensor; what was decoded is what
both ends compute with, so a run stays deterministic.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from parties.errors import BadMessage
from parties.protocol.wire import WireMessage

__all__ = ["PRECISIONS", "Precision", "allowed", "any_precision", "pack", "parse_precision", "unpack"]

Precision = Literal["fp32", "fp16", "bf16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_SCALE = "{}.exp"
# Exponents beyond these would overflow float32 (127 * 2**121 does not) or are below any gradient worth sending.
_EXP_RANGE = (-128, 120)


def parse_precision(value: str | None) -> Precision:
    """A precision named in a message (absent: ``fp32``); anything else is refused."""
    if value is None or value == "fp32":
        return "fp32"
    if value not in PRECISIONS:
        raise BadMessage(f"precision {value!r} is not one of {', '.join(PRECISIONS)}")
    return value  # type: ignore[return-value]


def allowed(name: str, precision: Precision) -> dict[str, torch.dtype]:
    """The tensors and dtypes that carry float tensor ``name`` at ``precision``."""
    if precision == "fp32":
        return {name: torch.float32}
    if precision == "int8":
        return {name: torch.int8, _SCALE.format(name): torch.int8}
    return {name: _HALF[precision]}


def any_precision(name: str) -> dict[str, tuple[torch.dtype, ...]]:
    """What may carry ``name`` at some precision: for a message whose precision is read from its own metadata.

    Any float or int8 dtype passes here; ``unpack`` then holds it to the message's precision, and says which
    dtype that precision expects."""
    carriers = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8)
    return {name: carriers, _SCALE.format(name): carriers}


def pack(name: str, tensor: torch.Tensor, precision: Precision) -> dict[str, torch.Tensor]:
    """``tensor`` (float32, one row per sample) as the tensors that carry it at ``precision``."""
    if precision == "fp32":
        return {name: tensor}
    if precision == "int8":
        rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() else tensor.reshape(1, 1)
        mantissa, exponent = torch.frexp(rows.abs().amax(dim=1) / 127.0)  # x = m * 2**k, m in [0.5, 1)
        exp = (exponent - (mantissa == 0.5).to(exponent.dtype)).clamp_(*_EXP_RANGE)  # the least e with x <= 2**e
        codes = torch.round(torch.ldexp(rows, -exp[:, None])).clamp_(-127, 127).to(torch.int8)
        return {name: codes.reshape(tensor.shape), _SCALE.format(name): exp.to(torch.int8)}
    return {name: tensor.to(_HALF[precision])}


def unpack(message: WireMessage, name: str, precision: Precision) -> torch.Tensor | None:
    """Float tensor ``name`` back as float32 (``None`` if absent); a malformed one is a ``BadMessage``."""
    carried = message.get(name)
    if carried is None:
        return None
    expected = allowed(name, precision)
    if carried.dtype != expected[name]:
        named = "" if precision == "fp32" else f" (precision {precision})"
        raise BadMessage(f"tensor {name!r} is {carried.dtype}; expected {expected[name]}{named}")
    if precision != "int8" and message.get(_SCALE.format(name)) is not None:
        raise BadMessage(f"{name!r} in {precision} carries no exponents")
    if precision == "fp32":
        return carried
    if precision != "int8":
        return carried.to(torch.float32)
    exp = message.get(_SCALE.format(name))
    rows = carried.shape[0] if carried.dim() else 1
    if exp is None or exp.dtype != torch.int8 or tuple(exp.shape) != (rows,):
        raise BadMessage(f"{name!r} in int8 needs one int8 exponent per row ({rows})")
    if rows and int(exp.max()) > _EXP_RANGE[1]:
        raise BadMessage(f"the exponents of {name!r} must be at most {_EXP_RANGE[1]} (float32 would overflow)")
    values = torch.ldexp(carried.reshape(rows, -1).to(torch.float32), exp[:, None].to(torch.float32))
    return values.reshape(carried.shape)
