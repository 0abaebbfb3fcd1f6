"""A finished run in MLflow (the optional ``mlflow`` extra): its settings, per-epoch metrics, final metrics, files.

The bank service logs each run it finishes when its settings ask (``--mlflow``, ``--mlflow-uri URI``). By default
it logs to a local store under its state folder: an SQLite file and an artifact folder, ``<state>/mlflow/``.
(MLflow's plain-folder store is in maintenance mode and refuses to start without an opt-out; SQLite is the local
store it recommends.) ``--mlflow-uri`` names a tracking server instead.

What is logged: every training setting (``config.json``, flattened: ``bank_bottom.learning_rate``), each epoch's
row of ``history.csv`` as metrics at that epoch, the test metrics (``test_roc_auc``...), and the run folder's files
except its checkpoints (the bank's protective secret is kept beside them) and, unless asked
(``--mlflow-customer-files``), the files with a row per customer (predictions, splits, calibration).
A run that cannot be logged is still a finished run: the failure is reported in the job's result and the log.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parties.errors import ConfigError

if TYPE_CHECKING:
    from bank.settings import BankSettings

__all__ = ["CUSTOMER_FILES", "available", "local_store", "log_run", "track"]

logger = logging.getLogger(__name__)

#: Files of a run folder with a row per customer: the bank's own, yet not what a tracking server needs.
CUSTOMER_FILES = frozenset({"test_predictions.csv", "split.csv", "unaligned_split.csv", "calibration.csv"})
#: Never logged: checkpoints (and the secret the bank's noise is drawn from, kept with them).
PRIVATE_FOLDERS = frozenset({"checkpoints"})


def available() -> bool:
    """Whether MLflow is installed (``pip install -e '.[mlflow]'``), without importing it."""
    return importlib.util.find_spec("mlflow") is not None


def local_store(state: Path) -> tuple[str, Path]:
    """The default store: an SQLite file and an artifact folder under the party's state folder."""
    folder = (Path(state) / "mlflow").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", folder / "artifacts"


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


def _files(run_dir: Path, customer_files: bool) -> list[Path]:
    return sorted(p for p in run_dir.rglob("*") if p.is_file()
                  and not PRIVATE_FOLDERS & set(p.relative_to(run_dir).parts)
                  and (customer_files or p.name not in CUSTOMER_FILES))


def log_run(run_dir: Path, uri: str, *, experiment: str = "cutlayer", artifacts: Path | None = None,
            customer_files: bool = False) -> str:
    """Log the run folder ``run_dir`` to the MLflow store at ``uri``; returns the MLflow run id.

    ``artifacts``: where a new experiment keeps its files (a local store's folder); a server decides itself.
    """
    if not available():
        raise ConfigError("MLflow tracking needs the mlflow extra: pip install -e '.[mlflow]'")
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(
        experiment, artifact_location=artifacts.resolve().as_uri() if artifacts is not None else None)
    run = client.create_run(experiment_id, run_name=str(metrics.get("session", run_dir.name)),
                            tags={"cutlayer.session": str(metrics.get("session", "")),
                                  "cutlayer.alignment": str(metrics.get("alignment_id", "")),
                                  "cutlayer.task": str(metrics.get("task", ""))})
    run_id = run.info.run_id
    try:
        now = int(time.time() * 1000)
        params = [Param(k[:250], v[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            client.log_batch(run_id, params=params[i:i + 100])
        series: list[Metric] = []
        history = run_dir / "history.csv"
        if history.exists():
            with history.open(newline="") as f:
                for row in csv.DictReader(f):
                    epoch = int(row["epoch"])
                    series += [Metric(k, float(v), now, epoch) for k, v in row.items()
                               if k != "epoch" and v not in ("", None) and math.isfinite(float(v))]
        series += [Metric(f"test_{k}", float(v), now, 0) for k, v in metrics.get("test", {}).items()
                   if isinstance(v, (int, float)) and math.isfinite(v)]
        for i in range(0, len(series), 1000):  # and at most 1,000 metrics
            client.log_batch(run_id, metrics=series[i:i + 1000])
        for path in _files(run_dir, customer_files):
            parent = path.parent.relative_to(run_dir).as_posix()
            client.log_artifact(run_id, str(path), None if parent == "." else parent)
    except Exception:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id)
    return run_id


def track(run_dir: Path, settings: BankSettings) -> dict[str, str]:
    """Log a finished run as the bank's settings say (``--mlflow``, ``--mlflow-uri``): ``{"uri", "run_id"}``, or
    ``{"uri", "error"}`` when it could not be logged (the run stays finished; the log says why too)."""
    if settings.mlflow_uri:
        uri, artifacts = settings.mlflow_uri, None
    else:
        uri, artifacts = local_store(settings.state_path)
    try:
        run_id = log_run(run_dir, uri, experiment=settings.mlflow_experiment, artifacts=artifacts,
                         customer_files=settings.mlflow_customer_files)
    except Exception as exc:  # the tracking store's trouble, not the training's
        logger.warning("the run %s was not logged to MLflow at %s: %s", run_dir.name, uri, exc)
        return {"uri": uri, "error": f"{type(exc).__name__}: {exc}"}
    logger.info("run %s logged to MLflow at %s as %s", run_dir.name, uri, run_id)
    return {"uri": uri, "run_id": run_id}
