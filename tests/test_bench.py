"""The benchmarks run and report consistent figures (speed itself is judged by people, not tests)."""

from __future__ import annotations

from pathlib import Path

from bank.lab.bench.psi import format_result, run_bench
from bank.lab.bench.training import format_bench, run_training_bench
from bank.lab.bench.wire_floor import measure_wire_floor
from parties import speed
from parties.transport.pki import write_dev_pki


def test_bench_reports_the_intersection_and_wire_cost() -> None:
    result = run_bench(size=3000, overlap=0.25, workers=1)
    assert result.intersection == 750 and result.correct
    # 32 + 12 bytes per bank ID, 32 per partner ID (38 on average), 4 per committed row, and HTTP headers.
    assert 38 <= result.bytes_per_id < 45
    assert result.cold_floor_seconds > result.warm_floor_seconds > 0  # cold adds the hashing
    assert "ratio" in format_result(result)
    assert result.cold_seconds > 0 and result.warm_seconds > 0 and result.x25519_per_second > 0
    assert "bytes on the wire per ID" in format_result(result)


def test_training_bench_alternates_rounds_and_accounts_the_wire(bank_full: Path) -> None:
    result = run_training_bench(epochs=1, rows=3000, cache=bank_full.parent, download=False, rounds=2)
    assert result.rounds == 2 and result.epochs == 1
    assert result.split_epoch_seconds > 0 and result.unsplit_epoch_seconds > 0
    low, high = result.ratio_range
    assert low <= result.ratio <= high
    # every step carries at least the embedding and its gradient, and little more than that
    assert result.minimum_bytes_per_step <= result.bytes_per_step < 1.5 * result.minimum_bytes_per_step
    assert "alternating rounds" in format_bench(result)
    # per step: the wire alone (a bare TLS round trip of the step's bytes) is part of what a split step costs
    assert 0 < result.wire_floor_seconds < result.split_step_seconds
    assert result.unsplit_step_seconds > 0 and "the wire alone" in format_bench(result)
    # which speed code the split side ran: this process's choice, which the services inherit
    state = "on" if speed.switched_on() else "off, the public API instead"
    assert [line.split(": ")[1].split(" (")[0] for line in result.speed_code] == [state]
    assert "torch fast path: " in format_bench(result) and "uvicorn" not in format_bench(result)


def test_wire_floor_times_a_real_tls_round_trip(tmp_path: Path) -> None:
    write_dev_pki(tmp_path / "certs", {"bank": "bank", "partner": "partner"})
    small = measure_wire_floor(tmp_path / "certs", request=64, answer=64, cpus=None, out=tmp_path, trips=200)
    large = measure_wire_floor(tmp_path / "certs", request=4 << 20, answer=4 << 20, cpus=None, out=tmp_path, trips=20)
    assert 0 < small < large  # 8 MiB through TLS costs more than 128 bytes: the bytes really cross
    assert "floor.log" in {p.name for p in tmp_path.iterdir()}
