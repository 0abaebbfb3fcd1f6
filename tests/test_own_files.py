"""A user's own pre-split files, as other vertical-FL platforms ship their examples, through the documented CLI.

Each party's file is made here the way two organisations hold them: the bank's with ``id``, ``y`` and its
columns, the partner's with ``id`` and its own, both under generic names (``x0, x1, ...``), integer IDs, and
the partner holding every one of the bank's customers. Three tables: binary (the partner writes its IDs
three ways: ``12.0``, ``00012``, `` 12 ``), regression, and a small multiclass one trained with defaults.
Every step is the README's "Your own data" path: ``data schema --write``, ``serve``, ``align``, ``train``,
``score``, ``report``.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from parties.transport.process import ServiceProcess

#: IDs large enough that none of them can appear in a log by accident (ports, counts, timestamps).
FIRST_ID = 7_300_000


def write_pair(folder: Path, task: str, rows: int, seed: int = 5, partner_extra: int = 100) -> None:
    """``bank.csv`` (id, y, x0..x3) and ``partner.csv`` (id, x0..x3: other features), every bank customer at the
    partner and ``partner_extra`` more. Columns of different scales, as real features are."""
    rng = np.random.default_rng(seed)
    n = rows + partner_extra
    x = rng.normal(size=(n, 8)) * [1, 10, 0.1, 3, 50, 2, 0.5, 7] + [0, 100, -3, 5, 1000, -20, 1, 0]
    z = (x - x.mean(0)) / x.std(0)
    if task == "binary":
        y = (rng.random(n) < 1 / (1 + np.exp(-(1.5 * z[:, 0] + 1.5 * z[:, 4] - z[:, 5] + 0.5 * z[:, 1])))).astype(int)
    elif task == "regression":
        y = (3 * z[:, 0] + 2 * z[:, 4] - z[:, 5] + 0.5 * rng.normal(size=n)).round(3)
    else:
        y = 2 * (z[:, 0] + z[:, 4] > 0) + (z[:, 1] - z[:, 5] > 0)
    ids = rng.permutation(n) + FIRST_ID
    bank = pd.DataFrame({"id": ids, "y": y, **{f"x{i}": x[:, i].round(4) for i in range(4)}}).iloc[:rows]
    partner_ids: list[object] = list(ids)
    if task == "binary":  # one customer, three spellings: as a spreadsheet, a zero-padded export and a text field
        partner_ids = [f"{v}.0" if k % 3 == 0 else f"{v:09d}" if k % 3 == 1 else f" {v} " for k, v in enumerate(ids)]
    partner = pd.DataFrame({"id": partner_ids, **{f"x{i}": x[:, i + 4].round(4) for i in range(4)}})
    folder.mkdir(parents=True, exist_ok=True)
    bank.to_csv(folder / "bank.csv", index=False)
    partner.sample(frac=1, random_state=1).to_csv(folder / "partner.csv", index=False)


def cli(*args: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if ok:
        assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


class Partnership:
    """A bank called ``lender`` and a partner, each started by its own ``serve`` on its own files."""

    def __init__(self, work: Path) -> None:
        self.work = work
        cli("data", "schema", "bank.csv", "--id-column", "id", "--label", "y", "--write", cwd=work)
        cli("data", "schema", "partner.csv", "--id-column", "id", "--write", cwd=work)
        cli("parties", "certs", "--out", "certs", "--party", "lender=bank", "--party", "partner=partner", cwd=work)
        self.partner = ServiceProcess("partner", ["--name", "partner", "--data", "partner.csv", "--tls-dir", "certs",
                                                  "--state-dir", "state/partner", "--workers", "1"],
                                      work / "partner.ready", work / "partner.log", cwd=work)
        self.bank: ServiceProcess | None = None
        partner_url = self.partner.wait_ready()
        self.bank = ServiceProcess("bank", ["--name", "lender", "--data", "bank.csv", "--tls-dir", "certs",
                                            "--state-dir", "state/lender", "--workers", "1",
                                            f"--partner=partner={partner_url}"],
                                   work / "bank.ready", work / "bank.log", cwd=work)
        self.url = self.bank.wait_ready()
        self.operator = ["--url", self.url, "--tls-dir", "certs", "--name", "lender"]
        self.aligned = cli("bank", "align", *self.operator, "--expect-overlap", "0.95", cwd=work)
        self.trained = cli("bank", "train", *self.operator, cwd=work)
        self.model = re.search(r"^model id: (\w+)$", self.trained.stdout, flags=re.M).group(1)
        self.run = work / "state" / "lender" / "runs" / self.model

    def metrics(self) -> dict:
        return json.loads((self.run / "metrics.json").read_text())

    def stop(self) -> None:
        for service in (self.bank, self.partner):
            if service is not None:
                service.stop()


@pytest.fixture(scope="module", params=["binary", "regression", "multiclass"])
def partnership(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    task = request.param
    work = tmp_path_factory.mktemp(f"own-files-{task}")
    write_pair(work, task, rows={"binary": 2000, "regression": 1000, "multiclass": 846}[task])
    started = None
    try:
        started = Partnership(work)
        yield task, started
    finally:
        if started is not None:
            started.stop()


def test_every_task_trains_with_every_customer_aligned_and_writes_its_run(partnership) -> None:
    task, p = partnership
    metrics = p.metrics()
    assert metrics["task"] == task  # the bank's label, read as what it is: no --task was given
    assert sum(metrics["rows"].values()) == len(pd.read_csv(p.work / "bank.csv"))  # every customer aligned
    # The bank-only model had no unaligned customer to be judged on: zero rows, said so, no made-up metric.
    unaligned = metrics["subsets"]["lender"]["held_out"]["unaligned test"]
    assert unaligned["rows"] == 0 and "too few customers" in unaligned["note"]
    if task == "regression":
        assert metrics["test"]["rmse"] == pytest.approx(metrics["test"]["mse"] ** 0.5)
    for name in ("config.json", "history.csv", "split.csv", "test_predictions.csv", "model/manifest.json"):
        assert (p.run / name).is_file(), name


def test_test_predictions_join_to_customers_by_their_id(partnership) -> None:
    _, p = partnership
    predictions = pd.read_csv(p.run / "test_predictions.csv")
    split = pd.read_csv(p.run / "split.csv")
    bank = pd.read_csv(p.work / "bank.csv")
    joined = predictions.merge(split, on="position")
    assert (predictions["id"].to_numpy() == bank["id"].to_numpy()[joined["bank_row"].to_numpy()]).all()


def test_the_split_model_learns_from_both_parties(partnership) -> None:
    """The references join both files (a simulation's privilege), named one by one: no partition folder."""
    task, p = partnership
    cli("bank.lab", "report", str(p.run), "--party-file", "lender=bank.csv", "--party-file", "partner=partner.csv",
        cwd=p.work)
    comparison = pd.read_csv(p.run / "analysis" / "comparison.csv").set_index("model")
    metric = {"binary": "test_roc_auc", "regression": "test_r2", "multiclass": "test_accuracy"}[task]
    split_model = comparison.loc["split model (this run)", metric]
    bank_only = comparison.loc["bank only: HistGradientBoosting", metric]
    central = comparison.loc["centralised: HistGradientBoosting", metric]
    assert split_model > bank_only + 0.05  # the partner's columns are put to use
    assert split_model > central - 0.03, comparison  # as well as one model on the joined table, with defaults
    assert "bank-only model (this run)" in comparison.index  # the bank's own fallback, whatever the bank is called
    (p.work / "comparison.txt").write_text(comparison.to_string() + "\n")


def test_ids_written_three_ways_are_one_customer_and_the_partner_reports_the_formats(partnership) -> None:
    task, p = partnership
    if task != "binary":
        pytest.skip("the binary table's partner writes its IDs three ways")
    assert "partner: 2,000 of the bank's 2,000 customers matched (100.0%)" in p.aligned.stderr
    assert "warning" not in p.aligned.stderr
    log = (p.work / "partner.log").read_text()
    reported = next(line for line in log.splitlines() if "writes its IDs in" in line)
    # Each ID counted once, in the one way it is written: a third each.
    assert "in 3 ways (700 zero-padded integer, 700 integer with a decimal point, 700 with surrounding white " \
           "space)" in reported and "read as integer IDs" in reported, reported
    # counts only: no ID in the log (a hex session id may hold the digits, so an ID stands apart from letters)
    assert not re.search(rf"(?<![0-9a-z]){FIRST_ID // 100_000}\d{{5}}(?![0-9a-z])", log)


def test_the_printed_score_command_works_as_printed(partnership) -> None:
    _, p = partnership
    line = p.trained.stdout.splitlines()[-1].strip()
    assert line.startswith("python -m bank score") and "--name lender" in line
    command = shlex.split(line)
    result = cli(*command[2:], cwd=p.work)  # ``python -m`` as this interpreter
    scores = pd.read_csv(p.work / "scores.csv")
    assert len(scores) == len(pd.read_csv(p.work / "bank.csv")) and (scores["status"] == "scored").all()
    assert "drift" not in result.stdout  # the bank's own customers are the population it trained on


def test_scoring_the_partners_file_as_the_banks_is_refused_for_drift(partnership) -> None:
    _, p = partnership
    wrong = cli("bank", "score", *p.operator, "--model", p.model, "--data", "partner.csv", "--out", "wrong.csv",
                cwd=p.work, ok=False)
    assert wrong.returncode == 2 and not (p.work / "wrong.csv").exists()
    assert "population stability index above 0.25" in wrong.stderr and "'x0'" in wrong.stderr
    assert "--accept-drift" in wrong.stderr
    accepted = cli("bank", "score", *p.operator, "--model", p.model, "--data", "partner.csv", "--out", "wrong.csv",
                   "--accept-drift", cwd=p.work)
    assert re.search(r"drift: lender column 'x0': population stability index \d+\.\d\d .*accepted", accepted.stdout)


def test_the_schema_command_shows_the_label_its_schema_file_names(partnership) -> None:
    _, p = partnership
    shown = json.loads(cli("data", "schema", "bank.csv", cwd=p.work).stdout)
    assert shown["label_column"] == "y" and shown["id_type"] == "integer"
    assert "y" not in shown["numeric"] + shown["categorical"]


def test_a_small_table_trains_with_defaults_that_fit_it(partnership) -> None:
    task, p = partnership
    if task != "multiclass":
        pytest.skip("the multiclass table is the small one")
    config = json.loads((p.run / "config.json").read_text())
    assert config["batch_size"] == 64  # 676 training rows: about ten steps an epoch, not one
    assert "batch_size: 64 (adapts to the table: 676 training rows" in p.trained.stderr
    assert p.metrics()["defaults_chosen"]["task"].startswith("multiclass")
