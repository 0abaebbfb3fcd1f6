"""A party's own file: every bad input gets an error naming the file and the column."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parties.errors import DataError
from parties.tables.table import load_party_table


def test_a_good_file_loads_with_its_schema(write_csv) -> None:
    path = write_csv("bank.csv", customer_id=["007", "8"], age=["31", "40"], job=["a", "b"], y=["no", "yes"])
    table = load_party_table(path, "customer_id", "y")
    assert list(table.ids) == ["007", "8"]
    assert table.schema.numeric == ("age",) and table.schema.categorical == ("job",)
    assert table.features["age"].tolist() == [31.0, 40.0]
    assert table.labels is not None and table.labels.tolist() == ["no", "yes"]


CASES = {
    "missing-id-column": (dict(id=["1"], a=["1"]), "customer_id", None, r"no ID column 'customer_id'"),
    "missing-label": (dict(customer_id=["1"], a=["1"]), "customer_id", "y", r"no label column 'y'"),
    "duplicate-ids": (dict(customer_id=["1", "2", "1"], a=["1", "2", "3"]), "customer_id", None, r"duplicate IDs \(rows 2 and 4"),
    "duplicate-after-normalising": (dict(customer_id=["A1", " A1"], a=["1", "2"]), "customer_id", None, "duplicate IDs"),
    "blank-id": (dict(customer_id=["1", " "], a=["1", "2"]), "customer_id", None, r"'customer_id' is empty at row 3"),
    "blank-label": (dict(customer_id=["1", "2"], y=["no", ""]), "customer_id", "y", r"'y' has no label at row 3"),
}


@pytest.mark.parametrize(("columns", "id_column", "label", "message"), CASES.values(), ids=CASES.keys())
def test_bad_files(write_csv, columns, id_column, label, message) -> None:
    path = write_csv("party.csv", **columns)
    with pytest.raises(DataError, match=message) as info:
        load_party_table(path, id_column, label)
    assert "party.csv" in str(info.value)


def test_unparsable_numeric_values_name_column_kind_count_and_row(write_csv, tmp_path: Path) -> None:
    path = write_csv("p.csv", customer_id=["1", "2", "3", "4", "5"], balance=["10", "abc", "", "x", "inf"])
    path.with_suffix(".schema.json").write_text('{"numeric": ["balance"], "categorical": []}')
    with pytest.raises(DataError, match=r"p.csv: column 'balance' is numeric, but holds values that are not finite "
                                        r"numbers: 1 empty \(first at row 4\), 2 text \(first at row 3\), "
                                        r"1 infinite \(first at row 6\)"):
        load_party_table(path, "customer_id", missing_numbers=False)
    # By default an empty cell is a missing value the encoder imputes (and counts); text still is not a number.
    with pytest.raises(DataError, match=r"2 text \(first at row 3\), 1 infinite"):
        load_party_table(path, "customer_id")


def test_empty_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text("customer_id,a\n")
    with pytest.raises(DataError, match="empty.csv: the file is empty"):
        load_party_table(tmp_path / "empty.csv", "customer_id")
    with pytest.raises(DataError, match="header.csv: the file has a header but no rows"):
        load_party_table(tmp_path / "header.csv", "customer_id")
    with pytest.raises(DataError, match="nothere.csv: no such file"):
        load_party_table(tmp_path / "nothere.csv", "customer_id")


def test_a_row_of_the_wrong_width_is_named_by_number_never_quoted(tmp_path: Path) -> None:
    """Arrow's reader quotes the offending row; a customer's ID must not reach an error message or a log."""
    (tmp_path / "long.csv").write_text("customer_id,a\nC-0001,x\nC-SECRET-77,y,z\n")
    (tmp_path / "short.csv").write_text("customer_id,a\r\nC-0001,x\r\nC-SECRET-77\r\n")
    for name, problem in (("long.csv", "row 3 has 3 fields; the header has 2"),
                          ("short.csv", "row 3 has 1 field; the header has 2")):
        with pytest.raises(DataError) as info:
            load_party_table(tmp_path / name, "customer_id")
        assert str(info.value) == f"{tmp_path / name}: not a readable CSV file ({problem})"


def test_cells_are_text_as_written_whatever_the_reader(tmp_path: Path) -> None:
    """NA, null and quoted separators are text as written; CRLF, CR and a BOM change nothing."""
    body = 'customer_id,a\n1,NA\n2,null\n3,"x,y"\n4,\n'
    for name, data in (("lf.csv", body.encode()), ("crlf.csv", body.replace("\n", "\r\n").encode()),
                       ("cr.csv", body.replace("\n", "\r").encode()), ("bom.csv", b"\xef\xbb\xbf" + body.encode())):
        (tmp_path / name).write_bytes(data)
        table = load_party_table(tmp_path / name, "customer_id", categorical=["a"])
        assert list(table.ids) == ["1", "2", "3", "4"], name
        assert table.features["a"].tolist() == ["NA", "null", "x,y", ""], name


def test_schema_naming_a_missing_column(write_csv) -> None:
    path = write_csv("p.csv", customer_id=["1"], a=["1"])
    path.with_suffix(".schema.json").write_text('{"numeric": ["a", "b"]}')
    with pytest.raises(DataError, match="column 'b' named in p.schema.json is missing"):
        load_party_table(path, "customer_id")


@pytest.mark.parametrize("module", ["partner", "bank"])
def test_serve_cli_refuses_bad_data_without_a_traceback(write_csv, module: str) -> None:
    path = write_csv("dup.csv", customer_id=["1", "1"], a=["1", "2"], y=["no", "yes"])
    result = subprocess.run(
        [sys.executable, "-m", module, "serve", "--name", module, "--data", str(path), "--insecure"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "dup.csv: column 'customer_id' has duplicate IDs" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_cli_requires_tls_or_insecure(write_csv) -> None:
    path = write_csv("p.csv", customer_id=["1"], a=["1"])
    result = subprocess.run(
        [sys.executable, "-m", "partner", "serve", "--name", "partner", "--data", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "TLS is required" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("cpus", "message"),
    [("zero", "--cpus takes CPU numbers separated by commas"), ("4096", "--cpus 4096: this machine cannot run on")],
    ids=["not-a-number", "no-such-cpu"],
)
def test_serve_cli_refuses_cpus_it_cannot_use(write_csv, cpus: str, message: str) -> None:
    path = write_csv("p.csv", customer_id=["1"], a=["1"])
    result = subprocess.run(
        [sys.executable, "-m", "partner", "serve", "--name", "partner", "--data", str(path), "--insecure",
         "--cpus", cpus],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_serve_pins_its_cpus_before_reading_the_table(write_csv, tmp_path: Path) -> None:
    """Linux pins the calling thread only: a table reader that starts threads (Parquet's) before the pinning
    would leave them on every CPU. The table is read with the process already pinned."""
    path = write_csv("p.csv", customer_id=["1"], a=["1"])
    script = (
        "import os, sys\n"
        "import partner.__main__ as cli, partner.settings as s\n"
        "def load_table(self):\n"
        "    print('cpus while reading', sorted(os.sched_getaffinity(0)), flush=True)\n"
        "    raise SystemExit(0)\n"
        "s.PartnerSettings.load_table = load_table\n"
        "cli.main(sys.argv[1:])\n"
    )
    result = subprocess.run([sys.executable, "-c", script, "serve", "--name", "partner", "--data", str(path),
                             "--insecure", "--cpus", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "cpus while reading [0]" in result.stdout, result.stderr[-2000:]


def test_kinds_are_inferred_from_any_column_pandas_holds_and_categories_are_held_as_codes(write_csv) -> None:
    """``infer_kinds`` takes what a caller's frame holds (an object column of mixed Python types reads as its
    text); a loaded table keeps a category of few values as codes, whose values are the text as written."""
    import pandas as pd

    from parties.tables.schema import infer_kinds

    frame = pd.DataFrame({"mixed": pd.Series([1, "2", 3.5], dtype=object), "words": ["a", "b", "a"],
                          "spaced": pd.Series(["", "4", " "], dtype=object)})
    assert infer_kinds(frame, ["mixed", "words", "spaced"]) == (("mixed", "spaced"), ("words",))
    path = write_csv("t.csv", customer_id=[f"c{i}" for i in range(12)], y=[i % 2 for i in range(12)],
                     job=[f"{'ab'[i % 2]} " for i in range(12)], age=list(range(12)))
    table = load_party_table(path, labelled=True, categorical=["job"])
    assert isinstance(table.features["job"].dtype, pd.CategoricalDtype)
    assert table.features["job"].astype(str).tolist() == ["a ", "b "] * 6


def _cell_by_cell(frame):
    """The reference for a typed file's text: every cell written out in Python (floats by ``repr``)."""
    import numpy as np
    import pandas as pd

    def text(v: object) -> str:
        if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)):
            return ""
        return repr(float(v)) if isinstance(v, float) else str(v)

    return {str(c): [text(v) for v in frame[c].astype(object)] for c in frame.columns}


