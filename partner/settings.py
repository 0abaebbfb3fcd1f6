"""The partner's settings, and those of the services that run layers for a bank (a compute party, a branch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from parties.flags import Flag
from parties.learning.config import BottomConfig, MonitorConfig, MonitorFlags, PrivacyConfig, PrivacyFlags
from parties.limits import BankQuotas, PsiLimits
from parties.settings import NAME, ServiceSettings
from parties.transport.tls import Role

__all__ = ["BranchSettings", "ComputeSettings", "LayerHostSettings", "PartnerSettings"]


class PartnerSettings(ServiceSettings):
    """A passive party: it holds features, no labels, and answers the bank."""

    model_config = SettingsConfigDict(
        env_prefix="CUTLAYER_PARTNER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )
    role: ClassVar[Role] = "partner"

    bottom: BottomConfig = Field(default_factory=BottomConfig, description="this partner's own bottom model")
    privacy: PrivacyFlags = Field(default_factory=PrivacyConfig,
                                  description="embedding noise (off without a clip) and NoPeek (off at 0)")
    monitor: MonitorFlags = Field(default_factory=MonitorConfig,
                                  description="hijack monitor (off unless watch or probe_every)")
    max_training_sessions: int = Field(2, ge=1, description="live training sessions at once, per bank")
    training_session_ttl: float = Field(
        3600.0, gt=0, description="seconds an idle training session stays live (then only resumable from disk)"
    )

    psi_session_ttl: float = Field(900.0, gt=0, description="seconds an idle PSI session is kept")
    max_psi_sessions: int = Field(4, ge=1, description="open PSI sessions at once, per bank")
    psi_limits: PsiLimits = Field(default_factory=lambda: PsiLimits(),
                                  description="per bank: what its PSI sessions may cost, checked before any blinding")
    quotas: BankQuotas = Field(default_factory=lambda: BankQuotas(), description="per bank: disk, and idle files")

    @model_validator(mode="after")
    def _secret_initial_weights(self) -> PartnerSettings:
        # A partner that watches for hijacking must not start from weights the bank can rebuild: a bank that
        # keeps them there (gradients too small to act on) passes every test and inverts every embedding.
        if self.monitor.active and "seed" not in self.bottom.model_fields_set:
            object.__setattr__(self, "bottom", self.bottom.model_copy(update={"seed": None}))  # frozen: set once
        return self

    @model_validator(mode="after")
    def _rank_test_can_see(self) -> PartnerSettings:
        if self.monitor.watch and self.monitor.task_rank >= self.bottom.cut_width:
            raise ValueError(f"--hijack-task-rank {self.monitor.task_rank} leaves the rank test nothing to see: "
                             f"it must be below the embedding width (--cut-width {self.bottom.cut_width})")
        return self


class LayerHostSettings(ServiceSettings):
    """A service that runs layers for a bank (``partner/layer_service.py``): a compute party or a branch."""

    max_sessions: int = Field(2, ge=1, description="live layer sessions at once, per bank")
    max_batch_rows: int = Field(1 << 16, ge=1, description="rows one forward or backward call may carry")
    max_width: int = Field(4096, ge=1, description="widest layer a bank may ask this service to hold")
    max_parameters: int = Field(1 << 24, ge=1, description="most parameters a bank may ask this service to hold")
    max_activations: int = Field(
        1 << 26, ge=1, description="activation values one call may make this service hold: its rows times the widths "
        "of every layer (a deep, wide model on max_batch_rows rows would otherwise keep gigabytes for the backward)"
    )
    session_ttl: float = Field(
        3600.0, gt=0, description="seconds an idle session stays live; then it is dropped, its checkpoints kept "
        "(the bank resumes it with resume_step), so a bank that walks away cannot hold max_sessions for ever"
    )
    min_stats_rows: int = Field(
        100, ge=1, description="branch: the fewest distinct rows column statistics are given on (sums of one row "
        "are that row's values)"
    )
    banks: Annotated[tuple[str, ...], Flag("--bank", repeat=True, metavar="NAME")] = Field(
        (), description="required: the bank this service holds layers for (its certificate name); repeat for "
        "several. Each has its own sessions and disk; a branch names its own bank, since whoever starts a bottom "
        "sets its weights and can read the branch's rows through it", validate_default=True,
    )
    quotas: BankQuotas = Field(default_factory=lambda: BankQuotas(), description="per bank: disk, and idle files")

    @field_validator("banks")
    @classmethod
    def _banks_named(cls, banks: tuple[str, ...]) -> tuple[str, ...]:
        if not banks:
            raise ValueError("name the banks this service holds layers for (--bank NAME, repeat per bank): "
                             "otherwise any bank the CA certifies could take its sessions and disk")
        for bank in banks:
            if not NAME.fullmatch(bank):
                raise ValueError(f"{bank!r} is not a party's name (its certificate's CN: letters, digits, '_', '.', "
                                 "'-', at most 64)")
        return banks


class ComputeSettings(LayerHostSettings):
    """A compute party: it holds a trunk (U-shaped) or a trunk and the training labels it is sent (vanilla), no data."""

    model_config = SettingsConfigDict(env_prefix="CUTLAYER_COMPUTE_", extra="forbid", frozen=True)
    role: ClassVar[Role] = "compute"

    data: Path | None = None  # type: ignore[assignment]  # a compute party holds no table


class BranchSettings(LayerHostSettings):
    """A branch in horizontal split learning: the bank's schema, its own customers, the client-side bottom model."""

    model_config = SettingsConfigDict(env_prefix="CUTLAYER_BRANCH_", extra="forbid", frozen=True)
    role: ClassVar[Role] = "partner"
