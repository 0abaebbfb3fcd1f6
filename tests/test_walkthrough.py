"""The README's first command, on a slice: separate service processes, PSI, training, results on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from safetensors.torch import load_file
from parties.storage.layout import model_folder


@pytest.mark.parametrize("partners", [1, 2], ids=["1-partner", "2-partners"])
def test_walkthrough_runs_end_to_end_with_separate_processes(bank_full: Path, tmp_path: Path, partners: int) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "bank", "walkthrough", "--out", str(out), "--rows", "3000", "--partners", str(partners),
         "--epochs", "2", "--cache-dir", str(bank_full.parent), "--no-download", "--workers", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = ["partner"] if partners == 1 else ["partner1", "partner2"]
    frames = {n: pd.read_csv(out / "data" / n / f"{n}.csv", dtype=str) for n in ["bank", *names]}
    truth = set.intersection(*(set(f["customer_id"]) for f in frames.values()))

    summary = json.loads((out / "summary.json").read_text())
    assert summary["alignment"]["rows"] == len(truth) > 2000
    metrics = json.loads((out / "metrics.json").read_text())
    assert sum(metrics["rows"].values()) == len(truth)
    assert 0 <= metrics["test"]["roc_auc"] <= 1 and set(metrics["test"]) >= {"pr_auc", "accuracy", "log_loss", "f1"}
    history = pd.read_csv(out / "history.csv")
    assert list(history["epoch"]) == [1, 2]
    assert history["train_loss"][1] < history["train_loss"][0]  # it learns (two epochs on a slice: no more)
    assert "roc_auc" in result.stdout and "aligned" in result.stdout

    # Each party wrote its own model files, under its own state folder.
    session = metrics["session"]
    # The summary's paths lie inside the run folder, relative to it: the folder can move.
    assert summary["bank_run_dir"] == f"bank/runs/{session}"
    assert summary["model_files"] == {"bank": f"bank/runs/{session}/model",
                                      **{n: f"{n}/banks/bank/models/{session}" for n in names}}
    bank_model = out / summary["bank_run_dir"] / "model"
    assert load_file(str(bank_model / "bank" / "bottom.safetensors")) and (bank_model / "top.safetensors").exists()
    for name in names:
        folder = model_folder(out / name, "bank", session)
        weights = load_file(str(folder / "bottom.safetensors"))
        assert weights and json.loads((folder / "files.json").read_text()) == metrics["model_files"][name]
        assert not list((out / name).rglob("top.safetensors"))  # the top model never leaves the bank
    for comm in metrics["communication"].values():
        assert comm["bytes_per_step"] >= comm["minimum_bytes_per_step"] > 0

    for name in ["bank", *names]:
        log = (out / "logs" / f"{name}.log").read_text()
        assert "listening on https://127.0.0.1:" in log
        assert not any(i in log for i in list(frames[name]["customer_id"])[:300])  # logs never hold IDs
