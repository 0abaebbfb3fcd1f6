"""``python -m bank.lab bench``: split training's cost next to the unsplit model's, measured in one run.

The split side is the real thing: the bank and one partner as separate
processes, mutual TLS over loopback, trained through the bank's job resource.
On a machine with two or more CPUs each service is pinned to a CPU of its own,
as if it ran on its own machine. The unsplit side trains the same architecture
on the same rows in this process, with one torch thread and with every core;
the faster is the baseline.

Machines drift (other tenants, turbo, caches), so the two sides alternate:
each round trains a split session and then the unsplit model, and the ratio
reported is the median of the rounds' ratios, each from the median epoch.

Per step, the bench also times the wire alone (``bank.lab.bench.wire_floor``): a bare
mutual-TLS round trip of one step's tensor bytes between the same two CPUs.

It records whether the torch fast path ran (``parties.speed``): the services
inherit this process's environment and libraries, so they decide as it does.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from pydantic import ValidationError

from bank.config import MAX_AUTO_BATCH, TrainingConfig
from bank.lab.bench.wire_floor import measure_wire_floor
from bank.lab.references.unsplit import UnsplitModel
from bank.service.operator import BankOperator
from bank.task import Task
from bank.vertical.coordinator import epoch_batches, split_rows
from data.prepare import prepare_bank_marketing
from parties.errors import ConfigError
from parties.learning import fast_path
from parties.learning.training_session import PartySession
from parties.tables.table import AlignedRows, load_party_table
from parties.transport.pki import write_dev_pki
from parties.transport.process import ServiceProcess
from parties.transport.tls import TLSFiles

__all__ = ["TrainingBench", "run_training_bench"]

PARTNER_SEED = 1


@dataclass(frozen=True)
class TrainingBench:
    rows: int
    epochs: int
    rounds: int
    pinned: bool
    batch_size: int
    wire_precision: str
    split_epoch_seconds: float
    unsplit_epoch_seconds: float
    unsplit_threads: int
    ratio: float
    ratio_range: tuple[float, float]
    split_epoch_seconds_with_eval: float
    unsplit_epoch_seconds_with_eval: float
    ratio_with_eval: float
    bytes_per_step: float
    minimum_bytes_per_step: float
    bytes_per_epoch: float
    minimum_bytes_per_epoch: float
    round_trips_per_epoch: float
    split_step_seconds: float  # per round trip of a training epoch (its steps and the final flush)
    unsplit_step_seconds: float
    wire_floor_seconds: float  # a bare mutual-TLS round trip of one step's tensor bytes
    speed_code: tuple[str, ...] = ()  # which speed code the split side ran, and why (``parties.speed``)


class _SplitServices:
    """A partner and a bank service on this machine, aligned once, trained as often as asked."""

    def __init__(self, out: Path, paths: dict[str, Path], cpus: tuple[int, int] | None) -> None:
        write_dev_pki(out / "certs", {"bank": "bank", "partner": "partner"})
        common = ["--tls-dir", str(out / "certs"), "--torch-threads", "1"]
        cpus_of = {"bank": ["--cpus", str(cpus[0])], "partner": ["--cpus", str(cpus[1])]} if cpus else {
            "bank": [], "partner": []}
        self.services = [ServiceProcess(
            "partner", ["--name", "partner", "--data", str(paths["partner"]), "--state-dir", str(out / "partner"),
                        "--seed", str(PARTNER_SEED), *common, *cpus_of["partner"]],
            out / "partner.ready", out / "partner.log",
        )]
        try:
            url = self.services[0].wait_ready()
            self.services.append(ServiceProcess(
                "bank", ["--name", "bank", "--data", str(paths["bank"]), "--state-dir", str(out / "bank"),
                         f"--partner=partner={url}", *common, *cpus_of["bank"]],
                out / "bank.ready", out / "bank.log",
            ))
            self.operator = BankOperator(self.services[1].wait_ready(), TLSFiles.from_dir(out / "certs", "bank"))
            self.operator.wait(self.operator.start_alignment())
        except BaseException:
            self.close()
            raise

    def train(self, config: TrainingConfig) -> dict:
        return self.operator.wait(self.operator.start_training(config))

    def close(self) -> None:
        if hasattr(self, "operator"):
            self.operator.close()
        for s in self.services:
            s.stop()


def _unsplit_side(paths: dict[str, Path], config: TrainingConfig, threads: int) -> tuple[float, float]:
    """Median seconds per epoch (training steps; training steps + validation) of the unsplit model."""
    bank = load_party_table(paths["bank"], "customer_id", "y")
    partner = load_party_table(paths["partner"], "customer_id")
    where = {i: k for k, i in enumerate(partner.ids)}
    rows = np.array([k for k, i in enumerate(bank.ids) if i in where])
    alignments = {"bank": AlignedRows("sim", rows), "partner": AlignedRows("sim", np.array([where[bank.ids[k]] for k in rows]))}
    labels = bank.labels.iloc[rows]
    task = Task(config.task).fit(labels)
    targets = task.targets(labels)
    split = split_rows(len(rows), targets, task, config)
    train = torch.from_numpy(split.train.astype(np.int64))
    bottoms = {"bank": config.bank_bottom, "partner": config.bank_bottom.model_copy(update={"seed": PARTNER_SEED})}
    features = {
        name: PartySession("sim", table, alignments[name], train, bottoms[name]).trainer.x.all().numpy()
        for name, table in (("bank", bank), ("partner", partner))
    }
    model = UnsplitModel(features, bottoms, config.top, config.aggregation, task)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps, totals = [], []
        val = torch.from_numpy(split.val.astype(np.int64))
        for epoch in range(config.epochs):
            start = time.perf_counter()
            model.train_batches(epoch_batches(split.train, config.batch, config.seed, epoch), targets)
            steps.append(time.perf_counter() - start)
            model.eval()
            with torch.no_grad():
                task.metrics(targets[val], task.scores(model(val)))
            model.train()
            totals.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return float(np.median(steps)), float(np.median(totals))


def run_training_bench(
    epochs: int = 3, rows: int | None = None, cache: Path | None = None, download: bool = True, rounds: int = 3,
    progress: Callable[[str], None] = lambda _msg: None, batch_size: int | None = None,
    wire_precision: str | None = None,
) -> TrainingBench:
    """``batch_size``: the training default unless given (per-step costs are fixed, so the ratio falls as it grows);
    ``wire_precision``: how step tensors travel (default fp32, exact)."""
    if epochs < 1 or rounds < 1:
        raise ConfigError(f"the bench needs at least one round of one epoch (got {rounds} of {epochs})")
    try:
        # The batch its figures were measured at, on slices too: per-step costs are what it compares.
        config = TrainingConfig(epochs=epochs, patience=epochs + 1, batch_size=batch_size or MAX_AUTO_BATCH,
                                **({"wire_precision": wire_precision} if wire_precision is not None else {}))
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise ConfigError(f"bench settings: {problem['loc'][0]}: {problem['msg']}") from exc
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = (usable[0], usable[1]) if len(usable) >= 2 else None  # the bank's CPU, the partner's
    split_steps, split_totals, unsplit_steps, unsplit_totals, threads_used = [], [], [], [], []
    width = config.bank_bottom.cut_width  # the partner runs the default bottom too
    with tempfile.TemporaryDirectory(prefix="cutlayer-train-bench-") as tmp:
        out = Path(tmp)
        paths = prepare_bank_marketing(out / "data", rows=rows, cache=cache, download=download)
        services = _SplitServices(out, paths, cpus)
        try:
            for r in range(rounds):
                result = services.train(config)
                if r == 0:
                    first = result
                history = pd.read_csv(Path(result["run_dir"]) / "history.csv")
                round_trips = int(history["steps"].iloc[0])  # an epoch's steps and its flush
                split_steps.append(float(history["train_seconds"].median()))
                split_totals.append(float(history["seconds"].median()))
                unsplit = {t: _unsplit_side(paths, config, t) for t in sorted({1, torch.get_num_threads()})}
                threads = min(unsplit, key=lambda t: unsplit[t][0])
                unsplit_steps.append(unsplit[threads][0])
                unsplit_totals.append(unsplit[threads][1])
                threads_used.append(threads)
                progress(f"round {r + 1}/{rounds}: split {split_steps[-1]:.3f} s, unsplit {unsplit_steps[-1]:.3f} s "
                         f"per epoch ({split_steps[-1] / unsplit_steps[-1]:.2f}x)")
        finally:
            services.close()
        progress("timing the wire alone")
        floor = measure_wire_floor(out / "certs", request=config.batch * (4 * width + 8),
                                   answer=config.batch * 4 * width, cpus=cpus, out=out)
    ratios = [s / u for s, u in zip(split_steps, unsplit_steps)]
    totals = [s / u for s, u in zip(split_totals, unsplit_totals)]
    comm = first["communication"]["partner"]
    return TrainingBench(
        rows=sum(first["rows"].values()), epochs=epochs, rounds=rounds, pinned=cpus is not None, batch_size=config.batch,
        wire_precision=config.wire_precision,
        split_epoch_seconds=round(float(np.median(split_steps)), 4),
        unsplit_epoch_seconds=round(float(np.median(unsplit_steps)), 4),
        unsplit_threads=max(set(threads_used), key=threads_used.count),
        ratio=round(float(np.median(ratios)), 3), ratio_range=(round(min(ratios), 3), round(max(ratios), 3)),
        split_epoch_seconds_with_eval=round(float(np.median(split_totals)), 4),
        unsplit_epoch_seconds_with_eval=round(float(np.median(unsplit_totals)), 4),
        ratio_with_eval=round(float(np.median(totals)), 3),
        bytes_per_step=round(comm["bytes_per_step"], 1), minimum_bytes_per_step=round(comm["minimum_bytes_per_step"], 1),
        bytes_per_epoch=round(comm["bytes_per_epoch"], 1), minimum_bytes_per_epoch=round(comm["minimum_bytes_per_epoch"], 1),
        round_trips_per_epoch=round(comm["round_trips"] / epochs, 1),
        split_step_seconds=round(float(np.median(split_steps)) / round_trips, 6),
        unsplit_step_seconds=round(float(np.median(unsplit_steps)) / (round_trips - 1), 6),
        wire_floor_seconds=round(floor, 6),
        speed_code=(str(fast_path.status()),),
    )


def format_bench(b: TrainingBench) -> str:
    return "\n".join([
        f"Split training vs the unsplit model: {b.rows:,} aligned rows, batch {b.batch_size}, "
        f"{b.rounds} alternating rounds of {b.epochs} epochs (medians), step tensors in {b.wire_precision}",
        "split: bank + 1 partner as separate processes, mutual TLS over loopback"
        + (", each pinned to a CPU of its own" if b.pinned else ""),
        f"  seconds per epoch, training steps   split {b.split_epoch_seconds:7.3f}   unsplit {b.unsplit_epoch_seconds:7.3f}"
        f" ({b.unsplit_threads} thread{'s' if b.unsplit_threads > 1 else ''})   ratio {b.ratio:5.2f}x"
        f" (rounds {b.ratio_range[0]:.2f}-{b.ratio_range[1]:.2f})",
        f"  seconds per epoch, with validation  split {b.split_epoch_seconds_with_eval:7.3f}"
        f"   unsplit {b.unsplit_epoch_seconds_with_eval:7.3f}   ratio {b.ratio_with_eval:5.2f}x",
        f"  bytes on the wire per step     {b.bytes_per_step:12,.0f}   minimum {b.minimum_bytes_per_step:12,.0f}"
        f"   ({b.bytes_per_step / b.minimum_bytes_per_step:.2f}x)",
        f"  bytes on the wire per epoch    {b.bytes_per_epoch:12,.0f}   minimum {b.minimum_bytes_per_epoch:12,.0f}",
        f"  round trips per epoch          {b.round_trips_per_epoch:12,.0f}",
        "  (minimum: float32 embeddings and gradients of the training rows, embeddings of the evaluation rows)",
        f"  milliseconds per training step      split {1e3 * b.split_step_seconds:7.2f}"
        f"   unsplit {1e3 * b.unsplit_step_seconds:7.2f}   the wire alone {1e3 * b.wire_floor_seconds:5.2f}",
        "  (the wire alone: a bare mutual-TLS round trip of one step's tensor bytes between the same two CPUs)",
        *(f"  {line}" for line in b.speed_code),
    ])


def bench_json(b: TrainingBench) -> str:
    return json.dumps(asdict(b), indent=2)
