"""Fixtures: certificates, the UCI file, small partitions, and party services on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from alignment.parallel import WorkerPool
from bank.service.app import create_app as create_bank_app
from bank.settings import BankSettings
from data.uci import BANK_FULL_NAME, cache_dir, locate_bank_full
from parties.transport.pki import write_dev_pki
from parties.transport.server import ServerThread
from parties.transport.tls import TLSFiles
from partner.service import create_app as create_partner_app
from partner.settings import PartnerSettings

SHARED_COPY = Path(__file__).resolve().parents[2] / "shared" / "data" / BANK_FULL_NAME
PARTIES = {"bank": "bank", "partner": "partner", "partner2": "partner", "bank2": "bank",
           # the configurations beside vertical: a compute party and a bank's branches
           "compute": "compute", "compute2": "compute", "branch-1": "partner", "branch-2": "partner",
           "branch-3": "partner"}


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A development CA with certificates for two banks, two partners, two compute parties and three branches."""
    out = tmp_path_factory.mktemp("pki")
    write_dev_pki(out, PARTIES)
    return out


@pytest.fixture(scope="session")
def rogue_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA issuing certificates with the same names: must not be trusted."""
    out = tmp_path_factory.mktemp("rogue-pki")
    write_dev_pki(out, PARTIES, ca_name="Rogue CA")
    return out


@pytest.fixture(scope="session")
def bank_full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verified bank-full.csv: from the data cache, else from the shared copy, never downloaded."""
    if (cache_dir() / BANK_FULL_NAME).exists():
        return locate_bank_full(download=False)
    if not SHARED_COPY.exists():
        pytest.skip(f"bank-full.csv is not in the data cache {cache_dir()} (set CUTLAYER_DATA_DIR to a folder "
                    f"holding it, or run `python -m data fetch` once to download it)")
    folder = tmp_path_factory.mktemp("data-cache")
    shutil.copy(SHARED_COPY, folder / BANK_FULL_NAME)
    return locate_bank_full(folder, download=False)


@pytest.fixture()
def write_csv(tmp_path: Path) -> Callable[..., Path]:
    """Write a small party CSV from columns: ``write_csv("p.csv", customer_id=[...], x=[...])``."""

    def write(name: str, **columns: list[object]) -> Path:
        path = tmp_path / name
        pd.DataFrame(columns).to_csv(path, index=False)
        return path

    return write


def _settings_values(pki: Path, name: str, data: Path, tmp: Path, **extra: object) -> dict[str, object]:
    files = TLSFiles.from_dir(pki, name)
    return {"name": name, "data": data, "tls_ca": files.ca, "tls_cert": files.cert, "tls_key": files.key,
            "state_dir": tmp / f"state-{name}", "workers": 1, **extra}


@pytest.fixture()
def start_partner(pki: Path, tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start a partner service (real uvicorn, real mutual TLS) on an ephemeral port."""
    servers: list[ServerThread] = []

    def start(data: Path, name: str = "partner", **extra: object) -> ServerThread:
        settings = PartnerSettings(**_settings_values(pki, name, data, tmp_path, **extra))
        server = ServerThread(create_partner_app(settings), settings.tls_files()).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


@pytest.fixture()
def start_bank(pki: Path, tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    servers: list[ServerThread] = []

    def start(data: Path, partners: dict[str, str], name: str = "bank", **extra: object) -> ServerThread:
        settings = BankSettings(**_settings_values(pki, name, data, tmp_path, partners=partners, **extra))
        server = ServerThread(create_bank_app(settings), settings.tls_files()).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def pytest_configure(config: pytest.Config) -> None:
    # Services must never reach anything but loopback; make an accidental proxy impossible too.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        os.environ.pop(var, None)


@pytest.fixture()
def pool() -> Iterator[WorkerPool]:
    """A PSI worker pool that runs everything in the test's process."""
    with WorkerPool(workers=1) as p:
        yield p


@pytest.fixture()
def threads() -> Iterator[ThreadPoolExecutor]:
    """Threads for a PSI responder called in process."""
    with ThreadPoolExecutor(4) as t:
        yield t


@pytest.fixture(autouse=True)
def _no_stream_handler_left() -> Iterator[None]:
    """A command run in process (``main([...])``) puts a stream handler on the root logger, onto the test's
    captured stderr; take it off after the test, so later tests do not log into a closed stream
    ("--- Logging error ---"). pytest's own handlers (subclasses) are pytest's to manage."""
    import logging

    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)
