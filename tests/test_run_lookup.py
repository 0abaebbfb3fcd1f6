"""Finding a run folder from wherever a kernel or a shell starts, and reading the paths a run folder stores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from bank.lab.__main__ import main
from bank.lab.report.analysis import latest_run, load_run, resolve_run, write_report
from parties.errors import DataError
from parties.storage.layout import model_folder

SESSION = "s1"


def fake_run(folder: Path, *, summary: dict[str, object] | None = None, audit: bool = False) -> Path:
    """The files ``load_run`` and a report without references read, with made-up values."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"session": SESSION, "audit": audit}))
    (folder / "metrics.json").write_text(json.dumps({
        "session": SESSION, "task": "binary", "best_epoch": 1, "epochs_run": 2, "test": {"roc_auc": 0.75},
        "communication": {}, "timings": {"total_seconds": 1.0},
    }))
    pd.DataFrame({"epoch": [1, 2], "train_loss": [0.5, 0.4], "val_roc_auc": [0.7, 0.72]}).to_csv(
        folder / "history.csv", index=False)
    pd.DataFrame({"position": [0, 1], "bank_row": [0, 1], "split": ["test", "test"]}).to_csv(
        folder / "split.csv", index=False)
    pd.DataFrame({"position": [0, 1, 2, 3], "target": [0, 1, 0, 1], "score": [0.1, 0.8, 0.6, 0.4]}).to_csv(
        folder / "test_predictions.csv", index=False)
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def walkthrough_layout(folder: Path, summary: dict[str, object] | None = None) -> Path:
    """A run folder laid out as the walkthrough writes it: the bank's run and a partner's model inside."""
    run = fake_run(folder, summary=summary, audit=True)
    (run / "bank" / "runs" / SESSION / "audit").mkdir(parents=True)
    (run / "bank" / "runs" / SESSION / "model").mkdir()
    (run / "partner" / "models" / SESSION).mkdir(parents=True)
    return run


def set_mtime(run: Path, seconds: float) -> None:
    os.utime(run / "metrics.json", (seconds, seconds))


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """A project folder as a user has it: runs/ at the top, the notebook's folder below."""
    (tmp_path / "project" / "notebooks" / "deeper").mkdir(parents=True)
    return tmp_path / "project"


