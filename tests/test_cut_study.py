"""The cut-layer study: its wire bytes are the protocol's, its frontier is right, and a small sweep writes
what the notebook reads, with the default marked and every attack measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from bank.lab.studies.cut import STRONGEST, CutPoint, _pareto, default_grid, run_cut_study, step_bytes, step_compute
from bank.lab.studies.privacy import LABEL_ATTACKS
from parties.protocol.training import StepReply, StepRequest


def test_step_bytes_are_the_protocols_bodies_and_grow_with_the_width() -> None:
    rows, z = torch.arange(1024), torch.ones(1024, 16)
    expected = len(StepRequest("s" * 32, 1, z, rows).encode()) + len(StepReply("s" * 32, 1, z).encode())
    assert step_bytes(1024, 16) == expected
    # Two float32 matrices of batch x width, and the rows as int32: the width's share is 8 bytes a row.
    assert step_bytes(1024, 32) - step_bytes(1024, 16) == 1024 * 16 * 8
    assert step_bytes(1024, 4) < step_bytes(1024, 16) < step_bytes(1024, 64)


def test_the_frontier_keeps_exactly_the_undominated_points() -> None:
    x = np.array([1.0, 2.0, 3.0, 2.5, 0.5])
    y = np.array([0.90, 0.95, 0.94, 0.96, 0.80])
    # 3.0/0.94 is beaten by 2.0/0.95 (cheaper and better); the others each win somewhere.
    assert list(_pareto(x, y)) == [4, 0, 1, 3]


def test_the_default_grid_holds_the_walkthroughs_cut_once_and_sweeps_every_axis() -> None:
    grid = default_grid()
    assert sum(p.is_default for p in grid) == 1
    assert {p.axis for p in grid} == {"width", "partner depth", "cut position"}
    assert len({(p.partner_hidden, p.cut_width, p.top_hidden) for p in grid}) == len(grid)


def test_a_deeper_partner_computes_more_per_step() -> None:
    shallow, _ = step_compute(CutPoint("partner depth", partner_hidden=()), 40, 30, 1024, repeats=15)
    deep, _ = step_compute(CutPoint("partner depth", partner_hidden=(256, 256)), 40, 30, 1024, repeats=15)
    assert deep > shallow > 0


@pytest.fixture(scope="module")
def small_study(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pd.DataFrame]:
    out = tmp_path_factory.mktemp("cut-study")
    grid = [CutPoint("width", cut_width=4), CutPoint("width"), CutPoint("cut position", partner_hidden=(),
                                                                        top_hidden=(64, 32))]
    table = run_cut_study(out, rows=4000, epochs=4, grid=grid, known_labels=50, cache=bank_full.parent,
                          download=False)
    return out, table


@pytest.mark.slow  # a sweep of the cut, trained
def test_a_small_sweep_writes_every_column_the_notebook_reads(small_study: tuple[Path, pd.DataFrame]) -> None:
    out, table = small_study
    written = pd.read_csv(out / "cut_study.csv")
    assert len(written) == 3 and list(written["default"]) == [False, True, False]
    assert (out / "cut_frontier.png").stat().st_size > 10_000
    assert written.loc[0, "bytes_per_step"] < written.loc[1, "bytes_per_step"]  # width 4 against 16
    assert written.loc[1, "bytes_per_step"] == written.loc[2, "bytes_per_step"]  # same width, other cut
    assert (written["bytes_per_epoch"] > written["bytes_per_step"]).all()
    assert {*LABEL_ATTACKS, STRONGEST, "from_scratch_leak_auc", "model_completion_advantage"} <= set(written.columns)
    attacks = written[list(LABEL_ATTACKS)]
    assert (written[STRONGEST] == np.maximum(attacks, 1 - attacks).max(axis=1)).all()
    for column in ("test_roc_auc", *LABEL_ATTACKS, STRONGEST):
        assert written[column].between(0, 1).all(), column
    assert (written["test_roc_auc"] > 0.7).all()  # it learned (4 epochs on 4,000 rows: about 0.75-0.8)
    assert written["inversion_r2_advantage"].notna().all()
    assert (written[["partner_ms_per_step", "bank_ms_per_step"]] > 0).all().all()


@pytest.mark.slow  # a sweep of the cut, trained
def test_the_sweep_is_deterministic(small_study: tuple[Path, pd.DataFrame], bank_full: Path, tmp_path: Path) -> None:
    _, table = small_study
    again = run_cut_study(tmp_path, rows=4000, epochs=4, grid=[CutPoint("width", cut_width=4)], known_labels=50,
                          cache=bank_full.parent, download=False)
    measured = ["test_roc_auc", *LABEL_ATTACKS, "model_completion_advantage", "inversion_r2_advantage"]
    assert again.loc[0, measured].to_dict() == table.loc[0, measured].to_dict()


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--epochs", "0", "--epochs must be at least 1, got 0"),
    ("--known-labels", "0", "--known-labels must be at least 1, got 0"),
    ("--rows", "-5", "--rows must be 0 or more, got -5"),
])
def test_the_command_refuses_impossible_settings_in_one_line(tmp_path: Path, flag: str, value: str, message: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import bank.lab.__main__ as lab_cli
    from parties.cli import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: lab_cli.main(["cut-study", "--out", str(tmp_path / "study"), flag, value]))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "study").exists()  # refused before any work
