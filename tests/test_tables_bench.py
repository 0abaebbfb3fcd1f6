"""``python -m bank.lab tables``: every model on the same rows of each table, the setting chosen on validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.datasets import load_wine
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

from bank.lab.bench import tables


def _lab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bank.lab", "tables", *args], cwd=cwd, capture_output=True, check=False,
                          text=True, timeout=600)


def test_the_benchmark_compares_every_model_on_the_same_rows(tmp_path: Path) -> None:
    done = _lab("--tables", "wine,diabetes", "--settings", "default,ple", "--epochs", "3", "--no-step-costs",
                "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "tables.json").read_text())
    wine, diabetes = results["tables"]
    assert (wine["metric"], diabetes["metric"], wine["repeats"]) == ("roc_auc", "r2", 5)
    expected = {"centralised: HistGradientBoosting", "bank only: HistGradientBoosting", "split: default", "split: ple"}
    assert set(wine["test"]) == expected | {"centralised: logistic"}
    assert set(diabetes["test"]) == expected | {"centralised: ridge"}
    for table in (wine, diabetes):
        assert table["chosen_on_validation"] in ("default", "ple")
        assert all(len(each) == table["repeats"] for each in table["test_each_split"].values())
    # The same rows as an independent HistGradientBoosting on the raw columns (trees see only their order).
    frame = load_wine(as_frame=True).frame
    x, y = frame.drop(columns="target").to_numpy(), frame["target"].to_numpy()
    figures = []
    for repeat in range(5):
        split = tables._split(len(frame), repeat, 0.2, 0.2)
        model = HistGradientBoostingClassifier(random_state=0).fit(x[split["train"]], y[split["train"]])
        figures.append(roc_auc_score(y[split["test"]], model.predict_proba(x[split["test"]]), multi_class="ovr"))
    assert np.allclose(wine["test_each_split"]["centralised: HistGradientBoosting"], figures, atol=1e-9)
    csv = pd.read_csv(tmp_path / "out" / "tables.csv")
    assert len(csv) == len(wine["test"]) + len(diabetes["test"])
    assert "<- best built-in on validation" in done.stdout and "diabetes (442 rows, regression" in done.stdout
    assert results["training"]["epochs"] == 3 and "at most 3 epochs" in done.stdout
    assert diabetes["validation_objective"] == {"name": "mse", "better": "min"}


def test_unknown_tables_and_settings_are_refused_by_name(tmp_path: Path) -> None:
    done = _lab("--settings", "default,bogus", "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode != 0 and "--settings: bogus; choose from default, ple" in done.stderr
    assert "Traceback" not in done.stderr
    done = _lab("--tables", "adult", "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode != 0 and "--tables: adult; choose from bank-full, credit" in done.stderr


def test_step_costs_time_each_setting_for_both_parties() -> None:
    costs = tables.step_costs(tables.wine(), ["default", "periodic"], batch=32, steps=4)
    assert set(costs) == {"bank", "partner"}
    for figures in costs.values():
        assert figures["default"] > 0 and figures["periodic"] > 0
        assert figures["periodic / default"] == pytest.approx(figures["periodic"] / figures["default"])
