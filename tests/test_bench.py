"""The PSI benchmark runs and reports consistent figures (speed itself is judged by people, not tests)."""

from __future__ import annotations

from alignment.bench import format_result, run_bench


def test_bench_reports_the_intersection_and_wire_cost() -> None:
    result = run_bench(size=3000, overlap=0.25, workers=1)
    assert result.intersection == 750
    assert 44 <= result.bytes_per_id < 52
    assert result.cold_seconds > 0 and result.warm_seconds > 0 and result.x25519_per_second > 0
    assert "bytes on the wire per ID" in format_result(result)
