"""The bank's service settings: its label, its partners, what each partner's PSI sessions may cost."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from parties.learning.config import TaskKind
from parties.limits import DEFAULT_MAX_OVERLAP, PsiLimits
from parties.settings import ServiceSettings
from parties.transport.tls import Role

if TYPE_CHECKING:  # pandas, for the table alone: the command line reads these settings' defaults for --help
    from parties.tables.table import PartyTable

__all__ = ["BankSettings"]


class BankSettings(ServiceSettings):
    """The label holder: it drives alignment and training."""

    model_config = SettingsConfigDict(env_prefix="CUTLAYER_BANK_", extra="forbid", frozen=True)
    role: ClassVar[Role] = "bank"

    label: str | None = Field(None, description="the label column; default: the schema file's, else y")
    task: TaskKind | None = Field(None, description="what the label is: binary, multiclass or regression; default: "
                                  "the schema file's, else inferred from the label's values")
    partners: dict[str, str] = Field(default_factory=dict)
    peer_timeout: float = Field(600.0, gt=0, description="seconds to wait for a partner's answer")
    peer_retry_deadline: float = Field(
        120.0, gt=0, description="seconds a silent partner is retried (it may be restarting) before training stops"
    )
    psi_limits: PsiLimits = Field(default_factory=lambda: PsiLimits(),
                                  description="per partner: what its PSI sessions may cost, checked before any blinding")
    max_overlap: float = Field(
        DEFAULT_MAX_OVERLAP, gt=0, le=1, description="the largest share of the bank's customers a partner may match before "
        "anything is committed (a partner that claims IDs it does not hold learns which are the bank's customers "
        "at the commit); an alignment or scoring may ask for its own")

    def load_table(self) -> PartyTable:
        from parties.tables.table import load_party_table

        return load_party_table(self.data, self.id_column, self.label, schema_path=self.schema_file, labelled=True,
                                categorical=self.categorical, numeric=self.numeric, id_type=self.id_type,
                                task=self.task)

    @field_validator("partners")
    @classmethod
    def _urls(cls, partners: dict[str, str]) -> dict[str, str]:
        for name, url in partners.items():
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"partner {name!r}: {url!r} is not an http(s) URL")
        return {n: u.rstrip("/") for n, u in partners.items()}

    @model_validator(mode="after")
    def _scheme_matches_tls(self) -> BankSettings:
        for name, url in self.partners.items():
            if url.startswith("http://") and not self.insecure:
                raise ValueError(f"partner {name!r} uses plain http; use https (or --insecure for development)")
        return self
