"""Customers a partner lacks: a model per subset of parties, trained with the joint model, honestly evaluated,
and used at scoring for exactly the customers only those parties hold."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bank.scoring.bank_only import BankOnlyModel
from bank.scoring.calibration import MIN_METRIC_ROWS
from bank.config import TrainingConfig
from bank.scoring.manifest import read_manifest
from bank.service.operator import BankOperator, JobFailed
from bank.vertical.schedule import split_rows
from bank.scoring.subsets import partial_subsets, train_subset_models
from bank.task import Task
from data.prepare import prepare_bank_marketing
from parties.tables.table import load_party_table
from parties.transport.tls import TLSFiles


def test_partial_subsets_are_every_subset_with_the_bank_and_not_all_partners() -> None:
    assert partial_subsets(["bank", "p"]) == []
    assert partial_subsets(["bank", "a", "b", "c"]) == [
        ("bank", "a", "b"), ("bank", "a", "c"), ("bank", "b", "c"), ("bank", "a"), ("bank", "b"), ("bank", "c")]


@pytest.fixture(scope="module")
def bank_table(bank_full: Path, tmp_path_factory: pytest.TempPathFactory):
    paths = prepare_bank_marketing(tmp_path_factory.mktemp("data"), rows=4000, cache=bank_full.parent, download=False)
    return load_party_table(paths["bank"], labelled=True)


def _train(table, seed: int = 0):
    aligned = np.random.default_rng(1).permutation(len(table))[: int(0.8 * len(table))]
    task = Task("binary").fit(table.labels.iloc[aligned])
    targets = task.targets(table.labels.iloc[aligned])
    config = TrainingConfig(seed=seed)
    split = split_rows(len(aligned), targets, task, config)
    joint = np.random.default_rng(2).random(len(split.test))  # the joint model's test scores: only reported here
    models = train_subset_models(table=table, aligned=aligned, task=task, targets=targets, split=split,
                                 config=config, names=["bank", "partner"], joint_test_scores=joint)
    return models, aligned, task


def test_the_bank_only_model_learns_from_unaligned_customers_and_holds_some_out(bank_table, tmp_path: Path) -> None:
    models, aligned, task = _train(bank_table)
    unaligned = len(bank_table) - len(aligned)
    bank = models.held_out["bank"]
    assert bank["model"] == "bank-only"
    # 80% of the unaligned customers train it, 10% are held out for the test, as for the aligned rows.
    assert bank["trained_on"]["unaligned"] == pytest.approx(0.8 * unaligned, abs=2)
    assert bank["held_out"]["unaligned test"]["rows"] == pytest.approx(0.1 * unaligned, abs=2)
    for group in ("unaligned test", "aligned test, partners withheld"):
        figures = bank["held_out"][group]
        assert 0.55 < figures["roc_auc"] < 0.9 and abs(figures["mean_score"] - figures["observed_rate"]) < 0.05
        assert 0 < figures["brier"] < 0.2
    assert set(models.calibration["subset"]) == {"bank", "bank+partner"}
    assert models.calibration.groupby(["subset", "held_out"])["rows"].sum().loc[("bank", "unaligned test")] == \
        bank["held_out"]["unaligned test"]["rows"]

    # Deterministic: the same data and seed give the same model; saved and loaded, it scores the same.
    again, _, _ = _train(bank_table)
    frame = bank_table.features
    first, _ = models.bank_only.predict(frame)
    assert np.array_equal(first, again.bank_only.predict(frame)[0])
    entries = models.save(tmp_path)
    loaded = BankOnlyModel.load(tmp_path / "subsets" / "bank", entries["bank"].files, task)
    assert np.array_equal(first, loaded.predict(frame)[0])


def test_past_its_row_cap_the_bank_only_model_fits_a_seeded_sample_and_says_so(
        bank_table, monkeypatch: pytest.MonkeyPatch) -> None:
    full, _, _ = _train(bank_table)
    trained = full.held_out["bank"]["trained_on"]
    assert "sample" not in trained and full.bank_only.trained_rows_ == trained["aligned"] + trained["unaligned"]

    monkeypatch.setattr("bank.scoring.bank_only.MAX_ROWS", 1000)
    capped, _, _ = _train(bank_table)
    assert capped.bank_only.trained_rows_ == 1000
    assert capped.held_out["bank"]["trained_on"] == {**trained, "sample": 1000}  # the metrics say it
    # The encoder saw every training row: a rare category the sample missed is no "unseen" fallback at scoring.
    assert capped.bank_only.encoder_.to_dict() == full.bank_only.encoder_.to_dict()
    frame = bank_table.features
    scores = capped.bank_only.predict(frame)[0]
    assert not np.array_equal(scores, full.bank_only.predict(frame)[0])  # a different model: fewer rows
    assert np.array_equal(scores, _train(bank_table)[0].bank_only.predict(frame)[0])  # the same sample each time
    assert not np.array_equal(scores, _train(bank_table, seed=1)[0].bank_only.predict(frame)[0])  # seeded by the run
    assert capped.held_out["bank"]["held_out"]["unaligned test"]["roc_auc"] > 0.55


def test_a_stored_bank_only_model_is_checked_before_it_is_read(bank_table, tmp_path: Path) -> None:
    models, _, task = _train(bank_table)
    entries = models.save(tmp_path)
    blob = tmp_path / "subsets" / "bank" / "model.skops"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(Exception, match="model.skops: does not match the manifest"):
        BankOnlyModel.load(tmp_path / "subsets" / "bank", entries["bank"].files, task)


# --- through the services -----------------------------------------------------------------------------


@pytest.fixture()
def trained(pki, bank_full: Path, tmp_path: Path, start_partner, start_bank):
    paths = prepare_bank_marketing(tmp_path / "data", rows=3000, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"], min_intersection=20)
    bank = start_bank(paths["bank"], {"partner": partner.url})
    op = BankOperator(bank.url, TLSFiles.from_dir(pki, "bank"))
    op.wait(op.start_alignment())
    result = op.wait(op.start_training(TrainingConfig(epochs=3, batch_size=128)))
    yield op, result, paths, bank
    op.close()


def _customers(paths: dict[str, Path]) -> tuple[pd.DataFrame, set[str]]:
    bank = pd.read_csv(paths["bank"], dtype=str)
    held = set(pd.read_csv(paths["partner"], dtype=str)["customer_id"])
    return bank.drop(columns=["y"]), held


def _score(op: BankOperator, model: str, frame: pd.DataFrame, allow_missing: bool) -> tuple[dict, pd.DataFrame]:
    job = op.start_scoring(model, frame.to_csv(index=False).encode(), allow_missing)
    summary = op.wait(job)
    return summary, pd.read_csv(io.BytesIO(op.scores(job.job_id)), dtype={"customer_id": str})


def test_customers_a_partner_lacks_are_scored_by_the_bank_only_model(trained) -> None:
    op, result, paths, _ = trained
    run = Path(result["run_dir"])
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["subsets"]) == {"bank+partner", "bank"}
    unaligned_test = metrics["subsets"]["bank"]["held_out"]["unaligned test"]
    assert 0 < unaligned_test["rows"] < MIN_METRIC_ROWS  # too few to judge: counted, and said so, not a number
    assert "roc_auc" not in unaligned_test and "too few customers" in unaligned_test["note"]
    calibration = pd.read_csv(run / "calibration.csv")
    assert set(calibration["held_out"]) == {"aligned test", "aligned test, partners withheld"}
    manifest = read_manifest(run / "model")
    assert manifest.subsets["bank"].kind == "bank-only" and set(manifest.subsets) == {"bank"}

    customers, held = _customers(paths)
    lacking = customers[~customers["customer_id"].isin(held)].head(40)
    mix = pd.concat([customers[customers["customer_id"].isin(held)].head(60), lacking]).sample(frac=1, random_state=0)
    summary, scores = _score(op, result["session"], mix, allow_missing=True)
    assert summary["scored"] == 100 and summary["models"] == {"joint": 60, "bank-only": 40}
    assert summary["scored_without"] == {"partner": 40} and summary["refused"] == {}
    by_id = scores.set_index("customer_id")
    without = by_id.loc[lacking["customer_id"]]
    assert (without["model"] == "bank-only").all() and (without["parties"] == "bank").all()
    assert (without["status"] == "scored without: partner").all()
    # The scores are the bank-only model's, not the joint model's with a made-up (zero) partner embedding.
    model = BankOnlyModel.load(run / "model" / "subsets" / "bank", manifest.subsets["bank"].files,
                               Task.from_dict(manifest.task))
    expected, _ = model.predict(lacking.set_index("customer_id")[list(model.encoder_.schema.columns)])
    assert np.allclose(without["score"].to_numpy(), expected, atol=1e-9)
    full = by_id.drop(index=lacking["customer_id"])
    assert (full["model"] == "joint").all() and (full["parties"] == "bank+partner").all()
    assert (full["status"] == "scored").all()

    # Without --allow-missing they stay unscorable, and say why.
    summary, scores = _score(op, result["session"], mix, allow_missing=False)
    assert summary["models"] == {"joint": 60} and summary["unscorable"] == 40
    unscored = scores.set_index("customer_id").loc[lacking["customer_id"]]
    assert unscored["score"].isna().all() and (unscored["status"] == "not held by partner").all()
    assert (unscored["model"].fillna("") == "").all()


def test_a_partner_that_holds_none_or_too_few_refuses_and_scoring_goes_on(trained, pki: Path, tmp_path: Path) -> None:
    op, result, paths, bank = trained
    customers, held = _customers(paths)
    strangers = customers.head(30).assign(customer_id=[f"NEW-{i}" for i in range(30)])
    summary, scores = _score(op, result["session"], strangers, allow_missing=True)
    assert "the intersection with the bank is empty" in summary["refused"]["partner"]
    assert summary["models"] == {"bank-only": 30} and scores["score"].notna().all()
    assert (scores["parties"] == "bank").all()

    # The partner's minimum (20 customers) applies to scoring too: 10 of its customers are refused as a group.
    few = pd.concat([customers[customers["customer_id"].isin(held)].head(10), strangers.head(5)])
    summary, scores = _score(op, result["session"], few, allow_missing=False)
    assert "under the minimum of 20" in summary["refused"]["partner"] and summary["scored"] == 0
    assert (scores["status"] == "partner refused the alignment").all()

    # The CLI says it in words.
    path = tmp_path / "few.csv"
    few.to_csv(path, index=False)
    cli = subprocess.run(
        [sys.executable, "-m", "bank", "score", "--url", bank.url, "--tls-dir", str(pki), "--model",
         result["session"], "--data", str(path), "--out", str(tmp_path / "scores.csv"), "--allow-missing"],
        capture_output=True, text=True, timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "15 of 15 customers scored" in cli.stdout
    assert "under the minimum of 20; partner counts as holding none of them" in cli.stdout
    assert "15 scored by the bank-only model" in cli.stdout


def test_a_model_without_subset_models_does_not_make_up_scores(trained) -> None:
    op, result, paths, _ = trained
    manifest_path = Path(result["run_dir"]) / "model" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["subsets"]  # as a model trained before subsets existed
    manifest_path.write_text(json.dumps(manifest))
    customers, held = _customers(paths)
    lacking = customers[~customers["customer_id"].isin(held)].head(5)
    mix = pd.concat([customers[customers["customer_id"].isin(held)].head(25), lacking])
    summary, scores = _score(op, result["session"], mix, allow_missing=True)
    assert summary["models"] == {"joint": 25} and summary["unscorable"] == 5
    unscored = scores.set_index("customer_id").loc[lacking["customer_id"]]
    assert unscored["score"].isna().all()
    assert unscored["status"].str.contains("the model has no fallback for customers only bank hold").all()


def test_a_tampered_bank_only_model_is_refused_at_scoring(trained) -> None:
    op, result, paths, _ = trained
    blob = Path(result["run_dir"]) / "model" / "subsets" / "bank" / "model.skops"
    data = bytearray(blob.read_bytes())
    data[-10] ^= 1
    blob.write_bytes(bytes(data))
    customers, held = _customers(paths)
    lacking = customers[~customers["customer_id"].isin(held)].head(5)
    with pytest.raises(JobFailed, match="model.skops: does not match the manifest"):
        _score(op, result["session"], pd.concat([customers[customers["customer_id"].isin(held)].head(25), lacking]),
               allow_missing=True)


def test_with_two_partners_each_partial_subset_has_a_head(pki, bank_full: Path, tmp_path: Path, start_partner,
                                                          start_bank) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", n_partners=2, rows=3000, cache=bank_full.parent, download=False)
    one = start_partner(paths["partner1"], name="partner")
    two = start_partner(paths["partner2"], name="partner2")
    bank = start_bank(paths["bank"], {"partner": one.url, "partner2": two.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        result = op.wait(op.start_training(TrainingConfig(epochs=2, batch_size=128)))
        run = Path(result["run_dir"])
        manifest = read_manifest(run / "model")
        assert {k: v.kind for k, v in manifest.subsets.items()} == {
            "bank": "bank-only", "bank+partner": "head", "bank+partner2": "head"}
        metrics = json.loads((run / "metrics.json").read_text())
        head = metrics["subsets"]["bank+partner"]["held_out"]["aligned test, partner2 withheld"]
        assert head["rows"] == metrics["rows"]["test"] and 0.5 < head["roc_auc"] <= 1

        bank_rows = pd.read_csv(paths["bank"], dtype=str).drop(columns=["y"])
        ids = {n: set(pd.read_csv(paths[f], dtype=str)["customer_id"]) for n, f in
               (("partner", "partner1"), ("partner2", "partner2"))}
        only_one = bank_rows[bank_rows["customer_id"].isin(ids["partner"] - ids["partner2"])].head(20)
        both = bank_rows[bank_rows["customer_id"].isin(ids["partner"] & ids["partner2"])].head(30)
        summary, scores = _score(op, result["session"], pd.concat([only_one, both]), allow_missing=True)
    assert summary["models"] == {"joint": 30, "head": 20} and summary["scored_without"] == {"partner2": 20}
    by_id = scores.set_index("customer_id").loc[only_one["customer_id"]]
    assert (by_id["parties"] == "bank+partner").all() and (by_id["status"] == "scored without: partner2").all()
    assert by_id["score"].between(0, 1).all()
    # The head uses partner's embedding: its scores are not the bank-only model's.
    model = BankOnlyModel.load(run / "model" / "subsets" / "bank", manifest.subsets["bank"].files,
                               Task.from_dict(manifest.task))
    bank_only, _ = model.predict(only_one.set_index("customer_id")[list(model.encoder_.schema.columns)])
    assert not np.allclose(by_id["score"].to_numpy(), bank_only, atol=1e-3)
