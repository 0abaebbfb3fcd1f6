"""The bank CLI's output: the walkthrough's summary, and what a scoring job did (used by `python -m bank`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["print_scoring", "print_summary"]


def print_summary(out: Path, summary: dict[str, Any]) -> None:
    alignment, test = summary["alignment"], summary["test"]
    print(f"\nRun folder: {out}")
    print(f"{'party':<12}{'customers':>10}")
    for name, n in summary["rows_per_party"].items():
        print(f"{name:<12}{n:>10}")
    print(f"{'aligned':<12}{alignment['rows']:>10}   (alignment {alignment['alignment_id']})")
    print(f"\nTest metrics (best epoch {summary['best_epoch']} of {summary['epochs_run']}):")
    for metric, value in test.items():
        print(f"  {metric:<10}{value:8.4f}")
    for subset, info in summary.get("subsets", {}).items():
        if info["model"] == "joint":
            continue
        print(f"\nCustomers only {subset} hold{'s' if '+' not in subset else ''} ({info['model']} model), held out:")
        for group, figures in info["held_out"].items():
            line = f"  {group:<34}{figures['rows']:>6} customers"
            if "roc_auc" in figures:
                line += f"  roc_auc {figures['roc_auc']:.4f}"
            if "mean_score" in figures:
                line += f"  mean score {figures['mean_score']:.3f} vs observed {figures['observed_rate']:.3f}"
            print(line)
    for name, comm in summary["communication"].items():
        print(f"\n{name}: {comm['round_trips']} round trips, {comm['bytes_per_step'] / 1024:.1f} KiB per step "
              f"(minimum {comm['minimum_bytes_per_step'] / 1024:.1f} KiB: embedding + gradient)")
    print("\nModel files (each party wrote its own):")
    for name, path in summary["model_files"].items():
        print(f"  {name:<10}{out / path}")
    print(f"\nwall time: {summary['wall_seconds']} s")


def print_scoring(result: dict[str, Any], out: Path) -> None:
    """A scoring job's result: how many customers were scored, by which model, and what took a fallback."""
    print(f"{result['scored']} of {result['rows']} customers scored; {result['unscorable']} unscorable -> {out}")
    for partner, reason in result.get("refused", {}).items():
        print(f"  {reason}; {partner} counts as holding none of them")
    for model, count in result.get("models", {}).items():
        if model != "joint":
            print(f"  {count} scored by the {model} model: customers some partners do not hold (or refused)")
    if len(result.get("scored_without", {})) > 1:
        for partner, count in result["scored_without"].items():
            print(f"    of which {count} without {partner}")
    if result["unscorable"]:
        print(f"  {result['unscorable']} not scored: some partners do not hold them (their status says which); "
              "--allow-missing scores them with the model of the parties that do")
    for party, columns in result.get("fallbacks", {}).items():
        for column, counts in columns.items():
            took = ", ".join(f"{n} {policy}" for policy, n in counts.items())
            print(f"  {party} column {column!r}: {took} (encoded by the model's declared policy)")
