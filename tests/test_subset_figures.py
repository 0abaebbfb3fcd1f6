"""The bars for customers a partner lacks, on bank-full with the walkthrough's defaults, as a user gets them.

The README's walkthrough command trains; the services are then started again on its state folders, as an
operator would, and a mix of customers (4,000 the partner holds, and every bank customer it lacks) is scored
through ``python -m bank score --allow-missing``. Run with ``-s`` to see the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn import metrics as skm
from sklearn.ensemble import HistGradientBoostingClassifier

from parties.tables.encoding import TabularEncoder
from parties.tables.table import load_party_table
from parties.transport.process import ServiceProcess

#: The walkthrough's joint test ROC-AUC (README), which the subset models, trained after it, must not change.
JOINT_AUC = 0.9344

#: A walkthrough on all of bank-full and its scoring: study-sized.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def walkthrough(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("walkthrough") / "run"
    result = subprocess.run(
        [sys.executable, "-m", "bank", "walkthrough", "--out", str(out), "--cache-dir", str(bank_full.parent),
         "--no-download"], capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Customers only bank holds (bank-only model), held out:" in result.stdout
    return out


@pytest.fixture(scope="module")
def mix_scores(walkthrough: Path) -> pd.DataFrame:
    out = walkthrough
    bank = pd.read_csv(out / "data" / "bank" / "bank.csv", dtype=str)
    held = set(pd.read_csv(out / "data" / "partner" / "partner.csv", dtype=str)["customer_id"])
    mix = pd.concat([bank[bank["customer_id"].isin(held)].head(4000), bank[~bank["customer_id"].isin(held)]])
    mix.drop(columns=["y"]).to_csv(out / "mix.csv", index=False)
    common = ["--tls-dir", str(out / "certs"), "--workers", "1"]
    partner = ServiceProcess("partner", ["--name", "partner", "--data", str(out / "data" / "partner" / "partner.csv"),
                                         "--state-dir", str(out / "partner"), *common],
                             out / "partner" / "ready.json", out / "logs" / "partner-again.log")
    services = [partner]
    try:
        url = partner.wait_ready()
        services.append(bank := ServiceProcess(
            "bank", ["--name", "bank", "--data", str(out / "data" / "bank" / "bank.csv"), "--label", "y",
                     "--state-dir", str(out / "bank"), f"--partner=partner={url}", *common],
            out / "bank" / "ready.json", out / "logs" / "bank-again.log"))
        session = json.loads((out / "metrics.json").read_text())["session"]
        scored = subprocess.run(
            [sys.executable, "-m", "bank", "score", "--url", bank.wait_ready(), "--tls-dir", str(out / "certs"),
             "--model", session, "--data", str(out / "mix.csv"), "--out", str(out / "mix-scores.csv"),
             "--allow-missing"], capture_output=True, text=True, timeout=600,
        )
    finally:
        for service in reversed(services):
            service.stop()
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert f"{len(mix)} of {len(mix)} customers scored" in scored.stdout
    scores = pd.read_csv(out / "mix-scores.csv", dtype={"customer_id": str})
    return scores.merge(mix[["customer_id", "y"]], on="customer_id").assign(target=lambda f: (f["y"] == "yes") * 1)


def _row(name: str, frame: pd.DataFrame) -> dict[str, object]:
    return {"customers": name, "rows": len(frame), "mean score": frame["score"].mean(),
            "positive rate": frame["target"].mean(), "ROC-AUC": skm.roc_auc_score(frame["target"], frame["score"])}


def _reference_hgb(out: Path) -> dict[str, float]:
    """A bank-only HistGradientBoosting (sklearn's defaults) trained on the same bank rows as the bank-only model."""
    bank = load_party_table(out / "data" / "bank" / "bank.csv", labelled=True)
    y = (bank.labels.str.strip() == "yes").to_numpy().astype(int)
    split = pd.read_csv(out / "split.csv")
    unaligned = pd.read_csv(out / "unaligned_split.csv")
    rows = {f"aligned {k}": split.loc[split["split"] == k, "bank_row"].to_numpy() for k in ("train", "test")}
    rows |= {f"unaligned {k}": unaligned.loc[unaligned["split"] == k, "bank_row"].to_numpy() for k in ("train", "test")}
    train = np.concatenate([rows["aligned train"], rows["unaligned train"]])
    encoder = TabularEncoder(bank.schema).fit(bank.features.iloc[train])
    x = encoder.transform(bank.features)
    hgb = HistGradientBoostingClassifier(random_state=0).fit(x[train], y[train])
    return {group: skm.roc_auc_score(y[rows[group]], hgb.predict_proba(x[rows[group]])[:, 1])
            for group in ("unaligned test", "aligned test")}


def test_customers_without_the_partner_get_honest_calibrated_scores(walkthrough: Path, mix_scores: pd.DataFrame) -> None:
    out = walkthrough
    metrics = json.loads((out / "metrics.json").read_text())
    held_out_unaligned = set(pd.read_csv(out / "unaligned_split.csv").query("split == 'test'")["bank_row"])
    bank_ids = pd.read_csv(out / "data" / "bank" / "bank.csv", dtype=str)["customer_id"]
    test_ids = set(bank_ids.iloc[sorted(held_out_unaligned)])
    full = mix_scores[mix_scores["model"] == "joint"]
    without = mix_scores[mix_scores["model"] == "bank-only"]
    table = pd.DataFrame([_row("fully scored", full), _row("scored without: partner (all)", without),
                          _row("  of which held out from training", without[without["customer_id"].isin(test_ids)])])
    print("\n" + table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    assert len(full) == 4000 and len(without) == len(mix_scores) - 4000
    assert (without["parties"] == "bank").all() and (without["status"] == "scored without: partner").all()

    subsets = metrics["subsets"]
    joint = subsets["bank+partner"]["held_out"]["aligned test"]
    bank_only = subsets["bank"]["held_out"]
    reference = _reference_hgb(out)
    print(json.dumps({"joint": joint, "bank-only": bank_only, "reference HGB, same rows": reference}, indent=1))
    # The joint model is unchanged, and calibrated.
    assert joint["roc_auc"] == pytest.approx(JOINT_AUC, abs=0.002)
    # Customers scored without the partner: at least a bank-only HistGradientBoosting on the same rows, and
    # calibrated within 0.02, on customers no model trained on.
    for group, reference_group in (("unaligned test", "unaligned test"),
                                   ("aligned test, partners withheld", "aligned test")):
        figures = bank_only[group]
        assert figures["roc_auc"] >= reference[reference_group] - 1e-9, (group, figures, reference)
        assert abs(figures["mean_score"] - figures["observed_rate"]) <= 0.02
    assert abs(without["score"].mean() - without["target"].mean()) <= 0.02
