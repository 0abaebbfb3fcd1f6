"""Every task finishes and writes its run when the partners hold all, all but one, or all but two of the
bank's customers: the models for customers a partner lacks have zero, one or two rows to learn from and
to be judged on, and say so instead of crashing or printing a metric of two customers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from parties.protocol.control import AlignmentRequest
from parties.transport.tls import TLSFiles

ROWS = 240


def _labels(task: str, rng: np.random.Generator, signal: np.ndarray) -> list[str]:
    if task == "binary":
        return ["yes" if s > 0 else "no" for s in signal + rng.normal(size=len(signal))]
    if task == "multiclass":
        return [str(int(k)) for k in np.digitize(signal, [-0.7, 0.0, 0.7])]
    return [f"{3 * s + rng.normal():.3f}" for s in signal]


@pytest.mark.parametrize("partners", [1, 2])
@pytest.mark.parametrize("unaligned", [0, 1, 2])
@pytest.mark.parametrize("task", ["binary", "multiclass", "regression"])
def test_a_run_is_written_whatever_few_customers_the_partners_lack(
        pki, write_csv, start_partner, start_bank, tmp_path: Path, task: str, unaligned: int, partners: int) -> None:
    rng = np.random.default_rng(7)
    ids = [f"C{i:04d}" for i in range(ROWS)]
    signal = rng.normal(size=ROWS)
    bank = write_csv("bank.csv", customer_id=ids, a=list(signal + rng.normal(size=ROWS)),
                     y=_labels(task, rng, signal))
    held = ids[unaligned:]  # the first ``unaligned`` customers are at no partner
    urls = {}
    for k in range(partners):
        name = ["partner", "partner2"][k]
        file = write_csv(f"{name}.csv", customer_id=held, b=list(signal[unaligned:] + rng.normal(size=len(held))))
        urls[name] = start_partner(file, name=name).url
    service = start_bank(bank, urls)
    with BankOperator(service.url, TLSFiles.from_dir(pki, "bank")) as op:
        # The operator knows these partners hold (nearly) every customer: it says so, or the bank refuses them.
        op.wait(op.start_alignment(AlignmentRequest(expect_overlap=1.0)))
        result = op.wait(op.start_training(TrainingConfig(task=task, epochs=2)))
    run = Path(result["run_dir"])
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["task"] == task and sum(metrics["rows"].values()) == ROWS - unaligned
    # 24 test rows: the metrics are given, with the warning that they are figures of a handful of customers.
    assert metrics["rows"]["test"] < 30 and "too few to judge the model by" in metrics["test_note"]
    for name in ("test_predictions.csv", "split.csv", "model/manifest.json", "unaligned_split.csv"):
        assert (run / name).is_file(), name
    bank_only = metrics["subsets"]["bank"]
    assert bank_only["trained_on"]["unaligned"] == unaligned  # too few to hold any out: all of them train
    judged = bank_only["held_out"]["unaligned test"]
    assert judged["rows"] == 0 and "too few customers" in judged["note"] and len(judged) == 2
    if partners == 2:  # the heads for customers one partner lacks, judged on the aligned test rows
        assert {"bank+partner", "bank+partner2"} <= set(metrics["subsets"])
