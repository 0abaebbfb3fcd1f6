"""Where to cut: what each cut-layer position costs and exposes, measured. SIMULATION ONLY.

The cut decides three things at once: how many bytes cross the network each
step (the embedding's width, forward and back), how much of the model each
party computes (the partner's bottom against the bank's top), and how much a
curious party can learn from what crosses (the partner's embedding is what the
bank could invert; its gradient is what the partner reads labels from). This
study sweeps the cut along three axes, one point per configuration, each
trained and audited like a privacy-study setting (``bank.lab.studies.privacy``):

* the **embedding width** (the partner's ``cut_width``);
* the **depth of the partner's bottom** (its hidden layers);
* **where the partner's model stops**: layers moved between the partner's
  bottom and the bank's top at a fixed total depth.

Per point it records test ROC-AUC; bytes per training step and per epoch (the
exact wire bodies of a step's request and answer, fp32); the partner's and the
bank's compute per step (medians of timed steps of the same models, apart from
training so that training stays deterministic); the leak AUC of every label
attack and the strongest; and the embedding-inversion R² advantage. It writes
``cut_study.csv`` and ``cut_frontier.png`` (test AUC against bytes, label
leakage and inversion, with the Pareto frontier and the walkthrough's default
marked), which the notebook's section 7 reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from bank.config import MAX_AUTO_BATCH, TopConfig, TrainingConfig
from bank.lab.studies.privacy import Federation, measure
from bank.vertical.schedule import split_rows
from data.prepare import prepare_bank_marketing
from parties.learning.model import BottomConfig, build_bottom, build_optimizer, mlp
from parties.protocol.training import StepReply, StepRequest
from parties.tables.encoding import TabularEncoder

__all__ = ["STRONGEST", "CutPoint", "default_grid", "frontier_figure", "run_cut_study", "step_bytes", "step_compute"]

STRONGEST = "strongest_label_leak_auc"
DEFAULT_PARTNER = BottomConfig()
DEFAULT_TOP = TopConfig()


@dataclass(frozen=True)
class CutPoint:
    """One cut: the partner's bottom (hidden layers, embedding width) and the bank's top (hidden layers)."""

    axis: str  # which sweep it belongs to: "width", "partner depth", "cut position"
    partner_hidden: tuple[int, ...] = DEFAULT_PARTNER.hidden
    cut_width: int = DEFAULT_PARTNER.cut_width
    top_hidden: tuple[int, ...] = DEFAULT_TOP.hidden

    @property
    def name(self) -> str:
        arrow = " → ".join(str(h) for h in (*self.partner_hidden, f"[{self.cut_width}]", *self.top_hidden))
        return f"partner {arrow} top"

    @property
    def is_default(self) -> bool:
        """The walkthrough's architecture."""
        return (self.partner_hidden, self.cut_width, self.top_hidden) == (
            DEFAULT_PARTNER.hidden, DEFAULT_PARTNER.cut_width, DEFAULT_TOP.hidden)


def default_grid() -> list[CutPoint]:
    """Nine points: five widths at the default depth; a linear and a deeper partner bottom; the cut one layer
    later (the partner computes two hidden layers, the top is linear) and one earlier (the partner is linear,
    the top has two hidden layers). The default (64 → [16] → 32) is on the width axis."""
    return [
        *(CutPoint("width", cut_width=w) for w in (4, 8, 16, 32, 64)),
        CutPoint("partner depth", partner_hidden=()),
        CutPoint("partner depth", partner_hidden=(64, 64)),
        CutPoint("cut position", partner_hidden=(64, 32), top_hidden=()),
        CutPoint("cut position", partner_hidden=(), top_hidden=(64, 32)),
    ]


