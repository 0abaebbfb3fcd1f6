"""``python -m bank.lab scale-bench``: a seeded synthetic bank and N partners, run end to end, timed per stage.

Every party is a real service in its own process (mutual TLS over loopback),
aligned and trained through the bank's job resource, as in production; only
the data are made up. The stages reported: generating the data, each
service's start-up (listening, its table loaded), alignment, each party's
training-session setup before its first step (from the service's own log
line), and seconds per epoch.

Alignment figures: the first alignment hashes every party's IDs onto the
curve (cold caches); with ``sequential`` the bench then aligns once one
partner after another and once with all partners at once, both on cached
hashes, so the two are compared on the same work and the same CPUs.

All services share this machine's CPUs (``cpus`` in the result): nothing is
pinned, each service runs as many PSI workers as there are CPUs. With ``ray``
(an address, or ``auto``) every service runs its PSI on that Ray cluster instead
(``--ray-address``), as a party past one machine would on its own.

Per party and stage the bench also reports its service process's peak resident
memory (the kernel's high-water mark, ``VmHWM``, read at the end of the stage and
reset for the next one where Linux lets it): start-up (its table loaded),
alignment, training. The table, the ID index and the PSI sets live in that
process; PSI workers are processes of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from bank.config import TrainingConfig
from bank.service.operator import BankOperator
from parties.errors import ConfigError
from parties.protocol.control import AlignmentRequest
from parties.transport.pki import write_dev_pki
from parties.transport.process import ServiceProcess
from parties.transport.tls import TLSFiles

__all__ = ["ScaleBench", "format_scale_bench", "run_scale_bench", "scale_bench_json", "write_synthetic_parties"]

#: The share of the bank's customers each partner holds, and how many of its own (the bank lacks) it adds.
COVERAGE = 0.8
OWN_ONLY = 0.1
_SETUP_LINE = re.compile(r"training session (\w+): .* set up in ([0-9.]+) s")


@dataclass(frozen=True)
class ScaleBench:
    customers: int
    partners: int
    epochs: int
    cpus: int
    rows: dict[str, int]  # each party's table
    aligned_rows: int
    data_seconds: float
    startup_seconds: dict[str, float]  # each service, from its process start to listening with its table loaded
    alignment_seconds: float  # the first alignment, all partners at once, hashing every ID (cold caches)
    setup_seconds: dict[str, float]  # each party's training session, before its first step
    epoch_seconds: list[float]  # training steps and validation, per epoch
    train_job_seconds: float
    sequential_seconds: float | None = None  # cached hashes, one partner after another
    concurrent_seconds: float | None = None  # cached hashes, every partner at once
    ray_address: str | None = None  # PSI on this Ray cluster; None: worker processes of each service
    peak_rss_mb: dict[str, float] | None = None  # each service process's high-water mark over the run
    stage_peak_rss_mb: dict[str, dict[str, float]] | None = None  # stage -> service -> its high-water mark then

    @property
    def alignment_ids_per_core_second(self) -> float:
        """Every party's IDs through the first alignment (hashed and blinded), per CPU and second."""
        return sum(self.rows.values()) / (self.alignment_seconds * self.cpus)

    @property
    def alignment_ratio(self) -> float | None:
        if self.sequential_seconds and self.concurrent_seconds:
            return self.concurrent_seconds / self.sequential_seconds
        return None


def _ids(prefix: str, numbers: np.ndarray) -> np.ndarray:
    return np.char.add(prefix, np.char.zfill(numbers.astype(str), 9)).astype(object)


def write_synthetic_parties(out: Path, customers: int, partners: int, seed: int = 0) -> dict[str, Path]:
    """Seeded CSVs: ``bank.csv`` (``customer_id``, label ``y``, 3 columns) and ``partnerK.csv`` (3 of its own).

    Each partner holds ``COVERAGE`` of the bank's customers, drawn at random, plus ``OWN_ONLY`` as
    many customers the bank does not know; every file is in its own random order. The label depends
    on every party's columns, so the joint model has something to learn.
    """
    if customers < 10 or partners < 1:
        raise ConfigError(f"the scale bench needs at least 10 customers and 1 partner (got {customers}, {partners})")
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    bank_ids = _ids("C", rng.permutation(customers))
    score = np.zeros(customers)
    paths: dict[str, Path] = {}
    columns: dict[str, pd.DataFrame] = {}
    for k in range(1, partners + 1):
        name = f"partner{k}"
        held = rng.permutation(customers)[: int(COVERAGE * customers)]
        extra = int(OWN_ONLY * customers)
        a, b = rng.normal(size=customers), rng.gamma(2.0, 1.0, size=customers)
        region = rng.integers(0, 8, size=customers)
        score += 0.5 * a - 0.3 * np.log1p(b) + 0.2 * (region % 3 == 0)
        own = pd.DataFrame({
            "customer_id": np.concatenate([bank_ids[held], _ids(f"P{k}-", np.arange(extra))]),
            f"{name}_a": np.concatenate([a[held], rng.normal(size=extra)]).round(4),
            f"{name}_b": np.concatenate([b[held], rng.gamma(2.0, 1.0, size=extra)]).round(4),
            f"{name}_region": np.char.add("r", np.concatenate([region[held], rng.integers(0, 8, extra)]).astype(str)),
        })
        columns[name] = own.iloc[rng.permutation(len(own))]
    age = rng.integers(18, 90, size=customers)
    balance = rng.lognormal(7.0, 1.0, size=customers).round(2)
    segment = rng.choice(np.array(["retail", "premier", "business", "student", "private"]), size=customers)
    score += 0.02 * (age - 50) + 0.3 * (segment == "premier")
    label = np.where(score + rng.logistic(size=customers) > 0.5, "yes", "no")
    bank = pd.DataFrame({"customer_id": bank_ids, "y": label, "age": age, "balance": balance, "segment": segment})
    paths["bank"] = out / "bank.csv"
    bank.to_csv(paths["bank"], index=False)
    for name, frame in columns.items():
        paths[name] = out / f"{name}.csv"
        frame.to_csv(paths[name], index=False)
    return paths


