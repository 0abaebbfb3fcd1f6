"""Customer IDs and labels as users' files write them: one customer however its ID is written, one label however
its value is written, and whatever cannot be matched or learned refused with the reason, before alignment."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bank.service.aligner import overlap_warnings
from bank.service.operator import BankOperator, JobFailed
from bank.task import Task
from parties.errors import DataError
from parties.protocol.control import AlignmentRequest
from parties.limits import PsiLimits
from parties.tables.ids import canonical_ids, id_formats, infer_id_type
from parties.tables.table import load_party_table
from parties.transport.tls import TLSFiles


def _ids(*values: str) -> pd.Series:
    return pd.Series(list(values), dtype="str")


def test_integer_ids_are_one_customer_however_written() -> None:
    written = _ids("12", "12.0", "0012", " 12 ", "+12", "1.2e1", "1200000000000000000001")
    assert infer_id_type(written) == "integer"
    assert canonical_ids(written, "integer") == [b"12"] * 6 + [b"1200000000000000000001"]  # exact, past 2**53
    with pytest.raises(ValueError, match="1 IDs that are numbers with a fraction"):
        canonical_ids(_ids("12", "12.5"), "integer")
    assert infer_id_type(_ids("12", "C12")) == "text"
    assert canonical_ids(_ids("0012", "12", " 12 "), "text") == [b"0012", b"12", b"12"]  # text IDs as written


def test_id_formats_are_counted_per_format() -> None:
    assert id_formats(_ids("1", "2", "0003", "4.0", " 5 ", "C6")) == {
        "plain integer": 2, "zero-padded integer": 1, "integer with a decimal point": 1, "text": 1,
        "with surrounding white space": 1}
    assert id_formats(_ids("1", "2")) == {"plain integer": 2}


def test_a_table_with_ids_written_several_ways_loads_as_integer_ids_and_says_so(write_csv, caplog) -> None:
    path = write_csv("p.csv", customer_id=["1.0", "00101", " 151 ", "7"], x=[1, 2, 3, 4])
    with caplog.at_level(logging.WARNING, logger="parties.tables.table"):
        table = load_party_table(path)
    assert table.id_type == "integer" and table.normalized_ids == (b"1", b"101", b"151", b"7")
    assert "writes its IDs in 4 ways" in caplog.text and "00101" not in caplog.text and "151" not in caplog.text
    # Two spellings of one integer are one customer: a duplicate, named by its rows.
    twice = write_csv("twice.csv", customer_id=["12", "12.0"], x=[1, 2])
    with pytest.raises(DataError, match=r"duplicate IDs \(rows 2 and 3, as integers"):
        load_party_table(twice)
    declared = write_csv("declared.csv", customer_id=["12", "12.5"], x=[1, 2])
    with pytest.raises(DataError, match="1 IDs that are numbers with a fraction, not integers, first at row 3"):
        load_party_table(declared, id_type="integer")


def test_one_label_however_written() -> None:
    labels = pd.Series(["1", "1.0", " 0 ", "0.0", "1"], dtype="str")
    task = Task(None).fit(labels)
    assert task.kind == "binary" and task.classes_ == ["0", "1"]
    assert task.targets(labels).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]


def _serve_bank(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``python -m bank serve`` on ``path``: it must refuse the file before it listens (no TLS needed for that)."""
    return subprocess.run([sys.executable, "-m", "bank", "serve", "--name", "bank", "--data", str(path),
                           "--insecure", *flags], capture_output=True, text=True, timeout=120)


def _labels(tmp_path: Path, values: list[str]) -> Path:
    path = tmp_path / "bank.csv"
    pd.DataFrame({"customer_id": range(len(values)), "x": range(len(values)), "y": values}).to_csv(path, index=False)
    return path


@pytest.mark.parametrize(("values", "flags", "expected"), [
    (["0", "1"] * 50 + ["2"], (), r"'2' \(1 row, row 102\)"),
    (["0", "1"] * 50 + ["?", "?"], (), r"mean 'no label': '\?' \(2 rows, first at row 102\)"),
    ([f"{v:.2f}" for v in np.linspace(0, 9, 100)] + ["high"], ("--task", "regression"),
     r"regression target \(declared\), but holds values that are not finite numbers: 'high' \(1 row, row 102\)"),
    (["0", "1"] * 50 + ["2"], ("--task", "binary"), r"is binary \(declared\), but holds 3 values: '0' \(50 rows"),
], ids=["stray-class", "missing-marker", "text-in-regression", "declared-binary"])
def test_a_bad_label_is_refused_at_serve_naming_the_values(tmp_path: Path, values, flags, expected) -> None:
    result = _serve_bank(_labels(tmp_path, values), *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert __import__("re").search(expected, result.stderr), result.stderr


def test_ids_of_different_types_are_refused_not_matched(pki, write_csv, start_partner, start_bank) -> None:
    partner = start_partner(write_csv("p.csv", customer_id=["0012", "13", "14"], x=[1, 2, 3]), id_type="text")
    bank = start_bank(write_csv("b.csv", customer_id=["12", "13", "14"], z=[1, 2, 3], y=["no", "yes", "no"]),
                      {"partner": partner.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op, \
            pytest.raises(JobFailed, match="the partner's customer IDs are text and the bank's are integer"):
        op.wait(op.start_alignment())
    assert partner.app.state.core.alignment_of("bank") is None


def test_align_reports_each_partners_share_and_warns_far_below_what_was_expected(
        pki, write_csv, start_partner, start_bank) -> None:
    ids = [f"C{i}" for i in range(100)]
    partner = start_partner(write_csv("p.csv", customer_id=ids[:40], x=list(range(40))),
                            psi_limits=PsiLimits(peer_max_ids={"bank": 100}, peer_ids_per_day=1000))  # agreed
    bank = start_bank(write_csv("b.csv", customer_id=ids, z=list(range(100)), y=["no", "yes"] * 50),
                      {"partner": partner.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        expected = op.wait(op.start_alignment(AlignmentRequest(expect_overlap=0.9)))
        fine = op.wait(op.start_alignment(AlignmentRequest(expect_overlap=0.45)))
    assert expected["shares"] == {"partner": 0.4} and expected["bank_customers"] == 100
    assert len(expected["warnings"]) == 1 and "matched 40.0% of the bank's 100 customers" in expected["warnings"][0]
    assert fine["warnings"] == []
    assert overlap_warnings({"p": 0.5}, 10, None, "text") == []  # no expectation, no warning


def test_drift_on_few_customers_is_judged_only_when_gross_and_says_so() -> None:
    from parties.tables.drift import judge_drift

    many = judge_drift({"bank": {"x0": 0.3}}, True, {"bank": 500})
    assert any("0.30" in w and "accepted" in w for w in many)
    with pytest.raises(DataError, match="'x0' 0.30"):
        judge_drift({"bank": {"x0": 0.3}}, False, {"bank": 500})
    few = judge_drift({"bank": {"x0": 0.6}}, False, {"bank": 80})  # noise on 80 rows: not refused, and said
    assert few == ["bank: drift judged on 80 customers (fewer than 200): only gross drift, a column's population stability index above 1.0, is refused"]
    with pytest.raises(DataError, match="'x0' 8.24"):  # another party's columns: refused on 80 rows too
        judge_drift({"bank": {"x0": 8.24}}, False, {"bank": 80})
    none = judge_drift({"bank": {}}, False, {"bank": 12})
    assert "drift not measured on 12 customers" in none[0]
