"""What every party's service is set with (``ServiceSettings``), and how settings are loaded and their problems told.

Each role's own settings live with the role: ``bank.settings.BankSettings``, ``partner.settings.PartnerSettings``
(and a compute party's and a branch's). Flags and ``CUTLAYER_<ROLE>_*`` environment variables fill them.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from parties.errors import ConfigError
from parties.flags import Flag, flag_for, settings_table
from parties.tables.ids import IdType
from parties.transport.tls import NAME, Role, TLSFiles, is_loopback

if TYPE_CHECKING:  # pandas, for the table alone: the command lines read these settings' defaults for --help
    from parties.tables.table import PartyTable

__all__ = ["NAME", "ServiceSettings", "describe_problems", "load_settings", "parse_ray_address"]

logger = logging.getLogger(__name__)




def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        cpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus takes CPU numbers separated by commas, not {text!r}") from None
    if any(c < 0 for c in cpus):
        raise argparse.ArgumentTypeError(f"--cpus takes CPU numbers from 0, not {text!r}")
    return cpus


def _pin(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not NAME.fullmatch(name) or not path:
        raise argparse.ArgumentTypeError(f"--tls-pin takes NAME=CA_FILE (a peer's name and its CA's certificate), "
                                         f"not {text!r}")
    return name, Path(path)


_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def parse_ray_address(address: str) -> str:
    """``auto``, ``HOST:PORT``, ``[IPv6]:PORT`` or ``ray://HOST:PORT`` (Ray Client), or a ``ConfigError``."""
    text = address.strip()
    if text == "auto":
        return text
    scheme = "ray://" if text.startswith("ray://") else ""
    host, sep, port = text[len(scheme):].rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    name_ok = bool(_HOST.fullmatch(host)) or (bracketed and ":" in host)
    if not sep or not name_ok or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--ray-address {address!r}: give HOST:PORT of the cluster's head (an IPv6 address in "
                          "brackets, [::1]:6379), ray://HOST:PORT for Ray Client, or auto")
    return f"{scheme}{host}:{port}"


