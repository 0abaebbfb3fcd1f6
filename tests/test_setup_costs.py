"""Training-session setup at scale: the encoder's fast path equals its reference, and no heavy first-use import."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from parties.tables.encoding import _category_text_each, category_text

COLUMNS = {
    "text": pd.Series([" a", "b ", "a", "3.0", "03", "3", "", "  ", "-2.000", "+4.0", "a"] * 3),
    "text-dtype": pd.Series(["x", None, " 1.0", "x", "y"], dtype="string"),
    "object-with-missing": pd.Series(["a", None, np.nan, " a ", "7.50", "7.0"], dtype=object),
    "mixed-object": pd.Series([1, True, 1.0, "1", "1.0", None, 0, False, -0.0], dtype=object),
    "floats": pd.Series([3.0, 3.5, np.nan, -0.0, 0.0, 1e20, np.inf, -np.inf, 3.0]),
    "ints": pd.Series([3, 1, 3, -7, 0]),
    "nullable-ints": pd.Series([3, None, 3, 12], dtype="Int64"),
    "bools": pd.Series([True, False, True]),
    "categorical": pd.Series(pd.Categorical(["u", " v", "u", None])),
    "empty": pd.Series([], dtype=object),
    "other-index": pd.Series(["b", "a", " b"], index=[10, 3, 7], name="col"),
}


@pytest.mark.parametrize("values", COLUMNS.values(), ids=COLUMNS.keys())
def test_category_text_fast_path_equals_the_value_by_value_reference(values: pd.Series) -> None:
    pd.testing.assert_series_equal(category_text(values), _category_text_each(values))


def test_the_first_training_session_imports_nothing_heavy() -> None:
    """A service builds its optimizers at start-up: a session's setup must then import no module at all."""
    script = """
import sys
import numpy as np, pandas as pd, torch
from parties.learning.model import prepare_optimizers
from parties.learning.training_session import PartySession
from parties.tables.table import AlignedRows, FeatureSchema, PartyTable
prepare_optimizers()  # what the services' start-up does
frame = pd.DataFrame({"a": np.arange(50.0), "c": ["x", "y"] * 25})
table = PartyTable("t.csv", "id", tuple(map(str, range(50))), frame, FeatureSchema(("a",), ("c",)))
before = set(sys.modules)
PartySession("s", table, AlignedRows("al", np.arange(50)), torch.arange(40), __import__(
    "parties.learning.model", fromlist=["BottomConfig"]).BottomConfig())
print(sorted(set(sys.modules) - before))
print("dynamo before setup:", "torch._dynamo" in before)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    imported, dynamo = run.stdout.strip().splitlines()
    assert imported == "[]", f"session setup imported {imported}"
    assert dynamo == "dynamo before setup: True"  # it is what building Adam pulls in: at start-up, not here
