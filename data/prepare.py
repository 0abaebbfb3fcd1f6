"""Prepare the bank-marketing walkthrough's per-party files in one call."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data.partition import bank_marketing_spec, partition, read_source_csv, write_partition
from data.uci import BANK_MARKETING_URL, locate_bank_full
from parties.errors import ConfigError

__all__ = ["prepare_bank_marketing"]


def prepare_bank_marketing(
    out_dir: Path,
    *,
    n_partners: int = 1,
    partner_names: Sequence[str] | None = None,
    seed: int = 0,
    rows: int | None = None,
    bank_coverage: float = 0.95,
    partner_coverage: float = 0.90,
    cache: Path | None = None,
    download: bool = True,
    url: str = BANK_MARKETING_URL,
) -> dict[str, Path]:
    """Locate (or download) ``bank-full.csv`` and write one file per party under ``out_dir``.

    ``rows`` keeps a seeded random slice of the customers, for quick runs.
    """
    if rows is not None and rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {rows}")
    frame = read_source_csv(locate_bank_full(cache, download=download, url=url))
    if rows is not None and rows < len(frame):
        keep = np.sort(np.random.default_rng(seed).permutation(len(frame))[:rows])
        frame = frame.iloc[keep]
    spec = bank_marketing_spec(
        n_partners,
        partner_names=partner_names,
        bank_coverage=bank_coverage,
        partner_coverage=partner_coverage,
        seed=seed,
    )
    return write_partition(partition(frame, spec, "bank-full.csv"), spec, out_dir)