@pytest.mark.parametrize("where", [".", "notebooks", "notebooks/deeper"], ids=["top", "notebooks", "deeper"])
def test_the_latest_run_is_found_from_the_folder_below_as_git_finds_its_repository(
        project: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    set_mtime(fake_run(project / "runs" / "20260101-000000"), 1_000_000)
    newest = fake_run(project / "runs" / "20260102-000000")
    set_mtime(newest, 2_000_000)
    monkeypatch.chdir(project / where)
    assert latest_run() == project / "runs" / "20260102-000000"
    assert load_run().path == project / "runs" / "20260102-000000"


def test_the_nearest_folder_with_a_run_wins_and_an_empty_runs_folder_is_passed_over(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_run(project / "runs" / "top")
    fake_run(project / "notebooks" / "runs" / "nearer")
    (project / "notebooks" / "deeper" / "runs").mkdir()  # no run in it
    monkeypatch.chdir(project / "notebooks" / "deeper")
    assert latest_run() == project / "notebooks" / "runs" / "nearer"


def test_a_newer_run_of_another_configuration_is_passed_over_and_not_read_as_a_vertical_run(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vertical = fake_run(project / "runs" / "20260101-000000")
    set_mtime(vertical, 1_000_000)
    for name, configuration in (("20260102-000000", "u-shaped"), ("20260103-000000", "vertical")):
        (project / "runs" / name).mkdir()
        (project / "runs" / name / "metrics.json").write_text(json.dumps({"configuration": configuration}))
        set_mtime(project / "runs" / name, 2_000_000)
    monkeypatch.chdir(project / "notebooks")
    assert latest_run() == project / "runs" / "20260103-000000"  # "vertical" named outright is still vertical
    os.remove(project / "runs" / "20260103-000000" / "metrics.json")
    assert load_run().path == vertical  # the U-shaped run is newer, and no vertical run
    with pytest.raises(DataError, match="is a u-shaped run, not a vertical one"):
        load_run("runs/20260102-000000")


def test_no_run_anywhere_says_where_it_looked(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(project / "notebooks")
    with pytest.raises(DataError, match=f"no run under runs/ in {project / 'notebooks'} or any folder above it"):
        load_run()


@pytest.mark.parametrize("where", [".", "notebooks", "notebooks/deeper"], ids=["top", "notebooks", "deeper"])
def test_a_relative_run_path_resolves_against_the_cwd_then_the_folders_above(
        project: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = fake_run(project / "runs" / "20260101-000000")
    monkeypatch.chdir(project / where)
    assert resolve_run("runs/20260101-000000") == run
    assert load_run("runs/20260101-000000").path == run
    assert load_run(run).path == run  # absolute: as is


def test_a_relative_run_path_that_is_a_run_here_wins_over_one_above(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_run(project / "runs" / "x")
    here = fake_run(project / "notebooks" / "runs" / "x")
    monkeypatch.chdir(project / "notebooks")
    assert resolve_run(Path("runs/x")) == here


def test_a_relative_run_path_that_is_nowhere_says_where_it_looked(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (project / "runs" / "half").mkdir(parents=True)  # a folder, but no run in it
    monkeypatch.chdir(project / "notebooks")
    with pytest.raises(DataError, match=f"runs/half: no run folder .* in {project / 'notebooks'} or any folder above"):
        load_run("runs/half")


def test_the_paths_a_summary_stores_resolve_inside_the_run_folder_wherever_it_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = {"bank_run_dir": f"bank/runs/{SESSION}",
               "model_files": {"bank": f"bank/runs/{SESSION}/model", "partner": f"partner/models/{SESSION}"}}
    run = walkthrough_layout(tmp_path / "elsewhere" / "moved", summary)
    monkeypatch.chdir(tmp_path)
    loaded = load_run("elsewhere/moved")
    assert loaded.bank_run_dir == run / "bank" / "runs" / SESSION
    assert loaded.audit_dir == run / "bank" / "runs" / SESSION / "audit"
    assert loaded.model_dir("bank") == run / "bank" / "runs" / SESSION / "model"
    assert loaded.model_dir("partner") == run / "partner" / "models" / SESSION


@pytest.mark.parametrize("absolute", [False, True], ids=["cwd-relative", "absolute"])
def test_an_older_summary_with_paths_as_the_walkthrough_saw_them_still_resolves(
        tmp_path: Path, absolute: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before run folders were relocatable: paths relative to the walkthrough's cwd (the project), or absolute.
    project = tmp_path / "project"
    prefix = f"{project}/runs/old" if absolute else "runs/old"
    summary = {"bank_run_dir": f"{prefix}/bank/runs/{SESSION}",
               "model_files": {"bank": f"{prefix}/bank/runs/{SESSION}/model", "partner": f"{prefix}/partner/models/{SESSION}"}}
    run = walkthrough_layout(project / "runs" / "old", summary)
    (project / "notebooks").mkdir()
    monkeypatch.chdir(project / "notebooks")  # where Jupyter starts the kernel
    loaded = load_run()
    assert loaded.audit_dir == run / "bank" / "runs" / SESSION / "audit"
    assert loaded.model_dir("partner") == run / "partner" / "models" / SESSION


def test_a_run_without_a_summary_is_its_own_bank_run(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "bank-run")  # what `python -m bank train` leaves in the bank's state folder
    loaded = load_run(run)
    assert loaded.bank_run_dir == run and loaded.audit_dir == run / "audit"
    assert loaded.model_dir("bank") == run / "model"
    assert loaded.model_dir("partner") == model_folder(run / "partner", "bank", SESSION)
    (run / "partner" / "models" / SESSION).mkdir(parents=True)  # a partner from before per-bank folders
    assert loaded.model_dir("partner") == run / "partner" / "models" / SESSION


def test_an_audited_run_whose_audit_files_are_not_found_is_an_error_not_a_run_without_audit(tmp_path: Path) -> None:
    run = walkthrough_layout(tmp_path / "run", {"bank_run_dir": "bank/runs/elsewhere"})
    with pytest.raises(DataError, match="missing, though the run was trained with --audit"):
        write_report(load_run(run), references=False)


def test_report_from_a_folder_below_finds_the_latest_run(
        project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = fake_run(project / "runs" / "20260101-000000")
    monkeypatch.chdir(project / "notebooks")
    assert main(["report", "--no-references"]) == 0
    assert f"written to {run / 'analysis'}" in capsys.readouterr().out
    assert (run / "analysis" / "roc_pr.png").exists()
    assert main(["report", "--no-references", "runs/20260101-000000"]) == 0
