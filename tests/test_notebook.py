"""The analysis notebook, run as the README says, finds the latest run and shows its audit; its tables hold sane values.

One small audited walkthrough serves every test here: it runs in a project folder
without ``--out`` (so it writes ``runs/<stamp>/``), and the notebook is then
executed by ``jupyter nbconvert`` with the kernel in ``notebooks/``, where
Jupyter starts it, and no ``CUTLAYER_RUN``. Beside that run, ``runs/`` also holds
small audited runs of the other configurations, which section 8 shows (and the
notebook's first cell passes over, though they are newer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest

from bank.config import TrainingConfig
from bank.configurations.runs import configuration_walkthrough
from bank.lab.report.analysis import load_run
from bank.lab.report.audit import label_leakage, model_completion
from bank.lab.studies.privacy import LABEL_ATTACKS, default_settings
from bank.configurations.split_run import ConfigurationSettings
from parties.errors import DataError
from parties.storage.layout import model_folder

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
CONFIGURATIONS = ["u-shaped", "vanilla", "relay", "splitfed"]
# The module fixtures run the walkthrough, a privacy, hijack and cut study and four configurations: about two
# minutes on an idle two-core machine, over the default run's 120 s a test, so the module runs with the slow
# tests (`python -m pytest -m slow`).
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

#: Section 5's privacy study, one setting of each defense family (the full sweep is `python -m bank.lab
#: privacy-study`, study-sized): what the notebook shows of each family, at a tenth of the sweep's time.
FAMILIES = ["no defense", "label DP (RR, ε=1)", "max-norm gradients", "Marvell (s=1)", "matched (s=1)",
            "embedding noise (C=1, σ=2)", "NoPeek (α=0.03)", "matched persistent (s=1) + label DP (ε=3)"]


@pytest.fixture(scope="module")
def project(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder holding the notebook, where the walkthrough ran as the README says."""
    project = tmp_path_factory.mktemp("project")
    (project / "notebooks").mkdir()
    shutil.copy(NOTEBOOK, project / "notebooks" / NOTEBOOK.name)
    result = subprocess.run(
        [sys.executable, "-m", "bank", "walkthrough", "--rows", "5000", "--epochs", "4", "--audit",
         "--cache-dir", str(bank_full.parent), "--no-download", "--workers", "1"],
        capture_output=True, text=True, timeout=600, cwd=project,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return project


@pytest.fixture(scope="module")
def audited_run(project: Path) -> Path:
    (run,) = (project / "runs").iterdir()
    return run


@pytest.fixture(scope="module")
def executed(project: Path, audited_run: Path, bank_full: Path) -> nbformat.NotebookNode:
    """The notebook after ``jupyter nbconvert --to notebook --execute notebooks/analysis.ipynb`` from the project."""
    from bank.lab.studies.cut import CutPoint, run_cut_study
    from bank.lab.studies.hijack import StudyConfig, run_hijack_study
    from bank.lab.attacks.hijackers import Attacker
    from bank.lab.studies.privacy import run_study

    study = audited_run / "privacy"  # section 5 reads a privacy study kept in the run folder
    settings = [s for s in default_settings() if s.name in FAMILIES]
    assert [s.name for s in settings] == FAMILIES
    run_study(study, rows=3000, epochs=3, settings=settings, cache=bank_full.parent, download=False)
    run_hijack_study(study, runs=2, attackers=[Attacker("FSHA", "fsha")], config=StudyConfig(rows=1500, epochs=2),
                     cache=bank_full.parent, download=False)
    # Section 7 reads a cut-layer study kept in the run folder: two cuts are enough to draw its frontier.
    run_cut_study(audited_run / "cut-study", rows=3000, epochs=2,
                  grid=[CutPoint("width", cut_width=4), CutPoint("width")], cache=bank_full.parent, download=False)
    # Section 8 reads runs of the other configurations beside the run, in the same runs/ folder.
    for configuration in CONFIGURATIONS:
        settings = ConfigurationSettings(configuration=configuration, training=TrainingConfig(epochs=2), audit=True)
        configuration_walkthrough(settings, project / "runs" / configuration, rows=1500, cache_dir=bank_full.parent,
                                  download=False)
    return _execute(project, "notebooks/analysis.ipynb")


def _execute(project: Path, notebook: str) -> nbformat.NotebookNode:
    """``jupyter nbconvert --to notebook --execute`` from the project, without ``CUTLAYER_RUN``; the result."""
    env = {k: v for k, v in os.environ.items() if k != "CUTLAYER_RUN"}
    result = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", notebook,
         "--ExecutePreprocessor.timeout=600"],
        capture_output=True, text=True, timeout=900, cwd=project, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return nbformat.read(project / Path(notebook).with_suffix(".nbconvert.ipynb"), as_version=4)


