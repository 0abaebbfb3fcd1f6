"""Failures a newcomer meets first are one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from bank.vertical.http_partner import HttpPartner
from bank.service.operator import BankOperator
from parties.errors import PeerUntrusted
from parties.transport.client import StepConnection, make_client
from parties.transport.tls import PeerIdentity, TLSFiles


def _partner_csv(path: Path, rows: int) -> Path:
    pd.DataFrame({"customer_id": [f"c{i}" for i in range(rows)], "x": range(rows)}).to_csv(path, index=False)
    return path


def _serve(module: str, args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A service in a session of its own, as a terminal runs it: Ctrl-C reaches its whole process group."""
    ready = tmp_path / f"{module}-ready.json"
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", *args, "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{module} did not start:\n{proc.communicate()[0]}")
        time.sleep(0.05)
    return proc, ready


def test_a_port_in_use_is_named_with_the_way_out(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with taken:
        run = subprocess.run(
            [sys.executable, "-m", "partner", "serve", "--name", "partner", "--insecure",
             "--data", str(_partner_csv(tmp_path / "p.csv", 10)), "--port", str(port), "--state-dir", str(tmp_path / "s")],
            capture_output=True, text=True, timeout=120,
        )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot listen on 127.0.0.1:{port}: port {port} is already in use; "
                      "choose another with --port (--port 0 takes any free port)"]


def test_ctrl_c_stops_a_service_and_its_psi_workers_quietly(tmp_path: Path) -> None:
    # 2 workers: the partner starts its PSI worker pool at start-up.
    data = _partner_csv(tmp_path / "p.csv", 10_000)
    proc, _ = _serve("partner", ["--name", "partner", "--insecure", "--data", str(data), "--workers", "2",
                                 "--state-dir", str(tmp_path / "state")], tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
    out, _ = proc.communicate(timeout=60)
    assert "started 2 PSI worker processes" in out  # the workers were there to be interrupted
    assert proc.returncode in (0, 130)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "Process ForkServerProcess" not in out


def test_ctrl_c_pressed_twice_stops_the_bank_quietly(tmp_path: Path) -> None:
    bank = tmp_path / "b.csv"
    pd.DataFrame({"customer_id": ["a", "b"], "x": [1, 2], "y": ["no", "yes"]}).to_csv(bank, index=False)
    proc, _ = _serve("bank", ["--name", "bank", "--insecure", "--data", str(bank), "--state-dir", str(tmp_path / "s")],
                     tmp_path)
    for _ in range(2):  # people press it twice; the second must not skip the bank's own shutdown
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130) and "Traceback" not in out and "KeyboardInterrupt" not in out
    assert "Finished server process" in out


def test_a_bank_certificate_from_another_ca_is_named_not_called_silence(pki: Path, rogue_pki: Path, start_bank,
                                                                       write_csv) -> None:
    bank = start_bank(write_csv("b.csv", customer_id=["a", "b"], x=[1, 2], y=["no", "yes"]), {})
    # The operator trusts another CA: the bank service answers, with a certificate the operator must refuse.
    with BankOperator(bank.url, TLSFiles.from_dir(rogue_pki, "bank")) as operator:
        with pytest.raises(PeerUntrusted, match="answered, but its certificate is not from this partnership's CA"):
            operator.start_alignment()


def test_a_partner_with_a_foreign_certificate_is_refused_at_once(pki: Path, rogue_pki: Path, start_partner,
                                                                 write_csv) -> None:
    partner = start_partner(write_csv("p.csv", customer_id=["a", "b"], x=[1, 2]))
    rogue = TLSFiles.from_dir(rogue_pki, "bank")  # the bank's client trusts a CA the partner's certificate is not from
    me, them = PeerIdentity("bank", "bank"), PeerIdentity("partner", "partner")
    with make_client(rogue, caller=me) as client:
        proxy = HttpPartner("partner", partner.url, client, retry_deadline=30)
        started = time.monotonic()
        with pytest.raises(PeerUntrusted, match="partner 'partner' .* answered .*not from this partnership's CA"):
            proxy.open(2, 1024)
        assert time.monotonic() - started < 10  # not retried for the deadline: a certificate does not heal
    with StepConnection(partner.url, rogue, expect=them, caller=me) as steps:
        with pytest.raises(PeerUntrusted, match="not from this partnership's CA"):  # on the step connection too
            steps.send("/x", b"", "application/octet-stream")()


def test_training_before_alignment_says_which_command_comes_first(pki: Path, start_bank, write_csv) -> None:
    bank = start_bank(write_csv("b.csv", customer_id=["a", "b"], x=[1, 2], y=["no", "yes"]), {})
    run = subprocess.run([sys.executable, "-m", "bank", "train", "--url", bank.url, "--tls-dir", str(pki)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == "error: the bank has no alignment yet: run `python -m bank align` first"
