"""What one peer may cost a party that serves several: its PSI sessions, and the disk its sessions keep.

Settings of the bank (``PsiLimits``, towards its partners) and of every service that holds something for
banks (``PsiLimits`` at a partner; ``BankQuotas`` at a partner, compute party or branch). The mechanisms are
``alignment.partnership``, ``alignment.exposure`` and ``parties.storage.quota``.
"""

from __future__ import annotations

import argparse
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from parties.flags import Flag, pair

__all__ = ["DEFAULT_MAX_OVERLAP", "BankQuotas", "PsiLimits"]


#: The largest share of the bank's customers a partner may match, unless the operator says otherwise.
DEFAULT_MAX_OVERLAP = 0.95


class PsiLimits(BaseModel):
    """What a peer's PSI sessions may cost this party and reveal to it, checked when a session opens.

    PSI tells a side which of the IDs it brought the other side holds, and nothing in the protocol stops a
    peer from bringing IDs it guessed. These bound how many a peer may bring, per session and per day
    (aborted and refused sessions count), whatever it pads its set with (``alignment.partnership``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_max_ids: Annotated[dict[str, int], Flag(parse=pair(int, "N"), repeat=True, collect=dict,
                                                  metavar="[PEER=]N")] = Field(
        default_factory=dict, description="the most IDs a peer may bring to one PSI session: the set size the "
        "partnership agreed; PEER=N for one peer (its certificate name), N for every other; repeat (default: "
        "twice this party's own set)")
    peer_ids_per_day: Annotated[int | None, Flag(metavar="N")] = Field(
        None, ge=1, description="IDs one peer may bring over 24 hours, every session it opened counted, aborted "
        "ones too (default: four times this party's own set)")
    sessions_per_hour: Annotated[int, Flag("psi-sessions-per-hour", metavar="N")] = Field(
        30, ge=1, description="PSI sessions one peer may open per hour (aborted ones count)")

    @field_validator("peer_max_ids")
    @classmethod
    def _positive(cls, limits: dict[str, int]) -> dict[str, int]:
        for peer, n in limits.items():
            if n < 1:
                raise ValueError(f"{peer}: the most IDs a peer may bring is at least 1, not {n}")
        return limits


class BankQuotas(BaseModel):
    """What one bank may keep at a party that serves several: sessions, disk, and how long idle files stay."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    disk_per_bank: Annotated[int | None, Flag("disk-quota-per-bank", parse=lambda text: size(text), metavar="SIZE",
                                              default="1G")] = Field(
        1 << 30, ge=1, description="disk one bank's checkpoints, models and alignments may take here, e.g. 500M or "
        "2G, or none (in a file: bytes, or null); past it, what would be written is refused with HTTP 507")
    checkpoint_ttl: Annotated[float, Flag(metavar="SECONDS")] = Field(
        7 * 86400.0, gt=0, description="seconds a session's checkpoints stay on disk after it was last used (a "
        "bank resumes within this); then they are removed")


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size(text: str) -> int | None:
    """``500M``, ``2G``, ``1048576`` as bytes; ``none``: no limit."""
    if text.strip().lower() == "none":
        return None
    number, unit = text.strip().upper().rstrip("B").rstrip("I"), ""
    if number and number[-1] in _UNITS:
        number, unit = number[:-1], number[-1]
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is bytes, or a number with K, M, G or T (e.g. 500M), or none; "
                                         f"not {text!r}") from None
