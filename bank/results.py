"""A training run's files at the bank: config, metrics, history, predictions and the bank's own model.

Every file is plain JSON, CSV or safetensors, written atomically, so a notebook
or a script can read a run without Cutlayer's code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import save as save_tensors

from bank.calibration import MIN_METRIC_ROWS
from bank.config import TrainingConfig
from bank.manifest import Manifest, PartyEntry, write_manifest
from bank.subsets import SubsetModels
from bank.task import Task
from bank.trainer import TrainingOutcome
from parties.storage.files import atomic_write_bytes, atomic_write_text, private_dir

__all__ = ["write_run"]


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
        predictions.insert(1, id_column, [bank_ids[r] for r in bank_rows[test]])
    scores = outcome.test_scores
    if scores.ndim == 1:
        predictions["score"] = scores
    else:
        for i, c in enumerate(task.classes_):
            predictions[f"score_{c}"] = scores[:, i]
    _csv(run_dir / "test_predictions.csv", predictions)
    splits = {"train": outcome.split.train, "val": outcome.split.val, "test": outcome.split.test}
    split = pd.DataFrame(
        {"position": np.concatenate(list(splits.values())),
         "split": np.concatenate([[k] * len(v) for k, v in splits.items()])}
    ).sort_values("position")
    split.insert(1, "bank_row", bank_rows[split["position"].to_numpy()])  # row in the bank's own file
    _csv(run_dir / "split.csv", split)
    if outcome.audit is not None:
        for name, tensors in outcome.audit.tensors().items():
            atomic_write_bytes(run_dir / "audit" / f"{name}.safetensors", save_tensors(tensors))
    top_blob = save_tensors({k: v.contiguous() for k, v in top.state_dict().items()}, metadata={"session": outcome.session_id})
    atomic_write_bytes(run_dir / "model" / "top.safetensors", top_blob)
    _json(run_dir / "model" / "task.json", task.to_dict())
    top_digest = {"top.safetensors": hashlib.sha256(top_blob).hexdigest()}
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
