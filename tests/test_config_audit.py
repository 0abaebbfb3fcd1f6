"""Who could infer what in the configurations beside vertical, measured on small audited runs.

One run per configuration (2,000 rows, 2 epochs, every party a service over mutual TLS), made once for the
module: the U-shaped compute party reads the labels off the cut-2 gradients, vanilla's holds them, each branch
reads its customers' labels off its gradients and the bank decodes every branch's features; with the labels
and the features shuffled, the same attacks find nothing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from safetensors.numpy import load_file, save_file

from bank.config import TrainingConfig
from bank.configurations.runs import configuration_walkthrough
from bank.lab.report.config_audit import COLUMNS, audit_headlines, configuration_audit, print_configuration_audit
from bank.configurations.split_run import ConfigurationSettings
from parties.errors import DataError

BRANCHES = ["branch-1", "branch-2", "branch-3"]
FEATURES = {"age", "job", "marital", "education", "default", "balance", "housing", "loan", "contact", "day",
            "month", "duration", "campaign", "pdays", "previous", "poutcome"}


@pytest.fixture(scope="module")
def audited(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """An audited run of a configuration, made the first time a test asks for it."""
    made: dict[str, Path] = {}

    def run(configuration: str) -> Path:
        if configuration not in made:
            out = tmp_path_factory.mktemp(configuration) / "run"
            settings = ConfigurationSettings(configuration=configuration, training=TrainingConfig(epochs=2),
                                             audit=True)
            configuration_walkthrough(settings, out, rows=2000, cache_dir=bank_full.parent, download=False)
            made[configuration] = out
        return made[configuration]

    return run


def _labels(frame: pd.DataFrame, observer: str) -> pd.DataFrame:
    return frame[(frame["observer"] == observer) & (frame["target"] == "labels")]


def test_the_u_shaped_compute_party_reads_the_labels_off_the_cut_2_gradients(
        audited: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    run = audited("u-shaped")
    frame = configuration_audit(run)
    assert list(frame.columns) == COLUMNS and set(frame["observer"]) == {"compute"}
    leaks = _labels(frame, "compute").set_index(["epoch", "measure"])["value"]
    assert set(leaks.index.get_level_values("epoch")) == {"1", "2", "all (row means)"}
    # The head after the trunk is linear: each row's cut-2 gradient is (p - y) times one vector, so its
    # direction gives the label away exactly; nothing defends it here.
    assert leaks[("all (row means)", "direction_leak_auc")] > 0.99
    assert leaks.loc[(slice(None), "direction_leak_auc")].min() > 0.95
    headlines = audit_headlines(frame).set_index("target")
    assert headlines.loc["labels", "value"] > 0.95
    # Features, from the cut-1 activations of every row; the compute party has no columns: its baseline is 0.
    inversion = frame[frame["target"] == "bank's features"].pivot(index="feature", columns="measure", values="value")
    assert set(inversion.index) == FEATURES
    assert inversion["baseline_r2"].abs().max() < 0.05
    assert inversion["inversion_r2_advantage"].mean() > 0.2
    assert inversion["inversion_r2"].max() > 0.6

    saved = pd.read_csv(run / "audit" / "leakage.csv", dtype={"epoch": "string"})
    assert len(saved) == len(frame) and np.allclose(saved["value"], frame["value"], equal_nan=True)
    record = json.loads((run / "audit" / "leakage.json").read_text())
    assert record["configuration"] == "u-shaped" and len(record["rows"]) == len(frame)
    assert record["rows"][0]["feature"] is None  # NaN written as null: the file is valid JSON
    print_configuration_audit(frame)
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 2 and shown[0].startswith("u-shaped: compute -> labels: strongest label leak AUC")


def test_vanillas_compute_party_holds_every_training_label(audited: Callable[[str], Path]) -> None:
    run = audited("vanilla")
    frame = configuration_audit(run)
    train = load_file(str(run / "audit" / "cut1.safetensors"))["train"]
    labels = _labels(frame, "compute").set_index("measure")
    assert labels.loc["labels_received", "value"] == len(train) == 1600  # 80% of 2,000 rows
    assert labels.loc["label_leak_auc", "value"] == 1.0 and labels.loc["label_leak_auc", "note"] == "held"
    assert not (run / "audit" / "gradients-compute.safetensors").exists()  # nothing to attack: it has them
    inversion = frame[frame["measure"] == "inversion_r2_advantage"]
    assert set(inversion["feature"]) == FEATURES and inversion["value"].mean() > 0.2


@pytest.mark.slow  # two horizontal runs with their audits; u-shaped and vanilla stay in the default run
@pytest.mark.parametrize("configuration", ["relay", "splitfed"])
def test_each_branch_reads_its_labels_and_the_bank_decodes_every_branchs_features(
        audited: Callable[[str], Path], configuration: str) -> None:
    frame = configuration_audit(audited(configuration))
    headlines = audit_headlines(frame)
    for branch in BRANCHES:
        leaks = _labels(frame, branch)
        assert set(leaks["epoch"]) == {"1", "2", "all (row means)"}
        strongest = headlines[(headlines["observer"] == branch) & (headlines["target"] == "labels")]["value"]
        assert float(strongest.iloc[0]) > 0.9
        inversion = frame[(frame["observer"] == "bank") & (frame["target"] == f"{branch}'s features")]
        advantage = inversion[inversion["measure"] == "inversion_r2_advantage"]
        assert set(advantage["feature"]) == FEATURES and advantage["value"].mean() > 0.15
        weights = frame[(frame["observer"] == "bank") & (frame["target"] == f"{branch}'s bottom")]
        assert list(weights["measure"]) == ["holds_weights"] and "white-box" in weights["note"].iloc[0]
    assert set(frame["observer"]) == {"bank", *BRANCHES}


def test_with_the_labels_and_features_shuffled_the_same_attacks_find_nothing(
        audited: Callable[[str], Path], tmp_path: Path) -> None:
    copy = tmp_path / "shuffled"
    shutil.copytree(audited("u-shaped"), copy)
    cut1_path = copy / "audit" / "cut1.safetensors"
    cut1 = load_file(str(cut1_path))
    rng = np.random.default_rng(7)
    cut1["targets"] = rng.permutation(cut1["targets"])
    cut1["features"] = cut1["features"][rng.permutation(len(cut1["features"]))]
    save_file(cut1, str(cut1_path))
    frame = configuration_audit(copy)
    leaks = _labels(frame, "compute")["value"]
    assert len(leaks) == 6 and (leaks - 0.5).abs().max() < 0.1
    r2 = frame[frame["measure"] == "inversion_r2"]["value"]
    assert r2.mean() < 0.05


def test_the_audit_refuses_a_vertical_run_and_a_run_without_its_audit_files(
        audited: Callable[[str], Path], tmp_path: Path) -> None:
    vertical = tmp_path / "vertical"
    vertical.mkdir()
    (vertical / "metrics.json").write_text(json.dumps({"test": {"roc_auc": 0.8}}))
    with pytest.raises(DataError, match="is a vertical run"):
        configuration_audit(vertical)
    copy = tmp_path / "u-shaped"
    shutil.copytree(audited("u-shaped"), copy)
    (copy / "audit" / "gradients-compute.safetensors").unlink()
    with pytest.raises(DataError, match="gradients-compute.safetensors: missing"):
        configuration_audit(copy, write=False)


def test_a_branch_file_the_auditor_cannot_read_is_reported_as_not_measured_and_read_where_it_is_given(
        audited: Callable[[str], Path], tmp_path: Path) -> None:
    run = audited("relay")
    copy = tmp_path / "relay"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "data")  # as a run by hand leaves it: the branches' files are theirs
    frame = configuration_audit(copy, write=False)
    missing = frame[frame["measure"] == "not_measured"]
    assert list(missing["target"]) == [f"{b}'s features" for b in BRANCHES] and missing["value"].isna().all()
    assert set(_labels(frame, "branch-2")["measure"]) == {"norm_leak_auc", "direction_leak_auc"}  # still audited
    assert "not measured" in set(audit_headlines(frame)["headline"])
    given = configuration_audit(copy, write=False, branch_data=run / "data")
    assert given.equals(configuration_audit(run, write=False))
