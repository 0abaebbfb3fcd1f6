"""A column means at scoring what it meant at training: integer-coded categoricals, unseen and missing values."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from parties.errors import PeerError
from parties.tables.encoding import MISSING_CATEGORY, MISSING_NUMBER, UNSEEN, TabularEncoder, category_text
from parties.tables.table import FeatureSchema
from parties.transport.tls import TLSFiles


def test_an_integer_coded_category_is_one_category_whatever_its_dtype() -> None:
    encoder = TabularEncoder(FeatureSchema(("amount",), ("grade",))).fit(
        pd.DataFrame({"amount": [1.0, 2.0, 4.0], "grade": ["0", "1", "2"]}))
    as_text, none = encoder.encode(pd.DataFrame({"amount": [1.0, 2.0, 4.0], "grade": ["0", "1", "2"]}))
    for grade in ([0, 1, 2], [0.0, 1.0, 2.0], ["0.0", " 1", "2"]):
        other, counted = encoder.encode(pd.DataFrame({"amount": [1.0, 2.0, 4.0], "grade": grade}))
        assert np.array_equal(as_text, other) and counted == none == {}
    assert category_text(pd.Series(["01", "1"])).tolist() == ["01", "1"]  # a leading zero is part of a code


def test_unseen_and_missing_values_take_the_declared_policy_and_are_counted() -> None:
    encoder = TabularEncoder(FeatureSchema(("amount",), ("grade",))).fit(
        pd.DataFrame({"amount": [1.0, 2.0, 6.0], "grade": ["a", "b", "b"]}))
    x, counted = encoder.encode(pd.DataFrame({"amount": [np.nan, 2.0, np.nan], "grade": ["c", "", "a"]}))
    assert counted == {"amount": {MISSING_NUMBER: 2}, "grade": {UNSEEN: 1, MISSING_CATEGORY: 1}}
    assert x[0, 0] == x[2, 0] == 0.0  # the training mean, standardised
    assert not x[0, 1:].any() and not x[1, 1:].any()  # the one-hot's all-zero "unknown" slot


def _dataset(folder: Path, n: int = 1500) -> dict[str, Path]:
    """A bank with integer-coded categoricals (declared in its schema file) and a partner that holds most customers."""
    rng = np.random.default_rng(7)
    ids = [f"K{i:05d}" for i in range(n)]
    education = rng.integers(0, 7, n)  # a code, not a quantity: 6 is not "twice" 3
    marital = rng.integers(1, 4, n)
    income = rng.lognormal(10, 0.5, n).round(2)
    usage = rng.normal(size=n)
    logit = 1.2 * (education == 3) - 1.0 * (education == 5) + 0.8 * (marital == 2) + 0.9 * usage - 0.5
    default = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    bank = pd.DataFrame({"customer_id": ids, "education": education, "marital": marital, "income": income,
                         "y": default})
    partner = pd.DataFrame({"customer_id": ids, "usage": usage.round(4)}).iloc[: int(n * 0.9)]
    paths = {"bank": folder / "bank.csv", "partner": folder / "partner.csv"}
    folder.mkdir(parents=True, exist_ok=True)
    bank.to_csv(paths["bank"], index=False)
    partner.to_csv(paths["partner"], index=False)
    paths["bank"].with_suffix(".schema.json").write_text(
        json.dumps({"numeric": ["income"], "categorical": ["education", "marital"]}))
    return paths


def test_scoring_reproduces_the_runs_own_predictions_for_integer_coded_categoricals(pki, tmp_path, start_partner,
                                                                                  start_bank) -> None:
    paths = _dataset(tmp_path / "data")
    partner = start_partner(paths["partner"])
    bank = start_bank(paths["bank"], {"partner": partner.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        result = op.wait(op.start_training(TrainingConfig(epochs=4, batch_size=64)))
        run = Path(result["run_dir"])
        split = pd.read_csv(run / "split.csv")
        predictions = pd.read_csv(run / "test_predictions.csv").merge(split, on="position")
        # Read as a data scientist would: pandas makes the codes integers; that must not change a score.
        customers = pd.read_csv(paths["bank"]).drop(columns=["y"])
        assert customers["education"].dtype.kind == "i"
        test = customers.iloc[predictions["bank_row"].to_numpy()]

        def score(frame: pd.DataFrame, accept_drift: bool = False) -> tuple[pd.DataFrame, dict]:
            job = op.start_scoring(result["session"], frame.to_csv(index=False).encode(), accept_drift=accept_drift)
            summary = op.wait(job)
            return pd.read_csv(io.BytesIO(op.scores(job.job_id))), summary

        scored, summary = score(test)
        assert summary["fallbacks"] == {}  # every value was seen in training
        assert np.allclose(scored["score"].to_numpy(), predictions["score"].to_numpy(), atol=1e-6, rtol=0)

        # The code is a category: changing it changes the score.
        changed = test.assign(education=np.where(test["education"] == 3, 5, 3))
        with pytest.raises(PeerError, match="population stability index above 0.25 for bank: 'education'"):
            score(changed)  # a column this far from its training distribution is refused, named
        rescored, _ = score(changed, accept_drift=True)
        assert np.abs(rescored["score"].to_numpy() - scored["score"].to_numpy()).max() > 1e-3

        # An unseen code and a missing income take the declared policies, and are counted, not hidden.
        odd = test.head(20).assign(education=[9] * 5 + list(test["education"].head(20))[5:])
        odd["income"] = odd["income"].astype(object)
        odd.iloc[:3, odd.columns.get_loc("income")] = ""
        _, summary = score(odd)
        assert summary["fallbacks"] == {"bank": {"education": {UNSEEN: 5}, "income": {MISSING_NUMBER: 3}}}

        # A value that is not a number in a numeric column is refused at once (HTTP 422), naming column, kind
        # and count; nothing is half-scored.
        bad = test.head(10).assign(income=["n/a"] * 2 + list(test["income"].head(10))[2:])
        with pytest.raises(PeerError, match=r"HTTP 422\): the customers file: column 'income' is numeric, but holds "
                                            r"values that are not finite numbers: 2 text \(first at row 2\)"):
            score(bad)
