"""A bank's disk quota at a party: what it counts, where it stops, and what the refusal tells the bank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parties.errors import BadMessage, QuotaExceeded, StorageError
from parties.storage.quota import FOLDER_BYTES, DiskQuota

MB = 1 << 20


def _file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the size without the writing
    return path


def test_used_counts_nested_files_and_not_links(tmp_path: Path) -> None:
    quota = DiskQuota(tmp_path / "banks", None, party="partner 'telco'")
    folder = quota.folder("evil")
    assert folder == tmp_path / "banks" / "evil"
    assert quota.used("evil") == 0  # nothing yet: no folder

    model = _file(folder / "model.safetensors", 1000)
    _file(folder / "sessions" / "s1" / "step-3.safetensors", 200)
    _file(folder / "sessions" / "s1" / "meta" / "step-3.json", 30)
    outside = _file(tmp_path / "elsewhere" / "big.bin", 10 * MB)
    (folder / "sessions" / "link-to-big").symlink_to(outside)
    (folder / "link-to-folder").symlink_to(outside.parent, target_is_directory=True)
    os.link(model, folder / "sessions" / "model-again.safetensors")  # one file, two names
    _file(tmp_path / "banks" / "other" / "model.safetensors", 5 * MB)  # another bank's

    # Files once each, links not followed, and each folder inside a block (sessions, s1, meta): a bank that
    # makes folders without end pays for them.
    assert quota.used("evil") == 1230 + 3 * FOLDER_BYTES
    assert quota.used("other") == 5 * MB


@pytest.mark.parametrize("flag", ["--disk-quota-per-bank", "--quotas.disk-per-bank"], ids=["default-flag", "own-flag"])
def test_check_passes_at_the_limit_and_refuses_one_byte_more(tmp_path: Path, flag: str) -> None:
    quota = DiskQuota(tmp_path, 4 * MB, party="partner 'telco'", flag=flag)
    _file(tmp_path / "evil" / "model.safetensors", 3 * MB)
    _file(tmp_path / "evil" / "runs" / "a" / "step-1.safetensors", MB // 2 - 2 * FOLDER_BYTES)  # runs, a

    quota.check("evil", MB // 2)  # exactly at the quota: allowed
    with pytest.raises(QuotaExceeded) as refused:
        quota.check("evil", MB // 2 + 1)
    assert isinstance(refused.value, StorageError) and refused.value.status_code == 507
    message = str(refused.value)
    for part in ("bank 'evil' keeps 3.5 MB (3,670,016 bytes) at partner 'telco'",
                 "0.5 MB (524,289 bytes) more would pass its quota of 4.0 MB (4,194,304 bytes, " + flag + ")",
                 "End finished sessions", "ask the operator of partner 'telco' to raise the quota",
                 "remove evil's old models and checkpoints"):
        assert part in message, message
    assert str(tmp_path) not in message  # the bank is told no path of the party's disk
    quota.check("other", 4 * MB)  # the quota is per bank


def test_no_limit_never_refuses(tmp_path: Path) -> None:
    quota = DiskQuota(tmp_path, None, party="partner 'telco'")
    _file(tmp_path / "evil" / "model.safetensors", 3 * MB)
    quota.check("evil", 1 << 50)
    assert quota.used("evil") == 3 * MB


@pytest.mark.parametrize("bank", ["", "../telco", "a/b", ".hidden", "-flag", "x" * 65, "evil\n", "é"],
                         ids=["empty", "climbs-out", "slash", "dot-first", "dash-first", "too-long", "newline",
                              "not-ascii"])
def test_a_bank_name_that_is_no_folder_name_is_refused(tmp_path: Path, bank: str) -> None:
    quota = DiskQuota(tmp_path, MB, party="partner 'telco'")
    for call in (lambda: quota.folder(bank), lambda: quota.used(bank), lambda: quota.check(bank, 0)):
        with pytest.raises(BadMessage, match="cannot name a folder"):
            call()


@pytest.mark.parametrize("bank", ["b", "bank-2", "Bank_2.eu", "x" * 64], ids=["one-letter", "dash", "mixed", "64"])
def test_a_bank_name_makes_its_folder_under_the_root(tmp_path: Path, bank: str) -> None:
    assert DiskQuota(tmp_path, MB, party="partner 'telco'").folder(bank) == tmp_path / bank


def test_a_write_under_way_holds_its_bytes_so_two_at_once_cannot_both_pass(tmp_path: Path) -> None:
    """Two checkpoints of one bank at once: each passes a check only the two together fail, unless reserved."""
    quota = DiskQuota(tmp_path, 3 * MB, party="compute 'c'")
    with quota.reserve("evil", 2 * MB):
        with pytest.raises(QuotaExceeded, match="keeps 2.0 MB"):
            quota.check("evil", 2 * MB)
        quota.check("other", 2 * MB)  # another bank's writes hold none of this bank's quota
    quota.check("evil", 2 * MB)  # released once written (or failed)
    with pytest.raises(RuntimeError), quota.reserve("evil", 2 * MB):
        raise RuntimeError("the write failed")
    quota.check("evil", 3 * MB)
