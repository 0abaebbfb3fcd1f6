"""``python -m bank bench``: split training's cost next to the unsplit model's, measured in one run.

The split side is the real thing: the bank and one partner as separate
processes, mutual TLS over loopback, trained through the bank's job resource.
The unsplit side trains the same architecture on the same rows in this
process. Both use one torch thread per process (the services' default, and
the faster setting for these small models; the unsplit model is also timed
with every core, and the faster of the two is the baseline).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bank.config import TrainingConfig
from bank.operator import BankOperator
from bank.task import Task
from bank.trainer import epoch_batches, split_rows
from bank.unsplit import UnsplitModel
from data.prepare import prepare_bank_marketing
from parties.dataset import AlignedRows, load_party_table
from parties.process import ServiceProcess
from parties.session import PartySession
from parties.tls import TLSFiles, write_dev_pki

__all__ = ["TrainingBench", "run_training_bench"]

PARTNER_SEED = 1


@dataclass(frozen=True)
class TrainingBench:
    rows: int
    epochs: int
    batch_size: int
    split_epoch_seconds: float
    unsplit_epoch_seconds: float
    unsplit_threads: int
    ratio: float
    split_epoch_seconds_with_eval: float
    unsplit_epoch_seconds_with_eval: float
    ratio_with_eval: float
    bytes_per_step: float
    minimum_bytes_per_step: float
    bytes_per_epoch: float
    minimum_bytes_per_epoch: float
    round_trips_per_epoch: float


def _split_side(out: Path, paths: dict[str, Path], config: TrainingConfig) -> dict:
    write_dev_pki(out / "certs", {"bank": "bank", "partner": "partner"})
    common = ["--tls-dir", str(out / "certs"), "--torch-threads", "1"]
    partner = ServiceProcess(
        "partner", ["--name", "partner", "--data", str(paths["partner"]), "--state-dir", str(out / "partner"),
                    "--seed", str(PARTNER_SEED), *common],
        out / "partner.ready", out / "partner.log",
    )
    services = [partner]
    try:
        url = partner.wait_ready()
        bank = ServiceProcess(
            "bank", ["--name", "bank", "--data", str(paths["bank"]), "--state-dir", str(out / "bank"),
                     f"--partner=partner={url}", *common],
            out / "bank.ready", out / "bank.log",
        )
        services.append(bank)
        with BankOperator(bank.wait_ready(), TLSFiles.from_dir(out / "certs", "bank")) as op:
            op.wait(op.start_alignment())
            return op.wait(op.start_training(config))
    finally:
        for s in services:
            s.stop()


def _unsplit_side(paths: dict[str, Path], config: TrainingConfig, threads: int) -> tuple[float, float]:
    """Mean seconds per epoch (training steps; training steps + validation) of the unsplit model."""
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
        name: PartySession("sim", table, alignments[name], train, bottoms[name]).trainer.x.numpy()
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
            model.train_batches(epoch_batches(split.train, config.batch_size, config.seed, epoch), targets)
            steps.append(time.perf_counter() - start)
            model.eval()
            with torch.no_grad():
                task.metrics(targets[val], task.scores(model(val)))
            model.train()
            totals.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return float(np.mean(steps)), float(np.mean(totals))


def run_training_bench(
    epochs: int = 3, rows: int | None = None, cache: Path | None = None, download: bool = True
) -> TrainingBench:
    config = TrainingConfig(epochs=epochs, patience=epochs + 1)
    with tempfile.TemporaryDirectory(prefix="cutlayer-train-bench-") as tmp:
        out = Path(tmp)
        paths = prepare_bank_marketing(out / "data", rows=rows, cache=cache, download=download)
        result = _split_side(out, paths, config)
        history = pd.read_csv(Path(result["run_dir"]) / "history.csv")
        unsplit = {t: _unsplit_side(paths, config, t) for t in (1, torch.get_num_threads())}
    threads = min(unsplit, key=lambda t: unsplit[t][0])
    steps_s, total_s = unsplit[threads]
    split_steps, split_total = float(history["train_seconds"].mean()), float(history["seconds"].mean())
    comm = result["communication"]["partner"]
    return TrainingBench(
        rows=sum(result["rows"].values()), epochs=epochs, batch_size=config.batch_size,
        split_epoch_seconds=round(split_steps, 4), unsplit_epoch_seconds=round(steps_s, 4), unsplit_threads=threads,
        ratio=round(split_steps / steps_s, 3),
        split_epoch_seconds_with_eval=round(split_total, 4), unsplit_epoch_seconds_with_eval=round(total_s, 4),
        ratio_with_eval=round(split_total / total_s, 3),
        bytes_per_step=round(comm["bytes_per_step"], 1), minimum_bytes_per_step=round(comm["minimum_bytes_per_step"], 1),
        bytes_per_epoch=round(comm["bytes_per_epoch"], 1), minimum_bytes_per_epoch=round(comm["minimum_bytes_per_epoch"], 1),
        round_trips_per_epoch=round(comm["round_trips"] / epochs, 1),
    )


def format_bench(b: TrainingBench) -> str:
    return "\n".join([
        f"Split training vs the unsplit model: {b.rows:,} aligned rows, batch {b.batch_size}, mean of {b.epochs} epochs",
        "split: bank + 1 partner as separate processes, mutual TLS over loopback",
        f"  seconds per epoch, training steps   split {b.split_epoch_seconds:7.3f}   unsplit {b.unsplit_epoch_seconds:7.3f}"
        f" ({b.unsplit_threads} thread{'s' if b.unsplit_threads > 1 else ''})   ratio {b.ratio:5.2f}x",
        f"  seconds per epoch, with validation  split {b.split_epoch_seconds_with_eval:7.3f}"
        f"   unsplit {b.unsplit_epoch_seconds_with_eval:7.3f}   ratio {b.ratio_with_eval:5.2f}x",
        f"  bytes on the wire per step     {b.bytes_per_step:12,.0f}   minimum {b.minimum_bytes_per_step:12,.0f}"
        f"   ({b.bytes_per_step / b.minimum_bytes_per_step:.2f}x)",
        f"  bytes on the wire per epoch    {b.bytes_per_epoch:12,.0f}   minimum {b.minimum_bytes_per_epoch:12,.0f}",
        f"  round trips per epoch          {b.round_trips_per_epoch:12,.0f}",
        "  (minimum: float32 embeddings and gradients of the training rows, embeddings of the evaluation rows)",
    ])


def bench_json(b: TrainingBench) -> str:
    return json.dumps(asdict(b), indent=2)
