"""A training run's folder at the bank, written and read: config, metrics, history, predictions, the model files.

Every file is plain JSON, CSV or safetensors, written atomically, so a notebook
or a script can read a run without Cutlayer's code; ``load_run`` reads one back
(``Run``), ``latest_run`` and ``resolve_run`` find one the way git finds its
repository.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import save as save_tensors

from bank.config import TrainingConfig
from bank.scoring.calibration import MIN_METRIC_ROWS
from bank.scoring.manifest import Manifest, PartyEntry, write_manifest
from bank.scoring.subsets import SubsetModels
from bank.task import Task
from bank.vertical.coordinator import Coordinator, TrainingOutcome
from parties.errors import DataError
from parties.storage.files import atomic_write_bytes, atomic_write_text, private_dir
from parties.storage.layout import model_folder

if TYPE_CHECKING:  # the bank's client of a partner service; not needed to read a run
    from bank.vertical.http_partner import HttpPartner

__all__ = ["Run", "communication_stats", "is_configuration_run", "latest_run", "load_run", "resolve_run", "write_run"]


def _json(path: Path, value: Any) -> None:
    atomic_write_text(path, json.dumps(value, indent=2, default=str) + "\n")


def _csv(path: Path, frame: pd.DataFrame) -> None:
    """A table through the atomic writer: whole, and 0600 like every file of the run (pandas writes 0644)."""
    atomic_write_text(path, frame.to_csv(index=False))


def write_run(
    run_dir: Path,
    *,
    config: TrainingConfig,
    task: Task,
    outcome: TrainingOutcome,
    top: torch.nn.Module,
    targets: torch.Tensor,
    communication: dict[str, dict[str, float]],
    party_files: dict[str, dict[str, str]],
    alignment_id: str,
    bank_rows: np.ndarray,
    subsets: SubsetModels | None = None,
    chosen: dict[str, str] | None = None,
    bank_ids: Sequence[str] | None = None,
    id_column: str = "customer_id",
    protective_noise: str | None = None,
) -> dict[str, Any]:
    """Write the run folder; return the metrics document.

    ``chosen``: the settings that adapted to the table, and why (``TrainingConfig.resolved``).
    ``bank_ids``: the bank's customer IDs by row of its file: the test predictions carry them, so scores
    join to customers without ``split.csv``.
    """
    private_dir(run_dir)
    _json(run_dir / "config.json", {"session": outcome.session_id, "alignment_id": alignment_id, **config.model_dump()})
    _csv(run_dir / "history.csv", pd.DataFrame(outcome.history))
    test = outcome.split.test
    predictions = pd.DataFrame({"position": test, "target": targets[torch.from_numpy(test)].numpy()})
    if bank_ids is not None:
        predictions.insert(1, id_column, pd.Series(bank_ids).iloc[bank_rows[test]].tolist())
    for column, values in task.score_columns(outcome.test_scores).items():
        predictions[column] = values
    _csv(run_dir / "test_predictions.csv", predictions)
    splits = {"train": outcome.split.train, "val": outcome.split.val, "test": outcome.split.test}
    split = pd.DataFrame(
        {"position": np.concatenate(list(splits.values())),
         "split": np.concatenate([[k] * len(v) for k, v in splits.items()])}
    ).sort_values("position")
    split.insert(1, "bank_row", bank_rows[split["position"].to_numpy()])  # row in the bank's own file
    _csv(run_dir / "split.csv", split)
    if outcome.audit is not None:
        outcome.audit.save(run_dir / "audit")
    top_blob = save_tensors({k: v.contiguous() for k, v in top.state_dict().items()}, metadata={"session": outcome.session_id})
    atomic_write_bytes(run_dir / "model" / "top.safetensors", top_blob)
    _json(run_dir / "model" / "task.json", task.to_dict())
    top_digest = {"top.safetensors": hashlib.sha256(top_blob).hexdigest()}
    if config.top.factory is not None:  # scoring builds the bank's own top again from it
        top_config = config.top.model_dump_json(indent=2).encode()
        atomic_write_bytes(run_dir / "model" / "top-config.json", top_config)
        top_digest["top-config.json"] = hashlib.sha256(top_config).hexdigest()
    write_manifest(run_dir / "model" / "manifest.json", Manifest(
        model_id=outcome.session_id,
        alignment_id=alignment_id,
        task=task.to_dict(),
        aggregation=config.aggregation,
        parties=[PartyEntry(name=name, embedding_width=width, schema_hash=party_files[name]["encoder.json"],
                            files=party_files[name]) for name, width in outcome.widths.items()],
        top=top_digest,
        subsets=subsets.save(run_dir / "model") if subsets is not None else {},
    ))
    if subsets is not None and subsets.unaligned is not None:  # which unaligned customers trained, which judged
        unaligned = subsets.unaligned
        parts = {k: unaligned.rows[getattr(unaligned.split, k)] for k in ("train", "val", "test")}
        _csv(run_dir / "unaligned_split.csv",
             pd.DataFrame({"bank_row": np.concatenate(list(parts.values())),
                           "split": np.concatenate([[k] * len(v) for k, v in parts.items()])}).sort_values("bank_row"))
    if subsets is not None and not subsets.calibration.empty:
        columns = ["subset", "held_out", "bin", "rows", "mean_score", "observed_rate"]
        _csv(run_dir / "calibration.csv", subsets.calibration[columns])
    party_files = {**party_files, "bank-top": top_digest}
    metrics = {
        "session": outcome.session_id,
        "alignment_id": alignment_id,
        "task": task.kind,
        "rows": {k: int(len(v)) for k, v in splits.items()},
        "test": outcome.test_metrics,
        # The test metrics of a small table are figures of a few rows: said, next to them.
        **({"test_note": f"the test metrics are of {len(test)} customers (fewer than {MIN_METRIC_ROWS}): too few to "
                         "judge the model by; a larger test_fraction or more customers give figures to act on"}
           if len(test) < MIN_METRIC_ROWS else {}),
        # Per subset of the parties scoring can meet, its model and how it did on held-out customers.
        "subsets": subsets.held_out if subsets is not None else {},
        "defaults_chosen": chosen or {},
        # Where the bank's label DP and gradient noise came from: its secret, or a pin the run says it had.
        **({"protective_noise": protective_noise} if protective_noise else {}),
        "best_epoch": outcome.best_epoch,
        "epochs_run": len(outcome.history),
        "steps": outcome.steps,
        "embedding_widths": outcome.widths,
        "communication": communication,
        "timings": outcome.timings,
        "model_files": party_files,
    }
    _json(run_dir / "metrics.json", metrics)
    return metrics


# --- reading a run folder -----------------------------------------------------------------------------------


@dataclass
class Run:
    """A run folder, read: the bank's config, metrics, history, split and test predictions."""

    path: Path
    config: dict[str, Any]
    metrics: dict[str, Any]
    history: pd.DataFrame
    split: pd.DataFrame
    predictions: pd.DataFrame
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def partners(self) -> list[str]:
        return list(self.metrics.get("communication", {}))

    @property
    def bank_run_dir(self) -> Path:
        """The bank's own run folder (the walkthrough keeps it under ``bank/runs/<session>``)."""
        stored = self.summary.get("bank_run_dir")
        return self.path if stored is None else self._stored_path(stored)

    @property
    def audit_dir(self) -> Path:
        return self.bank_run_dir / "audit"

    def model_dir(self, party: str) -> Path:
        """The folder holding ``party``'s model files (the bank's: its top model, its bottom under ``bank/``)."""
        stored = self.summary.get("model_files", {}).get(party)
        if stored is not None:
            return self._stored_path(stored)
        if party == "bank":
            return self.bank_run_dir / "model"
        folder = model_folder(self.path / party, "bank", self.metrics["session"])
        older = self.path / party / "models" / self.metrics["session"]  # a partner from before per-bank folders
        return older if not folder.exists() and older.exists() else folder

    def _stored_path(self, value: str) -> Path:
        """A path ``summary.json`` names, relative to the run folder.

        Older summaries stored paths as the walkthrough saw them: absolute, or
        relative to its working directory, which is usually a folder above the
        run (``runs/<stamp>/...``). Those are accepted where they exist.
        """
        stored = Path(value)
        if stored.is_absolute():
            return stored
        candidates = [self.path / stored, stored, *(folder / stored for folder in self.path.resolve().parents)]
        return next((c for c in candidates if c.exists()), self.path / stored)


