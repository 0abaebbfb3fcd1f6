"""The hijack monitor against banks that know it. SIMULATION ONLY: it plays the bank and reads the partner's features.

For the honest bank and each hijacking bank of ``default_attackers`` (FSHA and the adaptive banks of
``bank.lab.attacks.hijackers``), ``runs`` seeded training runs on a slice of bank-full measure:

- **the rank test** (``MonitorConfig(watch=True)``, in warn mode so every run trains to the end): whether and
  at which step it alarms;
- **how well the attack works**: the bank's reconstruction error of the partner's features from the
  embeddings of the last epoch (1.0: no better than the mean);
- **the copy probes** (``probe_every``), in a short run of their own (the probes change training): whether
  they alarm.

An attack *succeeds* when its mean reconstruction error is at least halfway from the unattacked baseline
(the honest bank's, or the mean's, whichever is lower) to the non-adaptive FSHA's. Rates come with Wilson
95% intervals. ``monitor_cost`` times the partner's step unmonitored, with the rank test and with the probes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bank.config import TrainingConfig
from bank.lab.attacks.hijackers import Attacker, HijackingBank
from bank.lab.studies.privacy import PARTNER_BOTTOM, Federation
from data.partition import read_source_csv
from data.prepare import prepare_bank_marketing
from data.uci import locate_bank_full
from parties.errors import HijackSuspected
from parties.learning.bottom import BottomTrainer
from parties.learning.hijack_monitor import HijackMonitor, MonitorConfig

__all__ = ["StudyConfig", "default_attackers", "format_study", "monitor_cost", "run_hijack_study", "summarise", "wilson"]


def default_attackers() -> list[Attacker]:
    """FSHA, and the adaptive banks: noise, a mix with the honest gradient, probe-aware answers."""
    return [
        Attacker("FSHA", "fsha"),
        *(Attacker(f"FSHA + row-keyed noise ×{r:g}", "noise", r) for r in (0.5, 2.0)),
        *(Attacker(f"FSHA mixed with {b:.0%} honest gradient", "mix", b) for b in (0.5, 0.8, 0.95)),
        Attacker("FSHA cut to one direction per step", "one-direction"),
        Attacker("rank-aware: shaped under the rank test's limits", "rank-aware"),
        Attacker("rank-aware, wandering to 0.95 of the limit", "rank-aware", 0.95),
        Attacker("rank-aware, copies answered honestly", "rank-and-probe-aware"),
        *(Attacker(f"ballast ×{r:g}: a gradient on output units that are off", "ballast", r) for r in (1.0, 20.0)),
        Attacker("freeze: the honest gradient ×1e-12, the partner kept at its initial weights", "freeze"),
        Attacker("probe-aware: copies answered honestly", "probe-aware", answer="honest"),
        Attacker("probe-aware: copies answered with noise ×0.5", "probe-aware", 0.5, answer="noise"),
    ]


HONEST = Attacker("honest bank", "honest")


class StudyConfig:
    """The slice, the training and the monitors of every run (defaults: the figures of docs/explanation/privacy.md)."""

    def __init__(self, rows: int = 5000, epochs: int = 17, batch: int = 64, aux_rows: int = 5000,
                 monitor: MonitorConfig | None = None, probe_every: int = 5, probe_steps: int = 40,
                 secret_init: bool = False) -> None:
        """``secret_init``: the partner draws its initial weights from its secret (what a deployed partner
        with the monitor on does); default: from a seed the bank knows, the bank's best case."""
        self.rows, self.epochs, self.batch, self.aux_rows = rows, epochs, batch, aux_rows
        self.partner_bottom = PARTNER_BOTTOM.model_copy(update={"seed": None}) if secret_init else PARTNER_BOTTOM
        self.monitor = monitor or MonitorConfig(watch=True, on_alarm="warn")
        self.probe_every, self.probe_steps = probe_every, probe_steps

    def training(self, seed: int, **overrides: int) -> TrainingConfig:
        # No early stopping: a hijacking bank does not stop while the attack still gains.
        return TrainingConfig(epochs=self.epochs, batch_size=self.batch, seed=seed, patience=self.epochs,
                              **overrides)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a rate of ``hits`` in ``n``."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _slice(out: Path, config: StudyConfig, cache: Path | None, download: bool) -> tuple[Federation, pd.DataFrame]:
    """The federation on a seeded slice, and auxiliary customers from outside it (the bank's public rows)."""
    fed = Federation(prepare_bank_marketing(out / "data-hijack", rows=config.rows, cache=cache, download=download))
    source = read_source_csv(locate_bank_full(cache, download=download))
    order = np.random.default_rng(0).permutation(len(source))  # prepare_bank_marketing's slice is order[:rows]
    return fed, source.iloc[order[config.rows:config.rows + config.aux_rows]]


