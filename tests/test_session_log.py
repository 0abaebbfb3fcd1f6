"""The PSI session log: a hash chain that verifies, reloads, survives a crash mid-write and refuses every edit."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from parties.errors import DataError, LogTampered
from parties.storage.session_log import GENESIS, SessionLog, verify_log

ROOT = Path(__file__).resolve().parents[1]


def _hash(record: dict[str, object]) -> str:
    """The chain's hash, computed here from the specification rather than by the module under test."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                          .encode()).hexdigest()


def _write_sessions(path: Path, n: int) -> list[dict[str, object]]:
    with SessionLog(path) as log:
        return [log.append("psi", peer=f"bank-{i % 2}", declared=100 + i, received=90 + i, result=i,
                           purpose="churn model") for i in range(n)]


def test_a_chain_verifies_and_a_reopened_log_continues_it(tmp_path: Path) -> None:
    path = tmp_path / "psi.log"
    written = _write_sessions(path, 3)
    for seq, record in enumerate(written):
        assert record["seq"] == seq
        assert record["prev"] == (GENESIS if seq == 0 else written[seq - 1]["hash"])
        assert record["hash"] == _hash(record)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(record["time"]))
        assert abs(float(record["unix"]) - time.time()) < 60  # type: ignore[arg-type]
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == written == verify_log(path)
    assert written[1]["purpose"] == "churn model" and written[1]["declared"] == 101

    reopened = SessionLog(path)
    assert reopened.records() == written
    fourth = reopened.append("refused", peer="bank-1", declared=10**7, reason="over budget")
    reopened.close()
    assert (fourth["seq"], fourth["prev"]) == (3, written[-1]["hash"])
    assert verify_log(path) == [*written, fourth]
    assert not verify_log(path).torn


def test_the_log_is_private_and_created_only_by_the_first_append(tmp_path: Path) -> None:
    path = tmp_path / "state" / "logs" / "psi.log"
    log = SessionLog(path)
    assert not (tmp_path / "state").exists()
    log.append("psi", peer="bank", result=1)
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700


def _edit(lines: list[str]) -> list[str]:
    record = json.loads(lines[2])
    record["result"] = int(record["result"]) + 1
    return [*lines[:2], json.dumps(record), *lines[3:]]


def _delete(lines: list[str]) -> list[str]:
    return [*lines[:2], *lines[3:]]


def _swap(lines: list[str]) -> list[str]:
    return [lines[0], lines[2], lines[1], *lines[3:]]


def _forge(lines: list[str]) -> list[str]:
    forged: dict[str, object] = {**json.loads(lines[1]), "seq": 2, "result": 0, "prev": "f" * 64}
    forged["hash"] = _hash(forged)  # its own hash is right; the chain to it is not
    return [*lines[:2], json.dumps(forged), *lines[2:]]


def _garbage(lines: list[str]) -> list[str]:
    return [lines[0], "{not json", *lines[2:]]


@pytest.mark.parametrize(("damage", "line", "reason"), [
    (_edit, 3, "the hash does not match the record"),
    (_delete, 3, "seq is 3, expected 2"),
    (_swap, 2, "seq is 2, expected 1"),
    (_forge, 3, "prev is not the hash of line 2"),
    (_garbage, 2, "not a JSON record"),
], ids=["edited-field", "deleted-middle-line", "swapped-lines", "forged-insert", "garbage-line"])
def test_a_damaged_log_is_refused_at_its_line(tmp_path: Path, damage: Callable[[list[str]], list[str]],
                                              line: int, reason: str) -> None:
    path = tmp_path / "psi.log"
    _write_sessions(path, 5)
    path.write_text("\n".join(damage(path.read_text().splitlines())) + "\n")
    before = path.read_bytes()
    expected = f"{re.escape(str(path))}, line {line}: .*{re.escape(reason)}"
    with pytest.raises(LogTampered, match=expected):
        verify_log(path)
    with pytest.raises(LogTampered, match=expected):
        SessionLog(path)
    assert path.read_bytes() == before  # a damaged log is evidence: opening it changes nothing


