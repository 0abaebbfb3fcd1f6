"""The README's first command, on a slice: separate service processes, PSI, results on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd


def test_walkthrough_runs_end_to_end_with_separate_processes(bank_full: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "bank", "walkthrough", "--out", str(out), "--rows", "2500", "--partners", "2",
         "--cache-dir", str(bank_full.parent), "--no-download", "--workers", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    frames = {n: pd.read_csv(out / "data" / n / f"{n}.csv", dtype=str) for n in ("bank", "partner1", "partner2")}
    truth = set.intersection(*(set(f["customer_id"]) for f in frames.values()))
    assert summary["alignment"]["rows"] == len(truth) > 1500
    assert "aligned" in result.stdout and str(len(truth)) in result.stdout
    for name in ("bank", "partner1", "partner2"):
        log = (out / "logs" / f"{name}.log").read_text()
        assert "listening on https://127.0.0.1:" in log
        # Logs never hold customer IDs.
        assert not any(i in log for i in list(frames[name]["customer_id"])[:200])