def _run(fed: Federation, aux: pd.DataFrame, attacker: Attacker, seed: int, config: StudyConfig) -> dict:
    coordinator = fed.coordinator(config.training(seed), monitor=config.monitor, partner_bottom=config.partner_bottom)
    bank = HijackingBank(coordinator, attacker, aux, PARTNER_BOTTOM, seed)  # its guess of the initial weights
    monitor: dict[str, HijackMonitor] = {}
    original = coordinator.parties[1].start_training

    def start(*args, **kwargs):  # keep the partner's monitor: the session ends with the run
        width = original(*args, **kwargs)
        monitor["rank"] = coordinator.parties[1].session.trainer.monitor  # type: ignore[attr-defined]
        return width

    coordinator.parties[1].start_training = start  # type: ignore[method-assign]
    outcome = coordinator.run()
    steps_per_epoch = math.ceil(len(coordinator.split.train) / config.batch)
    rank = monitor["rank"]
    return {"bank": attacker.name, "seed": seed, "steps": len(bank.sent),
            "rank_alarm": rank.alarm is not None, "rank_alarm_step": rank.alarm_step,
            "reconstruction_error": bank.reconstruction_error(steps_per_epoch),
            "test_roc_auc": outcome.test_metrics["roc_auc"]}


def _probe_run(fed: Federation, aux: pd.DataFrame, attacker: Attacker, seed: int, config: StudyConfig) -> bool:
    """Whether the copy probes alarm within ``probe_steps`` steps."""
    probes = MonitorConfig(probe_every=config.probe_every, seed=seed)
    coordinator = fed.coordinator(config.training(seed, max_steps=config.probe_steps), monitor=probes,
                                  partner_bottom=config.partner_bottom)
    HijackingBank(coordinator, attacker, aux, PARTNER_BOTTOM, seed)
    try:
        coordinator.run()
    except HijackSuspected:
        return True
    return False


def run_hijack_study(out: Path, *, runs: int = 20, attackers: Sequence[Attacker] | None = None,
                     config: StudyConfig | None = None, cache: Path | None = None, download: bool = True,
                     progress: Callable[[str], None] = lambda _: None) -> dict[str, pd.DataFrame]:
    """Every bank over seeds 0 to ``runs`` − 1; writes ``hijack_runs.csv`` and ``hijack_study.csv`` to ``out``."""
    config = config or StudyConfig()
    attackers = list(attackers if attackers is not None else default_attackers())
    out.mkdir(parents=True, exist_ok=True)
    fed, aux = _slice(out, config, cache, download)
    rows = []
    alarms = logging.getLogger("parties.learning.hijack_monitor")
    level, alarms.level = alarms.level, logging.CRITICAL  # the alarms are the study's data, in its tables
    try:
        for bank in (HONEST, *attackers):
            progress(bank.name)
            for seed in range(runs):
                row = _run(fed, aux, bank, seed, config)
                row["probe_alarm"] = _probe_run(fed, aux, bank, seed, config)
                rows.append(row)
    finally:
        alarms.setLevel(level)
    table = pd.DataFrame(rows)
    table.to_csv(out / "hijack_runs.csv", index=False)
    study = summarise(table)
    study.to_csv(out / "hijack_study.csv", index=False)
    (out / "hijack_study.txt").write_text(format_study(study, config, runs) + "\n")
    return {"runs": table, "study": study}


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """One row per bank: rates with their intervals, the attack's error, and whether it succeeds."""
    honest = table[table.bank == HONEST.name]
    baseline = min(1.0, float(honest.reconstruction_error.mean()))
    fsha = table[table.bank == "FSHA"]
    # No bar when plain FSHA itself does no better than the baseline: then nothing here "succeeds".
    fsha_error = float(fsha.reconstruction_error.mean()) if len(fsha) else math.inf
    halfway = baseline - 0.5 * (baseline - fsha_error) if fsha_error < baseline else None
    out = []
    for name, runs_of in table.groupby("bank", sort=False):
        n = len(runs_of)
        row = {"bank": name, "runs": n, "seeds": f"{runs_of.seed.min()}–{runs_of.seed.max()}",
               "reconstruction_error": runs_of.reconstruction_error.mean(),
               "reconstruction_error_sd": runs_of.reconstruction_error.std(ddof=1) if n > 1 else 0.0,
               "test_roc_auc": runs_of.test_roc_auc.mean() if "test_roc_auc" in runs_of else math.nan}
        for test in ("rank", "probe"):
            hits = int(runs_of[f"{test}_alarm"].sum())
            low, high = wilson(hits, n)
            row |= {f"{test}_alarm_rate": hits / n, f"{test}_alarm_low": low, f"{test}_alarm_high": high}
        row["median_alarm_step"] = runs_of.rank_alarm_step.median()
        honest_bank = name == HONEST.name
        row["attack_succeeds"] = (None if honest_bank or halfway is None
                                  else bool(row["reconstruction_error"] <= halfway))
        out.append(row)
    study = pd.DataFrame(out)
    study.attrs |= {"baseline": baseline, "halfway": halfway}
    return study


