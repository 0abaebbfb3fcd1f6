"""What one peer may cost a party that serves several: its PSI sessions, and the disk its sessions keep.

Settings of the bank (``PsiLimits``, towards its partners) and of every service that holds something for
banks (``PsiLimits`` at a partner; ``BankQuotas`` at a partner, compute party or branch). The mechanisms are
``alignment.partnership``, ``alignment.exposure`` and ``parties.storage.quota``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

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

    peer_max_ids: dict[str, int] = Field(
        default_factory=dict, description="per peer (its certificate name; '*': every peer not named), the most IDs "
        "it may bring to one session: the set size the partnership agreed. Default: twice this party's own set")
    peer_ids_per_day: int | None = Field(
        None, ge=1, description="IDs one peer may bring over 24 hours, every session it opened counted (aborted "
        "ones too). Default: four times this party's own set")
    sessions_per_hour: int = Field(30, ge=1, description="PSI sessions one peer may open per hour (aborted ones count)")

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

    disk_per_bank: int | None = Field(
        1 << 30, ge=1, description="bytes of checkpoints, models and alignments one bank may keep here "
        "(None: no limit); past it, what would be written is refused with HTTP 507")
    checkpoint_ttl: float = Field(
        7 * 86400.0, gt=0, description="seconds a session's checkpoints stay on disk after it was last used (a "
        "bank resumes within this); then they are removed")
