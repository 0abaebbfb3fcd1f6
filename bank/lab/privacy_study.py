"""What each defense costs and buys, measured. SIMULATION ONLY: it reads every party's file.

For each defense setting it trains the bank-marketing model (bank + one
partner, in process: the same parties and coordinator as the services, without
the network) with the audit on, and reports test ROC-AUC next to the leak AUCs
of the label attacks (norm, direction, cross-epoch), the embedding-inversion R²
advantage, and the partner's ε. The hijack monitor is measured apart: repeated
honest and hijacking runs give its detection and false-alarm rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from bank.config import TrainingConfig
from bank.in_process_party import InProcessParty
from bank.lab.audit import inversion_rows, leakage_rows
from bank.task import Task
from bank.trainer import Coordinator
from data.prepare import prepare_bank_marketing
from parties.errors import HijackSuspected
from parties.learning.embedding_dp import PrivacyConfig
from parties.learning.hijack_monitor import MonitorConfig
from parties.learning.model import BottomConfig
from parties.tables.encoding import TabularEncoder
from parties.tables.table import AlignedRows, PartyTable, load_party_table

__all__ = ["Setting", "default_settings", "hijack_rates", "run_study", "tradeoff_figure"]


@dataclass(frozen=True)
class Setting:
    name: str
    training: dict[str, Any] = field(default_factory=dict)
    privacy: PrivacyConfig | None = None


def default_settings() -> list[Setting]:
    return [
        Setting("no defense"),
        Setting("embedding DP (C=1, σ=0.5)", privacy=PrivacyConfig(clip=1.0, noise=0.5)),
        Setting("embedding DP (C=1, σ=2)", privacy=PrivacyConfig(clip=1.0, noise=2.0)),
        Setting("label DP (RR, ε=3)", {"label_dp_epsilon": 3.0}),
        Setting("label DP (RR, ε=1)", {"label_dp_epsilon": 1.0}),
        Setting("max-norm gradients", {"gradient_defense": "max_norm"}),
        Setting("isotropic gradient noise ×1", {"gradient_defense": "isotropic", "gradient_noise": 1.0}),
        Setting("isotropic gradient noise ×4", {"gradient_defense": "isotropic", "gradient_noise": 4.0}),
    ]


class _Federation:
    """Bank and partner tables aligned by a plain ID join (what the simulation may do; PSI does it for real)."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.bank = load_party_table(paths["bank"], "customer_id", "y")
        self.partner = load_party_table(paths["partner"], "customer_id")
        where = {i: k for k, i in enumerate(self.partner.ids)}
        rows = np.array([k for k, i in enumerate(self.bank.ids) if i in where])
        self.alignments = {"bank": AlignedRows("sim", rows),
                           "partner": AlignedRows("sim", np.array([where[self.bank.ids[k]] for k in rows]))}
        labels = self.bank.labels.iloc[rows]
        self.task = Task().fit(labels)
        self.targets = self.task.targets(labels)

    def party(self, name: str, table: PartyTable, config: BottomConfig, **kwargs: Any) -> InProcessParty:
        return InProcessParty(name, table, lambda: self.alignments[name], config, **kwargs)

    def coordinator(self, training: TrainingConfig, privacy: PrivacyConfig | None = None,
                    monitor: MonitorConfig | None = None) -> Coordinator:
        own = self.party("bank", self.bank, training.bank_bottom)
        partner = self.party("partner", self.partner, BottomConfig(seed=1), privacy=privacy, monitor=monitor)
        return Coordinator(training, self.task, self.targets, [own, partner], alignment_id="sim")


def _inversion_advantage(fed: _Federation, coordinator: Coordinator, record: dict[str, torch.Tensor]) -> float:
    """Mean R² advantage over the partner's features; encoders fitted on the training rows, as the parties do."""
    positions = record["rows"].numpy()
    features, names = {}, []
    for name, table in (("bank", fed.bank), ("partner", fed.partner)):
        frame = table.features.iloc[fed.alignments[name].rows]
        encoder = TabularEncoder(table.schema).fit(frame.iloc[coordinator.split.train])
        features[name] = encoder.transform(frame.iloc[positions])
        names = encoder.feature_names()
    rows = inversion_rows("partner", record["embedding"].numpy(), features["partner"], features["bank"], names)
    return float(np.mean([r["advantage"] for r in rows]))