def step_bytes(batch: int, width: int) -> int:
    """Bytes of one training step's wire bodies, fp32: the request (rows and the last step's gradient) and the
    answer (the embedding), as the protocol encodes them. HTTP framing (a few hundred bytes) is left out."""
    rows = torch.arange(batch, dtype=torch.int64)
    grad = torch.zeros(batch, width)
    request = StepRequest("0" * 32, 1, grad, rows).encode()
    answer = StepReply("0" * 32, 1, torch.zeros(batch, width)).encode()
    return len(request) + len(answer)


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median milliseconds of ``fn`` on one torch thread (a step this small gains nothing from more, and on a
    shared machine threads that wait for each other make the figure noise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(5):  # warm-up: first calls allocate
            fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return 1e3 * float(np.median(times))


def step_compute(point: CutPoint, partner_dim: int, bank_dim: int, batch: int, repeats: int = 30,
                 bank_bottom: BottomConfig = BottomConfig()) -> tuple[float, float]:
    """Median milliseconds of one training step's compute at the partner (its bottom's forward, backward and
    Adam step) and at the bank (its own bottom's and the top's, with the loss and the partner's gradient)."""
    generator = torch.Generator().manual_seed(0)
    partner = build_bottom(partner_dim, BottomConfig(hidden=point.partner_hidden, cut_width=point.cut_width))
    partner_opt = build_optimizer(partner.parameters(), DEFAULT_PARTNER)
    x_partner = torch.randn(batch, partner_dim, generator=generator)
    grad = torch.randn(batch, point.cut_width, generator=generator) / batch

    def partner_step() -> None:
        partner_opt.zero_grad()
        partner(x_partner).backward(grad)
        partner_opt.step()

    own = build_bottom(bank_dim, bank_bottom)
    top = mlp(bank_bottom.cut_width + point.cut_width, point.top_hidden, 1, activate_output=False, seed=1)
    params = [*own.parameters(), *top.parameters()]
    bank_opt = build_optimizer(params, DEFAULT_TOP)
    x_bank = torch.randn(batch, bank_dim, generator=generator)
    z_partner = torch.randn(batch, point.cut_width, generator=generator)
    y = (torch.rand(batch, 1, generator=generator) < 0.12).float()

    def bank_step() -> None:
        bank_opt.zero_grad()
        leaf = z_partner.clone().requires_grad_(True)
        logits = top(torch.cat([own(x_bank), leaf], dim=1))
        torch.nn.functional.binary_cross_entropy_with_logits(logits, y).backward()
        bank_opt.step()

    return _median_ms(partner_step, repeats), _median_ms(bank_step, repeats)


def run_cut_study(
    out: Path, *, rows: int | None = 8000, epochs: int = 8, grid: list[CutPoint] | None = None,
    known_labels: int = 50, cache: Path | None = None, download: bool = True,
    progress: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """Train and audit one model per cut point; write ``cut_study.csv`` and ``cut_frontier.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    fed = Federation(prepare_bank_marketing(out / "data", rows=rows, cache=cache, download=download))
    dims = {name: len(TabularEncoder(table.schema).fit(table.features).feature_names())
            for name, table in (("bank", fed.bank), ("partner", fed.partner))}
    grid = grid or default_grid()
    results = []
    for k, point in enumerate(grid, start=1):
        if progress is not None:
            progress(f"{k}/{len(grid)} {point.name}")
        # The batch the study's figures were measured at, whatever the slice (the product's adapts to the table).
        training = TrainingConfig(epochs=epochs, audit=True, top=TopConfig(hidden=point.top_hidden),
                                  batch_size=MAX_AUTO_BATCH)
        partner_bottom = BottomConfig(hidden=point.partner_hidden, cut_width=point.cut_width, seed=1)
        started = time.perf_counter()
        measured = measure(fed, training, partner_bottom=partner_bottom, known_labels=known_labels)
        seconds = time.perf_counter() - started
        partner_ms, bank_ms = step_compute(point, dims["partner"], dims["bank"], training.batch)
        per_step = step_bytes(training.batch, point.cut_width)
        split = split_rows(len(fed.targets), fed.targets, fed.task, training)
        steps = math.ceil(len(split.train) / training.batch)  # and a flush, which carries no embedding
        results.append({
            "point": point.name, "axis": point.axis, "default": point.is_default,
            "partner_hidden": "-".join(map(str, point.partner_hidden)) or "none", "cut_width": point.cut_width,
            "top_hidden": "-".join(map(str, point.top_hidden)) or "none",
            "test_roc_auc": measured.pop("test_roc_auc"),
            "bytes_per_step": per_step, "bytes_per_epoch": steps * per_step,
            "partner_ms_per_step": round(partner_ms, 3), "bank_ms_per_step": round(bank_ms, 3),
            **{k: v for k, v in measured.items() if k != "label_dp_epsilon"},
            "seconds": round(seconds, 1),
        })
    table = pd.DataFrame(results)
    table.to_csv(out / "cut_study.csv", index=False)
    fig = frontier_figure(table)
    fig.savefig(out / "cut_frontier.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return table


def _pareto(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the points no other point beats on both axes (less x, more y), in order of x."""
    order = np.lexsort((-y, x))
    best, keep = -np.inf, []
    for i in order:
        if y[i] > best:
            keep.append(i)
            best = y[i]
    return np.array(keep, dtype=int)


def frontier_figure(table: pd.DataFrame) -> plt.Figure:
    """Test ROC-AUC against bytes per step, model completion's label leak, and inversion: one dot per cut point,
    the Pareto frontier as a line, the walkthrough's default as a star."""
    panels = (
        ("bytes_per_step", "bytes per training step (fp32, both directions)", True),
        # Not the strongest attack: the direction attack reads the labels at 1.0 whatever the cut (the gradient's
        # sign carries them); what the cut changes is what the partner's trained bottom gives model completion.
        ("model_completion_leak_auc", "label leak AUC of model completion (the direction attack: 1.0 at every cut)",
         False),
        ("inversion_r2_advantage", "embedding-inversion R² advantage (0: nothing leaks)", False),
    )
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    auc = table["test_roc_auc"].to_numpy()
    colours = {axis: f"C{i}" for i, axis in enumerate(dict.fromkeys(table["axis"]))}
    for ax, (column, label, log) in zip(axes, panels):
        x = table[column].to_numpy(dtype=float)
        for axis, colour in colours.items():
            at = (table["axis"] == axis).to_numpy()
            ax.scatter(x[at], auc[at], s=50, color=colour, label=axis)
        for xi, yi, point in zip(x, auc, table["point"]):  # "64 → [4] → 32": which cut each dot is
            ax.annotate(point.removeprefix("partner ").removesuffix(" top"), (xi, yi), textcoords="offset points",
                        xytext=(4, 3), fontsize=6, color="dimgrey")
        front = _pareto(x, auc)
        ax.plot(x[front], auc[front], color="grey", linestyle="--", linewidth=1, label="frontier")
        default = table["default"].to_numpy(dtype=bool)
        ax.scatter(x[default], auc[default], s=260, marker="*", color="gold", edgecolor="black", zorder=3,
                   label="walkthrough default")
        if log:
            ax.set_xscale("log")
            ax.set_xticks(sorted(set(x)), [f"{v / 1024:.0f} KiB" for v in sorted(set(x))])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set(xlabel=label)
    axes[0].set(ylabel="test ROC-AUC")
    axes[0].legend(fontsize=8, loc="center right")
    fig.suptitle("where to cut: accuracy against traffic and exposure (one dot per cut)")
    fig.tight_layout()
    return fig
