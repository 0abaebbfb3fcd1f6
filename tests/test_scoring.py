"""Trained models as artefacts: a manifest ties the parties' files; new customers are scored across parties."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import bank.service.core
from bank.config import TrainingConfig
from bank.vertical.http_partner import HttpPartner
from bank.service.operator import BankOperator, JobFailed
from data.prepare import prepare_bank_marketing
from parties.errors import PeerError
from parties.transport.tls import TLSFiles


@pytest.fixture()
def trained(pki, bank_full: Path, tmp_path: Path, start_partner, start_bank):
    paths = prepare_bank_marketing(tmp_path / "data", rows=3000, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"])
    bank = start_bank(paths["bank"], {"partner": partner.url})
    op = BankOperator(bank.url, TLSFiles.from_dir(pki, "bank"))
    op.wait(op.start_alignment())
    result = op.wait(op.start_training(TrainingConfig(epochs=3, batch_size=128)))
    yield op, result, paths, partner, bank
    op.close()


def _new_customers(paths: dict[str, Path], result: dict, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Known customers (test rows of the run), customers the partner lacks, and brand-new IDs."""
    bank = pd.read_csv(paths["bank"], dtype=str)
    partner_ids = set(pd.read_csv(paths["partner"], dtype=str)["customer_id"])
    split = pd.read_csv(Path(result["run_dir"]) / "split.csv")
    test_rows = split[split["split"] == "test"]["bank_row"].to_numpy()[:40]
    known = bank.iloc[test_rows]
    lacking = bank[~bank["customer_id"].isin(partner_ids)].head(15)
    brand_new = bank.head(5).assign(customer_id=[f"NEW-{i}" for i in range(5)])
    frame = pd.concat([known, lacking, brand_new]).drop(columns=["y"]).sample(frac=1, random_state=0)
    path = tmp_path / "new_customers.csv"
    frame.to_csv(path, index=False)
    expected = {**{i: "known" for i in known["customer_id"]}, **{i: "lacking" for i in lacking["customer_id"]},
                **{i: "lacking" for i in brand_new["customer_id"]}}
    return path, expected


def test_scoring_a_file_of_known_and_unknown_customers(trained, tmp_path: Path) -> None:
    op, result, paths, _, _ = trained
    path, expected = _new_customers(paths, result, tmp_path)
    job = op.start_scoring(result["session"], path.read_bytes())
    summary = op.wait(job)
    scores = pd.read_csv(io.BytesIO(op.scores(job.job_id)), dtype={"customer_id": str})
    assert summary["rows"] == len(expected) == len(scores) and summary["scored"] == 40
    by_id = scores.set_index("customer_id")
    for customer, kind in expected.items():
        row = by_id.loc[customer]
        if kind == "known":
            assert row["status"] == "scored" and 0 <= row["score"] <= 1
        else:
            assert row["status"] == "not held by partner" and np.isnan(row["score"])

    # A known customer scores as the model scored it on the run's test rows.
    run = Path(result["run_dir"])
    split = pd.read_csv(run / "split.csv")
    predictions = pd.read_csv(run / "test_predictions.csv").merge(split, on="position")
    bank_ids = pd.read_csv(paths["bank"], dtype=str)["customer_id"]
    predictions["customer_id"] = bank_ids.iloc[predictions["bank_row"]].to_numpy()
    joined = predictions.merge(scores, on="customer_id", suffixes=("_run", "_scored"))
    assert len(joined) == 40
    assert np.allclose(joined["score_run"], joined["score_scored"], atol=1e-6)

    progress: list[str] = []
    job = op.start_scoring(result["session"], path.read_bytes(), allow_missing=True)
    allowed = op.wait(job, on_progress=lambda status: progress.append(status.progress))
    lacking = sum(kind == "lacking" for kind in expected.values())
    assert allowed["scored"] == len(expected) and allowed["scored_without"] == {"partner": lacking}
    # What the bar last said is what the summary says, fallbacks counted.
    assert progress[-1] == f"scored {len(expected)} of {len(expected)} ({lacking} without every partner)"
    relaxed = pd.read_csv(io.BytesIO(op.scores(job.job_id)))
    assert relaxed["score"].notna().all() and relaxed["status"].str.startswith("scored").all()


