"""A finished run in MLflow: the bank service logs it to a local store under its state folder (``--mlflow``),
with its settings, per-epoch and test metrics and files, never its checkpoints; a store it cannot reach is
reported in the job's result, and the run stays finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from bank.settings import BankSettings
from bank.tracking import local_store
from data.prepare import prepare_bank_marketing
from parties.errors import ConfigError
from parties.settings import load_settings
from parties.transport.tls import TLSFiles

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra (the test extra installs it)")


def train(pki: Path, bank_full: Path, tmp_path: Path, start_partner, start_bank, **bank: object) -> dict:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"])
    service = start_bank(paths["bank"], {"partner": partner.url}, **bank)
    with BankOperator(service.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        return op.wait(op.start_training(TrainingConfig(epochs=3, batch_size=128, patience=10)))


def test_a_finished_run_is_in_the_local_store_with_its_settings_curves_and_files(
        pki, bank_full, tmp_path, start_partner, start_bank) -> None:
    result = train(pki, bank_full, tmp_path, start_partner, start_bank, mlflow=True)
    uri, _ = local_store(tmp_path / "state-bank")
    assert result["mlflow"]["uri"] == uri and "error" not in result["mlflow"]

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.get_run(result["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["cutlayer.session"] == result["session"]
    assert run.data.params["bank_bottom.learning_rate"] == "0.005" and run.data.params["epochs"] == "3"
    curve = client.get_metric_history(run.info.run_id, "val_roc_auc")
    history = Path(result["run_dir"]) / "history.csv"
    assert [m.step for m in curve] == [1, 2, 3] == list(range(1, len(history.read_text().splitlines())))
    metrics = json.loads((Path(result["run_dir"]) / "metrics.json").read_text())
    assert run.data.metrics["test_roc_auc"] == pytest.approx(metrics["test"]["roc_auc"])

    def listed(path: str = "") -> set[str]:
        out = set()
        for item in client.list_artifacts(run.info.run_id, path):
            out |= listed(item.path) if item.is_dir else {item.path}
        return out

    logged = listed()
    assert {"metrics.json", "history.csv", "config.json", "model/manifest.json", "model/top.safetensors"} <= logged
    assert not any(p.startswith("checkpoints") or p.endswith("secret.json") for p in logged)
    assert not {"test_predictions.csv", "split.csv"} & logged  # rows per customer: only when asked
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path / "state-bank" / "mlflow")


def test_a_store_that_cannot_be_written_is_reported_and_the_run_still_finishes(
        pki, bank_full, tmp_path, start_partner, start_bank) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    result = train(pki, bank_full, tmp_path, start_partner, start_bank, mlflow_uri=f"sqlite:///{blocked}/x/mlflow.db")
    assert "error" in result["mlflow"] and "run_id" not in result["mlflow"]
    assert (Path(result["run_dir"]) / "metrics.json").exists() and result["test"]["roc_auc"] > 0.5


def test_tracking_settings_say_what_is_missing(tmp_path, pki, monkeypatch) -> None:
    settings = load_settings(BankSettings, name="bank", data=tmp_path / "b.csv", tls_dir=pki,
                             mlflow_uri="http://127.0.0.1:5000")
    assert settings.tracks_runs
    monkeypatch.setattr("bank.tracking.available", lambda: False)
    with pytest.raises(ConfigError, match=r"--mlflow needs MLflow: pip install -e '\.\[mlflow\]'"):
        load_settings(BankSettings, name="bank", data=tmp_path / "b.csv", tls_dir=pki, mlflow=True)
