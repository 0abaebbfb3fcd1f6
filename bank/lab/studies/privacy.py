"""What each defense costs and buys, measured. SIMULATION ONLY: it reads every party's file.

For each defense setting it trains the bank-marketing model (bank + one
partner, in process: the same parties and coordinator as the services, without
the network) with the audit on, and reports test ROC-AUC next to the leak AUCs
of the label attacks (norm, direction, cross-epoch norm and direction, model
completion) and the strongest of them, the embedding-inversion R² advantage,
and the partner's ε. Model completion is set beside its from-scratch baseline:
the partner's own columns predict the label, so what the collaboration gave
away is the difference (``model_completion_advantage``), not the AUC itself.
``measure`` is one configuration's measurement, for other sweeps to call. The
hijack monitor has its own study (``bank.lab.studies.hijack``).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from bank.config import MAX_AUTO_BATCH, TrainingConfig
from bank.vertical.in_process_party import InProcessParty
from bank.lab.report.audit import completion_leakage, inversion_rows, label_free_leakage, leakage_rows, load_bottom
from bank.task import Task
from bank.vertical.coordinator import Coordinator
from data.prepare import prepare_bank_marketing
from parties.learning.embedding_noise import PrivacyConfig
from parties.learning.hijack_monitor import MonitorConfig
from parties.learning.model import BottomConfig
from parties.tables.encoding import TabularEncoder
from parties.tables.table import AlignedRows, PartyTable, load_party_table

__all__ = [
    "GRADIENT_ATTACKS", "LABEL_ATTACKS", "PARTNER_BOTTOM", "Federation", "Setting", "default_settings",
    "leak", "measure", "run_study", "tradeoff_figure",
]

#: The partner's bottom in the study unless a sweep gives another.
PARTNER_BOTTOM = BottomConfig(seed=1)

#: The attacks on the gradients a partner receives (what a gradient defense can act on): the norm and direction
#: attacks per epoch and on row means, and those that need no known positive and no help from the code (the
#: off-direction energy, a mixture model and k-means on per-row gradient features, a logistic regression on them
#: with 10 and 50 known labels; ``bank.lab.report.audit.label_free_leakage``).
GRADIENT_ATTACKS = ("norm_leak_auc", "direction_leak_auc", "cross_epoch_norm_leak_auc",
                    "cross_epoch_direction_leak_auc", "off_direction_leak_auc", "projection_leak_auc",
                    "row_mean_pca_leak_auc", "mixture_leak_auc", "kmeans_leak_auc", "few_label_10_leak_auc",
                    "few_label_50_leak_auc")

#: Every label attack's leak-AUC column; ``strongest_label_leak_auc`` is their maximum.
LABEL_ATTACKS = (*GRADIENT_ATTACKS, "model_completion_leak_auc")


@dataclass(frozen=True)
class Setting:
    """One point of the study: the bank's ``training`` overrides and the partner's ``privacy`` settings.

    ``defense`` names the family the point belongs to (one frontier per family) and ``knob`` its knob's value
    (ε, σ, s, α, the noise scale; none for a defense without one).
    """

    name: str
    training: dict[str, Any] = field(default_factory=dict)
    privacy: PrivacyConfig | None = None
    defense: str = "no defense"
    knob: float | None = None


def default_settings() -> list[Setting]:
    """Every defense, each swept over its knob; and the combinations the single defenses point to."""
    matched = {"gradient_defense": "matched"}
    persistent = {"marvell_persistence": 1.0}
    return [
        Setting("no defense"),
        *(Setting(f"label DP (RR, ε={e:g})", {"label_dp_epsilon": e}, defense="label DP", knob=e) for e in (3.0, 1.0, 0.5)),
        Setting("max-norm gradients", {"gradient_defense": "max_norm"}, defense="max-norm"),
        *(Setting(f"isotropic gradient noise ×{k:g}", {"gradient_defense": "isotropic", "gradient_noise": k},
                  defense="isotropic noise", knob=k) for k in (1.0, 4.0)),
        # The paper's noise model (each class spread alike in every direction), for comparison: label-free
        # attacks read it (the class it gives off-direction noise stands out).
        *(Setting(f"Marvell (s={k:g})", {"gradient_defense": "marvell", "marvell_power": k}, defense="Marvell", knob=k)
          for k in (1.0, 4.0)),
        *(Setting(f"Marvell persistent (s={k:g}, ρ=1)", {"gradient_defense": "marvell", "marvell_power": k, **persistent},
                  defense="Marvell, persistent", knob=k) for k in (1.0, 4.0)),
        # Covariance-matched noise: each class gets the other's covariance, both the same noise along the mean
        # difference; persistent: each row's draw is the same at every step.
        *(Setting(f"matched (s={k:g})", {**matched, "marvell_power": k}, defense="matched", knob=k)
          for k in (0.25, 1.0, 4.0, 16.0)),
        *(Setting(f"matched persistent (s={k:g}, ρ=1)", {**matched, "marvell_power": k, **persistent},
                  defense="matched, persistent", knob=k) for k in (0.25, 1.0, 4.0, 16.0)),
        *(Setting(f"embedding noise (C=1, σ={k:g})", privacy=PrivacyConfig(clip=1.0, noise=k), defense="embedding noise",
                  knob=k) for k in (0.5, 2.0)),
        # Past α ≈ 0.1 NoPeek falls off a cliff (it silences the bottom's ReLU outputs): the sweep stays below.
        *(Setting(f"NoPeek (α={k:g})", privacy=PrivacyConfig(nopeek=k), defense="NoPeek", knob=k)
          for k in (0.01, 0.03, 0.05, 0.1)),
        Setting("matched persistent (s=1) + label DP (ε=3)", {**matched, "marvell_power": 1.0, **persistent,
                                                              "label_dp_epsilon": 3.0}, defense="combined"),
        Setting("matched persistent (s=4) + label DP (ε=1)", {**matched, "marvell_power": 4.0, **persistent,
                                                              "label_dp_epsilon": 1.0}, defense="combined"),
        Setting("NoPeek (α=0.05) + matched persistent (s=1)", {**matched, "marvell_power": 1.0, **persistent},
                PrivacyConfig(nopeek=0.05), defense="combined"),
        Setting("NoPeek (α=0.05) + embedding noise (C=4, σ=0.4)", privacy=PrivacyConfig(nopeek=0.05, clip=4.0, noise=0.4),
                defense="combined"),
    ]


class Federation:
    """Bank and partner tables aligned by a plain ID join (what the simulation may do; PSI does it for real).

    ``paths``: the party files ``data.prepare.prepare_bank_marketing`` wrote.
    """

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
                    monitor: MonitorConfig | None = None, partner_bottom: BottomConfig = PARTNER_BOTTOM,
                    model_dir: Path | None = None) -> Coordinator:
        """``model_dir``: where the partner writes its model files when training ends (default: nowhere)."""
        own = self.party("bank", self.bank, training.bank_bottom)
        files = None if model_dir is None else (lambda session: model_dir / session)
        partner = self.party("partner", self.partner, partner_bottom, privacy=privacy, monitor=monitor,
                             model_dir=files)
        return Coordinator(training, self.task, self.targets, [own, partner], alignment_id="sim")


def _inversion_advantage(fed: Federation, coordinator: Coordinator, record: dict[str, torch.Tensor],
                         seed: int) -> dict[str, Any]:
    """The R² advantage over the partner's features, their mean and their maximum (a mean can hide one feature
    decoded almost exactly); encoders fitted on the training rows, as the parties do."""
    positions = record["rows"].numpy()
    features, names = {}, []
    for name, table in (("bank", fed.bank), ("partner", fed.partner)):
        frame = table.features.iloc[fed.alignments[name].rows]
        encoder = TabularEncoder(table.schema).fit(frame.iloc[coordinator.split.train])
        features[name] = encoder.transform(frame.iloc[positions])
        names = encoder.feature_names()
    rows = inversion_rows("partner", record["embedding"].numpy(), features["partner"], features["bank"], names, seed)
    worst = max(rows, key=lambda r: r["advantage"])
    return {"inversion_r2_advantage": float(np.mean([r["advantage"] for r in rows])),
            "inversion_r2_max": float(worst["advantage"]), "inversion_worst_feature": worst["feature"]}


def leak(auc: float) -> float:
    """What an attack's leak AUC says leaks: a reversed ranking (AUC below 0.5) tells the classes apart as well as
    the ranking it reverses, so the strongest-attack columns count max(AUC, 1 − AUC)."""
    return max(auc, 1.0 - auc)


def measure(
    fed: Federation, training: TrainingConfig, privacy: PrivacyConfig | None = None,
    partner_bottom: BottomConfig | None = None, *, known_labels: int = 50, draws: int = 5, seed: int = 0,
) -> dict[str, Any]:
    """Train one configuration with the audit on and measure what it costs and what leaks.

    ``training``: the bank's settings (its defenses, top, schedule, seed of the split and batches);
    ``privacy``: the partner's embedding DP; ``partner_bottom``: the partner's bottom (default
    ``PARTNER_BOTTOM``). ``known_labels``: how many training rows' labels the partner has learned, for
    model completion, drawn ``draws`` times (seeds ``seed``, ``seed + 1``, ...); ``seed`` also seeds
    the inversion probe. Returns test ROC-AUC, every label attack's leak AUC (``LABEL_ATTACKS``; the
    per-epoch ones averaged over epochs) and the strongest, model completion's from-scratch baseline
    and advantage (``bank.lab.report.audit.completion_leakage``), the inversion R² advantage, and ε.
    """
    bottom_config = partner_bottom or PARTNER_BOTTOM
    with tempfile.TemporaryDirectory(prefix="cutlayer-study-") as folder:
        audited = training.model_copy(update={"audit": True})
        coordinator = fed.coordinator(audited, privacy, partner_bottom=bottom_config, model_dir=Path(folder))
        outcome = coordinator.run()
        bottom = load_bottom(Path(folder) / outcome.session_id)
    assert outcome.audit is not None
    tensors = outcome.audit.tensors()
    targets = fed.targets.numpy()
    grads = {k: v.numpy() for k, v in tensors["gradients-partner"].items()}
    leakage = leakage_rows("partner", grads, targets)
    per_epoch = [r for r in leakage if isinstance(r["epoch"], int)]
    pooled = leakage[-1]
    # The partner's columns for its training rows, encoded by its own encoder (fitted on them).
    train = coordinator.split.train
    frame = fed.partner.features.iloc[fed.alignments["partner"].rows[train]]
    completion = completion_leakage(bottom.model, bottom.config, bottom.encoder.transform(frame), targets[train],
                                    known=known_labels, draws=draws, seed=seed, layout=bottom.encoder.layout)
    row: dict[str, Any] = {
        "test_roc_auc": outcome.test_metrics["roc_auc"],
        "norm_leak_auc": float(np.mean([r["norm_leak_auc"] for r in per_epoch])),
        "direction_leak_auc": float(np.mean([r["direction_leak_auc"] for r in per_epoch])),
        "cross_epoch_norm_leak_auc": pooled["norm_leak_auc"],
        "cross_epoch_direction_leak_auc": pooled["direction_leak_auc"],
        **label_free_leakage(grads, targets, seed=seed),
        **completion,
    }
    strongest = max(LABEL_ATTACKS, key=lambda c: leak(row[c]))
    row |= {
        "strongest_label_leak_auc": leak(row[strongest]),
        "strongest_label_attack": strongest.removesuffix("_leak_auc"),
        # What the gradients alone give away: the attacks a gradient defense can act on.
        "strongest_gradient_leak_auc": max(leak(row[c]) for c in GRADIENT_ATTACKS),
        **_inversion_advantage(fed, coordinator, tensors["embeddings-partner"], seed),
        "label_dp_epsilon": training.label_dp_epsilon if training.label_dp_epsilon is not None else math.inf,
    }
    return row


def run_study(
    out: Path, *, rows: int | None = 8000, epochs: int = 8, settings: list[Setting] | None = None,
    cache: Path | None = None, download: bool = True, progress: Any = None, known_labels: int = 50,
) -> pd.DataFrame:
    """Train once per setting; write ``privacy_study.csv`` and ``privacy_tradeoff.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    fed = Federation(prepare_bank_marketing(out / "data", rows=rows, cache=cache, download=download))
    results = []
    for setting in settings or default_settings():
        if progress is not None:
            progress(setting.name)
        # The batch the study's figures were measured at, whatever the slice (the product's adapts to the table).
        training = TrainingConfig(**{"epochs": epochs, "batch_size": MAX_AUTO_BATCH, **setting.training})
        measured = measure(fed, training, setting.privacy, known_labels=known_labels)
        results.append({"setting": setting.name, "defense": setting.defense, "knob": setting.knob, **measured})
    table = pd.DataFrame(results)
    table.to_csv(out / "privacy_study.csv", index=False)
    fig = tradeoff_figure(table)
    fig.savefig(out / "privacy_tradeoff.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return table


#: The bars the study is judged by: (leak, AUC cost) corners a good setting lies inside.
LABEL_BAR = (0.60, 0.010)
INVERSION_BAR = (0.10, 0.02)


def tradeoff_figure(table: pd.DataFrame) -> plt.Figure:
    """One frontier per defense: test-AUC cost against what still leaks, each family's points joined in order
    of its knob and labelled with it.

    Left, labels: the strongest label attack of all (model completion included: its floor is what the
    partner's own columns and known labels give without any collaboration, marked). Middle: the strongest
    attack on the gradients alone (what a gradient defense acts on). Right, features: the inversion R²
    advantage. The shaded corner is the study's bar.
    """
    baseline = table.loc[table["defense"] == "no defense", "test_roc_auc"]
    base = float(baseline.iloc[0]) if len(baseline) else float(table["test_roc_auc"].max())
    cost = base - table["test_roc_auc"]
    panels = (
        ("strongest_label_leak_auc", "label leak AUC, strongest attack incl. model completion", LABEL_BAR),
        ("strongest_gradient_leak_auc", "label leak AUC, strongest attack on the gradients", LABEL_BAR),
        ("inversion_r2_advantage", "embedding-inversion R² advantage (0: nothing leaks)", INVERSION_BAR),
    )
    # The y axis stops a little above the bars' costs: a setting that costs more (embedding DP with a finite ε) is
    # drawn on the top edge with its cost written beside it, so it does not squash every other frontier.
    ymin = min(float(cost.min()), 0.0)
    ymax = max(min(float(cost.max()), 0.05), 0.03)
    pad = 0.06 * (ymax - ymin)
    shown = cost.clip(upper=ymax)
    combined = {name: f"C{i}" for i, name in enumerate(table.loc[table["defense"] == "combined", "setting"], start=1)}
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.6), sharey=True)
    families = list(dict.fromkeys(table["defense"]))
    for ax, (column, label, (leak_bar, cost_bar)) in zip(axes, panels):
        floor = 0.0 if column == "inversion_r2_advantage" else 0.5
        ax.fill_between([min(floor, table[column].min()) - 0.02, leak_bar], -1, cost_bar, color="tab:green",
                        alpha=0.12, label="the bar")
        for k, family in enumerate(families):
            part = table[table["defense"] == family]
            part = part.sort_values("knob") if part["knob"].notna().all() else part
            x, y = part[column].to_numpy(dtype=float), shown[part.index].to_numpy()
            ax.plot(x, y, marker="o" if family != "no defense" else "*", markersize=7 if family != "no defense" else 16,
                    color=f"C{k}", label=family, linestyle="-" if len(part) > 1 and family != "combined" else "none")
            for xi, yi, knob, name, true_cost in zip(x, y, part["knob"], part["setting"], cost[part.index]):
                text = combined.get(name) or (f"{knob:g}" if pd.notna(knob) else "")
                if true_cost > ymax:
                    text += f" (cost {true_cost:.2f} ↑)"
                if text:
                    ax.annotate(text, (xi, yi), textcoords="offset points", xytext=(5, 3), fontsize=7)
        ax.axvline(floor, color="grey", linestyle=":")
        ax.set(xlabel=label)
    if "from_scratch_leak_auc" in table:
        known = int(table["known_labels"].iloc[0])
        axes[0].axvline(float(table["from_scratch_leak_auc"].mean()), color="black", linestyle="--", linewidth=1,
                        label=f"own columns + {known} labels, no collaboration")
    axes[0].set(ylabel="test ROC-AUC cost against no defense (lower is better)", ylim=(ymin - pad, ymax + pad))
    axes[0].legend(fontsize=7, loc="upper left")
    if combined:
        fig.text(0.01, -0.02, "   ".join(f"{c}: {name}" for name, c in combined.items()), fontsize=8)
    fig.suptitle("what each defense costs and buys, over its knob (ε, σ, s, α, scale)")
    fig.tight_layout()
    return fig
