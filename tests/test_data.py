"""The UCI loader (cache, checksum, download) and the vertical partitioner."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from data.partition import BANK_COLUMNS, PARTNER_COLUMNS, PartitionSpec, PartySpec, partition, read_source_csv
from data.prepare import prepare_bank_marketing
from data.uci import BANK_FULL_NAME, locate_bank_full
from parties.errors import ConfigError, DataError, DatasetUnavailable
from parties.transport.server import bind_socket, running_server


def _nested_zip(csv: bytes) -> bytes:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr(BANK_FULL_NAME, csv)
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w") as z:
        z.writestr("bank.zip", inner.getvalue())
        z.writestr("bank-additional.zip", b"not used")
    return outer.getvalue()


def _archive_server(payload: bytes):
    app = FastAPI()

    @app.get("/bank+marketing.zip")
    def archive() -> Response:
        return Response(payload, media_type="application/zip")

    return running_server(app, tls=None)


def test_download_extracts_the_nested_archive_and_verifies_it(bank_full: Path, tmp_path: Path) -> None:
    with _archive_server(_nested_zip(bank_full.read_bytes())) as server:
        path = locate_bank_full(tmp_path, url=f"{server.url}/bank+marketing.zip")
    assert path == tmp_path / BANK_FULL_NAME
    assert path.read_bytes() == bank_full.read_bytes()


def test_a_tampered_download_is_refused_and_not_saved(bank_full: Path, tmp_path: Path) -> None:
    tampered = bank_full.read_bytes().replace(b'"no"', b'"yes"', 1)
    with _archive_server(_nested_zip(tampered)) as server:
        with pytest.raises(DatasetUnavailable, match="SHA-256"):
            locate_bank_full(tmp_path, url=f"{server.url}/bank+marketing.zip")
    assert not (tmp_path / BANK_FULL_NAME).exists()


def test_offline_gives_a_clear_message(tmp_path: Path) -> None:
    sock = bind_socket()  # bound but never listening: connections are refused
    port = sock.getsockname()[1]
    try:
        with pytest.raises(DatasetUnavailable, match="copy bank-full.csv into"):
            locate_bank_full(tmp_path, url=f"http://127.0.0.1:{port}/bank+marketing.zip")
    finally:
        sock.close()


def test_a_corrupted_cached_file_is_refused(bank_full: Path, tmp_path: Path) -> None:
    shutil.copy(bank_full, tmp_path / BANK_FULL_NAME)
    with (tmp_path / BANK_FULL_NAME).open("ab") as f:
        f.write(b"extra")
    with pytest.raises(DatasetUnavailable, match="fails its SHA-256"):
        locate_bank_full(tmp_path, download=False)


def test_bank_marketing_partition(bank_full: Path, tmp_path: Path) -> None:
    paths = prepare_bank_marketing(tmp_path, cache=bank_full.parent, download=False)
    bank = pd.read_csv(paths["bank"], dtype=str)
    partner = pd.read_csv(paths["partner"], dtype=str)
    assert list(bank.columns) == ["customer_id", *BANK_COLUMNS, "y"]
    assert list(partner.columns) == ["customer_id", *PARTNER_COLUMNS]
    assert len(bank) == round(0.95 * 45211) and len(partner) == round(0.90 * 45211)
    assert bank["customer_id"].is_unique and partner["customer_id"].is_unique
    overlap = len(set(bank["customer_id"]) & set(partner["customer_id"]))
    assert 0.83 * 45211 < overlap < 0.88 * 45211  # ~0.95 * 0.90: partial, as in real life
    assert not bank["customer_id"].is_monotonic_increasing  # each party's own shuffle
    # Rows carry the right values: the source row number is the ID.
    source = read_source_csv(bank_full)
    row = bank.iloc[0]
    assert source.loc[int(row["customer_id"][1:]), "age"] == row["age"]
    schema = json.loads(paths["bank"].with_suffix(".schema.json").read_text())
    assert schema["label_column"] == "y" and "age" in schema["numeric"] and "job" in schema["categorical"]


def test_partition_is_seeded(bank_full: Path, tmp_path: Path) -> None:
    a = prepare_bank_marketing(tmp_path / "a", cache=bank_full.parent, download=False, rows=2000, seed=3)
    b = prepare_bank_marketing(tmp_path / "b", cache=bank_full.parent, download=False, rows=2000, seed=3)
    c = prepare_bank_marketing(tmp_path / "c", cache=bank_full.parent, download=False, rows=2000, seed=4)
    assert a["bank"].read_bytes() == b["bank"].read_bytes()
    assert a["bank"].read_bytes() != c["bank"].read_bytes()


def test_partner_columns_spread_over_several_partners(bank_full: Path, tmp_path: Path) -> None:
    paths = prepare_bank_marketing(tmp_path, n_partners=3, cache=bank_full.parent, download=False, rows=1000)
    assert sorted(paths) == ["bank", "partner1", "partner2", "partner3"]
    spread = [c for n in ("partner1", "partner2", "partner3") for c in pd.read_csv(paths[n]).columns[1:]]
    assert spread == list(PARTNER_COLUMNS)


def test_generic_partition_keeps_a_given_id_column() -> None:
    frame = pd.DataFrame({"acct": ["007", "008", "009"], "a": ["1", "2", "3"], "b": ["x", "y", "z"], "t": ["0", "1", "0"]})
    spec = PartitionSpec((PartySpec("p1", ("a",)), PartySpec("p2", ("b",))), "t", "p1", id_column="acct")
    parts = partition(frame, spec)
    assert list(parts["p1"].columns) == ["acct", "a", "t"] and list(parts["p2"].columns) == ["acct", "b"]
    assert sorted(parts["p2"]["acct"]) == ["007", "008", "009"]  # text IDs keep their leading zeros


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (PartitionSpec((PartySpec("p", ("nope",)),), "t", "p"), "no column 'nope'"),
        (PartitionSpec((PartySpec("p", ("a",)), PartySpec("q", ("a",))), "t", "p"), "more than one party"),
        (PartitionSpec((PartySpec("p", ("a",)),), "t", "q"), "label party"),
        (PartitionSpec((PartySpec("p", ("a", "t")),), "t", "p"), "cannot also be a feature"),
        (PartitionSpec((PartySpec("p", ("a",), coverage=1.5),), "t", "p"), "coverage"),
    ],
    ids=["unknown-column", "column-twice", "unknown-label-party", "label-as-feature", "bad-coverage"],
)
def test_bad_partition_specs(spec: PartitionSpec, message: str) -> None:
    frame = pd.DataFrame({"a": ["1"], "t": ["0"]})
    with pytest.raises(ConfigError, match=message):
        partition(frame, spec)


def test_duplicate_source_ids_are_refused() -> None:
    frame = pd.DataFrame({"id": ["1", "1"], "a": ["1", "2"], "t": ["0", "1"]})
    with pytest.raises(DataError, match="duplicate"):
        partition(frame, PartitionSpec((PartySpec("p", ("a",)),), "t", "p", id_column="id"))


def test_cli_help_and_errors(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "data", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "bank-marketing" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "data", "partition", "--csv", str(tmp_path / "missing.csv"), "--out", str(tmp_path),
         "--label", "y", "--label-party", "bank", "--party", "bank=age"],
        capture_output=True, text=True,
    )
    assert bad.returncode == 2
    assert "missing.csv: no such file" in bad.stderr and "Traceback" not in bad.stderr