class ServiceSettings(BaseSettings):
    """What every party service needs."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True)
    role: ClassVar[Role]

    name: str = Field(min_length=1, max_length=64, pattern=NAME.pattern,
                      description="this party's name (its certificate's CN)")
    data: Path = Field(description="this party's own CSV file")
    id_column: str | None = Field(None, description="customer ID column (default: the schema file's, else customer_id)")
    id_type: IdType | None = Field(None, description="integer: 12, 12.0 and 0012 are one customer; text: IDs as "
                                   "written (default: the schema file's, else integer if every ID is a whole number)")
    schema_file: Annotated[Path | None, Flag("schema")] = Field(
        None, description="the table's schema file (default: <data>.schema.json if present, else inferred; "
        "python -m data schema FILE writes one to edit)")
    categorical: Annotated[tuple[str, ...], Flag(metavar="COL,COL")] = Field(
        (), description="treat these columns as categorical (e.g. integer codes), whatever the schema says")
    numeric: Annotated[tuple[str, ...], Flag(metavar="COL,COL")] = Field(
        (), description="treat these columns as numeric, whatever the schema says")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: Annotated[int, Flag(default="0: any free port")] = Field(0, ge=0, le=65535, description="port to listen on")
    tls_dir: Path | None = Field(None, description="folder with ca.pem, NAME.pem, NAME.key (as python -m parties "
                                 "certs writes them); or give the three files one by one:")
    tls_ca: Path | None = Field(None, description="the partnership's CA certificate (PEM)")
    tls_cert: Path | None = Field(None, description="this party's certificate (PEM)")
    tls_key: Path | None = Field(None, description="this party's private key (PEM)")
    tls_crl: Path | None = Field(None, description="revocation lists (PEM) from the CAs this party trusts, re-read "
                                 "when the file changes (default: crl.pem in --tls-dir, when there is one)")
    tls_pin: Annotated[dict[str, Path], Flag(parse=_pin, repeat=True, collect=dict, metavar="NAME=CA_FILE")] = Field(
        {}, description="the peer NAME must hold a certificate from this CA (with one CA per organisation); a peer "
        "not pinned, one from the CA of this party's own certificate")
    tls_warn_days: int = Field(30, ge=0, description="warn when this party's certificate, a trusted CA or a peer's "
                               "certificate ends within this many days")
    insecure: bool = Field(False, description="plain HTTP, no certificates, on a loopback address only: development "
                           "on one machine (the command line only; the environment cannot turn TLS off)")
    state_dir: Path | None = Field(None, description="where this party keeps caches, checkpoints and models "
                                   "(default ./cutlayer-state/NAME)")
    workers: int | None = Field(None, ge=1, description="PSI worker processes (default: every core; with "
                                "--ray-address, PSI slices in flight / 2, default the cluster's CPUs)")
    ray_address: str | None = Field(None, description="run PSI hashing and blinding on this party's own Ray cluster: "
                                    "HOST:PORT of its head, or auto for the one ray start began on this machine (needs "
                                    "the ray extra here and on every node; default: worker processes here)")
    min_intersection: int = Field(1, ge=1, description="commit policy: refuse to keep fewer aligned rows; not a "
                                  "privacy control: the PSI budgets are (see docs/explanation/security.md)")
    max_body_bytes: int = Field(64 << 20, ge=1024, description="the largest request body a peer may send")
    header_timeout: float = Field(30.0, gt=0, description="seconds for a client's TLS handshake and request head")
    body_timeout: float = Field(60.0, gt=0, description="seconds for a request's body to arrive, once its head has")
    ready_file: Path | None = Field(None, description='write {"url": ...} here once listening')
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus metrics on this port, plain "
                                     "HTTP on --metrics-host (0: any free port; default: no metrics)")
    metrics_host: str = Field("127.0.0.1", description="the loopback address metrics are served on")
    torch_threads: int = Field(1, ge=1, description="intra-op threads for this party's model (small MLPs: 1 is fastest)")
    cpus: Annotated[tuple[int, ...] | None, Flag(parse=_cpu_list)] = Field(
        None, min_length=1, description="CPUs to run on, e.g. 0 or 2,3 (Linux; default: any). Parties sharing one "
        "machine run best on CPUs of their own")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[Callable[[], dict[str, object]], ...]:
        """Every setting reads the environment, except ``insecure``: only a flag may turn TLS off.

        A stray ``CUTLAYER_PARTNER_INSECURE=1`` in a shell once served plain HTTP
        despite an explicit ``--tls-dir``; ``load_settings`` refuses such a variable
        with a reason instead of honouring or silently dropping it.
        """

        # A mapping (--tls-pin, --partner) comes whole from the highest source that sets it, as any other setting
        # does: merged key by key, a pin left in a file beside the command line's would widen which CA may speak
        # for a peer. Only a group of settings (a table: [bottom]) takes some keys from each source.
        mappings = {name for name, info in cls.model_fields.items()
                    if settings_table(info) is None and isinstance(_default_of(info), dict)}
        sources: list[Callable[[], dict[str, object]]] = [init_settings]

        def below(source: Callable[[], dict[str, object]], name: str) -> Callable[[], dict[str, object]]:
            higher = list(sources)

            def read() -> dict[str, object]:
                taken = {k for s in higher for k in s() if k in mappings}
                return {k: v for k, v in source().items() if k != "insecure" and k not in taken}

            read.__name__ = name
            return read

        def config_file() -> dict[str, object]:  # --config FILE: below the environment (parties.config_file)
            return _FILE_VALUES.get()

        for source, name in ((env_settings, "environment"), (dotenv_settings, "dotenv"), (config_file, "config file")):
            sources.append(below(source, name))
        return (*sources, file_secret_settings)

    @model_validator(mode="after")
    def _metrics_on_loopback(self) -> ServiceSettings:
        if self.metrics_port is not None and not is_loopback(self.metrics_host):
            raise ValueError(f"--metrics-host {self.metrics_host}: metrics are plain HTTP, served on a loopback "
                             f"address only (127.0.0.1, ::1, localhost); scrape them locally or through a tunnel")
        return self

    @model_validator(mode="after")
    def _ray_address_well_formed(self) -> ServiceSettings:
        if self.ray_address is not None:
            try:
                parse_ray_address(self.ray_address)  # RayPool keeps the normal form
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _tls_complete(self) -> ServiceSettings:
        if not self.insecure:
            self.tls_files()
        elif not is_loopback(self.host):
            raise ValueError(
                f"--insecure serves plain HTTP to anyone who connects: it listens on a loopback address only "
                f"(127.0.0.1, ::1 or localhost), not {self.host}; use TLS (--tls-dir) to listen on a network"
            )
        return self

    def tls_files(self) -> TLSFiles | None:
        """The party's TLS files, or ``None`` in ``--insecure`` mode."""
        if self.insecure:
            return None
        if self.tls_crl is not None and not self.tls_crl.is_file():
            raise ValueError(f"--tls-crl {self.tls_crl} does not exist")
        trust = {"pins": tuple(sorted(self.tls_pin.items())), "warn_days": self.tls_warn_days}
        if self.tls_crl is not None:
            trust["crl"] = self.tls_crl
        explicit = (self.tls_ca, self.tls_cert, self.tls_key)
        if all(explicit):
            return TLSFiles(*explicit, **trust)  # type: ignore[arg-type]
        if any(explicit):
            raise ValueError("give all of --tls-ca, --tls-cert and --tls-key, or --tls-dir")
        if self.tls_dir is not None:
            return TLSFiles.from_dir(self.tls_dir, self.name, **trust)
        raise ValueError("TLS is required: give --tls-dir (or --tls-ca/--tls-cert/--tls-key), or --insecure")

    def load_table(self) -> PartyTable:
        """This party's own table, read through its schema (file, flags, inference)."""
        from parties.storage.files import private_dir
        from parties.tables.table import load_party_table

        # Its feature columns are kept in an unnamed file in the party's own state folder (parties.memory).
        return load_party_table(self.data, self.id_column, schema_path=self.schema_file,
                                categorical=self.categorical, numeric=self.numeric, id_type=self.id_type,
                                spill_dir=private_dir(self.state_path))

    @property
    def state_path(self) -> Path:
        """Where this party keeps caches, models and runs: ``--state-dir``, else ``./cutlayer-state/<name>``."""
        return self.state_dir if self.state_dir is not None else Path("cutlayer-state") / self.name

    @property
    def cache_dir(self) -> Path:
        return self.state_path / "psi-cache"


