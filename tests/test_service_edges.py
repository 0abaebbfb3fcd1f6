"""The edges of a party service: hostile bodies, slow clients, refused handshakes, files on disk.

Every test here runs a real uvicorn server on 127.0.0.1 with real mutual TLS
and talks to it over real sockets, because each edge lives below the app.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from parties.client import make_client
from parties.errors import BadMessage
from parties.tls import TLSFiles
from parties.wire import check_nesting, decode


def deep_message(levels: int = 30_000) -> bytes:
    """A safetensors body whose JSON header nests ``levels`` deep, in under 64 KB."""
    header = b'{"__metadata__":{"schema_version":"1"},"x":' + b"[" * levels + b"]" * levels + b"}"
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


@pytest.fixture()
def tiny_partner_csv(write_csv) -> Path:
    return write_csv("p.csv", customer_id=[f"c{i}" for i in range(20)], x=[float(i) for i in range(20)])


def test_nesting_check_counts_brackets_outside_strings_only() -> None:
    check_nesting(b'{"a":{"b":[1,2]},"s":"[[[[[[[[[[[[[\\"[[[[[[[[[[[["}')  # brackets in strings do not count
    with pytest.raises(BadMessage, match="nests deeper"):
        check_nesting(b'{"a":' + b"[" * 9 + b"]" * 9 + b"}")
    with pytest.raises(BadMessage, match="nests deeper"):
        decode(deep_message(), {})


@pytest.mark.parametrize("path", ["/train/sessions", "/models/m1/embed"], ids=["train", "score"])
def test_a_deeply_nested_header_is_a_400_not_a_500(pki, start_partner, tiny_partner_csv, path) -> None:
    partner = start_partner(tiny_partner_csv)
    body = deep_message()
    assert len(body) < 1 << 16
    with make_client(TLSFiles.from_dir(pki, "bank")) as client:
        response = client.post(f"{partner.url}{path}", content=body)
        assert response.status_code == 400, response.text
        assert "nests deeper" in response.json()["detail"]
        assert client.get(f"{partner.url}/health").status_code == 200  # and the service still answers
