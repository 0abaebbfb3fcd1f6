"""The bank's run folders, read for its operator: each session's state, metrics and epochs, and the few files
of a run the operator may fetch through the service (its figures and tables, its model files' manifest).

Nothing here serves rows: predictions, splits and the bank's data stay in the folder, read by the bank's own
tools. A file is fetched by a name from ``run_files``, never by a path the caller makes up.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import numbers
from pathlib import Path
from typing import Any

import pandas as pd

from parties.errors import UnknownSession
from parties.protocol.control import RunDetail, RunSummary

__all__ = ["MEDIA_TYPES", "run_detail", "run_file", "run_files", "run_summary", "session_folder"]

logger = logging.getLogger(__name__)

#: A run's own files the operator may fetch, by the name it fetches them with.
TOP_FILES = {"metrics.json": "metrics.json", "config.json": "config.json", "history.csv": "history.csv",
             "manifest.json": "model/manifest.json"}
#: What the notebook (or ``bank.lab report``) writes under ``<run>/analysis/``: figures and tables.
MEDIA_TYPES = {".png": "image/png", ".csv": "text/csv", ".json": "application/json"}


def _started(folder: Path) -> str:
    stamp = (folder / "training.json").stat().st_mtime
    return dt.datetime.fromtimestamp(stamp, dt.timezone.utc).isoformat(timespec="seconds")


def _json(path: Path) -> dict[str, Any]:
    """A run file's JSON object; ``{}`` when it is missing or not one (said in the log: one odd run folder does
    not hide the others)."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("run file %s does not read as JSON (%s)", path, exc)
        return {}
    return value if isinstance(value, dict) else {}


def run_summary(folder: Path, state: str) -> RunSummary:
    started = _json(folder / "training.json")
    test = _json(folder / "metrics.json").get("test")
    test = test if isinstance(test, dict) else {}
    return RunSummary(session=folder.name, state=state, started=_started(folder),
                      alignment_id=str(started.get("alignment_id") or "") or None,
                      test={k: f for k, v in test.items() if (f := _finite(v)) is not None})


def _plain(path: Path, folder: Path) -> bool:
    """A regular file of the run's own, not a link to one elsewhere (a prediction file, another folder)."""
    return path.is_file() and not path.is_symlink() and path.resolve().is_relative_to(folder.resolve())


def run_files(folder: Path) -> list[str]:
    """The names ``run_file`` serves for this run: those of ``TOP_FILES`` it has, then its analysis."""
    names = [name for name, path in TOP_FILES.items() if _plain(folder / path, folder)]
    analysis = folder / "analysis"
    if analysis.is_dir() and not analysis.is_symlink():
        names += sorted(f"analysis/{f.name}" for f in analysis.iterdir()
                        if f.suffix in MEDIA_TYPES and not f.name.startswith(".") and _plain(f, folder))
    return names


def run_file(folder: Path, name: str) -> tuple[Path, str]:
    """The file ``name`` (one of ``run_files``) and its media type; anything else is unknown."""
    if name not in run_files(folder):
        raise UnknownSession(f"run {folder.name} has no file {name!r} to fetch")
    path = folder / TOP_FILES.get(name, name)
    return path, MEDIA_TYPES.get(path.suffix, "application/octet-stream")


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, numbers.Real) and math.isfinite(value) else None


def _clean(value: Any) -> Any:
    """``value`` with every float that is not finite as ``None``: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run_detail(folder: Path, state: str) -> RunDetail:
    history: list[dict[str, float | None]] = []
    if (folder / "history.csv").is_file():
        try:
            frame = pd.read_csv(folder / "history.csv")
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
            logger.warning("run file %s does not read as a table (%s)", folder / "history.csv", exc)
        else:
            history = [{str(k): _finite(v) for k, v in row.items()} for row in frame.to_dict("records")]
    config = _json(folder / "training.json").get("config")
    config = config if isinstance(config, dict) else {}
    return RunDetail(summary=run_summary(folder, state), metrics=_clean(_json(folder / "metrics.json")), config=config,
                     history=history, files=run_files(folder))


def session_folder(runs: Path, session_id: str) -> Path:
    """A session's run folder, by an id that can only name one (letters and digits)."""
    if not session_id.isalnum() or not (runs / session_id / "training.json").is_file():
        raise UnknownSession(f"no training session {session_id}")
    return runs / session_id
