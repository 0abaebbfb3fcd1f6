"""``python -m bank.lab psi-bench``: both PSI roles on this machine, over real mutual TLS on loopback.

Prints wall seconds (cold: both parties hash their IDs; warm: hashed sets
cached, as for a party whose data file has not changed), bytes on the wire per
input ID (HTTP bodies and headers, both directions, divided by n_bank +
n_partner), the raw rates of the curve operations on every core, and each wall
time against the crypto floor measured in the same run: the X25519 operations
(each side blinds its set and re-blinds the other's: 2 (n_bank + n_partner))
and, cold, the hash-to-curve calls (n_bank + n_partner), divided by the rates
of all workers, as both parties share this machine's cores.

The floor is libsodium's, not our own code's: hashing is priced at libsodium's
rates, through its public calls, for what RFC 9380's random-oracle hash does
(two Elligator 2 maps, ``crypto_core_ed25519_from_uniform``, and one point
addition, ``crypto_core_ed25519_add``, per ID), and X25519 at the faster of
libsodium's ``crypto_scalarmult`` and OpenSSL's (what ``curve.blind`` calls),
all measured on the same workers in the same run. Each of those calls decodes
and encodes its points, so a C implementation of the whole hash, written for
this, would go below it: the floor is what C reaches through a maintained
library's API, not the machine's limit.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
from nacl.bindings import crypto_core_ed25519_add, crypto_core_ed25519_from_uniform, crypto_scalarmult

from alignment import curve
from alignment.parallel import WorkerPool, make_pool
from bank.service.aligner import align_with_partners
from bank.vertical.http_partner import HttpPartner
from parties.tables.table import FeatureSchema, PartyTable
from parties.transport.client import make_client
from parties.transport.pki import write_dev_pki
from parties.transport.server import ServerThread
from parties.transport.tls import PeerIdentity, TLSFiles
from partner.service import create_app
from partner.settings import PartnerSettings

__all__ = ["BenchResult", "run_bench"]


@dataclass(frozen=True)
class BenchResult:
    size: int
    overlap: float
    workers: int
    intersection: int
    cold_seconds: float
    warm_seconds: float
    bytes_per_id: float
    x25519_per_second: float
    hash_to_curve_per_second: float
    expected_intersection: int = 0
    cold_floor_seconds: float = 0.0
    warm_floor_seconds: float = 0.0
    libsodium_hash_per_second: float = 0.0
    libsodium_x25519_per_second: float = 0.0
    checked_x25519_per_second: float = 0.0  # re-blinding a peer's set: every point checked first
    peak_rss_mb: float = 0.0  # this process's high-water mark: both parties, and the bench's own ID lists
    ray_address: str | None = None
    ray_cold_seconds: float | None = None
    ray_warm_seconds: float | None = None
    ray_rows_identical: bool | None = None

    @property
    def correct(self) -> bool:
        return self.intersection == self.expected_intersection

    @property
    def cold_ratio(self) -> float:
        return self.cold_seconds / self.cold_floor_seconds

    @property
    def warm_ratio(self) -> float:
        return self.warm_seconds / self.warm_floor_seconds


def _table(ids: list[str], path: Path) -> PartyTable:
    return PartyTable(
        path=path, id_column="customer_id", ids=tuple(ids), features=pd.DataFrame(index=range(len(ids))),
        schema=FeatureSchema(), normalized_ids=tuple(curve.normalize_id(i) for i in ids),
    )


class _WireCounter:
    def __init__(self) -> None:
        self.total = 0

    def request(self, request: httpx.Request) -> None:
        self.total += len(request.content) + sum(len(k) + len(v) + 4 for k, v in request.headers.raw) + 40

    def response(self, response: httpx.Response) -> None:
        # The body's length as announced (every PSI answer announces it): the bank's client reads the body
        # itself, as it arrives, and a hook that read it first would leave it nothing to read.
        body = int(response.headers.get("content-length", "0"))
        self.total += body + sum(len(k) + len(v) + 4 for k, v in response.headers.raw) + 20


def _ids(rng: np.random.Generator, n: int) -> list[str]:
    return [f"{v:016x}" for v in rng.integers(0, 2**63, size=n, dtype=np.int64)]


def _rates(pool: WorkerPool, n: int) -> tuple[float, float, float]:
    """Our X25519, hash-to-curve, and X25519 with the received points' checks (re-blinding a peer's set) rates."""
    pool.hash_to_curve([curve.normalize_id(f"warm-up-{i}") for i in range(1 << 14)])  # start the workers first
    ids = [curve.normalize_id(f"rate-{i}") for i in range(n)]
    t = time.perf_counter()
    points = pool.hash_to_curve(ids)
    hashing = n / (time.perf_counter() - t)
    t = time.perf_counter()
    pool.blind(curve.generate_key(), points, validate=False)  # the X25519 operation alone
    x25519 = n / (time.perf_counter() - t)
    t = time.perf_counter()
    pool.blind(curve.generate_key(), points, 12)
    return x25519, hashing, n / (time.perf_counter() - t)


def _sodium_ops(op: str, n: int) -> int:
    """``n`` of libsodium's operations on this worker, on fresh inputs; returns ``n``."""
    seeds = [os.urandom(32) for _ in range(n)]
    if op == "hash":  # RFC 9380's random-oracle construction in C: two maps and one addition per ID
        for k in range(0, n - 1, 2):
            crypto_core_ed25519_add(crypto_core_ed25519_from_uniform(seeds[k]),
                                    crypto_core_ed25519_from_uniform(seeds[k + 1]))
        return n // 2
    key = curve.generate_key()
    points = [curve.hash_to_curve([s]) for s in seeds[: min(n, 256)]]  # valid points, reused
    for k in range(n):
        crypto_scalarmult(key, points[k % len(points)])
    return n


