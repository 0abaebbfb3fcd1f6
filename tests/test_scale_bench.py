"""``python -m bank.lab scale-bench`` at a size CI can afford: every stage runs and is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from bank.lab.bench.scale import write_synthetic_parties


def test_synthetic_parties_are_seeded_and_overlap(tmp_path: Path) -> None:
    a = write_synthetic_parties(tmp_path / "a", 500, 2, seed=5)
    b = write_synthetic_parties(tmp_path / "b", 500, 2, seed=5)
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes()
    bank = pd.read_csv(a["bank"], dtype=str)
    partner = pd.read_csv(a["partner1"], dtype=str)
    assert list(bank.columns[:2]) == ["customer_id", "y"] and len(bank) == 500
    assert not {c for c in partner.columns if c != "customer_id"} & set(bank.columns)  # its own columns
    shared = set(bank["customer_id"]) & set(partner["customer_id"])
    assert len(shared) == 400 and len(partner) == 450  # 80% of the bank's customers, and 50 of its own


def test_a_small_scale_bench_reports_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, "-m", "bank.lab", "scale-bench", "--customers", "2000", "--partners", "2", "--epochs", "1",
         "--sequential", "--json", str(out), "--out", str(tmp_path / "bench")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    parties = ["bank", "partner1", "partner2"]
    assert figures["cpus"] >= 1 and figures["customers"] == 2000 and figures["partners"] == 2
    assert figures["data_seconds"] > 0
    assert sorted(figures["startup_seconds"]) == sorted(parties)
    assert sorted(figures["setup_seconds"]) == sorted(parties)
    assert all(v > 0 for v in [*figures["startup_seconds"].values(), *figures["setup_seconds"].values()])
    assert figures["alignment_seconds"] > 0 and figures["sequential_seconds"] > 0 and figures["concurrent_seconds"] > 0
    assert figures["alignment_ratio"] == figures["concurrent_seconds"] / figures["sequential_seconds"]
    assert len(figures["epoch_seconds"]) == 1 and figures["epoch_seconds"][0] > 0
    # The aligned rows are the customers every party holds.
    ids = {p: set(pd.read_csv(tmp_path / "bench" / "data" / f"{p}.csv", dtype=str)["customer_id"]) for p in parties}
    assert figures["aligned_rows"] == len(set.intersection(*ids.values())) > 0
    assert sorted(figures["peak_rss_mb"]) == sorted(parties) and all(v > 50 for v in figures["peak_rss_mb"].values())
    # Per stage, each service's peak then (the kernel's mark reset between stages); the run's is the highest.
    stages = figures["stage_peak_rss_mb"]
    assert list(stages) == ["start-up", "alignment", "alignments, hashes cached", "training"]
    for party in parties:
        assert figures["peak_rss_mb"][party] == max(stages[s][party] for s in stages) > 50
    bank_line = next(line for line in run.stdout.splitlines() if "peak memory, bank" in line)
    assert all(f", {stage} " in bank_line for stage in stages)
    assert figures["ray_address"] is None and figures["alignment_ids_per_core_second"] > 0
    for stage in ("peak memory, partner1", "IDs per CPU-second, PSI on each service's worker processes",
                  "data generation", "start-up, partner2", "one partner after another", "all partners at once",
                  "session setup, partner1", "epoch 1", "sharing"):
        assert stage in run.stdout
