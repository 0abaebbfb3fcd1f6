"""``python -m bank.lab bench --rtt-ms 20 [--rate-mbit 100]``: split training across an emulated WAN.

The partner service runs in one network namespace and the bank service in
another (``bank.lab.bench.netns``); the only path between them is the emulated link,
so every step pays its round trip and its bytes at the link's rate. The bank
listens on 127.0.0.1 inside its own namespace and its operator (alignment, the
training jobs, polling them) runs on a thread that entered that namespace:
operator traffic never crosses the link, as in a bank whose operator sits next
to its service.

Training settings are compared side by side on the same link, alternating
within each round (``WAN_MODES``). Each is set against the floor the link
allows: per step, one RTT plus the step's bytes at the rate; per epoch, one RTT
per round trip plus the epoch's bytes at the rate.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import ValidationError

from bank.config import TrainingConfig
from bank.lab.bench.netns import BANK_ADDRESS, PARTNER_ADDRESS, WanLink, emulated_link, privilege_problem
from bank.lab.bench.training import PARTNER_SEED
from bank.service.operator import BankOperator
from data.prepare import prepare_bank_marketing
from parties.errors import ConfigError
from parties.transport.pki import write_dev_pki
from parties.transport.process import ServiceProcess
from parties.transport.tls import DEFAULT_HOSTS, TLSFiles

__all__ = ["DEFAULT_TARGET_AUC", "WAN_MODES", "WanBench", "WanMode", "format_wan_bench", "run_wan_bench",
           "time_to_target", "wan_bench_json"]

#: Training settings compared on the same link: a name and its ``TrainingConfig`` overrides. ``efficient`` is
#: the communication-efficient setting docs/how-to/wan.md recommends for a WAN: int8 steps, four batches per round
#: trip, eight more updates per round trip from the last two round trips' batches.
WAN_MODES: dict[str, dict[str, Any]] = {
    "exact": {},
    "int8": {"wire_precision": "int8"},
    "efficient": {"wire_precision": "int8", "local_steps": 4, "reuse_steps": 8},
}
DEFAULT_TARGET_AUC = 0.930
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class WanMode:
    name: str
    overrides: dict[str, Any]
    step_seconds: float  # per round trip of a training epoch (its steps and the final flush), median over rounds
    round_trips_per_epoch: float
    bytes_per_step: float
    bytes_per_epoch: float
    floor_step_seconds: float  # RTT + bytes per step at the rate
    floor_epoch_seconds: float  # round trips x RTT + bytes per epoch at the rate
    epoch_seconds: float
    ratio: float | None  # step seconds / floor (None: no floor, at 0 ms RTT and no rate)
    time_to_target_seconds: float | None  # cumulative training seconds to the target AUC (median over rounds)
    target_column: str | None
    best_auc: float
    final_test_auc: float  # of the model the run ended with (the best validation epoch's), median over rounds


@dataclass(frozen=True)
class WanBench:
    rtt_ms: float
    rate_mbit: float | None
    congestion: str | None
    link: str
    rows: int
    epochs: int
    rounds: int
    batch_size: int
    target_auc: float
    modes: list[WanMode] = field(default_factory=list)


def time_to_target(history: pd.DataFrame, target: float) -> tuple[float | None, str]:
    """Cumulative ``train_seconds`` until the first epoch whose AUC reaches ``target`` (``None``: never),
    and the column read: ``test_roc_auc`` where the history has it, else ``val_roc_auc``."""
    column = "test_roc_auc" if "test_roc_auc" in history.columns else "val_roc_auc"
    reached = np.flatnonzero(history[column].to_numpy() >= target)
    if len(reached) == 0:
        return None, column
    return float(history["train_seconds"].iloc[: reached[0] + 1].sum()), column


def _enter_namespace(name: str) -> None:
    """Move the calling thread (only it) into network namespace ``name``: sockets it opens live there."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, os.CLONE_NEWNET)
        elif ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