def _typed_frame(n: int = 1500):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    return pd.DataFrame({
        "customer_id": [f"C{i:05d}" for i in range(n)],
        "y": rng.choice(["yes", "no"], n),
        "count": rng.integers(-10**12, 10**12, n),
        "amount": np.where(rng.random(n) < 0.1, np.nan, rng.normal(size=n) * 10.0 ** rng.integers(-8, 20, n)),
        "edge": rng.choice([0.0, -0.0, 1e16, 1e-5, 0.1, 3.0, 2.5e-300], n),
        "ratio": rng.normal(size=n).astype(np.float32),
        "flag": rng.random(n) < 0.5,
        "word": pd.Series(rng.choice(["a", " b", None, "é", "01"], n), dtype=object),
        "segment": pd.Categorical(rng.choice(["x", "y", "z"], n)),
        "code": pd.array(rng.choice([1, 2, None], n), dtype="Int64"),
        "opened": pd.to_datetime("2020-01-01") + pd.to_timedelta(rng.integers(0, 1000, n), unit="D"),
    })


@pytest.mark.parametrize("fmt", ["parquet", "feather"])
def test_a_typed_file_reads_as_its_cells_written_out_whatever_the_type(tmp_path: Path, fmt: str) -> None:
    """Parquet and Feather: each typed value is written out once per distinct value, as Python writes it cell by
    cell (floats by their shortest round trip, missing as ""); text columns stay Arrow's own."""
    from parties.tables.table import read_table_text

    frame = _typed_frame()
    path = tmp_path / f"t.{fmt}"
    frame.to_parquet(path) if fmt == "parquet" else frame.to_feather(path)
    text = read_table_text(path)
    assert list(text.columns) == list(frame.columns)
    for col, expected in _cell_by_cell(frame).items():
        assert text[col].tolist() == expected, col
    # A pandas index saved in the file is not a column; a file that is no table is refused, naming it.
    frame.set_index("customer_id").to_parquet(tmp_path / "indexed.parquet")
    assert "customer_id" not in read_table_text(tmp_path / "indexed.parquet").columns
    (tmp_path / "broken.feather").write_bytes(b"ARROW1" + b"\0" * 40)
    with pytest.raises(DataError, match=r"broken.feather: not a readable CSV, Parquet or Feather file"):
        load_party_table(tmp_path / "broken.feather")


