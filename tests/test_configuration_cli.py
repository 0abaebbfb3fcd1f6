"""The configurations beside vertical from the command line, as the README writes them.

The README's by-hand block (a compute party, three branches, one terminal each) trains the same models as
``python -m bank walkthrough --configuration ...``, bit for bit; the walkthrough says its run equals its
single-process twin; flags that only vertical has are refused with a reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.test_readme import ROOT, _bash_blocks, _commands, _free_port

SMALL_ROWS, SMALL_EPOCHS = "2500", "2"


def _configurations_block() -> str:
    return _bash_blocks((ROOT / "docs" / "how-to" / "configurations.md").read_text())[0]


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # four configurations trained through the by-hand commands
def test_the_readmes_by_hand_configurations_train_the_walkthroughs_models(bank_full: Path, tmp_path: Path) -> None:
    """Every command of the block as written (a slice, 2 epochs, free ports); then the walkthroughs of the same
    configurations: the test predictions are equal, number for number."""
    ports = {p: str(_free_port()) for p in ("8460", "8471", "8472", "8473")}
    small = {("data", "bank-owner"): ["--rows", SMALL_ROWS, "--cache-dir", str(bank_full.parent), "--no-download"],
             ("data", "bank-branches"): ["--rows", SMALL_ROWS, "--cache-dir", str(bank_full.parent), "--no-download"],
             ("bank", "train-owner"): ["--epochs", SMALL_EPOCHS],
             ("bank", "train-branches"): ["--epochs", SMALL_EPOCHS]}
    services: list[subprocess.Popen[bytes]] = []
    trained: dict[str, str] = {}
    try:
        for i, argv in enumerate(_commands(_configurations_block())):
            assert argv[:2] == ["python", "-m"], argv
            argv = [re.sub(r"\b(8460|8471|8472|8473)\b", lambda m: ports[m.group(1)], a) for a in argv[2:]]
            module, command = argv[0], argv[1]
            argv += small.get((module, command), [])
            if (module, command) in (("partner", "compute"), ("partner", "branch")):
                ready, log = tmp_path / f"service-{i}.ready", tmp_path / f"service-{i}.log"
                services.append(subprocess.Popen([sys.executable, "-m", *argv, "--ready-file", str(ready)],
                                                 cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT))
                deadline = time.monotonic() + 120
                while not ready.exists():
                    assert services[-1].poll() is None, log.read_text()[-3000:]
                    assert time.monotonic() < deadline, f"{' '.join(argv)} did not start"
                    time.sleep(0.05)
                continue
            run = _run(argv, tmp_path)
            assert run.returncode == 0, f"{' '.join(argv)}:\n{run.stderr[-3000:]}"
            if command.startswith("train-"):
                trained[argv[argv.index("--configuration") + 1]] = argv[argv.index("--out") + 1]
                assert "Test metrics" in run.stdout, run.stdout
    finally:
        for proc in services:
            proc.terminate()
            proc.wait(30)

    assert sorted(trained) == ["splitfed", "u-shaped"]
    for configuration, folder in trained.items():
        out = tmp_path / f"walkthrough-{configuration}"
        run = _run(["bank", "walkthrough", "--configuration", configuration, "--out", str(out), "--rows", SMALL_ROWS,
                    "--epochs", SMALL_EPOCHS, "--cache-dir", str(bank_full.parent), "--no-download"], tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "the split run equals it: yes, bit for bit" in run.stdout, run.stdout
        by_hand = pd.read_csv(tmp_path / folder / "test_predictions.csv")
        pd.testing.assert_frame_equal(by_hand, pd.read_csv(out / "test_predictions.csv"), check_exact=True)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["configuration"] == configuration and summary["reference"]["twin"]["equal"] is True
        for name in ("config.json", "metrics.json", "history.csv", "test_predictions.csv"):
            assert (out / name).is_file(), name


@pytest.mark.parametrize(("argv", "reason"), [
    (["--configuration", "relay", "--partners", "2"], "--partners: vertical only"),
    (["--configuration", "u-shaped", "--wire-precision", "int8"], "--wire-precision: vertical only"),
    (["--configuration", "splitfed", "--hijack-monitor"], "--hijack-monitor: vertical only"),
    (["--configuration", "u-shaped", "--branches", "4"], "--branches and --fedavg-every are for relay and splitfed"),
    (["--configuration", "relay", "--fedavg-every", "5"], "the relay hands one model on"),
    (["--branches", "3"], "--branches is for the relay and splitfed configurations"),
])
def test_flags_another_configuration_lacks_are_refused_in_one_line(tmp_path: Path, argv: list[str], reason: str) -> None:
    run = _run(["bank", "walkthrough", "--out", str(tmp_path / "run"), "--no-download", *argv], tmp_path, timeout=120)
    assert run.returncode != 0
    assert reason in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_run_folder_is_never_reused_and_a_runs_own_config_is_read_back(tmp_path: Path) -> None:
    """Two runs' files must not mix in one folder; a run's config.json is valid --config for its configuration
    and refused, in one line, for another."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.json").write_text("{}")
    run = _run(["bank", "walkthrough", "--configuration", "u-shaped", "--out", str(used), "--no-download"], tmp_path)
    assert run.returncode != 0 and "already holds a run" in run.stderr and "Traceback" not in run.stderr
    (used / "metrics.json").unlink()
    (used / "left-over.txt").write_text("x")
    run = _run(["bank", "walkthrough", "--configuration", "relay", "--out", str(used), "--no-download"], tmp_path)
    assert run.returncode != 0 and "is not empty" in run.stderr

    from bank.configurations.split_run import ConfigurationSettings

    config = tmp_path / "config.json"
    config.write_text(ConfigurationSettings(configuration="relay").model_dump_json())
    common = ["--compute", "c=https://127.0.0.1:1", "--data", "bank.csv", "--insecure", "--config", str(config)]
    run = _run(["bank", "train-owner", "--configuration", "u-shaped", *common], tmp_path)
    assert run.returncode != 0 and "is a relay configuration's settings" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    run = _run(["bank", "train-branches", "--configuration", "relay", "--labels", str(tmp_path / "missing.csv"),
                "--branch", "b=https://127.0.0.1:1", "--insecure", "--config", str(config)], tmp_path)
    assert run.returncode != 0 and "missing.csv" in run.stderr and "configuration's settings" not in run.stderr


