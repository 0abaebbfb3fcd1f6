"""How the bank combines the parties' cut-layer embeddings before its top model.

Pluggable: an aggregation is a function from the list of embeddings (the
bank's own first, then the partners' in a fixed order) to one tensor, plus
the width it produces. Add one by adding it to ``AGGREGATIONS`` and its name to
``AggregationName`` (in bank/config.py, which the command line reads without torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bank.config import AggregationName
from parties.errors import ConfigError

__all__ = ["AGGREGATIONS", "Aggregation", "AggregationName", "get_aggregation"]


@dataclass(frozen=True)
class Aggregation:
    name: str
    combine: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    width: Callable[[Sequence[int]], int]


def _same_width(name: str) -> Callable[[Sequence[int]], int]:
    def width(widths: Sequence[int]) -> int:
        if len(set(widths)) != 1:
            raise ConfigError(f"{name} aggregation needs equal embedding widths, got {list(widths)}")
        return widths[0]

    return width


def _sum(zs: Sequence[torch.Tensor]) -> torch.Tensor:
    out = zs[0]
    for z in zs[1:]:
        out = out + z
    return out


AGGREGATIONS: dict[str, Aggregation] = {
    "concat": Aggregation("concat", lambda zs: torch.cat(list(zs), dim=1), lambda ws: sum(ws)),
    "sum": Aggregation("sum", _sum, _same_width("sum")),
    "mean": Aggregation("mean", lambda zs: _sum(zs) / len(zs), _same_width("mean")),
}


def get_aggregation(name: str) -> Aggregation:
    try:
        return AGGREGATIONS[name]
    except KeyError:
        raise ConfigError(f"unknown aggregation {name!r}; choose from {sorted(AGGREGATIONS)}") from None
