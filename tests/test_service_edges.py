"""The edges of a party service: hostile bodies, slow clients, refused handshakes, files on disk.

Every test here runs a real uvicorn server on 127.0.0.1 with real mutual TLS
and talks to it over real sockets, because each edge lives below the app.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pandas as pd
import pytest

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.errors import BadMessage
from parties.protocol.wire import check_nesting, decode
from partner.settings import PartnerSettings
from parties.storage.files import open_private_log, private_dir
from parties.transport.client import make_client
from parties.transport.tls import TLSFiles, client_ssl_context


def deep_message(levels: int = 30_000) -> bytes:
    """A safetensors body whose JSON header nests ``levels`` deep, in under 64 KB."""
    header = b'{"__metadata__":{"schema_version":"1"},"x":' + b"[" * levels + b"]" * levels + b"}"
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


@pytest.fixture()
def tiny_partner_csv(write_csv) -> Path:
    return write_csv("p.csv", customer_id=[f"c{i}" for i in range(20)], x=[float(i) for i in range(20)])


def test_nesting_check_counts_brackets_outside_strings_only() -> None:
    check_nesting(b'{"a":{"b":[1,2]},"s":"[[[[[[[[[[[[[\\"[[[[[[[[[[[["}')  # brackets in strings do not count
    with pytest.raises(BadMessage, match="nests deeper"):
        check_nesting(b'{"a":' + b"[" * 9 + b"]" * 9 + b"}")
    with pytest.raises(BadMessage, match="nests deeper"):
        decode(deep_message(), {})


@pytest.mark.parametrize("path", ["/train/sessions", "/models/m1/embed"], ids=["train", "score"])
def test_a_deeply_nested_header_is_a_400_not_a_500(pki, start_partner, tiny_partner_csv, path) -> None:
    partner = start_partner(tiny_partner_csv)
    body = deep_message()
    assert len(body) < 1 << 16
    with make_client(TLSFiles.from_dir(pki, "bank")) as client:
        response = client.post(f"{partner.url}{path}", content=body)
        assert response.status_code == 400, response.text
        assert "nests deeper" in response.json()["detail"]
        assert client.get(f"{partner.url}/health").status_code == 200  # and the service still answers


# --- TLS is the command line's decision -------------------------------------------------------------


def _serve_partner(data: Path, flags: list[str], env: dict[str, str], tmp_path: Path) -> tuple[int | None, str, str]:
    """Start ``python -m partner serve``; once it listens (or exits), its URL (or "") and its log."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "partner", "serve", "--name", "partner", "--data", str(data), "--workers", "1",
         "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    url = json.loads(ready.read_text())["url"] if ready.exists() else ""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, url, err


@pytest.mark.parametrize("value", ["1", "yes", "on", "true"])
def test_an_insecure_variable_alone_is_refused(tiny_partner_csv, tmp_path, value) -> None:
    code, url, err = _serve_partner(tiny_partner_csv, [], {"CUTLAYER_PARTNER_INSECURE": value}, tmp_path)
    assert code == 2 and url == ""
    assert "CUTLAYER_PARTNER_INSECURE is set, but the environment cannot turn TLS off" in err


def test_an_explicit_tls_flag_wins_over_an_insecure_variable(pki, tiny_partner_csv, tmp_path) -> None:
    code, url, err = _serve_partner(tiny_partner_csv, ["--tls-dir", str(pki)], {"CUTLAYER_PARTNER_INSECURE": "1"},
                                    tmp_path)
    assert url.startswith("https://127.0.0.1:")
    assert "CUTLAYER_PARTNER_INSECURE is ignored" in err and "INSECURE: serving plain HTTP" not in err


def test_insecure_needs_loopback_and_says_so_loudly(tiny_partner_csv, tmp_path) -> None:
    code, url, err = _serve_partner(tiny_partner_csv, ["--insecure", "--host", "0.0.0.0"], {}, tmp_path)
    assert code == 2 and url == "" and "loopback address only" in err
    code, url, err = _serve_partner(tiny_partner_csv, ["--insecure"], {}, tmp_path)
    assert url.startswith("http://127.0.0.1:")
    assert "WARNING parties.transport.server: INSECURE: serving plain HTTP" in err


def test_insecure_and_a_tls_flag_together_are_refused(pki, tiny_partner_csv, tmp_path) -> None:
    code, url, err = _serve_partner(tiny_partner_csv, ["--insecure", "--tls-dir", str(pki)], {}, tmp_path)
    assert code == 2 and url == "" and "give one or the other" in err


def test_settings_never_read_insecure_from_the_environment(pki, tiny_partner_csv, monkeypatch) -> None:
    monkeypatch.setenv("CUTLAYER_PARTNER_INSECURE", "1")
    settings = PartnerSettings(name="partner", data=tiny_partner_csv, tls_dir=pki)
    assert not settings.insecure and settings.tls_files() == TLSFiles.from_dir(pki, "partner")


