"""The analysis notebook runs headless against a small audited run, and its tables hold sane values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import numpy as np
import pandas as pd
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"


@pytest.fixture(scope="module")
def audited_run(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audited") / "run"
    result = subprocess.run(
        [sys.executable, "-m", "bank", "walkthrough", "--out", str(out), "--rows", "5000", "--epochs", "4",
         "--audit", "--cache-dir", str(bank_full.parent), "--no-download", "--workers", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_the_notebook_executes_and_writes_its_tables_and_figures(audited_run: Path, bank_full: Path, monkeypatch) -> None:
    from bank.privacy_study import hijack_rates, run_study

    study = audited_run / "privacy"
    run_study(study, rows=4000, epochs=4, cache=bank_full.parent, download=False)
    hijack_rates(study, runs=2, rows=2000, cache=bank_full.parent, download=False)
    monkeypatch.setenv("CUTLAYER_RUN", str(audited_run))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = sum(1 for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    assert images == 5

    analysis = audited_run / "analysis"
    for name in ("learning_curves", "roc_pr", "comparison", "label_leakage"):
        assert (analysis / f"{name}.png").stat().st_size > 10_000
    metrics = json.loads((audited_run / "metrics.json").read_text())

    comparison = pd.read_csv(analysis / "comparison.csv").set_index("model")
    auc = comparison["test_roc_auc"]
    assert auc["split model (this run)"] == pytest.approx(metrics["test"]["roc_auc"])
    # The unsplit model with the same architecture and schedule is the split model.
    assert auc["centralised: unsplit MLP (same architecture)"] == pytest.approx(auc["split model (this run)"], abs=1e-12)
    assert auc["bank only: HistGradientBoosting"] < auc["centralised: HistGradientBoosting"] - 0.1
    assert ((auc > 0.5) & (auc <= 1)).all()

    communication = pd.read_csv(analysis / "communication.csv")
    assert (communication["MB_per_epoch"] >= communication["minimum_MB_per_epoch"]).all()
    assert (communication["round_trips_per_epoch"] > 1).all()

    leakage = pd.read_csv(analysis / "label_leakage.csv")
    assert list(leakage["epoch"]) == ["1", "2", "3", "4", "all (row means)"]
    assert leakage[["norm_leak_auc", "direction_leak_auc"]].stack().between(0, 1).all()
    assert leakage["direction_leak_auc"].iloc[-1] > 0.9  # no defence yet: the labels leak

    inversion = pd.read_csv(analysis / "inversion.csv")
    assert set(inversion["feature"]) == {"contact", "day", "month", "duration", "campaign", "pdays", "previous", "poutcome"}
    assert inversion["advantage"].max() > 0.2  # the embeddings reveal features the bank's columns do not

    privacy = pd.read_csv(study / "privacy_study.csv").set_index("setting")
    assert len(privacy) == 8 and (audited_run / "privacy" / "privacy_tradeoff.png").stat().st_size > 10_000
    # Each defence does what it is for, at some price.
    assert privacy.loc["max-norm gradients", "norm_leak_auc"] < privacy.loc["no defense", "norm_leak_auc"] - 0.2
    assert privacy.loc["label DP (RR, ε=1)", "direction_leak_auc"] < privacy.loc["no defense", "direction_leak_auc"] - 0.1
    no_defense = privacy.loc["no defense", "inversion_r2_advantage"]
    assert privacy.loc["embedding DP (C=1, σ=2)", "inversion_r2_advantage"] < no_defense - 0.2
    assert np.isfinite(privacy.loc["embedding DP (C=1, σ=2)", "partner_epsilon"])
    rates = pd.read_csv(study / "hijack_monitor.csv").set_index("measure")["value"]
    assert rates["detection rate (hijacking runs alarmed)"] == 1.0
    assert rates["false-alarm rate (honest runs alarmed)"] == 0.0