def _sodium_rates(workers: int, n: int) -> tuple[float, float]:
    """libsodium's hash-to-curve (per ID) and X25519 rates on ``workers`` processes at once."""
    rates = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_sodium_ops, ["hash"] * workers, [256] * workers))  # start the workers first
        for op in ("hash", "x25519"):
            started = time.perf_counter()
            done = sum(pool.map(_sodium_ops, [op] * workers, [max(2, n // workers)] * workers))
            rates.append(done / (time.perf_counter() - started))
    return rates[0], rates[1]


def _one_run(bank: PartyTable, partner_table: PartyTable, files: dict[str, TLSFiles], state: Path, workers: int,
             ray: str | None = None) -> tuple[float, int, list[int]]:
    """One alignment, both parties here; with ``ray`` both run their PSI on that cluster. The bank's aligned rows."""
    f = files["partner"]
    workers_asked = None if ray else workers  # on Ray: the cluster's CPUs
    settings = PartnerSettings(
        name="partner", data=partner_table.path, tls_ca=f.ca, tls_cert=f.cert, tls_key=f.key,
        state_dir=state / "partner", workers=workers_asked, ray_address=ray,
    )
    counter = _WireCounter()
    started = time.perf_counter()
    server = ServerThread(create_app(settings, partner_table), settings.tls_files()).start()
    try:
        client = make_client(files["bank"], caller=PeerIdentity("bank", "bank"), timeout=600)
        client.event_hooks = {"request": [counter.request], "response": [counter.response]}
        with client, make_pool(workers_asked, ray) as pool:
            peer = HttpPartner("partner", server.url, client)
            alignment, _ = align_with_partners(bank, {"partner": peer}, pool, cache_dir=state / "bank")
        seconds = time.perf_counter() - started
    finally:
        server.stop()
    return seconds, counter.total, alignment.rows.tolist()


def run_bench(size: int, overlap: float = 0.5, seed: int = 0, workers: int | None = None,
              ray: str | None = None) -> BenchResult:
    """Cold and warm runs with worker processes; with ``ray``, the same two runs again with both parties' PSI on
    that cluster, side by side."""
    workers = workers or os.cpu_count() or 1
    rng = np.random.default_rng(seed)
    common = _ids(rng, round(size * overlap))
    bank_ids = common + _ids(rng, size - len(common))
    partner_ids = common + _ids(rng, size - len(common))
    rng.shuffle(bank_ids)
    rng.shuffle(partner_ids)
    with tempfile.TemporaryDirectory(prefix="cutlayer-bench-") as tmp:
        root = Path(tmp)
        files = write_dev_pki(root / "pki", {"bank": "bank", "partner": "partner"})
        bank, partner = _table(bank_ids, root / "bank.csv"), _table(partner_ids, root / "partner.csv")
        cold, wire, rows = _one_run(bank, partner, files, root / "state", workers)
        warm, _, _ = _one_run(bank, partner, files, root / "state", workers)
        on_ray: dict[str, object] = {}
        if ray:
            ray_cold, _, ray_rows = _one_run(bank, partner, files, root / "ray-state", workers, ray)
            ray_warm, _, _ = _one_run(bank, partner, files, root / "ray-state", workers, ray)
            on_ray = {"ray_address": ray, "ray_cold_seconds": round(ray_cold, 2),
                      "ray_warm_seconds": round(ray_warm, 2), "ray_rows_identical": ray_rows == rows}
    with WorkerPool(workers) as pool:
        x_rate, h_rate, checked_rate = _rates(pool, min(size, 1 << 16))
    sodium_h, sodium_x = _sodium_rates(workers, min(size, 1 << 16))
    floor_x = max(x_rate, sodium_x)  # the fastest X25519 known here
    ids = 2 * size  # n_bank + n_partner
    return BenchResult(
        size=size, overlap=overlap, workers=workers, intersection=len(rows), expected_intersection=len(common),
        cold_seconds=round(cold, 2), warm_seconds=round(warm, 2), bytes_per_id=round(wire / ids, 2),
        x25519_per_second=round(x_rate), hash_to_curve_per_second=round(h_rate),
        cold_floor_seconds=round(2 * ids / floor_x + ids / sodium_h, 2), warm_floor_seconds=round(2 * ids / floor_x, 2),
        libsodium_hash_per_second=round(sodium_h), libsodium_x25519_per_second=round(sodium_x),
        checked_x25519_per_second=round(checked_rate),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), **on_ray,  # type: ignore[arg-type]
    )


def format_result(r: BenchResult) -> str:
    return "\n".join([
        f"PSI benchmark: {r.size:,} x {r.size:,} IDs, {r.overlap:.0%} overlap, {r.workers} worker processes per party,",
        "both parties on this machine, mutual TLS over loopback",
        f"  intersection found           {r.intersection:,}   ({'correct' if r.correct else 'WRONG'}: "
        f"{r.expected_intersection:,} common IDs)",
        f"  wall seconds (cold: hashing) {r.cold_seconds:8.2f}   crypto floor {r.cold_floor_seconds:.2f} s, "
        f"ratio {r.cold_ratio:.2f}",
        f"  wall seconds (warm cache)    {r.warm_seconds:8.2f}   crypto floor {r.warm_floor_seconds:.2f} s, "
        f"ratio {r.warm_ratio:.2f}",
        f"  bytes on the wire per ID     {r.bytes_per_id:8.2f}   (bodies + HTTP headers, both ways)",
        f"  X25519 blindings per second  {r.x25519_per_second:8,}   (all workers; libsodium "
        f"{r.libsodium_x25519_per_second:,})",
        f"  X25519 with point checks     {r.checked_x25519_per_second:8,}   (all workers: re-blinding a peer's set)",
        f"  hash-to-curve per second     {r.hash_to_curve_per_second:8,}   (all workers; libsodium, two maps and "
        f"an add per ID, {r.libsodium_hash_per_second:,}: ours is "
        f"{r.hash_to_curve_per_second / r.libsodium_hash_per_second:.2f}x its rate)",
        "  floors: hashing at libsodium's rate (its public calls), X25519 at the faster of libsodium's and OpenSSL's",
        f"  peak memory                  {r.peak_rss_mb:8.1f} MB (this process: both parties and the bench's ID lists)",
        *([f"  on the Ray cluster at {r.ray_address}: cold {r.ray_cold_seconds:.2f} s "
           f"({r.cold_seconds / r.ray_cold_seconds:.2f}x the worker processes' throughput), warm "
           f"{r.ray_warm_seconds:.2f} s ({r.warm_seconds / r.ray_warm_seconds:.2f}x); aligned rows "
           + ("identical, in the same order" if r.ray_rows_identical else "DIFFERENT")]
          if r.ray_cold_seconds and r.ray_warm_seconds else []),
    ])


def to_json(r: BenchResult) -> str:
    return json.dumps(asdict(r) | {"correct": r.correct, "cold_ratio": round(r.cold_ratio, 3),
                                   "warm_ratio": round(r.warm_ratio, 3)}, indent=2)