def _setup_seconds(log: Path) -> float | None:
    """The last training-session setup time a service logged."""
    found = _SETUP_LINE.findall(log.read_text(errors="replace"))
    return float(found[-1][1]) if found else None


class _Services:
    """N partner services and the bank, each its own process on this machine."""

    def __init__(self, out: Path, paths: dict[str, Path], say: Callable[[str], None], ray: str | None = None) -> None:
        names = list(paths)
        write_dev_pki(out / "certs", {n: "bank" if n == "bank" else "partner" for n in names})
        common = ["--tls-dir", str(out / "certs"), "--torch-threads", "1", *(["--ray-address", ray] if ray else [])]
        self.processes: dict[str, ServiceProcess] = {}
        self.startup: dict[str, float] = {}
        try:
            started = time.perf_counter()
            for name in names[1:]:  # the partners start together, as on their own machines
                self.processes[name] = self._start("partner", name, paths[name], out, common)
            urls = {}
            for name in names[1:]:
                urls[name] = self.processes[name].wait_ready(timeout=600)
                self.startup[name] = time.perf_counter() - started
                say(f"{name} listening after {self.startup[name]:.1f} s")
            started = time.perf_counter()
            self.processes["bank"] = self._start(
                "bank", "bank", paths["bank"], out, [*common, *(f"--partner={n}={u}" for n, u in urls.items())])
            url = self.processes["bank"].wait_ready(timeout=600)
            self.startup["bank"] = time.perf_counter() - started
            say(f"bank listening after {self.startup['bank']:.1f} s")
            self.operator = BankOperator(url, TLSFiles.from_dir(out / "certs", "bank"))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _start(module: str, name: str, data: Path, out: Path, extra: list[str]) -> ServiceProcess:
        args = ["--name", name, "--data", str(data), "--state-dir", str(out / name), *extra]
        return ServiceProcess(module, args, out / f"{name}.ready", out / f"{name}.log")

    def align(self, mode: str) -> tuple[float, dict]:
        started = time.perf_counter()
        result = self.operator.wait(self.operator.start_alignment(AlignmentRequest(mode=mode)))
        return time.perf_counter() - started, result

    def log(self, name: str) -> Path:
        return self.processes[name].log_file

    def peak_rss_mb(self, reset: bool = False) -> dict[str, float]:
        """Each service process's peak resident memory since it started or was last ``reset`` (Linux; empty elsewhere)."""
        peaks = {}
        for name, process in self.processes.items():
            proc = Path(f"/proc/{process.proc.pid}")
            try:
                status = (proc / "status").read_text()
            except OSError:
                continue
            found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
            if found:
                peaks[name] = round(int(found.group(1)) / 1024, 1)
            if reset:
                with contextlib.suppress(OSError):  # the kernel's peak back to the current size (Linux >= 4.0)
                    (proc / "clear_refs").write_text("5")
        return peaks

    def close(self) -> None:
        if hasattr(self, "operator"):
            self.operator.close()
        for p in self.processes.values():
            p.stop()


