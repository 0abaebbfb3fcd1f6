"""The wire format: what ``encode`` writes is safetensors, and ``decode`` refuses anything else."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load

from parties.errors import BadMessage
from parties.protocol.common import SCHEMA_VERSION
from parties.protocol.wire import all_finite, decode, encode

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1024, 16), (7,), (), (0, 3)], ids=["matrix", "vector", "scalar", "empty"])
def test_encode_writes_what_safetensors_reads(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(shape, generator=generator) * 50).to(dtype)
    b = torch.arange(5)
    body = encode({"a": a, "b": b}, session="s1", step=3)
    (header_len,) = struct.unpack("<Q", body[:8])
    assert header_len % 8 == 0  # tensors start 8-byte aligned
    read = load(body)
    assert read["a"].dtype == dtype and read["a"].shape == a.shape and torch.equal(read["a"], a)
    assert torch.equal(read["b"], b)
    meta = json.loads(body[8 : 8 + header_len])["__metadata__"]
    assert meta == {"session": "s1", "step": "3", "schema_version": str(SCHEMA_VERSION)}


def test_encode_takes_views_and_non_contiguous_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sliced = base.t()[1:3]
    message = decode(encode({"x": sliced}), {"x": torch.float32})
    assert torch.equal(message.get("x"), sliced)


def test_round_trip_and_refusals() -> None:
    grad = torch.randn(4, 2)
    body = encode({"grad": grad}, step=1)
    message = decode(body, {"grad": torch.float32})
    assert torch.equal(message.get("grad"), grad) and message.int_meta("step") == 1
    with pytest.raises(BadMessage, match="unexpected tensor"):
        decode(body, {"rows": torch.int64})
    with pytest.raises(BadMessage, match="expected torch.float64"):
        decode(body, {"grad": torch.float64})
    with pytest.raises(BadMessage, match="NaN"):
        decode(encode({"grad": torch.tensor([1.0, float("nan")])}), {"grad": torch.float32})
    with pytest.raises(BadMessage, match="not a valid safetensors"):
        decode(body[:-3], {"grad": torch.float32})
    with pytest.raises(BadMessage):
        decode(b"\x00" * 4, {"grad": torch.float32})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    cases = {
        "ordinary": torch.randn(1024, 16).to(dtype),
        "empty": torch.zeros(0, 16, dtype=dtype),
        "overflowing sum": torch.full((8,), big, dtype=dtype),  # every value finite, the sum is not
        "nan": torch.tensor([1.0, float("nan"), 2.0], dtype=dtype),
        "+inf": torch.tensor([1.0, float("inf")], dtype=dtype),
        "-inf": torch.tensor([float("-inf"), 1.0], dtype=dtype),
        "both infinities": torch.tensor([float("inf"), float("-inf")], dtype=dtype),
        "nan among big values": torch.tensor([big, big, float("nan")], dtype=dtype),
    }
    for name, tensor in cases.items():
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all()), name
    assert all_finite(cases["overflowing sum"]) and not all_finite(cases["nan"])


def test_decode_refuses_infinities_whose_sum_is_nan() -> None:
    body = encode({"grad": torch.tensor([float("inf"), float("-inf")])})
    with pytest.raises(BadMessage, match="infinite"):
        decode(body, {"grad": torch.float32})
