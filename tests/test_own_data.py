"""A bank's own data, end to end through the documented CLI: partition, schema, services, train, score, report.

The dataset is generated here, unlike bank-marketing in every way that matters: other ID and label
names, integer-coded categoricals, a numeric column with missing values, CR line endings, two partners.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from parties.transport.process import ServiceProcess

ROWS = 3000


def _generate(path: Path) -> None:
    rng = np.random.default_rng(11)
    n = ROWS
    sex = rng.integers(1, 3, n)  # 1, 2: codes
    education = rng.integers(0, 7, n)
    status = rng.integers(-2, 9, n)  # repayment status codes, -2 .. 8
    limit = rng.lognormal(11, 0.6, n).round(0)
    utilisation = rng.beta(2, 5, n).round(4)
    salary = rng.lognormal(8, 0.4, n).round(2)
    visits = rng.poisson(3, n)
    channel = rng.choice(["web", "branch", "phone"], n)
    logit = (1.2 * (status >= 2) + 1.0 * (education == 1) - 0.8 * (sex == 2) + 6 * utilisation
             - 1.5 * np.log(salary / 3000) + 0.4 * visits - 3.8)
    defaulted = np.where(rng.random(n) < 1 / (1 + np.exp(-logit)), "1", "0")
    frame = pd.DataFrame({
        "loan_ref": [f"L-{i:06d}" for i in rng.permutation(n)], "sex": sex, "education": education,
        "status": status, "limit": limit, "utilisation": utilisation, "salary": salary, "visits": visits,
        "channel": channel, "defaulted": defaulted,
    })
    frame["salary"] = frame["salary"].astype(object)
    frame.loc[rng.random(n) < 0.08, "salary"] = ""  # a partner's numeric column with missing values
    frame.to_csv(path, index=False, lineterminator="\r")


def _run(*args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def own_run(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("own-data")
    _generate(work / "credit.csv")
    _run("data", "partition", "--csv", "credit.csv", "--out", "parts", "--id-column", "loan_ref",
         "--label", "defaulted", "--label-party", "lender", "--party", "lender=sex,education,status,limit",
         "--party", "payroll=utilisation,salary", "--party", "retail=visits,channel",
         "--coverage", "payroll=0.9", "--coverage", "retail=0.85", "--categorical", "sex,education,status", cwd=work)
    _run("parties", "certs", "--out", "certs", "--party", "lender=bank", "--party", "payroll=partner",
         "--party", "retail=partner", cwd=work)
    services = []
    try:
        urls = {}
        for name in ("payroll", "retail"):
            svc = ServiceProcess("partner", ["--name", name, "--data", f"parts/{name}/{name}.csv", "--tls-dir", "certs",
                                             "--state-dir", f"state/{name}", "--workers", "1"],
                                 work / f"{name}.ready", work / f"{name}.log", cwd=work)
            services.append(svc)
            urls[name] = svc.wait_ready()
        bank = ServiceProcess("bank", ["--name", "lender", "--data", "parts/lender/lender.csv", "--tls-dir", "certs",
                                       "--state-dir", "state/lender", "--workers", "1",
                                       *[f"--partner={n}={u}" for n, u in urls.items()]],
                              work / "lender.ready", work / "lender.log", cwd=work)
        services.append(bank)
        url = bank.wait_ready()
        operator = ["--url", url, "--tls-dir", "certs", "--name", "lender"]
        _run("bank", "align", *operator, cwd=work)
        trained = _run("bank", "train", *operator, "--task", "binary", "--epochs", "6", "--batch-size", "128",
                       cwd=work)
        model_id = re.search(r"^model id: (\w+)$", trained, flags=re.M).group(1)
        yield work, operator, model_id
    finally:
        for svc in reversed(services):
            svc.stop()


def test_the_schema_follows_the_data_from_partition_to_serve(own_run) -> None:
    work, _, _ = own_run
    partition = json.loads((work / "parts" / "partition.json").read_text())
    assert partition["id_column"] == partition["spec"]["output_id_column"] == "loan_ref"
    lender = json.loads((work / "parts" / "lender" / "lender.schema.json").read_text())
    assert lender["id_column"] == "loan_ref" and lender["label_column"] == "defaulted"
    assert set(lender["categorical"]) == {"sex", "education", "status"} and lender["numeric"] == ["limit"]
    payroll = json.loads((work / "parts" / "payroll" / "payroll.schema.json").read_text())
    assert payroll["numeric"] == ["utilisation", "salary"] and payroll["label_column"] is None
    # Every serve found its ID column and label in the schema file: none was given a flag for them.


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_scoring_every_customer_reproduces_the_runs_predictions(own_run, fmt: str) -> None:
    work, operator, model_id = own_run
    run = work / "state" / "lender" / "runs" / model_id
    split = pd.read_csv(run / "split.csv")
    predictions = pd.read_csv(run / "test_predictions.csv").merge(split, on="position")
    lender = pd.read_csv(work / "parts" / "lender" / "lender.csv")  # codes read as integers: must not matter
    customers = lender.drop(columns=["defaulted"])
    path = work / f"customers.{fmt}"
    customers.to_csv(path, index=False) if fmt == "csv" else customers.to_parquet(path, index=False)
    out = work / f"scores-{fmt}.csv"
    printed = _run("bank", "score", *operator, "--model", model_id, "--data", str(path), "--out", str(out), cwd=work)
    scores = pd.read_csv(out, dtype={"loan_ref": str})
    assert len(scores) == len(customers)
    aligned = split["bank_row"].to_numpy()
    assert (scores["status"].iloc[aligned] == "scored").all()  # every trained customer is held by every partner
    by_id = scores.set_index("loan_ref")["score"]
    ids = lender["loan_ref"].iloc[predictions["bank_row"].to_numpy()]
    difference = np.abs(by_id.loc[ids].to_numpy() - predictions["score"].to_numpy())
    assert difference.max() <= 1e-6, f"max score difference {difference.max()}"
    # The partner's missing salaries took the declared policy and were counted, not hidden.
    assert re.search(r"payroll column 'salary': \d+ missing: training mean", printed)
    (work / f"max-difference-{fmt}.txt").write_text(f"{difference.max():.3e}\n")


def test_the_report_compares_the_split_model_on_any_partition(own_run) -> None:
    work, _, model_id = own_run
    run = work / "state" / "lender" / "runs" / model_id
    printed = _run("bank.lab", "report", str(run), "--partition", "parts", cwd=work)
    comparison = pd.read_csv(run / "analysis" / "comparison.csv").set_index("model")["test_roc_auc"]
    split_auc = comparison["split model (this run)"]
    assert split_auc > comparison["bank only: HistGradientBoosting"] + 0.05  # the partners are worth something
    assert split_auc > comparison["centralised: HistGradientBoosting"] - 0.05  # and it is used
    (work / "comparison.txt").write_text(comparison.to_string() + "\n")
    without = _run("bank.lab", "report", str(run), cwd=work)  # no partition folder: one clear line, no traceback
    assert "references left out" in without and "partition.json: missing" in without
    assert "== comparison" in printed
