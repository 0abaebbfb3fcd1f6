"""A party's feature columns live in a private mapped file, not in the service's memory, and read the same."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet
import pytest

from parties import memory
from parties.errors import DataError
from parties.memory import MappedColumns, release
from parties.tables import reading
from parties.tables.reading import read_table_text
from parties.tables.table import load_party_table


def _mapping_of(array: np.ndarray) -> mmap.mmap | None:
    base: object = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else base.base  # type: ignore[attr-defined]
    return base


@pytest.fixture()
def table_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(5)
    n = 3000
    frame = pd.DataFrame({
        "customer_id": [f"C{i:05d}" for i in range(n)],
        "age": rng.integers(18, 90, n).astype(str),
        "balance": np.where(rng.random(n) < 0.1, "", np.round(rng.normal(1000, 400, n), 2).astype(str)),
        "segment": rng.choice(["retail", "student", "premier"], n),
        "note": [f"free text {i}" for i in range(n)],  # many distinct values: stays text, in memory
        "y": rng.choice(["yes", "no"], n),
    })
    path = tmp_path / "bank.csv"
    frame.to_csv(path, index=False)
    (tmp_path / "bank.schema.json").write_text(
        '{"id_column": "customer_id", "label_column": "y", "numeric": ["age", "balance"], '
        '"categorical": ["segment", "note"]}')
    return path


def test_numbers_and_category_codes_are_read_only_views_of_a_private_mapping(table_file: Path, tmp_path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    table = load_party_table(table_file, labelled=True, spill_dir=spill)
    features = table.features
    assert os.listdir(spill) == []  # unnamed: nobody can open, truncate or rewrite it under the mapping
    for col in ("age", "balance"):
        values = features[col].to_numpy()
        assert values.dtype == np.float64 and not values.flags.writeable and _mapping_of(values) is not None
    codes = features["segment"].array.codes
    assert not codes.flags.writeable and _mapping_of(codes) is not None
    assert _mapping_of(features["note"].to_numpy()) is None  # text of many values is kept as it was
    # The values are the file's: numbers parsed (an empty cell is missing), categories as written.
    text = read_table_text(table_file)
    expected = pd.to_numeric(text["balance"].replace("", np.nan)).to_numpy(dtype=np.float64)
    assert np.array_equal(features["balance"].to_numpy(), expected, equal_nan=True)
    assert np.isnan(features["balance"].to_numpy()).sum() == (text["balance"] == "").sum() > 0
    assert features["segment"].astype(str).tolist() == text["segment"].tolist()
    assert list(features.columns) == ["age", "balance", "segment", "note"]
    # A copy a caller changes is its own: the table is not written through.
    changed = features.copy()
    changed.loc[0, "age"] = -1.0
    assert features.loc[0, "age"] == float(text.loc[0, "age"])


def test_release_lets_go_of_the_pages_a_step_read() -> None:
    """A step that reads every row (fitting an encoder, scoring) brings the file's pages into the process; ``release``
    hands them back (read again when next used) and the values are unchanged."""
    store = MappedColumns()
    values = np.arange(8 << 20, dtype=np.float64)  # 64 MB
    store.append(values)
    (mapped,) = store.open()
    assert float(mapped.sum()) == float(values.sum())  # every page read

    def file_pages_kb() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                return int(line.split()[1])
        pytest.skip("no RssFile line in /proc/self/status")

    before = file_pages_kb()
    release()
    assert before - file_pages_kb() > 48 * 1024
    assert float(mapped.sum()) == float(values.sum())
    mapping = weakref.ref(_mapping_of(mapped))
    assert mapping() in list(memory._MAPPED)
    del mapped
    assert mapping() is None  # gone with the last array over it, and with it the file


def test_a_table_without_numbers_or_categories_maps_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ids.csv"
    path.write_text("customer_id,comment\n" + "".join(f"{i},text {i}\n" for i in range(50)))
    table = load_party_table(path, categorical=["comment"])
    assert table.features["comment"].tolist() == [f"text {i}" for i in range(50)]


PEAK_SCRIPT = """
import sys
import pyarrow as pa
from parties.memory import use_system_allocator
use_system_allocator()
from parties.tables.table import load_party_table
table = load_party_table(sys.argv[1])
print(pa.default_memory_pool().max_memory(), len(table))
"""


@pytest.mark.parametrize("suffix", [".parquet", ".feather"])
def test_a_columnar_file_is_loaded_one_column_at_a_time(tmp_path: Path, suffix: str) -> None:
    """Twelve text columns of 100,000 rows: Arrow's peak while loading (in a fresh process) stays well under the
    text of the whole table, which reading the file whole would hold at once."""
    rng = np.random.default_rng(0)
    n = 100_000
    frame = pd.DataFrame({"customer_id": [f"C{i:07d}" for i in range(n)]}
                         | {f"c{k}": rng.choice([f"value-{v:04d}-of-column-{k}" for v in range(200)], n)
                            for k in range(12)})
    path = tmp_path / f"wide{suffix}"
    frame.to_parquet(path) if suffix == ".parquet" else frame.to_feather(path)
    whole = pa.Table.from_pandas(frame.drop(columns="customer_id")).nbytes  # the text of the feature columns
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    peak, rows = map(int, out.stdout.split())
    assert rows == n
    assert peak < whole / 3, (peak, whole)


def test_a_dotted_parquet_column_is_read_as_itself_not_as_a_nested_field(tmp_path: Path) -> None:
    """Parquet names a nested field by its dotted path: a top-level column "a.c" beside a struct "a" with a field "c"
    must read its own values (the file is then read whole)."""
    table = pa.table({"customer_id": ["1", "2", "3"], "a": [{"c": 1}, {"c": 1}, {"c": 2}],
                      "a.c": [10.5, 20.5, 30.5]})
    path = tmp_path / "dotted.parquet"
    pa.parquet.write_table(table, path)
    loaded = load_party_table(path, numeric=["a.c"], categorical=["a"])
    assert loaded.features["a.c"].tolist() == [10.5, 20.5, 30.5]


def test_a_file_replaced_while_it_is_read_column_by_column_is_refused(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Its columns could come from two versions: refused by name, not loaded half and half."""
    path = tmp_path / "bank.feather"
    pd.DataFrame({"customer_id": ["C1", "C2"], "age": [40.0, 30.0]}).to_feather(path)
    newer = tmp_path / "newer.feather"
    pd.DataFrame({"customer_id": ["C2", "C1"], "age": [30.0, 40.0]}).to_feather(newer)
    read = reading.TextColumns.__getitem__

    def replaced_after_the_ids(self, name):
        values = read(self, name)
        if name == "customer_id" and newer.exists():
            os.replace(newer, path)  # as an ETL job writes a file: a new one renamed over the old
        return values

    monkeypatch.setattr(reading.TextColumns, "__getitem__", replaced_after_the_ids)
    with pytest.raises(DataError, match="changed while it was read"):
        load_party_table(path)
    monkeypatch.undo()
    assert load_party_table(path).features["age"].tolist() == [30.0, 40.0]


def test_a_table_without_feature_columns_still_has_a_row_per_customer(tmp_path: Path) -> None:
    path = tmp_path / "ids.parquet"
    pd.DataFrame({"customer_id": [f"C{i}" for i in range(7)], "y": ["a", "b"] * 3 + ["a"]}).to_parquet(path)
    table = load_party_table(path, label_column="y", labelled=True)
    assert table.features.shape == (7, 0) and len(table.features) == len(table)


def test_a_service_keeps_its_columns_in_its_own_state_folder(tmp_path: Path, table_file: Path) -> None:
    """Not in the system's temporary folder: the party's disk, its permissions, its space."""
    from bank.settings import BankSettings

    state = tmp_path / "state"
    settings = BankSettings(name="bank", data=table_file, insecure=True, state_dir=state)
    table = settings.load_table()
    maps = Path("/proc/self/maps").read_text()
    assert f"{state.resolve()}/" in maps and "(deleted)" in maps
    assert table.features["age"].notna().all()