# --- a refused body is not read on ----------------------------------------------------------------


def tls_socket(pki: Path, name: str, url: str, timeout: float = 5.0) -> ssl.SSLSocket:
    """A raw mutual-TLS connection to a service, as party ``name``."""
    parts = urlsplit(url)
    raw = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    return client_ssl_context(TLSFiles.from_dir(pki, name)).wrap_socket(raw, server_hostname=parts.hostname)


def trickle_until_closed(sock: ssl.SSLSocket, chunk: bytes, seconds: float) -> tuple[bytes, float | None]:
    """Send ``chunk`` every 20 ms while reading; what the server said and when it closed (``None``: never)."""
    sock.settimeout(0.02)
    start, received = time.monotonic(), b""
    while time.monotonic() - start < seconds:
        try:
            sock.sendall(chunk)
        except (OSError, ssl.SSLError):
            return received, time.monotonic() - start
        try:
            data = sock.recv(65536)
        except (TimeoutError, socket.timeout, ssl.SSLWantReadError):
            continue
        except (OSError, ssl.SSLError):
            return received, time.monotonic() - start
        if not data:
            return received, time.monotonic() - start
        received += data
    return received, None


@pytest.mark.parametrize("caller, path, framing, status", [
    ("bank", "/train/sessions", "declared", b"413"),
    ("bank", "/train/sessions/s1/step", "declared", b"413"),
    ("bank", "/train/sessions", "chunked", b"413"),
    ("bank", "/train/sessions/s1/step", "chunked", b"413"),
    ("partner2", "/train/sessions", "declared", b"403"),
    ("partner2", "/train/sessions/s1/step", "declared", b"403"),
], ids=["413-declared", "413-declared-hot", "413-streamed", "413-streamed-hot", "403", "403-hot"])
def test_a_refused_body_closes_the_connection(pki, start_partner, tiny_partner_csv, caller, path, framing,
                                              status) -> None:
    partner = start_partner(tiny_partner_csv, max_body_bytes=4096)
    length = b"content-length: 2000000000" if framing == "declared" else b"transfer-encoding: chunked"
    chunk = b"x" * 1024 if framing == "declared" else b"400\r\n" + b"x" * 1024 + b"\r\n"
    with tls_socket(pki, caller, partner.url) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\n%s\r\n\r\n" % (path.encode(), length))
        answer, closed_after = trickle_until_closed(sock, chunk, seconds=5)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert b"connection: close" in answer.lower()
    assert closed_after is not None and closed_after < 3, "the server kept reading a refused body"


# --- a slow client is cut off -----------------------------------------------------------------------

HEAD = b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 100000\r\n"


@pytest.mark.parametrize("first, chunk", [
    (b"", b""),  # connected, said nothing
    (HEAD % b"/train/sessions", b"x-slow: 1\r\n"),  # a head that never ends
    (HEAD % b"/train/sessions" + b"\r\n", b"x" * 8),  # a body that trickles
    (HEAD % b"/train/sessions/s1/step" + b"\r\n", b"x" * 8),  # the same to a hot route
], ids=["idle", "head", "body", "body-hot"])
def test_a_trickling_client_is_cut_off(pki, start_partner, tiny_partner_csv, caplog, first, chunk) -> None:
    partner = start_partner(tiny_partner_csv, header_timeout=1.0, body_timeout=1.0)
    caplog.set_level("WARNING", logger="parties.transport")
    with tls_socket(pki, "bank", partner.url) as sock:
        sock.sendall(first) if first else None
        answer, closed_after = trickle_until_closed(sock, chunk, seconds=6)
    assert closed_after is not None and closed_after < 3.5, "a trickling client held the connection"
    assert "took longer than 1s to arrive" in caplog.text
    if first.endswith(b"\r\n\r\n"):
        assert not answer.startswith(b"HTTP/1.1 2")
    else:
        assert answer.startswith(b"HTTP/1.1 408")


def test_three_tricklers_do_not_hold_the_server(pki, start_partner, tiny_partner_csv) -> None:
    partner = start_partner(tiny_partner_csv, header_timeout=1.0, body_timeout=1.0)
    socks = [tls_socket(pki, "bank", partner.url) for _ in range(3)]
    for sock in socks:
        sock.sendall(HEAD % b"/train/sessions" + b"\r\n")
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda s: trickle_until_closed(s, b"x", seconds=8), socks))
    for sock in socks:
        sock.close()
    assert all(closed is not None and closed < 3.5 for _, closed in results)
    with make_client(TLSFiles.from_dir(pki, "bank")) as client:
        assert client.get(f"{partner.url}/health").status_code == 200


