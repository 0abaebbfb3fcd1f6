"""PSI on a Ray cluster (``--ray-address``): a real two-node cluster on this machine, started as a user would.

The head and a second node are started with ``ray start`` (one CPU each, loopback only, no usage stats) and
stopped at the end. The pool must give the local pool's bytes, the services the local pool's alignment, and a
dead worker or an unreachable cluster a clear error that aborts the session.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from alignment import curve
from alignment.parallel import SLICE_RECORDS, WorkerPool, make_pool
from alignment.ray_pool import RayPool
from bank.service.operator import BankOperator
from bank.settings import BankSettings
from data.prepare import prepare_bank_marketing
from parties.errors import ComputeUnavailable, ConfigError, CutlayerError
from parties.tables.table import PartyTable, load_alignment
from parties.transport.tls import TLSFiles
from partner.settings import PartnerSettings

ray = pytest.importorskip("ray")  # the ray extra (in the test extra); alignment.ray_pool imports it lazily
pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).parent / "ray")
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A head and a second node on this machine, one CPU each: ``ray start --head`` then ``ray start --address``."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    port = _free_port()
    address = f"127.0.0.1:{port}"
    temp = f"/tmp/cl-ray-{port}"  # Ray's sockets live here: a short path
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                    "--temp-dir", temp, *common], check=True, env=ENV, capture_output=True, timeout=120)
    try:
        subprocess.run([RAY, "start", "--address", address, *common], check=True, env=ENV, capture_output=True,
                       timeout=120)
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True, timeout=120)


IDS = [curve.normalize_id(f"customer-{i}") for i in range(5 * SLICE_RECORDS + 123)]


def test_ray_gives_the_local_pools_bytes_on_both_nodes(cluster: str) -> None:
    key = curve.generate_key()
    with WorkerPool(2) as local:
        points = local.hash_to_curve(IDS, curve.psi_dst("bank|telco"))
        double = local.blind(key, points, 12)
    with RayPool(cluster) as pool:
        pool.start()
        assert pool.workers == 2 and pool.in_flight == 4  # the two nodes' CPUs, two slices each in flight
        assert pool.hash_to_curve(IDS, curve.psi_dst("bank|telco")) == points
        assert pool.blind(key, points, 12) == double
        # A bad point from a peer is named as the local pool names it: its slice and its place there.
        bad = bytearray(points)
        at = 2 * SLICE_RECORDS + 5
        bad[32 * at : 32 * at + 32] = (1).to_bytes(32, "little")  # of low order
        named = f"point 5 of the batch is of low order .in the slice from point {2 * SLICE_RECORDS}"
        with pytest.raises(ValueError, match=named):
            pool.blind(key, bytes(bad), 12)


def test_no_more_slices_are_in_flight_than_the_bound(cluster: str) -> None:
    """Back-pressure: a consumer that stops reading stops the sending, whatever is left to do."""
    with RayPool(cluster) as pool:
        pool.start()
        slices = [IDS[i : i + 1000] for i in range(0, len(IDS), 1000)]  # 42 slices
        results = pool._ordered(curve.hash_to_curve, slices, None)
        first = next(results)
        assert first == curve.hash_to_curve(slices[0])
        assert pool.sent == pool.in_flight + 1  # the bound, and one more for the answer taken: not 42
        time.sleep(1.0)  # the cluster is idle now, waiting for this consumer
        assert pool.sent == pool.in_flight + 1
        rest = list(results)
        assert len(rest) == len(slices) - 1 and pool.sent == len(slices)
        assert b"".join([first, *rest]) == curve.hash_to_curve(IDS)


def test_one_cpu_asked_still_runs_on_the_cluster(cluster: str) -> None:
    """--workers 1 with --ray-address bounds what is in flight; it does not run the PSI inline in the service."""
    with RayPool(cluster, workers=1) as pool:
        pool.start()
        assert pool.in_flight == 2 and pool._parallel(len(IDS))
        assert pool.hash_to_curve(IDS) == WorkerPool(1).hash_to_curve(IDS)
        assert pool.sent == len(IDS) // SLICE_RECORDS + 1


def test_a_worker_killed_mid_blinding_aborts_with_the_reason(cluster: str) -> None:
    points = WorkerPool(1).hash_to_curve(IDS[: 2 * SLICE_RECORDS])
    many = points * 8  # 16 slices: about three seconds of work
    with RayPool(cluster) as pool:
        pool.start()
        killed = threading.Event()

        def kill_a_worker() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not killed.is_set():
                found = subprocess.run(["pgrep", "-f", "ray::_run"], capture_output=True, text=True).stdout.split()
                if found:
                    os.kill(int(found[0]), signal.SIGKILL)
                    killed.set()
                time.sleep(0.05)

        threading.Thread(target=kill_a_worker, daemon=True).start()
        reason = "failed: WorkerCrashedError.*run the alignment again once the cluster is whole"
        with pytest.raises(ComputeUnavailable, match=reason):
            pool.blind(curve.generate_key(), many, 12, validate=False)
        assert killed.is_set()
        # The cluster replaces the worker: the next blinding runs.
        assert pool.blind(curve.generate_key(), points[:32 * 10], 12, validate=False)


def test_a_cluster_lost_after_joining_fails_the_call_not_the_service(tmp_path: Path) -> None:
    """Ray ends a driver whose head is gone: the driver is a child, so the call fails with the reason, quickly,
    and this process (a service, with its trainings) lives on; the next call finds the cluster unreachable."""
    port = _free_port()
    temp = f"/tmp/cl-ray-{port}"
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp,
                    "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"],
                   check=True, env=ENV, capture_output=True, timeout=120)
    try:
        with RayPool(f"127.0.0.1:{port}") as pool:
            points = pool.hash_to_curve(IDS)
            subprocess.run(["pkill", "-9", "-f", f"{temp}/"], check=False)  # every process of that cluster
            started = time.monotonic()
            with pytest.raises(ComputeUnavailable, match="went away under a PSI task .*run the alignment again"):
                pool.blind(curve.generate_key(), points, 12)
            assert time.monotonic() - started < 20  # not Ray's minute
            with pytest.raises(ComputeUnavailable, match="cannot be reached"):
                pool.blind(curve.generate_key(), points, 12)
    finally:
        subprocess.run(["pkill", "-9", "-f", f"{temp}/"], check=False)


def test_an_unreachable_cluster_is_refused_at_once_with_the_address() -> None:
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ComputeUnavailable, match=f"Ray cluster at {address} cannot be reached"):
        RayPool(address).start()
    assert time.monotonic() - started < 10
    for bad in ("127.0.0.1:http", "127.0.0.1", ":6379", "::1", "127.0.0.1:99999", "ray://"):
        with pytest.raises(ConfigError, match="give HOST:PORT of the cluster's head"):
            make_pool(None, bad)
    assert RayPool("[::1]:6379").address == "[::1]:6379" and RayPool(" ray://h:10001").address == "ray://h:10001"


def _tables(paths: dict[str, Path], pki: Path) -> tuple[PartyTable, PartyTable]:
    bank = BankSettings(name="bank", data=paths["bank"], tls_dir=pki, partners={})
    partner = PartnerSettings(name="partner", data=paths["partner"], tls_dir=pki)
    return bank.load_table(), partner.load_table()


def test_services_on_ray_align_the_rows_the_local_pools_align(
        cluster: str, pki: Path, bank_full: Path, tmp_path: Path, start_partner, start_bank) -> None:
    """Both parties run their PSI on the cluster (as two organisations would, each on its own): the same rows,
    in the same order, at both, as with worker processes."""
    paths = prepare_bank_marketing(tmp_path / "data", rows=20_000, cache=bank_full.parent, download=False)
    bank_table, partner_table = _tables(paths, pki)
    rows = {}
    for run, extra in (("local", {"workers": 2}), ("ray", {"workers": None, "ray_address": cluster})):
        state = tmp_path / run
        partner = start_partner(paths["partner"], state_dir=state / "partner", **extra)
        bank = start_bank(paths["bank"], {"partner": partner.url}, state_dir=state / "bank", **extra)
        with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
            op.wait(op.start_alignment())
        partner_folder = next((state / "partner").rglob("alignment.safetensors")).parent
        rows[run] = (load_alignment(state / "bank", bank_table), load_alignment(partner_folder, partner_table))
    for side in (0, 1):
        assert rows["ray"][side] is not None and rows["local"][side] is not None
        assert rows["ray"][side].rows.tolist() == rows["local"][side].rows.tolist()
    assert len(rows["ray"][0]) > 10_000


def test_a_partner_whose_cluster_is_gone_refuses_the_session_and_tells_only_its_own_operator_why(
        pki: Path, bank_full: Path, tmp_path: Path, start_partner, start_bank, caplog) -> None:
    """The partner's log says why at start-up and at the refusal; the bank hears that the partner's own compute
    is unavailable, never where its cluster is."""
    paths = prepare_bank_marketing(tmp_path / "data", rows=20_000, cache=bank_full.parent, download=False)
    gone = f"127.0.0.1:{_free_port()}"
    with caplog.at_level("WARNING"):
        partner = start_partner(paths["partner"], workers=None, ray_address=gone)
        bank = start_bank(paths["bank"], {"partner": partner.url}, workers=2)
        with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
            with pytest.raises(CutlayerError, match="own compute is unavailable") as refused:
                op.wait(op.start_alignment())
    assert gone not in str(refused.value)
    said = [r.getMessage() for r in caplog.records]
    assert any("PSI workers could not start" in m and f"{gone} cannot be reached" in m for m in said)
    assert any("refused" in m and f"{gone} cannot be reached" in m for m in said)
    assert not list((tmp_path / "state-partner").rglob("alignment.safetensors"))  # nothing committed


def test_the_banks_own_cluster_gone_is_not_blamed_on_a_partner(
        pki: Path, bank_full: Path, tmp_path: Path, start_partner, start_bank) -> None:
    paths = prepare_bank_marketing(tmp_path / "data", rows=20_000, cache=bank_full.parent, download=False)
    gone = f"127.0.0.1:{_free_port()}"
    partner = start_partner(paths["partner"], workers=2)
    bank = start_bank(paths["bank"], {"partner": partner.url}, workers=None, ray_address=gone)
    with BankOperator(bank.url, TLSFiles.from_dir(pki, "bank")) as op:
        with pytest.raises(CutlayerError, match=f"Ray cluster at {gone} cannot be reached") as failed:
            op.wait(op.start_alignment())
    assert "partner 'partner'" not in str(failed.value)


def test_the_scale_bench_runs_every_service_on_the_cluster(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run(
        [sys.executable, "-m", "bank.lab", "scale-bench", "--customers", "20000", "--partners", "1", "--epochs", "1",
         "--ray", cluster, "--json", str(out), "--out", str(tmp_path / "bench")],
        capture_output=True, text=True, timeout=600, env=ENV,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["ray_address"] == cluster and figures["aligned_rows"] == 16_000
    assert sorted(figures["peak_rss_mb"]) == ["bank", "partner1"]
    assert f"PSI on the Ray cluster at {cluster}" in run.stdout
    for name in ("bank", "partner1"):  # each service joined the cluster and ran its PSI there
        assert f"PSI runs on the Ray cluster at {cluster}" in (tmp_path / "bench" / f"{name}.log").read_text()
