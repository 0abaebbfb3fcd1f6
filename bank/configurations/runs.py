"""Runs of the configurations beside vertical: by hand (the bank's side, against running services) and as a
walkthrough (every party a separate service, started here on 127.0.0.1 over mutual TLS).

- ``owner_run``: U-shaped or vanilla, the bank's own file against a compute party (``python -m partner compute``).
- ``horizontal_run``: relay or SplitFed, the bank's labels against its branches (``python -m partner branch``).
- ``configuration_walkthrough``: the bank-marketing files, certificates, the services, one of the above.

Each writes the run folder a vertical run writes (``config.json``, ``metrics.json``, ``history.csv``,
``test_predictions.csv``, ``summary.json``) and, with ``audit``, what crossed each cut under ``audit/``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.numpy import save as save_arrays
from safetensors.torch import save as save_tensors
from tqdm import tqdm

from bank.configurations.horizontal import HorizontalTrainer, branch_labels
from bank.configurations.layer_peer import LayerPeer
from bank.configurations.split_run import ConfigurationSettings, write_configuration_run
from bank.configurations.u_shaped import OwnerTrainer, owner_data
from bank.task import Task
from data.configurations import BRANCH_COLUMN, LABEL, prepare_branches, prepare_owner
from data.uci import locate_bank_full
from parties.errors import ConfigError, DataError
from parties.storage.files import atomic_write_bytes, atomic_write_text, private_dir
from parties.tables.table import load_party_table, read_table_text
from parties.transport.client import make_client
from parties.transport.pki import write_dev_pki
from parties.transport.process import ServiceProcess
from parties.transport.tls import PeerIdentity, TLSFiles

__all__ = ["OWNER_CONFIGURATIONS", "HORIZONTAL_CONFIGURATIONS", "configuration_walkthrough", "horizontal_run",
           "owner_run"]

logger = logging.getLogger(__name__)

OWNER_CONFIGURATIONS = ("u-shaped", "vanilla")
HORIZONTAL_CONFIGURATIONS = ("relay", "splitfed")


def _communication(peers: dict[str, LayerPeer], steps: int | dict[str, int]) -> dict[str, dict[str, float]]:
    out = {}
    for name, p in peers.items():
        n = steps[name] if isinstance(steps, dict) else steps
        out[name] = {"round_trips": p.round_trips, "bytes_sent": p.bytes_sent, "bytes_received": p.bytes_received,
                     "retries": p.retries, "training_steps": n}
    return out


def _save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    private_dir(path.parent)
    atomic_write_bytes(path, save_arrays({k: np.ascontiguousarray(v) for k, v in arrays.items()}))


def _save_model(out: Path, name: str, module: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """The bank's own model file (safetensors) under ``OUT/model/``; its path inside the run folder."""
    state = module if isinstance(module, dict) else module.state_dict()
    path = private_dir(out / "model") / f"{name}.safetensors"
    atomic_write_bytes(path, save_tensors({k: v.detach().contiguous() for k, v in state.items()}))
    return path.relative_to(out).as_posix()


def _bar(desc: str) -> tuple[tqdm, Any]:
    bar = tqdm(total=1000, desc=desc, bar_format="{l_bar}{bar}| {postfix}")

    def progress(message: str, fraction: float) -> None:
        bar.n = int(1000 * min(fraction, 1.0))
        bar.set_postfix_str(message[:60])
        bar.refresh()

    return bar, progress


def _fresh(out: Path) -> None:
    """Refuse a run folder that already holds a run: two runs' files would mix (a model of one beside the other's)."""
    if (out / "metrics.json").exists():
        raise ConfigError(f"{out} already holds a run ({out / 'metrics.json'}); give another --out")


