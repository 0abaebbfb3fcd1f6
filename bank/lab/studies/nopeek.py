"""NoPeek on the privacy study's slice: test ROC-AUC and inversion R² advantage against no defense.

SIMULATION ONLY (it reads every party's file), like ``bank.lab.studies.privacy``, whose ``run_study`` it calls:

    python -m bank.lab.studies.nopeek --out runs/nopeek-study --alphas 0.1 0.3 1 3 --seeds 0 1 2

Each (setting, seed) is one training run of the study's bank-marketing slice (default 8000 rows, 8 epochs);
``--dp 2:0.2`` adds embedding DP at clip C = 2 and noise σ = 0.2, alone and with NoPeek at each of
``--dp-alphas`` (default: every α). The AUC cost is against no defense with the same seed.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from bank.lab.studies.privacy import Setting, run_study
from parties.learning.config import PrivacyConfig

__all__ = ["main", "settings", "summary"]


def settings(alphas: list[float], dp: list[tuple[float, float]], dp_alphas: list[float], seeds: list[int],
             ) -> list[Setting]:
    out = []
    for seed in seeds:
        training = {"seed": seed}
        out.append(Setting(f"no defense | seed {seed}", training))
        out += [Setting(f"NoPeek α={a:g} | seed {seed}", training, PrivacyConfig(nopeek=a)) for a in alphas]
        for clip, noise in dp:
            out.append(Setting(f"embedding DP C={clip:g} σ={noise:g} | seed {seed}", training,
                               PrivacyConfig(clip=clip, noise=noise)))
            out += [Setting(f"NoPeek α={a:g} + DP C={clip:g} σ={noise:g} | seed {seed}", training,
                            PrivacyConfig(nopeek=a, clip=clip, noise=noise)) for a in dp_alphas]
    return out


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per setting, over seeds: mean test AUC, its cost against no defense (same seed), mean inversion advantage."""
    table = table.assign(defense=table["setting"].str.split(" | ", regex=False).str[0],  # the name, not the family
                         seed=table["setting"].str.split(" | seed ", regex=False).str[1].astype(int))
    base = table[table.defense == "no defense"].set_index("seed")["test_roc_auc"]
    table["auc_cost"] = table["seed"].map(base) - table["test_roc_auc"]
    grouped = table.groupby("defense", sort=False)
    return pd.DataFrame({
        "test_auc": grouped["test_roc_auc"].mean(),
        "auc_cost": grouped["auc_cost"].mean(),
        "auc_cost_max": grouped["auc_cost"].max(),
        "inversion_adv": grouped["inversion_r2_advantage"].mean(),
        "inversion_adv_max": grouped["inversion_r2_advantage"].max(),
        "runs": grouped.size(),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--dp", nargs="*", default=[], metavar="C:SIGMA", help="embedding DP, alone and with NoPeek")
    parser.add_argument("--dp-alphas", type=float, nargs="*", default=None, help="NoPeek's α with DP (default: --alphas)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    dp = [tuple(float(v) for v in spec.split(":")) for spec in args.dp]
    chosen = settings(args.alphas, dp, args.alphas if args.dp_alphas is None else args.dp_alphas, args.seeds)
    table = run_study(args.out, rows=args.rows, epochs=args.epochs, settings=chosen, cache=args.cache_dir,
                      download=False, progress=lambda name: print(name, flush=True))
    result = summary(table)
    result.to_csv(args.out / "nopeek_summary.csv")
    with pd.option_context("display.width", 200, "display.float_format", lambda v: f"{v:.4f}" if math.isfinite(v) else "–"):
        print(result.to_string())


if __name__ == "__main__":
    main()