def test_a_table_is_the_same_from_csv_parquet_or_feather(tmp_path: Path) -> None:
    import pyarrow as pa
    from pyarrow import feather

    # Left out: pandas writes a float32 to CSV at float32's precision, and a midnight timestamp as a date.
    frame = _typed_frame().drop(columns=["ratio", "opened"])
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / "t.parquet")
    frame.to_feather(tmp_path / "t.feather")
    tables = {fmt: load_party_table(tmp_path / f"t.{fmt}", labelled=True, categorical=["code", "flag"])
              for fmt in ("csv", "parquet", "feather")}
    csv = tables.pop("csv")
    for fmt, table in tables.items():
        assert table.schema == csv.schema and list(table.ids) == list(csv.ids), fmt
        assert table.labels.tolist() == csv.labels.tolist(), fmt
        for col in csv.schema.numeric:
            assert table.features[col].equals(csv.features[col]), (fmt, col)
        for col in csv.schema.categorical:
            assert table.features[col].astype(str).tolist() == csv.features[col].astype(str).tolist(), (fmt, col)
    twice = pa.table({"customer_id": ["a", "b"], "x": [1, 2], "x ": [3, 4]}).rename_columns(["customer_id", "x", "x"])
    feather.write_feather(twice, tmp_path / "twice.feather")
    with pytest.raises(DataError, match=r"twice.feather: columns named more than once: \['x'\]"):
        load_party_table(tmp_path / "twice.feather")


def test_rare_arrow_types_load_as_text_and_a_feather_file_may_be_rewritten_while_held(tmp_path: Path) -> None:
    """Views, nested values and dates past year 9999 load as text (cell by cell, as pandas holds them); a Feather
    file is read whole, so rewriting it in place under a running service changes nothing the service holds."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow import feather

    table = pa.table({
        "customer_id": pa.array(["a", "b", "c"], pa.string_view()),
        "tags": pa.array([[1, 2], None, []], pa.list_(pa.int64())),
        "until": pa.array([datetime.date(9999, 12, 31), None, datetime.date(2020, 1, 1)], pa.date32()),
        "far": pa.array([datetime.datetime(9999, 12, 31, 23, 59), None, datetime.datetime(2020, 1, 1)], pa.timestamp("us")),
        "count": pa.array([1, None, 3], pa.uint64()),
    })
    pq.write_table(table, tmp_path / "rare.parquet")
    loaded = load_party_table(tmp_path / "rare.parquet", categorical=["tags", "until", "far", "count"])
    assert list(loaded.ids) == ["a", "b", "c"]
    assert loaded.features["tags"].astype(str).tolist() == ["[1 2]", "", "[]"]
    assert loaded.features["until"].astype(str).tolist() == ["9999-12-31", "", "2020-01-01"]
    assert loaded.features["far"].astype(str).tolist()[1:] == ["", "2020-01-01 00:00:00"]
    assert loaded.features["count"].astype(str).tolist() == ["1", "", "3"]  # an integer with nulls stays one

    big = pa.table({"customer_id": [f"C{i}" for i in range(50_000)], "x": list(range(50_000))})
    feather.write_feather(big, tmp_path / "held.feather", compression="uncompressed")
    held = load_party_table(tmp_path / "held.feather")
    feather.write_feather(big.slice(0, 10), tmp_path / "held.feather", compression="uncompressed")  # in place
    assert len(held) == 50_000 and held.normalized_ids[49_999] == b"C49999"