def owner_run(settings: ConfigurationSettings, data: Path, *, label: str | None, compute: tuple[str, str],
              tls: TLSFiles | None, bank_name: str, out: Path, retry_deadline: float = 60.0) -> dict[str, Any]:
    """U-shaped or vanilla: train on the bank's file ``data`` with the compute party at ``compute`` (name, URL)."""
    if settings.configuration not in OWNER_CONFIGURATIONS:
        raise ConfigError(f"{settings.configuration} is not one of {OWNER_CONFIGURATIONS}")
    _fresh(out)
    torch.set_num_threads(1)  # small MLPs: one thread is fastest, and the same on every machine
    table = load_party_table(data, None, label, labelled=True)
    prepared = owner_data(table, settings.training)
    started = time.perf_counter()
    with make_client(tls, caller=PeerIdentity(bank_name, "bank"), timeout=600.0) as client:
        peer = LayerPeer(compute[0], compute[1], client, "compute", retry_deadline=retry_deadline)
        bar, progress = _bar(settings.configuration)
        with bar:
            trainer = OwnerTrainer(settings, prepared, peer, progress=progress)
            outcome = trainer.run()
        if settings.audit:
            audit = out / "audit"
            everyone = np.arange(len(table))
            _save_arrays(audit / "cut1.safetensors", {
                "rows": everyone, "embedding": trainer.embeddings(everyone),
                "features": prepared.features.numpy(), "targets": prepared.targets.numpy(),
                "train": prepared.split.train})
            if outcome.audit is not None:
                outcome.audit.save(audit)
            atomic_write_text(audit / "features.json", json.dumps(prepared.encoder.feature_names()) + "\n")
        peer.end()
        communication = _communication({compute[0]: peer}, outcome.steps)
    files = {"bottom": _save_model(out, "bottom", outcome.bottom)}
    if outcome.head is not None:
        files["head"] = _save_model(out, "head", outcome.head)
    metrics = write_configuration_run(
        out, settings=settings, book=outcome.book, test=outcome.test, predictions=outcome.predictions,
        communication=communication,
        extra={"steps": outcome.steps, "resumes": outcome.resumes, "train_seconds": time.perf_counter() - started,
               "model_files": files,
               "parties": {bank_name: "bank (rows, labels, bottom" + (", head)" if outcome.head is not None else ")"),
                           compute[0]: "compute (trunk)" if outcome.head is not None else "compute (server layers, "
                           "loss, the training labels)"}})
    atomic_write_text(out / "encoder.json", json.dumps(prepared.encoder.to_dict(), indent=2) + "\n")
    return metrics


def read_labels(path: Path) -> pd.DataFrame:
    frame = read_table_text(Path(path))
    missing = [c for c in ("customer_id", BRANCH_COLUMN, LABEL) if c not in frame.columns]
    if missing:
        raise DataError(f"{path}: the labels file lacks {missing} (it needs customer_id, {BRANCH_COLUMN}, {LABEL})")
    return frame


