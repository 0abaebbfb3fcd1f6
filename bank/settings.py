"""The bank's service settings: its label, its partners, what each partner's PSI sessions may cost."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Annotated, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from parties.flags import Flag, number
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

    label: str | None = Field(None, description="label column (default: the schema file's, else y)")
    task: TaskKind | None = Field(None, description="what the label is; its values are checked against it before "
                                  "anything is aligned, and training learns it unless told otherwise (default: the "
                                  "schema file's 'task', else inferred: two values binary, many numbers regression, "
                                  "else multiclass)")
    partners: Annotated[dict[str, str], Flag("--partner", parse=lambda text: _partner(text), repeat=True, collect=dict,
                                             metavar="NAME=URL")] = Field(
        default_factory=dict, description="a partner's name (its certificate's CN) and URL; repeat per partner")
    peer_timeout: float = Field(600.0, gt=0, description="seconds to wait for a partner's answer")
    peer_retry_deadline: float = Field(
        120.0, gt=0, description="seconds a silent partner is retried (it may be restarting) before training stops"
    )
    psi_limits: PsiLimits = Field(default_factory=lambda: PsiLimits(),
                                  description="per partner: what its PSI sessions may cost, checked before any blinding")
    max_overlap: Annotated[float, Flag(parse=lambda text: share(text), metavar="SHARE")] = Field(
        DEFAULT_MAX_OVERLAP, gt=0, le=1, description="refuse, before anything is committed, a partner matching more "
        "than this share of the bank's customers (a partner that claims IDs it does not hold learns them at the "
        "commit); align and score may ask for their own")
    mlflow: bool = Field(False, description="log each finished run to MLflow (the mlflow extra): settings, per-epoch "
                         "and test metrics, files; to a local store under the state folder unless --mlflow-uri")
    mlflow_uri: str | None = Field(None, description="an MLflow tracking server (turns --mlflow on)")
    mlflow_experiment: str = Field("cutlayer", min_length=1, description="the MLflow experiment runs go to")
    mlflow_customer_files: bool = Field(False, description="log the run folder's files with a row per customer "
                                        "too (predictions, splits, calibration)")

    @property
    def tracks_runs(self) -> bool:
        return self.mlflow or self.mlflow_uri is not None

    @model_validator(mode="after")
    def _mlflow_installed(self) -> BankSettings:
        from bank.tracking import available

        if self.tracks_runs and not available():
            raise ValueError("--mlflow needs MLflow: pip install -e '.[mlflow]' (or leave --mlflow off)")
        return self

    def load_table(self) -> PartyTable:
        from parties.storage.files import private_dir
        from parties.tables.table import load_party_table

        return load_party_table(self.data, self.id_column, self.label, schema_path=self.schema_file, labelled=True,
                                categorical=self.categorical, numeric=self.numeric, id_type=self.id_type,
                                task=self.task, spill_dir=private_dir(self.state_path))

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


def _partner(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"takes NAME=URL, not {text!r}")
    return name, url


def share(text: str) -> float:
    """An ``argparse`` type: a share above 0 and at most 1."""
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share is above 0 and at most 1, e.g. 0.9")
    return value
