"""Who could infer what in the configurations beside vertical, from what crossed each cut of an audited run.

Reads the run folder ``bank.configurations.runs`` writes with ``audit`` on and returns one long table
(``COLUMNS``), written to ``<run>/audit/leakage.csv`` and ``leakage.json``:

* **U-shaped**: the compute party receives, each step, the gradient at its trunk's output (cut 2); its leak
  AUC for the labels (norm and direction attacks, per epoch and on row means: ``bank.lab.report.audit.leakage_rows``).
  It also sees the bank's cut-1 activations of every row: the R² of decoding each bank feature from them.
  It holds no columns of its own, so its baseline is the constant guess.
* **Vanilla**: the compute party computes the loss, so it receives every training label outright: their
  count, and a leak of 1.0 (held). Inversion of the bank's features as in U-shaped.
* **Relay / SplitFed**: each branch's leak AUC for its customers' labels from the gradients it receives; the
  bank's inversion of each branch's features from the embeddings it sees (its baseline: the labels it
  holds; the auditor reads the branches' files, by default the walkthrough's ``<run>/data``). The bank also receives every branch's bottom weights (white-box), and each branch receives weights
  other branches trained: recorded as held, not measured.

SIMULATION ONLY: the auditor reads the true labels and every branch's file (``<run>/data``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pandas as pd
from safetensors.numpy import load_file

from bank.lab.report.audit import inversion_rows, leakage_rows
from parties.errors import DataError
from parties.tables.encoding import TabularEncoder
from parties.tables.table import load_party_table

__all__ = ["COLUMNS", "CONFIGURATIONS", "audit_headlines", "configuration_audit", "format_configuration_audit",
           "print_configuration_audit"]

CONFIGURATIONS = ("u-shaped", "vanilla", "relay", "splitfed")
#: The long table: one measured (or held) quantity per row; ``epoch`` for label attacks, ``feature`` for inversion.
COLUMNS = ["configuration", "observer", "target", "measure", "value", "epoch", "feature", "note"]
LABELS = "labels"


def _row(configuration: str, observer: str, target: str, measure: str, value: float, *, epoch: str | None = None,
         feature: str | None = None, note: str = "") -> dict[str, Any]:
    return {"configuration": configuration, "observer": observer, "target": target, "measure": measure,
            "value": float(value), "epoch": epoch, "feature": feature, "note": note}


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        raise DataError(f"{path}: missing; run the configuration with audit on (`--audit`)")
    return load_file(str(path))


def _label_rows(configuration: str, observer: str, g: dict[str, np.ndarray], targets: np.ndarray,
                what: str) -> list[dict[str, Any]]:
    note = f"from the gradients it received ({what})"
    labels = targets[g["rows"]]
    if not np.isin(labels, (0, 1)).all():  # the leak AUCs rank rows as positive or not: a binary task's measure
        return [_row(configuration, observer, LABELS, m, math.nan, epoch="all (row means)",
                     note="measured for binary tasks only") for m in ("norm_leak_auc", "direction_leak_auc")]
    if not 0 < labels.mean() < 1:  # one class only: no attack can rank, and the direction attack has no positive
        return [_row(configuration, observer, LABELS, m, math.nan, epoch="all (row means)",
                     note="its training rows hold one class only") for m in ("norm_leak_auc", "direction_leak_auc")]
    return [_row(configuration, observer, LABELS, measure, r[measure], epoch=str(r["epoch"]), note=note)
            for r in leakage_rows(observer, g, targets) for measure in ("norm_leak_auc", "direction_leak_auc")]


def _inversion_rows(configuration: str, observer: str, target: str, embedding: np.ndarray, truth: np.ndarray,
                    own: np.ndarray, names: list[str], baseline: str, seed: int,
                    aux_fraction: float) -> list[dict[str, Any]]:
    out = []
    for r in inversion_rows(observer, embedding, truth, own, names, seed, aux_fraction):
        for measure, key in (("inversion_r2", "r2_embedding_and_bank"), ("baseline_r2", "r2_bank_only"),
                             ("inversion_r2_advantage", "advantage")):
            out.append(_row(configuration, observer, target, measure, r[key], feature=r["feature"],
                            note=f"decoded from the embeddings it saw; baseline: {baseline}"))
    return out


def _owner(run: Path, configuration: str, seed: int, aux_fraction: float) -> list[dict[str, Any]]:
    audit = run / "audit"
    cut1 = _load(audit / "cut1.safetensors")
    names = json.loads((audit / "features.json").read_text())
    targets = cut1["targets"]
    out: list[dict[str, Any]] = []
    if configuration == "u-shaped":
        out += _label_rows(configuration, "compute", _load(audit / "gradients-compute.safetensors"), targets,
                           "cut 2, its trunk's output")
    else:
        epochs = json.loads((run / "metrics.json").read_text()).get("epochs_run")
        out += [_row(configuration, "compute", LABELS, "labels_received", len(cut1["train"]),
                     note=f"every training row's label, with its batch, each of {epochs} epochs"),
                _row(configuration, "compute", LABELS, "label_leak_auc", 1.0, epoch="all", note="held")]
    rows = cut1["rows"]
    out += _inversion_rows(configuration, "compute", "bank's features", cut1["embedding"], cut1["features"][rows],
                           np.empty((len(rows), 0)), names, "a constant (it holds no columns)", seed, aux_fraction)
    return out


def _branches(run: Path) -> list[str]:
    metrics = json.loads((run / "metrics.json").read_text())
    return sorted(metrics.get("communication", {}))


def _horizontal(run: Path, configuration: str, seed: int, aux_fraction: float,
                branch_data: Path) -> list[dict[str, Any]]:
    audit = run / "audit"
    encoder = TabularEncoder.from_dict(json.loads((run / "encoder.json").read_text()))
    names = encoder.feature_names()
    branches = _branches(run)
    out: list[dict[str, Any]] = []
    for i, b in enumerate(branches):
        seen = _load(audit / f"embeddings-{b}.safetensors")
        targets = seen["targets"]
        out += _label_rows(configuration, b, _load(audit / f"gradients-{b}.safetensors"), targets,
                           "its bottom's output")
        data = branch_data / b / f"{b}.csv"
        if data.exists():
            features = encoder.transform(load_party_table(data).features)
            if len(features) != len(targets):
                raise DataError(f"{data} holds {len(features)} rows, the audit recorded {len(targets)} for {b}")
            rows = seen["rows"]
            out += _inversion_rows(configuration, "bank", f"{b}'s features", seen["embedding"], features[rows],
                                   targets[rows, None].astype(np.float64), names, "the labels it holds", seed,
                                   aux_fraction)
        else:  # a run by hand: the branches' files are theirs; the label audit still stands
            out.append(_row(configuration, "bank", f"{b}'s features", "not_measured", math.nan,
                            note=f"{data} missing: the inversion reads the branch's file (give branch_data)"))
        how = ("the relay hands it on through the bank" if configuration == "relay"
               else "the bank averages the branches' copies")
        out.append(_row(configuration, "bank", f"{b}'s bottom", "holds_weights", 1.0,
                        note=f"white-box: {how}; not measured here"))
        if configuration == "relay":
            before = branches[i - 1]
            note = f"white-box: its turn starts from the bottom {before} left (its update on {before}'s rows)"
            if i == 0:  # the first branch's turn starts from the last one's previous turn
                note += ", from epoch 2"
            out.append(_row(configuration, b, f"{before}'s bottom", "holds_weights", 1.0,
                            note=note + "; not measured here"))
        else:
            out.append(_row(configuration, b, "the other branches' bottoms", "holds_weights", 1.0,
                            note="their row-weighted average (with two branches, the other's exactly); "
                                 "not measured here"))
    return out


def configuration_audit(run_dir: Path | str, *, seed: int = 0, aux_fraction: float = 0.5, write: bool = True,
                        branch_data: Path | str | None = None) -> pd.DataFrame:
    """The audit of one configuration run (``COLUMNS``); with ``write``, also ``audit/leakage.csv`` and ``.json``.

    ``branch_data``: relay and SplitFed, the folder holding ``<branch>/<branch>.csv`` for the bank-side
    inversion (default: the walkthrough's ``<run>/data``); a branch whose file is not there is reported as
    not measured.
    """
    run = Path(run_dir)
    metrics_path = run / "metrics.json"
    if not metrics_path.exists():
        raise DataError(f"{metrics_path}: missing; is {run} a run folder?")
    configuration = json.loads(metrics_path.read_text()).get("configuration")
    if configuration not in CONFIGURATIONS:
        raise DataError(f"{run} is a vertical run (no configuration in its metrics.json): its audit is in the "
                        "analysis notebook's section 4" if configuration is None
                        else f"{run}: unknown configuration {configuration!r}")
    if not (run / "audit").is_dir():
        raise DataError(f"{run / 'audit'}: missing; run the configuration with audit on (`--audit`)")
    if configuration in ("u-shaped", "vanilla"):
        rows = _owner(run, configuration, seed, aux_fraction)
    else:
        rows = _horizontal(run, configuration, seed, aux_fraction,
                           run / "data" if branch_data is None else Path(branch_data))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    if write:
        frame.to_csv(run / "audit" / "leakage.csv", index=False)
        records = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
                   for r in frame.to_dict(orient="records")]
        (run / "audit" / "leakage.json").write_text(json.dumps(
            {"configuration": configuration, "run": str(run), "seed": seed, "aux_fraction": aux_fraction,
             "rows": records}, indent=2) + "\n")
    return frame


def _strength(auc: float) -> float:
    return max(auc, 1 - auc)  # a reversed ranking leaks as much


def _headline(part: pd.DataFrame) -> tuple[str, float, str]:
    measures = set(part["measure"])
    if "labels_received" in measures:
        count = int(part.loc[part["measure"] == "labels_received", "value"].iloc[0])
        return "label leak AUC", 1.0, f"held: {count:,} training labels received"
    if measures & {"norm_leak_auc", "direction_leak_auc"}:
        leaks = part.dropna(subset=["value"])
        if leaks.empty:
            return "strongest label leak AUC", math.nan, str(part["note"].iloc[0])
        pooled = leaks[leaks["epoch"] == "all (row means)"].set_index("measure")["value"]
        strength = leaks["value"].map(_strength)
        strongest = leaks.loc[strength.idxmax()]  # the first (earliest) of equals
        when = "row means" if strongest["epoch"] == "all (row means)" else f"epoch {strongest['epoch']}"
        return ("strongest label leak AUC", float(strength.max()),
                f"{strongest['measure'].removesuffix('_leak_auc')} attack, {when}; row means: norm "
                f"{pooled.get('norm_leak_auc', math.nan):.3f}, direction {pooled.get('direction_leak_auc', math.nan):.3f}")
    if "inversion_r2" in measures:
        r2 = part[part["measure"] == "inversion_r2"].set_index("feature")["value"]
        advantage = part[part["measure"] == "inversion_r2_advantage"].set_index("feature")["value"]
        best = ", ".join(f"{f} {v:.2f}" for f, v in r2.sort_values(ascending=False).head(3).items())
        baseline = str(part["note"].iloc[0]).split("baseline: ")[-1]
        return "mean inversion R²", float(r2.mean()), (f"best: {best}; mean advantage over {baseline}: "
                                                        f"{advantage.mean():.2f}")
    if "not_measured" in measures:
        return "not measured", math.nan, str(part["note"].iloc[0])
    return "holds weights", 1.0, str(part["note"].iloc[0])


def audit_headlines(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration, observer and target: the strongest label attack (a reversed ranking counts as
    max(AUC, 1 - AUC)), the labels held, the mean inversion R² over features, or the weights held."""
    rows = [{"configuration": c, "observer": o, "target": t, **dict(zip(("headline", "value", "detail"),
                                                                        _headline(part)))}
            for (c, o, t), part in frame.groupby(["configuration", "observer", "target"], sort=False)]
    return pd.DataFrame(rows, columns=["configuration", "observer", "target", "headline", "value", "detail"])


def format_configuration_audit(frame: pd.DataFrame) -> str:
    """One line per observer and target (``audit_headlines``)."""
    lines = []
    for r in audit_headlines(frame).itertuples():
        figure = "" if r.headline in ("holds weights", "not measured") else f" {r.value:.3f}"
        lines.append(f"{r.configuration}: {r.observer} -> {r.target}: {r.headline}{figure} ({r.detail})")
    return "\n".join(lines)


def print_configuration_audit(frame: pd.DataFrame, file: TextIO | None = None) -> None:
    """Print ``format_configuration_audit`` (for the command line)."""
    print(format_configuration_audit(frame), file=file or sys.stdout)