def run_scale_bench(
    customers: int = 1_000_000, partners: int = 3, epochs: int = 2, *, sequential: bool = False, seed: int = 0,
    out: Path | None = None, progress: Callable[[str], None] = lambda _msg: None, ray: str | None = None,
) -> ScaleBench:
    """Generate, serve, align, train; time each stage. ``out``: keep the files there (default: a temporary folder)."""
    if epochs < 1:
        raise ConfigError(f"the scale bench trains at least one epoch (got {epochs})")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="cutlayer-scale-bench-") as tmp:
        folder = Path(out) if out is not None else Path(tmp)
        started = time.perf_counter()
        paths = write_synthetic_parties(folder / "data", customers, partners, seed)
        data_seconds = time.perf_counter() - started
        progress(f"data: {customers:,} customers, {partners} partners in {data_seconds:.1f} s")
        services = _Services(folder, paths, progress, ray)
        overall: dict[str, float] = {}
        stages: dict[str, dict[str, float]] = {}

        def stage_peaks(stage: str) -> None:
            stages[stage] = services.peak_rss_mb(reset=True)
            for name, mb in stages[stage].items():
                overall[name] = max(overall.get(name, 0.0), mb)

        try:
            stage_peaks("start-up")
            first, aligned = services.align("concurrent")
            progress(f"alignment (hashing every ID): {first:.1f} s, {aligned['rows']:,} rows in common")
            stage_peaks("alignment")
            seq = conc = None
            if sequential:
                seq, _ = services.align("sequential")
                progress(f"alignment, hashes cached, one partner after another: {seq:.1f} s")
                conc, again = services.align("concurrent")
                progress(f"alignment, hashes cached, all partners at once: {conc:.1f} s")
                if again["rows"] != aligned["rows"]:
                    raise ConfigError("the alignments disagree: the bench's figures would mean nothing")
                stage_peaks("alignments, hashes cached")
            started = time.perf_counter()
            config = TrainingConfig(epochs=epochs, patience=epochs + 1)
            result = services.operator.wait(services.operator.start_training(config))
            train_job = time.perf_counter() - started
            history = pd.read_csv(Path(result["run_dir"]) / "history.csv")
            setup = {name: _setup_seconds(services.log(name)) for name in paths}
            missing = [n for n, s in setup.items() if s is None]
            if missing:
                raise ConfigError(f"no training-session setup time in the logs of {missing}")
            progress(f"training: {len(history)} epochs in {train_job:.1f} s")
            stage_peaks("training")
        finally:
            services.close()
        rows = {name: int(sum(1 for _ in p.open()) - 1) for name, p in paths.items()}
    return ScaleBench(
        customers=customers, partners=partners, epochs=len(history), cpus=cpus, rows=rows,
        aligned_rows=int(aligned["rows"]), data_seconds=round(data_seconds, 2),
        startup_seconds={n: round(s, 2) for n, s in services.startup.items()},
        alignment_seconds=round(first, 2),
        setup_seconds={n: round(float(s), 3) for n, s in setup.items() if s is not None},
        epoch_seconds=[round(float(s), 3) for s in history["seconds"]], train_job_seconds=round(train_job, 2),
        sequential_seconds=round(seq, 2) if seq is not None else None,
        concurrent_seconds=round(conc, 2) if conc is not None else None, ray_address=ray, peak_rss_mb=overall,
        stage_peak_rss_mb=stages,
    )


def format_scale_bench(b: ScaleBench) -> str:
    lines = [
        f"Scale bench: {b.customers:,} customers, {b.partners} partners, every party its own service process, "
        f"mutual TLS over loopback, sharing {b.cpus} CPU{'s' if b.cpus > 1 else ''} (nothing pinned)",
        "  rows per party              " + ", ".join(f"{n} {r:,}" for n, r in b.rows.items())
        + f"; aligned {b.aligned_rows:,}",
        f"  data generation             {b.data_seconds:8.2f} s",
        *(f"  start-up, {n:<17} {s:8.2f} s" for n, s in b.startup_seconds.items()),
        f"  alignment (hashing all IDs) {b.alignment_seconds:8.2f} s   all partners at once, "
        f"{b.alignment_ids_per_core_second:,.0f} IDs per CPU-second, PSI on "
        + (f"the Ray cluster at {b.ray_address}" if b.ray_address else "each service's worker processes"),
    ]
    if b.sequential_seconds is not None and b.concurrent_seconds is not None:
        lines += [
            f"  alignment, hashes cached    {b.sequential_seconds:8.2f} s   one partner after another",
            f"  alignment, hashes cached    {b.concurrent_seconds:8.2f} s   all partners at once"
            f"   ({b.alignment_ratio:.2f}x the sequential wall time, same {b.cpus} CPUs)",
        ]
    lines += [
        *(f"  session setup, {n:<12} {s:8.3f} s   before the first step" for n, s in b.setup_seconds.items()),
        *(f"  epoch {i + 1:<21} {s:8.3f} s   training steps and validation" for i, s in enumerate(b.epoch_seconds)),
        f"  training job                {b.train_job_seconds:8.2f} s   start to model written",
        *(f"  peak memory, {n:<14} {mb:8.1f} MB  the service process's high-water mark"
          + ("".join(f", {stage} {peaks[n]:,.0f}" for stage, peaks in (b.stage_peak_rss_mb or {}).items() if n in peaks))
          for n, mb in (b.peak_rss_mb or {}).items()),
    ]
    return "\n".join(lines)


def scale_bench_json(b: ScaleBench) -> str:
    return json.dumps({**asdict(b), "alignment_ratio": b.alignment_ratio,
                       "alignment_ids_per_core_second": round(b.alignment_ids_per_core_second, 1)}, indent=2)