def run_study(
    out: Path, *, rows: int | None = 8000, epochs: int = 8, settings: list[Setting] | None = None,
    cache: Path | None = None, download: bool = True, progress: Any = None,
) -> pd.DataFrame:
    """Train once per setting; write ``privacy_study.csv`` and ``privacy_tradeoff.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    fed = _Federation(prepare_bank_marketing(out / "data", rows=rows, cache=cache, download=download))
    results = []
    for setting in settings or default_settings():
        if progress is not None:
            progress(setting.name)
        training = TrainingConfig(epochs=epochs, audit=True, **setting.training)
        coordinator = fed.coordinator(training, setting.privacy)
        outcome = coordinator.run()
        assert outcome.audit is not None
        tensors = outcome.audit.tensors()
        grads = {k: v.numpy() for k, v in tensors["gradients-partner"].items()}
        leakage = leakage_rows("partner", grads, fed.targets.numpy())
        per_epoch = [r for r in leakage if isinstance(r["epoch"], int)]
        pooled = leakage[-1]
        results.append({
            "setting": setting.name,
            "test_roc_auc": outcome.test_metrics["roc_auc"],
            "norm_leak_auc": float(np.mean([r["norm_leak_auc"] for r in per_epoch])),
            "direction_leak_auc": float(np.mean([r["direction_leak_auc"] for r in per_epoch])),
            "cross_epoch_norm_leak_auc": pooled["norm_leak_auc"],
            "cross_epoch_direction_leak_auc": pooled["direction_leak_auc"],
            "inversion_r2_advantage": _inversion_advantage(fed, coordinator, tensors["embeddings-partner"]),
            # ε after the last epoch's training and validation releases (δ = 1e-5); inf: no embedding DP.
            "partner_epsilon": outcome.history[-1].get("epsilon_partner", math.inf),
            "label_dp_epsilon": setting.training.get("label_dp_epsilon", math.inf),
        })
    table = pd.DataFrame(results)
    table.to_csv(out / "privacy_study.csv", index=False)
    fig = tradeoff_figure(table)
    fig.savefig(out / "privacy_tradeoff.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return table


def hijack_rates(out: Path, *, runs: int = 5, rows: int | None = 3000, epochs: int = 2, probe_every: int = 5,
                 cache: Path | None = None, download: bool = True) -> pd.DataFrame:
    """Detection and false-alarm rates of the hijack monitor over repeated honest and hijacking runs."""
    fed = _Federation(prepare_bank_marketing(out / "data-hijack", rows=rows, cache=cache, download=download))
    outcomes = []
    for seed in range(runs):
        for malicious in (False, True):
            training = TrainingConfig(epochs=epochs, batch_size=128, seed=seed)
            coordinator = fed.coordinator(training, monitor=MonitorConfig(probe_every=probe_every, seed=seed))
            if malicious:
                w = torch.randn(BottomConfig().cut_width, 1, generator=torch.Generator().manual_seed(seed))
                coordinator._loss = lambda top, leaves, rows, w=w: torch.tanh(leaves[1] @ w).mean() + 0 * leaves[0].sum()  # type: ignore[method-assign]
            try:
                coordinator.run()
                alarmed = False
            except HijackSuspected:
                alarmed = True
            outcomes.append({"seed": seed, "bank": "hijacking" if malicious else "honest", "alarm": alarmed})
    table = pd.DataFrame(outcomes)
    rates = pd.DataFrame([
        {"measure": "detection rate (hijacking runs alarmed)", "value": table[table.bank == "hijacking"].alarm.mean()},
        {"measure": "false-alarm rate (honest runs alarmed)", "value": table[table.bank == "honest"].alarm.mean()},
        {"measure": "runs of each kind", "value": runs},
    ])
    rates.to_csv(out / "hijack_monitor.csv", index=False)
    return rates


def tradeoff_figure(table: pd.DataFrame) -> plt.Figure:
    """Test ROC-AUC against what leaks, one numbered point per defense setting: labels (left), features (right)."""
    leak = table[["norm_leak_auc", "direction_leak_auc", "cross_epoch_norm_leak_auc",
                  "cross_epoch_direction_leak_auc"]].max(axis=1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, x, label, floor in (
        (left, leak, "label leak AUC, strongest attack (0.5: nothing leaks)", 0.5),
        (right, table["inversion_r2_advantage"], "embedding-inversion R² advantage (0: nothing leaks)", 0.0),
    ):
        ax.scatter(x, table["test_roc_auc"], s=70, color="tab:blue")
        for i, (xi, yi) in enumerate(zip(x, table["test_roc_auc"]), start=1):
            ax.annotate(str(i), (xi, yi), textcoords="offset points", xytext=(6, 3), fontsize=9)
        ax.axvline(floor, color="grey", linestyle=":")
        ax.set(xlabel=label)
    left.set(ylabel="test ROC-AUC")
    key = "\n".join(f"{i}. {name}" for i, name in enumerate(table["setting"], start=1))
    right.text(1.03, 0.5, key, transform=right.transAxes, va="center", fontsize=9)
    fig.suptitle("what each defense costs (test ROC-AUC) and buys (less leakage)")
    fig.tight_layout()
    return fig