def test_a_slow_app_is_not_mistaken_for_a_slow_client(pki, start_partner, tiny_partner_csv) -> None:
    partner = start_partner(tiny_partner_csv, header_timeout=0.5, body_timeout=0.5)
    with make_client(TLSFiles.from_dir(pki, "bank")) as client:
        for _ in range(3):  # kept-alive requests, each well within its limits, over more than the timeouts
            assert client.get(f"{partner.url}/health").status_code == 200
            time.sleep(0.3)


# --- refused handshakes are logged ------------------------------------------------------------------


def _handshake(pki_dir: Path | None, url: str) -> None:
    parts = urlsplit(url)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # the client side is not under test
    if pki_dir is not None:
        files = TLSFiles.from_dir(pki_dir, "bank")
        context.load_cert_chain(str(files.cert), str(files.key))
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=parts.hostname) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                sock.recv(100)  # TLS 1.3: the server's refusal of the client arrives after the client's finish
        except (OSError, ssl.SSLError):
            pass


@pytest.mark.parametrize("who, reason", [
    ("rogue", "its certificate is not from this partnership's CA"),
    ("anonymous", "it presented no client certificate"),
    ("plain", "it does not speak TLS"),
], ids=["wrong-ca", "no-certificate", "plain-http"])
def test_a_refused_handshake_is_logged_with_the_peer_and_the_reason(pki, rogue_pki, start_partner, tiny_partner_csv,
                                                                    caplog, who, reason) -> None:
    partner = start_partner(tiny_partner_csv)
    caplog.set_level("WARNING", logger="parties.transport.edges")
    if who == "plain":
        parts = urlsplit(partner.url)
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as raw:
            raw.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            raw.recv(100)
    else:
        _handshake(rogue_pki if who == "rogue" else None, partner.url)
    deadline = time.monotonic() + 5
    while "refused a TLS connection" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    [record] = [r for r in caplog.records if r.name == "parties.transport.edges"]
    assert record.levelname == "WARNING"
    assert "refused a TLS connection from 127.0.0.1:" in record.getMessage() and reason in record.getMessage()


def test_a_caller_in_the_wrong_role_is_logged_with_its_address(pki, start_partner, tiny_partner_csv, caplog) -> None:
    partner = start_partner(tiny_partner_csv)
    caplog.set_level("WARNING", logger="parties")
    with make_client(TLSFiles.from_dir(pki, "partner2")) as client:
        assert client.post(f"{partner.url}/train/sessions", content=b"").status_code == 403
    [record] = [r for r in caplog.records if r.levelname == "WARNING" and "refused" in r.getMessage()]
    assert "from 127.0.0.1:" in record.getMessage() and "for the bank" in record.getMessage()


# --- what a party writes is its own ----------------------------------------------------------------


def test_every_file_a_party_writes_is_0600_and_every_folder_0700(pki, bank_full, tmp_path, start_partner,
                                                                 start_bank) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=1500, cache=bank_full.parent, download=False)
    partner = start_partner(paths["partner"], min_intersection=20)
    bank = start_bank(paths["bank"], {"partner": partner.url})
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        op.wait(op.start_alignment())
        result = op.wait(op.start_training(TrainingConfig(epochs=1, batch_size=256)))
        frame = pd.read_csv(paths["bank"], dtype=str).drop(columns=["y"]).head(50)
        op.wait(op.start_scoring(result["session"], frame.to_csv(index=False).encode(), True))
    run = Path(result["run_dir"])
    assert {"history.csv", "test_predictions.csv", "split.csv", "calibration.csv", "unaligned_split.csv"} <= {
        p.name for p in run.iterdir()}
    assert list((run / "model" / "subsets").rglob("*.*"))
    written = [p for state in ("state-bank", "state-partner") for p in (tmp_path / state).rglob("*")]
    assert any(p.name == "scores.csv" for p in written)
    wrong = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written
             if p.stat().st_mode & 0o777 != (0o700 if p.is_dir() else 0o600)}
    assert not wrong
    for state in ("state-bank", "state-partner"):
        assert (tmp_path / state).stat().st_mode & 0o777 == 0o700


def test_a_service_log_is_private_even_if_it_existed(tmp_path) -> None:
    log = tmp_path / "logs" / "partner.log"
    log.parent.mkdir()
    log.write_text("before\n")
    log.chmod(0o644)
    with open_private_log(log) as f:
        f.write(b"after\n")
    assert log.stat().st_mode & 0o777 == 0o600 and log.read_text() == "before\nafter\n"
    private_dir(tmp_path / "a" / "b" / "c")
    assert all((tmp_path / p).stat().st_mode & 0o777 == 0o700 for p in ("a", "a/b", "a/b/c"))