def format_study(study: pd.DataFrame, config: StudyConfig, runs: int) -> str:
    """The study's table as docs/explanation/privacy.md shows it: one row per bank."""
    def rate(row: pd.Series, test: str) -> str:
        return f"{row[f'{test}_alarm_rate']:.2f} [{row[f'{test}_alarm_low']:.2f}, {row[f'{test}_alarm_high']:.2f}]"

    shown = pd.DataFrame({
        "bank": study.bank,
        "rank test alarms [95% CI]": [rate(r, "rank") for _, r in study.iterrows()],
        "median alarm step": study.median_alarm_step.map(lambda v: "–" if pd.isna(v) else f"{v:.0f}"),
        "copy probes alarm [95% CI]": [rate(r, "probe") for _, r in study.iterrows()],
        "reconstruction error (mean ± sd)": [f"{r.reconstruction_error:.3f} ± {r.reconstruction_error_sd:.3f}"
                                             for _, r in study.iterrows()],
        "test ROC-AUC": study.test_roc_auc.map(lambda v: f"{v:.4f}"),
        "attack succeeds": study.attack_succeeds.map(lambda v: "–" if v is None or pd.isna(v) else
                                                     ("yes" if v else "no")),
    })
    halfway = study.attrs.get("halfway")
    head = (f"bank-full slice of {config.rows} customers, {config.epochs} epochs of batch {config.batch}, "
            f"seeds 0–{runs - 1} per bank; the bank's auxiliary rows: {config.aux_rows} other customers.\n"
            f"reconstruction error: the share of the partner's feature variance the bank's decoder leaves; the "
            f"unattacked baseline is the honest bank's or the mean's (1.0), whichever is lower: "
            f"{study.attrs.get('baseline', float('nan')):.3f}. "
            + ("Plain FSHA does no better than that here, so no attack succeeds." if halfway is None else
               f"An attack succeeds at or under {halfway:.3f}, halfway from there to plain FSHA's.")
            + ("\nThe partners apply only each gradient's task part (project)." if config.monitor.project else "")
            + ("\nThe partners' initial weights come from their secret." if config.partner_bottom.seed is None else
               "\nThe bank knows the partners' initial weights (their seed)."))
    return head + "\n\n" + shown.to_string(index=False)


def monitor_cost(batch: int = 64, width: int = 16, features: int = 24, steps: int = 400, seed: int = 0) -> pd.DataFrame:
    """The partner's step with and without a monitor, side by side: median microseconds, bytes on the wire.

    Each step applies a gradient and embeds the next batch, as in training; the bytes per step are the
    protocol's: the rank test sends nothing; the copy probes send the same bytes, some rows of them fakes whose
    gradients are thrown away (``fake_rows_per_step``).
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, features, generator=generator).numpy()
    rows = [torch.randint(0, 4096, (batch,), generator=generator) for _ in range(steps)]
    grads = [torch.randn(batch, width, generator=generator) * 1e-3 for _ in range(steps)]
    bottom = PARTNER_BOTTOM.model_copy(update={"cut_width": width})
    # The limits only decide when to alarm, not what is computed: never alarming, it is timed every step.
    never = MonitorConfig(watch=True, limit=0.999, drift_limit=1.0)
    probes = MonitorConfig(probe_every=5)
    trainers = {"unmonitored": BottomTrainer(x, bottom), "rank test": BottomTrainer(x, bottom, monitor=never),
                "copy probes (every 5 steps)": BottomTrainer(x, bottom, monitor=probes)}
    timings = {name: [] for name in trainers}
    for step in range(steps):  # interleaved, so all three see the same machine
        for name, trainer in trainers.items():
            started = time.perf_counter()
            trainer.step(step, grads[step - 1] if step else None, rows[step])
            timings[name].append(time.perf_counter() - started)
    # One step's messages: the rows and embedding one way, the gradient back, all float32 / int64 here.
    payload = batch * 8 + 2 * batch * width * 4
    base = float(np.median(timings["unmonitored"][10:]))
    fake = {"copy probes (every 5 steps)": probes.pairs / probes.probe_every}
    return pd.DataFrame([
        {"partner": name, "median_step_us": float(np.median(t[10:])) * 1e6,
         "extra_compute": float(np.median(t[10:])) / base - 1.0, "payload_bytes_per_step": payload, "extra_bytes": 0,
         "fake_rows_per_step": fake.get(name, 0.0)}
        for name, t in timings.items()])