@pytest.mark.parametrize("tail", [b'{"seq":3,"ti', None], ids=["half-a-record", "whole-record-without-newline"])
def test_a_torn_last_line_is_dropped_and_the_chain_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          tail: bytes | None) -> None:
    path = tmp_path / "psi.log"
    _write_sessions(path, 4)
    whole = path.read_bytes()
    lines = whole.splitlines(keepends=True)
    if tail is None:  # the crash came between the record and its newline: still not a whole line
        whole, tail = b"".join(lines[:3]), lines[3].rstrip(b"\n")
    path.write_bytes(whole + tail)

    with caplog.at_level(logging.WARNING, logger="parties.storage.session_log"):
        checked = verify_log(path)
    assert checked.torn and len(checked) == whole.count(b"\n")
    assert path.read_bytes() == whole + tail  # verifying alone changes nothing
    assert f"line {len(checked) + 1} is torn" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="parties.storage.session_log"):
        log = SessionLog(path)
    assert path.read_bytes() == whole
    assert "dropped the torn line" in caplog.text
    added = log.append("psi", peer="bank-0", result=7)
    log.close()
    assert added["seq"] == len(checked) and added["prev"] == checked[-1]["hash"]
    again = verify_log(path)
    assert not again.torn and again == [*checked, added]


def test_appends_from_many_threads_make_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "psi.log"
    log = SessionLog(path)
    start = threading.Barrier(8)

    def work(thread: int) -> None:
        start.wait()
        for i in range(50):
            log.append("psi", peer=f"bank-{thread}", result=i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    records = verify_log(path)
    assert [r["seq"] for r in records] == list(range(400))
    assert sorted((str(r["peer"]), r["result"]) for r in records) == sorted(
        (f"bank-{t}", i) for t in range(8) for i in range(50))
    assert log.records() == records


def test_records_since_a_time(tmp_path: Path) -> None:
    path = tmp_path / "psi.log"
    log = SessionLog(path)
    written = []
    for i in range(3):
        written.append(log.append("psi", peer="bank", result=i))
        time.sleep(0.01)  # distinct times on any clock
    log.close()
    for reader in (log, SessionLog(path)):  # in memory, and read back from the file
        assert [r["seq"] for r in reader.records(since=float(written[1]["unix"]))] == [1, 2]  # type: ignore[arg-type]
        assert reader.records(since=float(written[2]["unix"]) + 1) == []  # type: ignore[arg-type]
        assert reader.records() == written
    copy = log.records()[0]
    copy["result"] = 99  # a caller's copy, not the log's own record
    assert log.records()[0]["result"] == 0


@pytest.mark.parametrize("name", ["seq", "time", "unix", "event", "prev", "hash"])
def test_the_log_keeps_its_own_keys(tmp_path: Path, name: str) -> None:
    path = tmp_path / "psi.log"
    log = SessionLog(path)
    with pytest.raises(ValueError, match=name):
        log.append("psi", **{name: 1})
    assert not path.exists() and log.records() == []


@pytest.mark.parametrize(("value", "error"), [([1, 2], TypeError), (float("nan"), ValueError)], ids=["list", "nan"])
def test_a_field_is_a_plain_json_value(tmp_path: Path, value: object, error: type[Exception]) -> None:
    log = SessionLog(tmp_path / "psi.log")
    with pytest.raises(error, match="field 'result'"):
        log.append("psi", result=value)  # type: ignore[arg-type]
    assert log.records() == []


def test_a_second_writer_is_noticed(tmp_path: Path) -> None:
    path = tmp_path / "psi.log"
    first, second = SessionLog(path), SessionLog(path)
    first.append("psi", result=1)
    with pytest.raises(LogTampered, match="changed since this log read it"):
        second.append("psi", result=2)
    first.close()
    second.close()
    assert len(verify_log(path)) == 1


def test_a_missing_log_cannot_be_verified(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read the session log"):
        verify_log(tmp_path / "absent.log")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parties", "verify-log", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_verify_log_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "psi.log"
    written = _write_sessions(path, 4)
    with SessionLog(path) as log:
        written.append(log.append("refused", peer="bank-1", declared=10**6, reason="over budget"))

    good = _cli(str(path))
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines() == [
        "peer bank-0, event psi: 2 records, declared 202, received 182, result 2",
        "peer bank-1, event psi: 2 records, declared 204, received 184, result 4",
        "peer bank-1, event refused: 1 record, declared 1000000",
        "5 records, chain intact",
    ]

    as_json = _cli(str(path), "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == written

    lines = path.read_text().splitlines()
    path.write_text("\n".join(_edit(lines)) + "\n")
    bad = _cli(str(path))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        f"error: {path}, line 3: the hash does not match the record: it was edited"]