def test_the_manifest_refuses_a_tampered_model_file(trained, tmp_path: Path) -> None:
    op, result, paths, partner, _ = trained
    path, _ = _new_customers(paths, result, tmp_path)
    manifest = json.loads((Path(result["run_dir"]) / "model" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["parties"]] == ["bank", "partner"]
    weights = partner.app.state.core.banks["bank"].folder / "models" / result["session"] / "bottom.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(blob))
    with pytest.raises(JobFailed, match="bottom.safetensors: does not match the manifest"):
        op.wait(op.start_scoring(result["session"], path.read_bytes()))


def test_scoring_refuses_unknown_models_and_bad_files(trained, tmp_path: Path) -> None:
    op, result, *_ = trained
    with pytest.raises(Exception, match="HTTP 404.*no trained model nosuchmodel"):
        op.start_scoring("nosuchmodel", b"customer_id,age\n1,30\n")
    with pytest.raises(PeerError, match=r"HTTP 422\): the customers file: the model needs the columns"):
        op.start_scoring(result["session"], b"customer_id,age\n1,30\n2,40\n")  # refused at once, not in a job


def test_score_cli_reports_a_missing_file(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bank", "score", "--url", "https://127.0.0.1:9", "--insecure", "--model", "m",
         "--data", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "s.csv")],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 2 and "nope.csv: cannot read" in run.stderr and "Traceback" not in run.stderr


def test_scoring_releases_are_noised_and_counted_under_embedding_noise(pki, bank_full, tmp_path, start_partner,
                                                                      start_bank) -> None:
    from parties.learning.embedding_noise import PrivacyConfig

    paths = prepare_bank_marketing(tmp_path / "data", rows=2000, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"], privacy=PrivacyConfig(clip=1.0, noise=1.0))
    bank = start_bank(paths["bank"], {"partner": partner.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        result = op.wait(op.start_training(TrainingConfig(epochs=1, batch_size=128)))
        customers = pd.read_csv(paths["bank"], dtype=str).drop(columns=["y"]).head(300).to_csv(index=False).encode()
        first = pd.read_csv(io.BytesIO(op.scores(op.wait_job_id(op.start_scoring(result["session"], customers)))))
        second = pd.read_csv(io.BytesIO(op.scores(op.wait_job_id(op.start_scoring(result["session"], customers)))))
    dp = partner.app.state.core.scoring_dp
    assert dp.releases.max() == 2  # each scored customer released twice, both counted
    scored = first["status"] == "scored"
    # The same customers scored again by the same model carry the same noise: asking twice averages nothing.
    assert scored.sum() > 100 and np.array_equal(first["score"][scored], second["score"][scored])
    clean = partner.app.state.core.banks["bank"].models[result["session"]]
    assert clean is not None  # the trained bottom, loaded: the noise is what makes the scores differ from it


def test_jobs_leave_no_connection_to_the_partner_open(trained, tmp_path: Path, monkeypatch) -> None:
    """A job closes its connections to the partner when it ends, even while something still holds its proxies
    (a job's result, or a failed job's traceback, can)."""
    op, result, paths, partner, _ = trained
    held: list[HttpPartner] = []

    class Held(HttpPartner):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            held.append(self)

    monkeypatch.setattr(bank.service.core, "HttpPartner", Held)
    path, _ = _new_customers(paths, result, tmp_path)
    op.wait(op.start_scoring(result["session"], path.read_bytes()))
    assert held and all(p.steps is not None and p.round_trips > 0 for p in held)
    port = int(partner.url.rsplit(":", 1)[1])
    open_to_partner = [line for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                       if line.split()[2] == f"0100007F:{port:04X}" and line.split()[3] == "01"]
    assert open_to_partner == []