class _WanServices:
    """The partner in its namespace on the link's address, the bank in its own, driven from inside it."""

    def __init__(self, out: Path, paths: dict[str, Path], link: WanLink, cpus: tuple[int, int] | None) -> None:
        write_dev_pki(out / "certs", {"bank": "bank", "partner": "partner"},
                      hosts=(*DEFAULT_HOSTS, PARTNER_ADDRESS, BANK_ADDRESS))
        common = ["--tls-dir", str(out / "certs"), "--torch-threads", "1"]
        cpus_of = {"bank": ["--cpus", str(cpus[0])], "partner": ["--cpus", str(cpus[1])]} if cpus else {
            "bank": [], "partner": []}
        self.services: list[ServiceProcess] = []
        self.driver = concurrent.futures.ThreadPoolExecutor(1, initializer=_enter_namespace, initargs=(link.bank_ns,))
        try:
            self.services.append(ServiceProcess(
                "partner", ["--name", "partner", "--data", str(paths["partner"]), "--state-dir", str(out / "partner"),
                            "--seed", str(PARTNER_SEED), "--host", PARTNER_ADDRESS, *common, *cpus_of["partner"]],
                out / "partner.ready", out / "partner.log", prefix=tuple(link.command(link.partner_ns, [])),
            ))
            url = self.services[0].wait_ready()
            self.services.append(ServiceProcess(
                "bank", ["--name", "bank", "--data", str(paths["bank"]), "--state-dir", str(out / "bank"),
                         "--host", "127.0.0.1", f"--partner=partner={url}", *common, *cpus_of["bank"]],
                out / "bank.ready", out / "bank.log", prefix=tuple(link.command(link.bank_ns, [])),
            ))
            bank_url = self.services[1].wait_ready()
            self.operator = self._call(BankOperator, bank_url, TLSFiles.from_dir(out / "certs", "bank"))
            self._call(lambda: self.operator.wait(self.operator.start_alignment()))
        except BaseException:
            self.close()
            raise

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.driver.submit(fn, *args).result()

    def train(self, config: TrainingConfig) -> dict[str, Any]:
        return self._call(lambda: self.operator.wait(self.operator.start_training(config)))  # type: ignore[no-any-return]

    def close(self) -> None:
        if hasattr(self, "operator"):
            self._call(self.operator.close)
        self.driver.shutdown(wait=True, cancel_futures=True)
        for s in reversed(self.services):
            s.stop()


def _configs(epochs: int, batch_size: int | None, modes: dict[str, dict[str, Any]]) -> dict[str, TrainingConfig]:
    configs = {}
    for name, overrides in modes.items():
        try:
            configs[name] = TrainingConfig(epochs=epochs, patience=epochs + 1, track_test=True,
                                           **({"batch_size": batch_size} if batch_size is not None else {}),
                                           **overrides)
        except ValidationError as exc:
            problem = exc.errors()[0]
            raise ConfigError(f"bench mode {name}: {problem['loc'][0]}: {problem['msg']}") from exc
    return configs


def run_wan_bench(
    rtt_ms: float, rate_mbit: float | None = None, congestion: str | None = None,
    target_auc: float = DEFAULT_TARGET_AUC, epochs: int = 4, rows: int | None = None, cache: Path | None = None,
    download: bool = True, rounds: int = 3, batch_size: int | None = None,
    modes: dict[str, dict[str, Any]] | None = None, progress: Callable[[str], None] = lambda _msg: None,
) -> WanBench:
    if epochs < 1 or rounds < 1:
        raise ConfigError(f"the bench needs at least one round of one epoch (got {rounds} of {epochs})")
    configs = _configs(epochs, batch_size, WAN_MODES if modes is None else modes)
    problem = privilege_problem(need_tun=False)  # /dev/net/tun is checked once it is known netem is missing
    if problem:  # before the data is prepared (perhaps downloaded) for nothing
        raise ConfigError(problem)
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = (usable[0], usable[1]) if len(usable) >= 2 else None
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="cutlayer-wan-bench-") as tmp:
        out = Path(tmp)
        paths = prepare_bank_marketing(out / "data", rows=rows, cache=cache, download=download)
        with emulated_link(rtt_ms, rate_mbit, congestion) as link:
            progress(f"emulated link ({link.kind}): {rtt_ms:g} ms RTT, "
                     f"{f'{rate_mbit:g} Mbit/s' if rate_mbit else 'unlimited rate'}; aligning")
            services = _WanServices(out, paths, link, cpus)
            try:
                for r in range(rounds):
                    for name, config in configs.items():
                        result = services.train(config)
                        history = pd.read_csv(Path(result["run_dir"]) / "history.csv")
                        seen[name].append({"result": result, "history": history})
                        steps = int(history["steps"].iloc[0])
                        progress(f"round {r + 1}/{rounds} {name}: {1e3 * history['train_seconds'].median() / steps:.1f} "
                                 f"ms per step")
            finally:
                services.close()
        first = seen[next(iter(configs))][0]["result"]
        return WanBench(
            rtt_ms=rtt_ms, rate_mbit=rate_mbit, congestion=congestion, link=link.kind, rows=sum(first["rows"].values()),
            epochs=epochs, rounds=rounds, batch_size=next(iter(configs.values())).batch_size or "adaptive", target_auc=target_auc,
            modes=[_mode(name, (WAN_MODES if modes is None else modes)[name], runs, link, target_auc)
                   for name, runs in seen.items()],
        )


