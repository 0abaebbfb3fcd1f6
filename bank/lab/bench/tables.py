"""The split model against what tabular teams compare everything with, on four unlike tables. SIMULATION ONLY.

``python -m bank.lab tables``: for bank-full, a generated credit table (integer-coded categoricals, a column
with missing values), a small regression table (scikit-learn's diabetes) and a small multiclass one (wine),
each split between a bank (the label and some columns) and a partner (the other columns), it trains on the same
train/validation/test rows

- the split model with each built-in setting (``SETTINGS``: the default MLP, piecewise-linear or periodic
  numeric embeddings, learned categorical embeddings), every party using the setting for its own bottom. It is
  trained as its unsplit twin, in one process: the exactness tests prove the two bit for bit equal for every
  setting here (``tests/test_exactness.py``), and the twin needs no services. The best setting is chosen on
  the validation rows, never the test rows;
- centralised HistGradientBoosting and a logistic (ridge, for regression) model on every column;
- the bank-only model: HistGradientBoosting on the bank's columns.

Small tables are split several times (``BenchTable.repeats``) and every figure is the mean over the splits.
Binary and multiclass tables are compared on test ROC-AUC (multiclass: one class against the rest, averaged
over classes), regression on test R². ``step_costs`` times one training step of each party's bottom per
setting on bank-full, side by side. Results go to ``<out>/tables.json`` and ``tables.csv``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from bank.config import TrainingConfig, default_batch_size
from bank.epochs import EpochBook
from bank.lab.references.models import fit_unsplit
from bank.lab.references.unsplit import UnsplitModel
from bank.task import Task
from parties.learning.config import BottomConfig, TaskKind
from parties.tables.encoding import TabularEncoder
from parties.tables.schema import FeatureSchema

__all__ = ["SETTINGS", "TABLES", "BenchTable", "bank_full", "compare", "credit", "diabetes", "report", "run", "step_costs",
           "wine"]

#: The built-in bottom's settings compared, as ``BottomConfig`` fields; every party uses the same.
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "ple": {"numeric_embedding": "ple"},
    "periodic": {"numeric_embedding": "periodic"},
    "categories": {"category_width": 4},
    "ple+categories": {"numeric_embedding": "ple", "category_width": 4},
}


@dataclass
class BenchTable:
    """A table split between the bank (``bank`` columns and the label) and a partner (the rest)."""

    name: str
    kind: TaskKind
    frame: pd.DataFrame
    label: str
    bank: list[str]
    categorical: list[str]
    repeats: int = 1

    @property
    def partner(self) -> list[str]:
        return [c for c in self.frame.columns if c not in (*self.bank, self.label)]

    def schema(self, columns: list[str]) -> FeatureSchema:
        return FeatureSchema(tuple(c for c in columns if c not in self.categorical),
                             tuple(c for c in columns if c in self.categorical))


def bank_full(cache: Path | None = None, download: bool = True) -> BenchTable:
    from data.partition import bank_marketing_spec, read_source_csv
    from data.uci import locate_bank_full

    frame = read_source_csv(locate_bank_full(cache, download=download))  # every column as text
    for column in frame.columns:
        numbers = pd.to_numeric(frame[column], errors="coerce")
        if numbers.notna().all():
            frame[column] = numbers
    bank, _ = (p.columns for p in bank_marketing_spec(1).parties)
    categorical = [c for c in frame.columns if not pd.api.types.is_numeric_dtype(frame[c]) and c != "y"]
    return BenchTable("bank-full", "binary", frame, "y", list(bank), categorical, repeats=3)


def credit(rows: int = 20_000, seed: int = 0) -> BenchTable:
    """A generated credit-default table: integer-coded categoricals (sex, education, repayment status), skewed
    amounts, a partner's salary with 8% missing, thresholds and an interaction trees find easily."""
    rng = np.random.default_rng(seed)
    sex, education, status = rng.integers(1, 3, rows), rng.integers(0, 7, rows), rng.integers(-2, 9, rows)
    age = rng.integers(21, 71, rows)
    limit = rng.lognormal(11, 0.6, rows).round(0)
    utilisation = rng.beta(2, 5, rows).round(4)
    salary = rng.lognormal(8, 0.4, rows).round(2)
    visits, channel = rng.poisson(3, rows), rng.choice(["web", "branch", "phone"], rows)
    logit = (1.4 * (status >= 2) + 0.6 * (status == -2) + 0.9 * np.isin(education, (1, 5)) - 0.5 * (sex == 2)
             + 4.0 * np.clip(utilisation - 0.35, 0, None) - 1.2 * np.log(salary / 3000) * (channel == "web")
             + 0.35 * np.minimum(visits, 6) - 0.02 * np.abs(age - 40) - 0.4 * np.log(limit / 60_000)
             + 1.5 * ((status >= 2) & (utilisation > 0.45)) + 0.8 * ((limit > 150_000) & (sex == 1)) - 2.8)
    frame = pd.DataFrame({
        "sex": sex, "education": education, "status": status, "age": age, "limit": limit,
        "utilisation": utilisation, "salary": salary, "visits": visits, "channel": channel,
        "defaulted": np.where(rng.random(rows) < 1 / (1 + np.exp(-logit)), "yes", "no"),
    })
    frame.loc[rng.random(rows) < 0.08, "salary"] = np.nan
    return BenchTable("credit", "binary", frame, "defaulted", ["sex", "education", "status", "age", "limit"],
                      ["sex", "education", "status", "channel"], repeats=3)