def _default_of(info: object) -> object:
    try:
        return info.get_default(call_default_factory=True)  # type: ignore[attr-defined]
    except Exception:  # a required field, or a factory that needs the other values
        return None


def describe_problems(exc: ValidationError, where: Callable[[tuple[int | str, ...]], str]) -> str:
    """A validation error as one line a person reads: ``where(loc): message`` per problem.

    Drops pydantic's framing ("Value error, ", the model's own name as a location):
    the message a validator raises is already the sentence to show.
    """
    problems = []
    for e in exc.errors():
        message = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if e["type"] == "extra_forbidden":
            message = "not a known setting"
        place = where(tuple(e["loc"])) if e["loc"] else ""
        problems.append(f"{place}: {message}" if place else message)
    return "; ".join(problems)


_TLS_FIELDS = ("tls_dir", "tls_ca", "tls_cert", "tls_key")
_TRUE = {"1", "true", "t", "yes", "y", "on"}


def _insecure_variable(cls: type[ServiceSettings]) -> str | None:
    """The ``<PREFIX>INSECURE`` environment variable, if it is set to a true value."""
    wanted = f"{cls.model_config.get('env_prefix', '')}INSECURE".upper()
    return next((k for k, v in os.environ.items() if k.upper() == wanted and v.strip().lower() in _TRUE), None)


def _check_transport_flags(cls: type[ServiceSettings], values: dict[str, object]) -> None:
    """The command line decides between TLS and plain HTTP; the environment never turns TLS off.

    ``--insecure`` with a TLS flag is a contradiction and refused. An
    ``...INSECURE`` variable is ignored (with a warning) beside an explicit TLS
    flag, and refused without one: a service must not start in plain HTTP, nor
    in a mode its operator did not expect, because of a variable left in a shell.
    """
    given = [flag_for(cls, (field,)) for field in _TLS_FIELDS if values.get(field) is not None]
    if values.get("insecure"):
        if given:
            raise ConfigError(f"--insecure turns TLS off and {', '.join(given)} turns it on: give one or the other")
        return
    variable = _insecure_variable(cls)
    if variable is None:
        return
    if given:
        logger.warning("%s is ignored: %s on the command line serves TLS (plain HTTP needs --insecure on the "
                       "command line)", variable, ", ".join(given))
        return
    raise ConfigError(f"{variable} is set, but the environment cannot turn TLS off: give --insecure on the command "
                      f"line for plain HTTP, or --tls-dir for TLS, and unset {variable}")


#: A ``--config`` file's settings while ``load_settings`` builds a model (``settings_customise_sources``).
_FILE_VALUES: ContextVar[dict[str, object]] = ContextVar("cutlayer_config_file", default={})


def load_settings(cls: type[ServiceSettings], config_file: Path | None = None, **values: object) -> ServiceSettings:
    """Build settings from flags (``None`` means: not given), the environment, a ``--config`` TOML file and the
    defaults, in that order; a problem names its flag, or the file and key it came from.

    Whether TLS is on is decided by the flags alone (``_check_transport_flags``).
    """
    from parties.config_file import read_config_file

    _check_transport_flags(cls, values)
    given = {k: v for k, v in values.items() if v is not None}
    in_file = read_config_file(config_file) if config_file is not None else {}

    def where(loc: tuple[int | str, ...]) -> str:
        if loc and loc[0] in in_file and loc[0] not in given:
            return f"{config_file}: {'.'.join(map(str, loc))}"
        return flag_for(cls, loc)

    token = _FILE_VALUES.set(in_file)
    try:
        return cls(**given)
    except ValidationError as exc:
        raise ConfigError(describe_problems(exc, where)) from exc
    finally:
        _FILE_VALUES.reset(token)