def _mode(name: str, overrides: dict[str, Any], runs: list[dict[str, Any]], link: WanLink, target: float) -> WanMode:
    epoch_seconds, step_seconds, reach = [], [], []
    column = None
    for run in runs:
        history = run["history"]
        median_epoch = float(history["train_seconds"].median())
        epoch_seconds.append(median_epoch)
        step_seconds.append(median_epoch / int(history["steps"].iloc[0]))  # an epoch's steps and its flush
        seconds, column = time_to_target(history, target)
        reach.append(seconds)
    comm = runs[0]["result"]["communication"]["partner"]
    epochs_run = len(runs[0]["history"])
    rtt = link.rtt_ms / 1e3
    round_trips = comm["round_trips"] / epochs_run
    floor_step = rtt + link.transfer_seconds(comm["bytes_per_step"])
    step = float(np.median(step_seconds))
    reached = [s for s in reach if s is not None]
    best = max(float(run["history"][column].max()) for run in runs) if column else float("nan")
    return WanMode(
        name=name, overrides=overrides, step_seconds=round(step, 6), round_trips_per_epoch=round(round_trips, 1),
        bytes_per_step=round(comm["bytes_per_step"], 1), bytes_per_epoch=round(comm["bytes_per_epoch"], 1),
        floor_step_seconds=round(floor_step, 6),
        floor_epoch_seconds=round(round_trips * rtt + link.transfer_seconds(comm["bytes_per_epoch"]), 4),
        epoch_seconds=round(float(np.median(epoch_seconds)), 4), ratio=round(step / floor_step, 3) if floor_step > 0 else None,
        time_to_target_seconds=round(float(np.median(reached)), 3) if len(reached) == len(reach) else None,
        target_column=column, best_auc=round(best, 4),
        final_test_auc=round(float(np.median([run["result"]["test"]["roc_auc"] for run in runs])), 4),
    )


def format_wan_bench(b: WanBench) -> str:
    rate = f"{b.rate_mbit:g} Mbit/s" if b.rate_mbit else "unlimited rate"
    lines = [
        f"Split training across an emulated WAN ({b.link}): {b.rtt_ms:g} ms RTT, {rate}"
        + (f", congestion control {b.congestion}" if b.congestion else "") + f"; {b.rows:,} aligned rows, "
        f"batch {b.batch_size}, {b.rounds} alternating rounds of {b.epochs} epochs (medians)",
        "bank and 1 partner in network namespaces of their own, mutual TLS across the link",
        f"  {'mode':<10}{'ms/step':>9}{'floor':>8}{'ratio':>7}{'trips/epoch':>13}{'bytes/step':>12}"
        f"{'s/epoch':>9}{'floor':>8}{f'to AUC {b.target_auc:g} (s)':>20}{'final AUC':>11}",
    ]
    for m in b.modes:
        reach = f"{m.time_to_target_seconds:.2f}" if m.time_to_target_seconds is not None else f"not (best {m.best_auc:.3f})"
        lines.append(
            f"  {m.name:<10}{1e3 * m.step_seconds:9.2f}{1e3 * m.floor_step_seconds:8.2f}"
            f"{f'{m.ratio:.2f}' if m.ratio is not None else '-':>7}"
            f"{m.round_trips_per_epoch:13.0f}{m.bytes_per_step:12,.0f}{m.epoch_seconds:9.3f}{m.floor_epoch_seconds:8.3f}"
            f"{reach:>20}{m.final_test_auc:11.4f}"
        )
    columns = {m.target_column for m in b.modes}
    lines += [
        "  (ms/step: per round trip of a training epoch; floor: RTT + the step's bytes at the link rate; "
        "ratio: ms/step over floor;",
        "   s/epoch: training seconds per epoch, its floor: round trips x RTT + the epoch's bytes at the rate;",
        "   final AUC: test ROC-AUC of the model each run ended with, the best validation epoch's;",
        f"   to AUC: cumulative training seconds until {' / '.join(sorted(c for c in columns if c))} "
        "first reaches the target, median over rounds)",
    ]
    return "\n".join(lines)


def wan_bench_json(b: WanBench) -> str:
    return json.dumps(asdict(b), indent=2)