def horizontal_run(settings: ConfigurationSettings, labels_file: Path, *, branches: dict[str, str],
                   tls: TLSFiles | None, bank_name: str, out: Path) -> dict[str, Any]:
    """Relay or SplitFed: the bank's labels (``customer_id, branch, y``) against its branches (name -> URL)."""
    if settings.configuration not in HORIZONTAL_CONFIGURATIONS:
        raise ConfigError(f"{settings.configuration} is not one of {HORIZONTAL_CONFIGURATIONS}")
    _fresh(out)
    torch.set_num_threads(1)
    frame = read_labels(labels_file)
    named = sorted(frame[BRANCH_COLUMN].astype(str).unique())
    if sorted(branches) != named:
        raise ConfigError(f"{labels_file} names branches {named}; --branch gives {sorted(branches)}")
    task = Task(settings.training.task, settings.training.positive_label).fit(frame[LABEL])
    labels = branch_labels(frame, "customer_id", BRANCH_COLUMN, LABEL, task, settings)
    started = time.perf_counter()
    with make_client(tls, caller=PeerIdentity(bank_name, "bank"), timeout=600.0) as client:
        peers = {name: LayerPeer(name, url, client, "partner") for name, url in branches.items()}
        bar, progress = _bar(settings.configuration)
        with bar:
            trainer = HorizontalTrainer(settings, task, labels, peers, progress=progress)
            outcome = trainer.run()
        if outcome.audit is not None:
            for b in trainer.order:
                rows = np.arange(len(labels[b].targets))
                outcome.audit.embeddings[b] = {"rows": torch.from_numpy(rows),
                                               "embedding": torch.from_numpy(trainer.embeddings(b, rows)),
                                               "targets": labels[b].targets}
            outcome.audit.save(out / "audit")
        # The client-side model every branch ended with (the relay's last, SplitFed's average): the bank holds it.
        weights, _ = peers[trainer.order[0]].weights(optimizer=False)
        files = {"top": _save_model(out, "top", outcome.top),
                 "branch_bottom": _save_model(out, "branch_bottom", {k.removeprefix("model."): v
                                                                     for k, v in weights.items()})}
        for peer in peers.values():
            peer.end()
        communication = _communication(peers, outcome.steps)
    atomic_write_text(out / "encoder.json", json.dumps(outcome.encoder, indent=2) + "\n")
    return write_configuration_run(
        out, settings=settings, book=outcome.book, test=outcome.test, predictions=outcome.predictions,
        communication=communication,
        extra={"per_branch": outcome.per_branch, "steps": sum(outcome.steps.values()), "model_files": files,
               "train_seconds": time.perf_counter() - started,
               "parties": {bank_name: "bank (labels, top)", **{b: "branch (rows, bottom)" for b in branches}},
               "rows": {b: {"train": len(labels[b].split.train), "val": len(labels[b].split.val),
                            "test": len(labels[b].split.test)} for b in trainer.order}})


def configuration_walkthrough(settings: ConfigurationSettings, out: Path, *, rows: int | None = None, seed: int = 0,
                              cache_dir: Path | None = None, download: bool = True, branches: int = 3) -> dict[str, Any]:
    """Files, certificates, every other party a separate service, the bank's run; ``OUT/summary.json``."""
    configuration = settings.configuration
    _fresh(out)
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: a walkthrough writes its data, certificates and run there; give "
                          "another --out")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    locate_bank_full(cache_dir, download=download)
    if configuration in OWNER_CONFIGURATIONS:
        paths = prepare_owner(out / "data", rows=rows, seed=seed, cache=cache_dir, download=download)
        others = {"compute": "compute"}
    else:
        paths = prepare_branches(out / "data", branches=branches, rows=rows, seed=seed, cache=cache_dir,
                                 download=download)
        others = {n: "partner" for n in paths if n != "bank"}
    write_dev_pki(out / "certs", {"bank": "bank", **others})
    services: dict[str, ServiceProcess] = {}
    try:
        for name, role in others.items():
            args = ["--name", name, "--tls-dir", str(out / "certs"), "--state-dir", str(out / name), "--bank", "bank"]
            if role == "partner":
                args += ["--data", str(paths[name])]
            services[name] = ServiceProcess("partner", args, out / name / "ready.json", out / "logs" / f"{name}.log",
                                            command="compute" if role == "compute" else "branch")
        urls = {name: svc.wait_ready() for name, svc in services.items()}
        tls = TLSFiles.from_dir(out / "certs", "bank")
        if configuration in OWNER_CONFIGURATIONS:
            metrics = owner_run(settings, paths["bank"], label=LABEL, compute=("compute", urls["compute"]), tls=tls,
                                bank_name="bank", out=out)
        else:
            metrics = horizontal_run(settings, paths["bank"], branches=urls, tls=tls, bank_name="bank", out=out)
    finally:
        for svc in services.values():
            svc.stop()
    summary = {
        **metrics,
        "rows_per_party": {n: sum(1 for _ in p.open()) - 1 for n, p in paths.items()},
        "wall_seconds": round(time.perf_counter() - started, 2),
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")
    return summary
