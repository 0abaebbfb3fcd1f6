"""A party's processes as an operator meets them: killed, its helpers go too; stopped, it stops in seconds;
restarted under a training, the operator sees the bank retry and roll back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.transport.process import ServiceProcess
from parties.transport.server import bind_socket
from parties.transport.tls import TLSFiles

#: Training long enough to be interrupted: small batches, no early stop.
LONG = {"epochs": 200, "patience": 200, "batch_size": 32, "checkpoint_every": 20}


def _parents() -> dict[int, int]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":  # a zombie has ended; only its parent has not reaped it
                out[int(entry.name)] = int(fields[1])
    return out


def _descendants(pid: int) -> set[int]:
    parents, found, frontier = _parents(), set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pids: set[int]) -> set[int]:
    return pids & set(_parents())


def _free_port() -> int:
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture(scope="module")
def files(bank_full: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return prepare_bank_marketing(tmp_path_factory.mktemp("data"), rows=3000, cache=bank_full.parent, download=False)


def _partner(pki: Path, files: dict[str, Path], state: Path, *flags: str) -> ServiceProcess:
    process = ServiceProcess("partner", ["--name", "partner", "--data", str(files["partner"]), "--tls-dir", str(pki),
                                         "--state-dir", str(state), *flags], state / "ready.json",
                             state / f"log-{time.monotonic_ns()}.txt")
    process.wait_ready()
    return process


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc (Linux)")
def test_a_killed_partners_psi_workers_die_with_it(pki: Path, files, tmp_path: Path) -> None:
    partner = _partner(pki, files, tmp_path / "state", "--workers", "2")
    pid = partner.proc.pid
    deadline = time.monotonic() + 60
    while len(_descendants(pid)) < 4 and time.monotonic() < deadline:  # fork server, resource tracker, 2 workers
        time.sleep(0.1)
    helpers = _descendants(pid)
    assert len(helpers) >= 4, f"expected the PSI helpers to be running: {helpers}"
    partner.proc.send_signal(signal.SIGKILL)
    partner.proc.wait()
    deadline = time.monotonic() + 15
    while _running(helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _running(helpers)
    for stray in left:  # do not leave them to the next test, whatever happened
        os.kill(stray, signal.SIGKILL)
    assert not left, f"{len(left)} of the killed partner's helper processes kept running"


def test_a_partner_stopped_mid_training_exits_within_seconds(pki: Path, files, tmp_path: Path, start_bank) -> None:
    partner = _partner(pki, files, tmp_path / "partner", "--workers", "1")
    assert partner.url is not None
    bank = start_bank(files["bank"], {"partner": partner.url}, peer_retry_deadline=3)
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        job = op.start_training(_long())
        deadline = time.monotonic() + 60
        while "epoch" not in op.job(job.job_id).progress and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.monotonic()
        partner.proc.send_signal(signal.SIGTERM)  # the bank holds its step connection open: it must not matter
        partner.proc.wait(timeout=30)
        stopped = time.monotonic() - started
    assert partner.proc.returncode == 0
    assert stopped < 5, f"the partner took {stopped:.1f} s to stop"


def _long():
    from bank.config import TrainingConfig

    return TrainingConfig(**LONG)


def test_train_shows_the_bank_retrying_and_rolling_back_a_restarted_partner(pki: Path, files, tmp_path: Path) -> None:
    port = _free_port()
    state = tmp_path / "partner"
    flags = ("--workers", "1", "--port", str(port))
    partner = _partner(pki, files, state, *flags)
    bank = ServiceProcess("bank", ["--name", "bank", "--data", str(files["bank"]), "--tls-dir", str(pki), "--state-dir",
                                   str(tmp_path / "bank"), "--workers", "1", f"--partner=partner={partner.url}"],
                          tmp_path / "bank.ready", tmp_path / "bank.log")
    try:
        url = bank.wait_ready()
        operator = ["--url", url, "--tls-dir", str(pki)]
        subprocess.run([sys.executable, "-m", "bank", "align", *operator], check=True, capture_output=True, timeout=300)
        (tmp_path / "long.json").write_text(json.dumps({**LONG, "epochs": 4}))
        train = subprocess.Popen([sys.executable, "-m", "bank", "train", *operator, "--config",
                                  str(tmp_path / "long.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not list(state.glob("banks/bank/training/*/*.safetensors")) and time.monotonic() < deadline:  # training has begun
            time.sleep(0.1)
        partner.proc.send_signal(signal.SIGKILL)
        partner.proc.wait()
        time.sleep(4)  # long enough for the bank to retry, and the operator to see it
        partner = _partner(pki, files, state, *flags)
        out, err = train.communicate(timeout=600)
        assert train.returncode == 0, err[-3000:]
        assert "partner 'partner' is not answering" in err and "retrying for up to 120 s" in err
        assert "rolling every party back to step" in err  # said as it happened, a line of its own
        assert "rolled back to a common checkpoint" in err
    finally:
        bank.stop()
        partner.stop()