def diabetes() -> BenchTable:
    """scikit-learn's diabetes progression (442 patients, bundled: no download): the bank holds age, sex, BMI and
    blood pressure, the partner the six blood serum measurements."""
    from sklearn.datasets import load_diabetes

    frame = load_diabetes(as_frame=True, scaled=False).frame
    return BenchTable("diabetes", "regression", frame, "target", ["age", "sex", "bmi", "bp"], ["sex"],
                      repeats=5)


def wine() -> BenchTable:
    """scikit-learn's wine recognition (178 wines, 3 cultivars, bundled): six columns each side."""
    from sklearn.datasets import load_wine

    frame = load_wine(as_frame=True).frame
    frame["target"] = frame["target"].map({0: "a", 1: "b", 2: "c"})
    return BenchTable("wine", "multiclass", frame, "target", list(frame.columns[:6]), [], repeats=5)


TABLES: dict[str, Callable[..., BenchTable]] = {"bank-full": bank_full, "credit": credit, "diabetes": diabetes,
                                                "wine": wine}


def _split(n: int, seed: int, val: float = 0.1, test: float = 0.1) -> dict[str, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_test, n_val = max(1, round(test * n)), max(1, round(val * n))
    return {"test": np.sort(order[:n_test]), "val": np.sort(order[n_test : n_test + n_val]),
            "train": np.sort(order[n_test + n_val :])}


def _metric(kind: TaskKind) -> str:
    return "r2" if kind == "regression" else "roc_auc"


def _score(task: Task, y: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import r2_score, roc_auc_score

    if task.kind == "regression":
        return float(r2_score(y, scores))
    if task.kind == "multiclass":
        return float(roc_auc_score(y, scores, multi_class="ovr", labels=list(range(task.output_dim))))
    return float(roc_auc_score(y, scores))


def _encoded(table: BenchTable, columns: list[str], train: np.ndarray, bins: int) -> tuple[np.ndarray, Any]:
    encoder = TabularEncoder(table.schema(columns), bins=bins).fit(table.frame[columns].iloc[train])
    return encoder.transform(table.frame[columns]), encoder.layout


def _split_model(table: BenchTable, task: Task, y: np.ndarray, splits: dict[str, np.ndarray], setting: str,
                 config: TrainingConfig) -> tuple[float, float]:
    """The split model with ``setting`` (as its unsplit twin): its best validation objective and test scores."""
    bottom = BottomConfig(**SETTINGS[setting])
    features, layouts = {}, {}
    for party, columns in (("bank", table.bank), ("partner", table.partner)):
        features[party], layouts[party] = _encoded(table, columns, splits["train"], bottom.encoder_bins)
    model = UnsplitModel(features, {"bank": bottom, "partner": bottom}, config.top, config.aggregation, task, layouts)
    schedule = config.model_dump() | {"batch_size": config.batch_size or default_batch_size(len(splits["train"]))}
    book = EpochBook(config.patience, task.objective)
    scores = fit_unsplit(model, y, splits, schedule, config.seed, book)
    return float(book.best_score), _score(task, y[splits["test"]], scores)


def _centralised(table: BenchTable, task: Task, y: np.ndarray, splits: dict[str, np.ndarray], seed: int
                 ) -> dict[str, float]:
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
    from sklearn.linear_model import LogisticRegression, Ridge

    train, test = splits["train"], splits["test"]
    bank, _ = _encoded(table, table.bank, train, 0)
    everything = np.hstack([bank, _encoded(table, table.partner, train, 0)[0]])
    if task.kind == "regression":
        models = {"HistGradientBoosting": HistGradientBoostingRegressor(random_state=seed), "linear": Ridge()}
    else:
        models = {"HistGradientBoosting": HistGradientBoostingClassifier(random_state=seed),
                  "linear": LogisticRegression(max_iter=5000)}
    out = {}
    for name, model in models.items():
        for columns, x in (("centralised", everything), ("bank only", bank)):
            if columns == "bank only" and name == "linear":
                continue
            model.fit(x[train], y[train])
            if task.kind == "regression":
                scores = model.predict(x[test])
            else:  # every class's probability, in the task's order
                proba = np.zeros((len(test), task.output_dim if task.kind == "multiclass" else 2))
                proba[:, model.classes_.astype(int)] = model.predict_proba(x[test])
                scores = proba[:, 1] if task.kind == "binary" else proba
            out[f"{columns}: {'logistic' if name == 'linear' and task.kind != 'regression' else name}"
                .replace("centralised: linear", "centralised: ridge")] = _score(task, y[test], scores)
    return out


def compare(table: BenchTable, settings: list[str], config: TrainingConfig,
            progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every model on ``table``'s splits: per model the test metric's mean (and each split's)."""
    task = Task(table.kind).fit(table.frame[table.label].astype(str) if table.kind != "regression"
                                else table.frame[table.label])
    y_all = task.targets(table.frame[table.label].astype(str) if table.kind != "regression"
                         else table.frame[table.label])
    test_scores: dict[str, list[float]] = {}
    validation: dict[str, list[float]] = {}
    for repeat in range(table.repeats):
        splits = _split(len(table.frame), config.seed + repeat,
                        *((0.1, 0.1) if len(table.frame) > 5000 else (0.2, 0.2)))
        if task.kind == "regression":
            task.fit_target_scale(y_all[splits["train"]])
        y = y_all.numpy()
        for name, score in _centralised(table, task, y, splits, config.seed).items():
            test_scores.setdefault(name, []).append(score)
        for setting in settings:
            started = time.perf_counter()
            best_val, score = _split_model(table, task, y, splits, setting, config)
            validation.setdefault(setting, []).append(best_val)
            test_scores.setdefault(f"split: {setting}", []).append(score)
            progress(f"{table.name} split {repeat + 1}/{table.repeats} {setting}: test {_metric(table.kind)} "
                     f"{score:.4f} ({time.perf_counter() - started:.1f} s)")
    better = min if task.objective[1] == "min" else max
    chosen = better(validation, key=lambda s: statistics.fmean(validation[s]))
    return {"table": table.name, "task": table.kind, "metric": _metric(table.kind), "rows": len(table.frame),
            "repeats": table.repeats, "bank_columns": table.bank, "partner_columns": table.partner,
            "chosen_on_validation": chosen,
            # early stopping's objective on the validation rows, not the test metric: lower is better for a loss
            "validation_objective": {"name": task.objective[0], "better": task.objective[1]},
            "validation": {s: statistics.fmean(v) for s, v in validation.items()},
            "test": {name: statistics.fmean(v) for name, v in test_scores.items()},
            "test_each_split": test_scores}


def step_costs(table: BenchTable, settings: list[str], *, batch: int = 1024, steps: int = 60,
               seed: int = 0) -> dict[str, dict[str, float]]:
    """Milliseconds per training step of each party's bottom with each setting, timed round-robin (one step of
    each setting in turn, so a noisy machine slows all alike): the median, and its ratio to the default's."""
    from parties.learning.bottom import BottomTrainer

    train = _split(len(table.frame), seed)["train"]
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, float]] = {}
    for party, columns in (("bank", table.bank), ("partner", table.partner)):
        trainers = {}
        for setting in settings:
            config = BottomConfig(**SETTINGS[setting])
            encoder = TabularEncoder(table.schema(columns), bins=config.encoder_bins).fit(table.frame[columns].iloc[train])
            rows, _ = encoder.encode_rows(table.frame[columns], train)
            trainers[setting] = BottomTrainer(rows, config)
        batches = [torch.from_numpy(rng.choice(len(train), batch, replace=False)) for _ in range(steps + 1)]
        grad = torch.from_numpy(rng.normal(0, 1e-3, (batch, BottomConfig().cut_width)).astype(np.float32))
        times: dict[str, list[float]] = {s: [] for s in settings}
        for step, rows in enumerate(batches):
            for setting, trainer in trainers.items():
                started = time.perf_counter()
                trainer.step(step, grad if step else None, rows)
                if step:  # the first step only embeds
                    times[setting].append(time.perf_counter() - started)
        base = statistics.median(times[settings[0]])
        out[party] = {s: 1e3 * statistics.median(t) for s, t in times.items()} | {
            f"{s} / {settings[0]}": statistics.median(t) / base for s, t in times.items() if s != settings[0]}
    return out


def run(out: Path, tables: list[str], settings: list[str], config: TrainingConfig, *, cache: Path | None = None,
        download: bool = True, costs: bool = True, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The comparison on every table named, and the step costs on bank-full; written to ``out``."""
    torch.set_num_threads(1)  # as every party computes by default: the split model's own arithmetic
    results: dict[str, Any] = {"settings": {s: SETTINGS[s] for s in settings},
                               "training": {"epochs": config.epochs, "patience": config.patience, "seed": config.seed},
                               "tables": []}
    loaded = {}
    for name in tables:
        loaded[name] = TABLES[name](cache, download) if name == "bank-full" else TABLES[name]()
        results["tables"].append(compare(loaded[name], settings, config, progress))
    if costs and "bank-full" in loaded:
        progress("timing one training step of each bottom on bank-full, the settings side by side")
        results["step_ms_bank_full"] = step_costs(loaded["bank-full"], settings)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = [{"table": t["table"], "model": model, t["metric"]: score}
            for t in results["tables"] for model, score in t["test"].items()]
    pd.DataFrame(rows).to_csv(out / "tables.csv", index=False)
    return results


def report(results: dict[str, Any]) -> str:
    """The comparison as text: per table, every model's test figure, the chosen setting marked."""
    training = results.get("training", {})
    lines = [f"at most {training.get('epochs')} epochs (patience {training.get('patience')}), seed "
             f"{training.get('seed')}; settings: " + ", ".join(results["settings"])]
    for t in results["tables"]:
        hgb = t["test"]["centralised: HistGradientBoosting"]
        chosen = f"split: {t['chosen_on_validation']}"
        lines.append(f"\n{t['table']} ({t['rows']:,} rows, {t['task']}; test {t['metric']}"
                     + (f", mean of {t['repeats']} splits" if t["repeats"] > 1 else "") + ")")
        for model, score in t["test"].items():
            mark = "  <- best built-in on validation" if model == chosen else ""
            lines.append(f"  {model:<40} {score:.4f}  ({score - hgb:+.4f} vs HGB){mark}")
    costs = results.get("step_ms_bank_full")
    if costs:
        lines.append("\nbank-full, one training step of a bottom (1024 rows; median ms, ratio to the default):")
        for party, figures in costs.items():
            shown = [f"{s} {ms:.2f}" + (f" ({figures[f'{s} / default']:.2f}x)" if f"{s} / default" in figures else "")
                     for s, ms in figures.items() if "/" not in s]
            lines.append(f"  {party}: " + ", ".join(shown))
    return "\n".join(lines)