def _text(cell: nbformat.NotebookNode) -> str:
    """What a code cell showed: its printed text and its displayed tables, as text."""
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_the_notebook_as_the_readme_runs_it_finds_the_latest_run_and_shows_its_audit(
        executed: nbformat.NotebookNode, audited_run: Path) -> None:
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert f"run folder: {audited_run}" in _text(code[0])
    (audit_cell,) = [c for c in code if "label_leakage" in c.source]
    shown = _text(audit_cell)
    assert "without --audit" not in shown
    assert "norm_leak_auc" in shown and "direction_leak_auc" in shown  # the label-leakage table
    assert "advantage" in shown  # the inversion table
    assert any("image/png" in o.get("data", {}) for o in audit_cell.outputs)  # the leakage figure


def test_a_moved_run_folder_is_read_from_where_it_now_lies(
        audited_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moved = tmp_path / "archive" / "moved-run"
    shutil.copytree(audited_run, moved)
    summary = json.loads((moved / "summary.json").read_text())
    assert not any(Path(p).is_absolute() for p in [summary["bank_run_dir"], *summary["model_files"].values()])
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # neither the project nor the archive: found one folder up
    run = load_run("archive/moved-run")
    session = run.metrics["session"]
    assert run.audit_dir == moved.resolve() / "bank" / "runs" / session / "audit"
    assert run.model_dir("bank") == moved.resolve() / "bank" / "runs" / session / "model"
    assert run.model_dir("partner") == model_folder(moved.resolve() / "partner", "bank", session)
    assert (run.model_dir("bank") / "top.safetensors").exists()
    assert (run.model_dir("partner") / "encoder.json").exists()
    assert len(label_leakage(run)) == 5  # the audit reads the moved folder's files


def test_model_completion_reads_the_partners_own_model_files(audited_run: Path, tmp_path: Path) -> None:
    run = load_run(audited_run)
    table = model_completion(run, known=50, draws=2)
    assert list(table["partner"]) == ["partner"]
    row = table.iloc[0]
    assert row["model_completion_leak_auc"] > 0.7 and row["from_scratch_leak_auc"] > 0.5  # its columns predict
    assert row["model_completion_advantage"] == pytest.approx(
        row["model_completion_leak_auc"] - row["from_scratch_leak_auc"])
    assert model_completion(run, known=50, draws=2).equals(table)  # seeded
    copy = tmp_path / "run"
    shutil.copytree(audited_run, copy)
    weights = load_run(copy).model_dir("partner") / "bottom.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(DataError, match="bottom.safetensors"):
        model_completion(load_run(copy))


def test_the_notebook_executes_and_writes_its_tables_and_figures(
        executed: nbformat.NotebookNode, audited_run: Path) -> None:
    study = audited_run / "privacy"
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = sum(1 for c in executed.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
    assert images == 8
    (section7,) = [c for c in executed.cells if c.cell_type == "code" and "cut_study(run)" in c.source]
    shown = _text(section7)
    assert "no cut-layer study" not in shown and "strongest_label_leak_auc" in shown and "bytes_per_step" in shown
    assert any("image/png" in o.get("data", {}) for o in section7.outputs)
    (section5,) = [c for c in executed.cells if c.cell_type == "code" and "hijack_study(run)" in c.source]
    shown = _text(section5)
    assert "no hijack study" not in shown and "rank test alarms" in shown and "FSHA" in shown

    analysis = audited_run / "analysis"
    for name in ("learning_curves", "roc_pr", "comparison", "label_leakage", "reliability"):
        assert (analysis / f"{name}.png").stat().st_size > 10_000
    metrics = json.loads((audited_run / "metrics.json").read_text())

    comparison = pd.read_csv(analysis / "comparison.csv").set_index("model")
    auc = comparison["test_roc_auc"]
    assert auc["split model (this run)"] == pytest.approx(metrics["test"]["roc_auc"])
    # The unsplit model with the same architecture and schedule is the split model.
    assert auc["centralised: unsplit MLP (same architecture)"] == pytest.approx(auc["split model (this run)"], abs=1e-12)
    assert auc["bank only: HistGradientBoosting"] < auc["centralised: HistGradientBoosting"] - 0.1
    assert ((auc > 0.5) & (auc <= 1)).all()
    # Section 6: every scoring path judged on held-out customers, the unaligned ones among them.
    subsets = pd.read_csv(analysis / "subsets.csv").set_index(["parties", "held_out"])
    assert list(subsets.index) == [("bank+partner", "aligned test"), ("bank", "unaligned test"),
                                   ("bank", "aligned test, partners withheld")]
    assert subsets.loc[("bank", "unaligned test"), "rows"] > 0
    assert auc["bank-only model (this run)"] == pytest.approx(
        subsets.loc[("bank", "aligned test, partners withheld"), "roc_auc"])
    (section6,) = [c for c in executed.cells if c.cell_type == "code" and 'tables["subsets"]' in c.source]
    assert "bank-only" in _text(section6) and any("image/png" in o.get("data", {}) for o in section6.outputs)

    communication = pd.read_csv(analysis / "communication.csv")
    assert (communication["MB_per_epoch"] >= communication["minimum_MB_per_epoch"]).all()
    assert (communication["round_trips_per_epoch"] > 1).all()

    leakage = pd.read_csv(analysis / "label_leakage.csv")
    assert list(leakage["epoch"]) == ["1", "2", "3", "4", "all (row means)"]
    assert leakage[["norm_leak_auc", "direction_leak_auc"]].stack().between(0, 1).all()
    assert leakage["direction_leak_auc"].iloc[-1] > 0.9  # no defence yet: the labels leak

    inversion = pd.read_csv(analysis / "inversion.csv")
    assert set(inversion["feature"]) == {"contact", "day", "month", "duration", "campaign", "pdays", "previous", "poutcome"}
    assert inversion["advantage"].max() > 0.2  # the embeddings reveal features the bank's columns do not

    privacy = pd.read_csv(study / "privacy_study.csv").set_index("setting")
    assert list(privacy.index) == FAMILIES
    assert (audited_run / "privacy" / "privacy_tradeoff.png").stat().st_size > 10_000
    (section5,) = [c for c in executed.cells if c.cell_type == "code" and "privacy_study(run)" in c.source]
    shown = _text(section5)  # one table per defense, over its knob, with its cost
    assert all(d in shown for d in ("label DP", "Marvell", "matched", "NoPeek", "embedding noise", "combined",
                                    "auc_cost"))
    attacks = list(LABEL_ATTACKS)  # the gradient attacks, label-free and few-label ones included, and completion
    assert {"off_direction_leak_auc", "row_mean_pca_leak_auc", "few_label_50_leak_auc"} <= set(attacks)
    # A reversed ranking leaks too: the strongest attack counts max(AUC, 1 - AUC).
    assert (privacy["strongest_label_leak_auc"] == np.maximum(privacy[attacks], 1 - privacy[attacks]).max(axis=1)).all()
    assert (privacy["from_scratch_leak_auc"] > 0.6).all()  # the partner's own columns predict the label
    # Each defence does what it is for, at some price.
    assert privacy.loc["max-norm gradients", "norm_leak_auc"] < privacy.loc["no defense", "norm_leak_auc"] - 0.2
    assert privacy.loc["label DP (RR, ε=1)", "direction_leak_auc"] < privacy.loc["no defense", "direction_leak_auc"] - 0.1
    no_defense = privacy.loc["no defense", "inversion_r2_advantage"]
    assert privacy.loc["embedding noise (C=1, σ=2)", "inversion_r2_advantage"] < no_defense - 0.2
    hijack = pd.read_csv(study / "hijack_study.csv").set_index("bank")
    assert hijack.loc["FSHA", "rank_alarm_rate"] == 1.0 and hijack.loc["honest bank", "rank_alarm_rate"] == 0.0


def test_the_subset_study_compares_the_bank_only_choices_on_the_run(audited_run: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "bank.lab", "subset-study", str(audited_run), "--seeds", "1"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    analysis = audited_run / "analysis"
    bank_only = pd.read_csv(analysis / "subset_study_bank_only.csv")
    assert bank_only.shape == (2, 3) and bank_only.iloc[:, 1:].stack().between(0.5, 1).all()
    metrics = json.loads((audited_run / "metrics.json").read_text())
    # Its first row is the run's own bank-only model, on the same held-out customers.
    assert bank_only.iloc[0, 1] == pytest.approx(metrics["subsets"]["bank"]["held_out"]["unaligned test"]["roc_auc"])
    warm = pd.read_csv(analysis / "subset_study_warm_start.csv")
    # Batch seed 0 from the bottom's own initial weights is the run's split model, bit for bit.
    assert warm.loc[0, "from its own initial weights"] == pytest.approx(metrics["test"]["roc_auc"], abs=1e-12)
    assert 0.5 < warm.loc[0, "bank bottom pretrained"] <= 1


def _section8(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    (cell,) = [c for c in cells if c.cell_type == "code" and "other_configurations(run)" in c.source]
    return cell


def test_section_8_sets_the_other_configurations_and_their_audits_beside_the_run(
        executed: nbformat.NotebookNode, audited_run: Path) -> None:
    shown = _text(_section8(executed.cells))
    assert "no runs of the other configurations" not in shown and "python -m bank walkthrough" not in shown
    assert all(c in shown for c in CONFIGURATIONS) and "test_roc_auc" in shown and "round_trips" in shown
    assert "strongest label leak AUC" in shown and "mean inversion R²" in shown  # the audit's headlines
    assert any("image/png" in o.get("data", {}) for o in _section8(executed.cells).outputs)  # the learning curves

    analysis = audited_run / "analysis"
    table = pd.read_csv(analysis / "configurations.csv").set_index("configuration")
    assert list(table.index) == CONFIGURATIONS and table["audited"].all()
    for configuration in CONFIGURATIONS:
        metrics = json.loads((audited_run.parent / configuration / "metrics.json").read_text())
        assert table.loc[configuration, "test_roc_auc"] == pytest.approx(metrics["test"]["roc_auc"])
        assert table.loc[configuration, "round_trips"] == sum(c["round_trips"] for c in metrics["communication"].values())
    assert (table["epochs_run"] == 2).all() and (table["bytes"] > 0).all()
    assert (analysis / "configuration_curves.png").stat().st_size > 10_000
    headlines = pd.read_csv(analysis / "configuration_audit_headlines.csv")
    leaks = headlines[headlines["target"] == "labels"].set_index("configuration")["value"]
    assert leaks["u-shaped"] > 0.9 and leaks["vanilla"] == 1.0  # the cut-2 gradients leak; vanilla holds them
    assert (leaks[["relay", "splitfed"]] > 0.9).all()  # every branch reads its customers' labels
    assert (audited_run.parent / "u-shaped" / "audit" / "leakage.csv").exists()  # the audit is kept with its run


def test_without_runs_of_the_other_configurations_section_8_prints_the_commands_that_make_them(
        audited_run: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(audited_run, project / "runs" / audited_run.name, ignore=shutil.ignore_patterns("analysis"))
    source = nbformat.read(NOTEBOOK, as_version=4)
    (project / "notebooks").mkdir()
    # The notebook's own first cell (it finds the run) and its section 8, on a runs/ folder with the run alone.
    trimmed = nbformat.v4.new_notebook(cells=[source.cells[1], _section8(source.cells)], metadata=source.metadata)
    nbformat.write(trimmed, project / "notebooks" / "section8.ipynb")
    executed = _execute(project, "notebooks/section8.ipynb")
    assert f"run folder: {project / 'runs' / audited_run.name}" in _text(executed.cells[0])
    shown = _text(executed.cells[1])
    assert "no runs of the other configurations beside this run" in shown
    for configuration in CONFIGURATIONS:
        assert f"python -m bank walkthrough --configuration {configuration} --audit" in shown
