"""A service's settings in one TOML file: ``--config partner.toml`` reads it, ``--print-config`` writes it.

The file holds the settings by their field names (``tls_dir = "tls"``; a nested model as a table,
``[bottom]``), read with the standard library's ``tomllib``. It sits below the other sources: a flag
overrides the environment (``CUTLAYER_<ROLE>_...``), which overrides the file, which overrides the default.
As with the environment, the file cannot turn TLS off: ``insecure`` is for the command line alone.
A relative path in the file is relative to the folder the service starts in, as on the command line.

``print_config`` writes every setting, commented with its description, its flag and its variable: the
values given (flags, a ``--config`` file) or else the defaults, a setting without a value commented out.
The environment's values are not written: they stay the environment's, and still override the file.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from parties.errors import ConfigError
from parties.flags import flag_for, has_flag, settings_table

__all__ = ["print_config", "read_config_file"]


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings in a TOML file, as a nested dictionary; a problem names the file."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    if "insecure" in values:
        raise ConfigError(f"{path}: insecure: a file cannot turn TLS off; give --insecure on the command line "
                          f"(development on one machine only)")
    return values


def _toml(value: Any) -> str:
    """A value as TOML writes it (JSON's strings and numbers are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, (tuple, list, set, frozenset)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, BaseModel):
        return _toml(value.model_dump(mode="json"))
    raise ValueError(f"{value!r} has no TOML spelling here")


def _default(info: FieldInfo) -> Any:
    return None if info.is_required() else info.get_default(call_default_factory=True)


def _lines(model: type[BaseModel], given: dict[str, Any], root: type[BaseModel], path: tuple[str, ...],
           prefix: str) -> tuple[list[str], list[str]]:
    """The model's plain settings as lines, and its nested models as TOML tables after them."""
    plain: list[str] = []
    tables: list[str] = []
    for name, info in model.model_fields.items():
        if name == "insecure":
            continue
        nested = settings_table(info)
        here = (*path, name)
        if nested is not None:
            inner, more = _lines(nested, given.get(name) or {}, root, here, prefix)
            tables += ["", f"[{'.'.join(here)}]", *inner, *more]
            continue
        nested_env = len(here) == 1 or root.model_config.get("env_nested_delimiter") == "__"
        sources = [flag_for(root, here)] if has_flag(info) else ["no flag"]
        sources += [f"{prefix}{'__'.join(here).upper()}"] if nested_env else []
        where = ", ".join(sources)
        about = info.description or ""
        plain.append(f"# {about} ({where})" if about else f"# ({where})")
        value = given[name] if name in given else _default(info)
        if value is None or value == {} and info.is_required():
            plain.append(f"# {name} = {'(required)' if info.is_required() else '(not set)'}")
        else:
            plain.append(f"{name} = {_toml(value)}")
    return plain, tables


def print_config(model: type[BaseModel], given: dict[str, Any], command: str) -> str:
    """A complete, commented TOML file of ``model``'s settings: ``given`` where given, else the defaults."""
    prefix = str(model.model_config.get("env_prefix", ""))
    plain, tables = _lines(model, given, model, (), prefix)
    head = [f"# {command}: every setting of this service. Start it with --config FILE; a flag, then an environment",
            f"# variable ({prefix}...), overrides what the file says (and no variable is written here). Paths are",
            "# relative to where the service starts: absolute paths suit a file a system service reads.", ""]
    return "\n".join(head + plain + tables) + "\n"