@pytest.mark.parametrize(("argv", "reason"), [
    (["train-branches", "--configuration", "relay", "--labels", "labels.csv", "--tls-dir", "certs"],
     "give every branch: --branch NAME=URL"),
    (["train-branches", "--configuration", "relay", "--labels", "labels.csv", "--branch", "b1", "--insecure"],
     "--branch takes NAME=URL"),
    (["train-owner", "--configuration", "vanilla", "--data", "bank.csv", "--compute", "c=https://127.0.0.1:1"],
     "TLS is required"),
    (["train-owner", "--configuration", "vanilla", "--data", "bank.csv", "--compute", "c=https://127.0.0.1:1",
      "--insecure", "--tls-dir", "certs"], "give one or the other"),
])
def test_the_by_hand_commands_refuse_what_they_cannot_use(tmp_path: Path, argv: list[str], reason: str) -> None:
    run = _run(["bank", *argv], tmp_path, timeout=120)
    assert run.returncode != 0 and reason in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_a_party_that_never_answered_is_reported_within_seconds_not_retried_for_a_minute() -> None:
    """A wrong port is not a restart: the first call gives up after a few seconds and says what to check."""
    import httpx

    from bank.configurations.layer_peer import LayerPeer
    from bank.peer import FIRST_CONTACT_DEADLINE
    from bank.vertical.http_partner import HttpPartner
    from parties.errors import PeerUnavailable

    port = _free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    with httpx.Client() as client:
        # One rule for every peer client: a branch's layers, and a partner's sessions alike.
        for call in (lambda: LayerPeer("branch-1", url, client, "partner", retry_deadline=60).stats(list(range(200))),
                     lambda: HttpPartner("partner", url, client, retry_deadline=60).sessions()):
            started = time.monotonic()
            with pytest.raises(PeerUnavailable, match="it never answered: is the URL right"):
                call()
            assert time.monotonic() - started < FIRST_CONTACT_DEADLINE + 5


def test_the_by_hand_training_flags_reach_the_settings_and_a_task_the_labels_are_not_is_refused(
        tmp_path: Path) -> None:
    """In process: every training flag of ``train-owner`` reaches its setting (not only ``--epochs`` and ``--seed``);
    ``--task binary`` on a four-class label is refused naming the count, before any party is called."""
    from bank.__main__ import build_parser
    from bank.configurations.commands import _training_flags, configuration_settings, train_owner
    from parties.errors import DataError

    data = tmp_path / "owner.csv"
    pd.DataFrame({"customer_id": [f"c{i}" for i in range(40)], "x": range(40),
                  "level": ["a", "b", "c", "d"] * 10}).to_csv(data, index=False)
    argv = ["train-owner", "--configuration", "vanilla", "--data", str(data), "--label", "level",
            "--compute", "c=https://127.0.0.1:1", "--insecure", "--out", str(tmp_path / "run")]
    flags = ["--task", "binary", "--positive-label", "b", "--epochs", "3", "--patience", "2", "--seed", "5"]
    args = build_parser().parse_args(argv + flags)
    training = configuration_settings(args.configuration, None, **_training_flags(args)).training
    assert (training.task, training.positive_label, training.epochs, training.patience, training.seed) == (
        "binary", "b", 3, 2, 5)
    with pytest.raises(DataError, match="binary task: the label column has 4 distinct values"):
        train_owner(args)
    assert not (tmp_path / "run").exists()