def is_configuration_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run of a configuration other than vertical (its ``metrics.json`` names one)."""
    try:
        metrics = json.loads((Path(folder) / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and metrics.get("configuration", "vertical") != "vertical"


def _upward(start: Path | None) -> list[Path]:
    """``start`` (default: the working directory) and every folder above it, nearest first."""
    here = Path.cwd() if start is None else Path(start).resolve()
    return [here, *here.parents]


def latest_run(root: Path | str = "runs", start: Path | None = None) -> Path:
    """The most recently written vertical run folder under ``root`` (runs of the other configurations, which
    the notebook shows beside it in its section 8, are passed over).

    A relative ``root`` is looked up as git looks up its repository: in
    ``start`` (default: the working directory), else in the nearest folder
    above that has a run under it. Jupyter starts a kernel in the notebook's
    folder, not where ``python -m bank walkthrough`` wrote ``runs/``.
    """
    root = Path(root)
    upward = _upward(start)
    for folder in [root] if root.is_absolute() else [folder / root for folder in upward]:
        candidates = sorted((p for p in folder.glob("*/metrics.json") if not is_configuration_run(p.parent)),
                            key=lambda p: p.stat().st_mtime)
        if candidates:
            return candidates[-1].parent
    where = root if root.is_absolute() else f"{root}/ in {upward[0]} or any folder above it"
    raise DataError(f"no run under {where}: run `python -m bank walkthrough` first")


def resolve_run(path: Path | str, start: Path | None = None) -> Path:
    """The run folder ``path`` names: as is if absolute; else ``path`` under ``start`` (default: the
    working directory) or under the nearest folder above it where it is a run folder (holds ``metrics.json``)."""
    path = Path(path)
    if path.is_absolute():
        return path
    upward = _upward(start)
    for folder in upward:
        if (folder / path / "metrics.json").is_file():
            return (folder / path).resolve()
    raise DataError(f"{path}: no run folder (one with metrics.json) of that name in {upward[0]} or any folder above it")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DataError(f"{path}: missing; is {path.parent} a run folder?") from exc


def load_run(path: Path | str | None = None, root: Path | str = "runs") -> Run:
    """Read a run folder (default: the latest under ``runs/`` here or above); see ``resolve_run``."""
    folder = resolve_run(path) if path is not None else latest_run(root)
    metrics = _read_json(folder / "metrics.json")
    if is_configuration_run(folder):
        raise DataError(f"{folder} is a {metrics['configuration']} run, not a vertical one: its audit is "
                        "bank.lab.report.config_audit.configuration_audit, and the notebook's section 8 shows it")
    summary_path = folder / "summary.json"
    return Run(
        path=folder,
        config=_read_json(folder / "config.json"),
        metrics=metrics,
        history=pd.read_csv(folder / "history.csv"),
        split=pd.read_csv(folder / "split.csv"),
        predictions=pd.read_csv(folder / "test_predictions.csv"),
        summary=_read_json(summary_path) if summary_path.exists() else {},
    )


def communication_stats(partner: HttpPartner, coordinator: Coordinator, outcome: TrainingOutcome) -> dict[str, float]:
    """Bytes (HTTP bodies) and round trips with one partner, next to the theoretical minimum.

    Per step: the training steps' messages alone, against what they must carry at float32 (each
    training row's embedding and its gradient). In total and per epoch: everything, evaluation
    embeddings included, against the same plus each evaluation row's embedding.
    """
    total = partner.bytes_sent + partner.bytes_received
    minimum = 4 * partner.width * (2 * coordinator.train_rows_sent + coordinator.eval_rows_sent)
    step_minimum = 4 * partner.width * 2 * coordinator.train_rows_sent
    steps, epochs = max(outcome.steps, 1), max(len(outcome.history), 1)
    return {
        "round_trips": partner.round_trips,
        "bytes_sent": partner.bytes_sent,
        "bytes_received": partner.bytes_received,
        "bytes_total": total,
        "minimum_bytes_total": minimum,
        "step_bytes_total": partner.step_bytes,
        "bytes_per_step": partner.step_bytes / steps,
        "minimum_bytes_per_step": step_minimum / steps,
        "bytes_per_epoch": total / epochs,
        "minimum_bytes_per_epoch": minimum / epochs,
        "overhead_ratio": total / minimum if minimum else float("nan"),
    }
