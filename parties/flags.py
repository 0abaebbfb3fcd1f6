"""Command-line flags made from the settings models, so a setting is declared once.

A field of a settings model is its flag: ``--`` and its name with dashes, its help the field's description
followed by the default the model holds, its type and choices from the annotation. A field says more with
``Flag`` in its annotation when the plain rule does not fit (``Annotated[float, Flag("lr")]``: ``--lr``);
a nested model's flags take the prefix its field's ``Flag`` gives (``--hijack-…`` for the monitor's).

``add_flags`` puts a model's flags on a parser; ``flag_values`` reads back, as the nested dictionary the model
takes, only what was given (an absent flag leaves the environment or the default in charge);
``flag_for`` names the flag behind a validation error's location.
"""

from __future__ import annotations

import argparse
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["Flag", "add_flags", "as_flags", "flag_for", "flag_values", "number", "has_flag", "pair", "settings_table", "show"]

#: Where ``add_flags`` keeps a setting's value in the namespace: ``setting:PartnerSettings:bottom.learning_rate``.
_DEST = "setting:"


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line, where its name and type do not say it.

    ``name``: the flag without dashes, after the nested model's prefix (``"--name"``: without the prefix).
    ``cli=False``: a setting for files and the environment only. ``prefix``, on a field holding a model:
    what its settings' flags start with. ``parse`` turns the text into the value (``repeat``: each
    occurrence, then ``collect`` gathers them: ``dict`` for ``NAME=VALUE`` pairs). ``default``: how help
    shows a default the value alone does not say (``"0: any free port"``).
    """

    name: str | None = None
    cli: bool = True
    prefix: str = ""
    parse: Callable[[str], Any] | None = None
    repeat: bool = False
    collect: Callable[[list[Any]], Any] = tuple
    metavar: str | None = None
    default: str | None = None
    group: str | None = None


def show(value: object) -> str:
    """A default as a person reads it in ``--help``: ``64,32`` for a tuple, ``0.005`` for a float."""
    if isinstance(value, (tuple, list)):
        return ",".join(show(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def number(text: str) -> float:
    """An ``argparse`` type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _meta(info: FieldInfo) -> Flag:
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def _bare(annotation: Any) -> Any:
    """``X`` from ``X | None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _model(annotation: Any) -> type[BaseModel] | None:
    bare = _bare(annotation)
    return bare if isinstance(bare, type) and issubclass(bare, BaseModel) else None


def _default(info: FieldInfo) -> object:
    return info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]


def _option(meta: Flag, name: str, prefix: str) -> str:
    if meta.name is not None and meta.name.startswith("--"):
        return meta.name
    return "--" + prefix + (meta.name or name.replace("_", "-"))


def _items(kind: Callable[[str], Any], what: str) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"give {what} separated by commas")
        try:
            return tuple(kind(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"give {what} separated by commas, not {text!r}") from None
    return parse


def _argument(name: str, info: FieldInfo, meta: Flag) -> dict[str, Any]:
    """argparse's keywords for a field: its type, choices or action, from the annotation."""
    bare = _bare(info.annotation)
    if meta.parse is not None:
        kwargs: dict[str, Any] = {"type": meta.parse}
    elif bare is bool:  # a setting that is on by default is turned off with --no-...
        return {"action": argparse.BooleanOptionalAction if _default(info) else "store_true"}
    elif get_origin(bare) is Literal:
        kwargs = {"choices": list(get_args(bare)), "type": type(get_args(bare)[0])}
    elif get_origin(bare) in (tuple, list) and meta.repeat:  # one item per occurrence
        kwargs = {"type": get_args(bare)[0]}
    elif get_origin(bare) in (tuple, list):
        item = get_args(bare)[0]
        kwargs = {"type": _items(item, "whole numbers" if item is int else "names"),
                  "metavar": "N,N" if item is int else "NAME,NAME"}
    elif bare is float:
        kwargs = {"type": number}
    elif bare in (int, str, Path):
        kwargs = {"type": bare}
    else:
        raise TypeError(f"{info.annotation} needs Flag(parse=...) to be read from the command line")
    if meta.repeat:
        kwargs["action"] = "append"
    if meta.metavar is not None:
        kwargs["metavar"] = meta.metavar
    elif "choices" not in kwargs and "metavar" not in kwargs:
        kwargs["metavar"] = name.upper()
    return kwargs


def _help(info: FieldInfo, meta: Flag) -> str:
    text = (info.description or "").rstrip(".").replace("%", "%%")
    default = _default(info)
    if meta.default is not None:
        return f"{text} (default {meta.default})"
    if info.is_required():
        return f"{text} (required)"
    if default is True:
        return f"{text} (default on)"
    if default is None or default == () or default == {} or default is False:
        return text
    return f"{text} (default {show(default)})"


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *, skip: tuple[str, ...] = (),
              only: tuple[str, ...] | None = None, group: Any = None) -> None:
    """Put ``model``'s settings on ``parser`` as flags (in ``group`` if given); a nested model's settings in a
    group of their own.

    ``skip``/``only``: top-level fields to leave out / to take alone (a command that sets a few).
    """
    _add(parser, model, f"{_DEST}{model.__name__}:", skip=skip, only=only, group=group)


def _add(parser: argparse.ArgumentParser, model: type[BaseModel], dest: str, *, skip: tuple[str, ...] = (),
         only: tuple[str, ...] | None = None, _path: tuple[str, ...] = (), _prefix: str = "",
         group: Any = None) -> None:
    target = group if group is not None else parser
    for name, info in model.model_fields.items():
        if not _path and (name in skip or (only is not None and name not in only)):
            continue
        meta = _meta(info)
        if not meta.cli:
            continue
        path = (*_path, name)
        nested = _model(info.annotation)
        if nested is not None and meta.parse is None:
            sub = parser.add_argument_group(meta.group or info.description or name)
            _add(parser, nested, dest, _path=path, _prefix=_prefix + meta.prefix, group=sub)
            continue
        target.add_argument(_option(meta, name, _prefix), dest=dest + ".".join(path), default=argparse.SUPPRESS,
                            help=_help(info, meta), **_argument(name, info, meta))


def has_flag(info: FieldInfo) -> bool:
    """Whether a setting has a command-line flag (``Flag(cli=False)``: the environment and files only)."""
    return _meta(info).cli


def settings_table(info: FieldInfo) -> type[BaseModel] | None:
    """The model a field holds as a group of settings of its own (prefixed flags, a table in a file), if any."""
    nested = _model(info.annotation)
    return nested if nested is not None and _meta(info).parse is None else None


def flag_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The settings given as flags, nested as ``model`` takes them; a flag not given is not there."""
    values: dict[str, Any] = {}
    mine = f"{_DEST}{model.__name__}:"
    for key, value in vars(args).items():
        if not key.startswith(mine):
            continue
        path = key.removeprefix(mine).split(".")
        info = _field(model, path)
        if info is not None and _meta(info).repeat:
            value = _meta(info).collect(value)
        place = values
        for part in path[:-1]:
            place = place.setdefault(part, {})
        place[path[-1]] = value
    return values


def _field(model: type[BaseModel], path: list[str]) -> FieldInfo | None:
    info = None
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = _model(info.annotation)  # type: ignore[assignment]
    return info


def flag_for(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The flag behind a settings location (a validation error's ``loc``); past the flag, a key or index
    (``psi_limits.peer_max_ids.bank``) belongs to it. The environment variable has the same name."""
    prefix = ""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or str(part) not in current.model_fields:
            break
        info = current.model_fields[str(part)]
        meta = _meta(info)
        nested = _model(info.annotation)
        if nested is None or meta.parse is not None:
            return _option(meta, str(part), prefix)
        prefix += meta.prefix
        current = nested
    return "--" + ".".join(str(p) for p in loc).replace("_", "-")


def pair(kind: Callable[[str], Any], what: str) -> Callable[[str], tuple[str, Any]]:
    """A ``NAME=VALUE`` flag's parser; ``VALUE`` alone stands for every peer not named (``*``)."""
    def parse(text: str) -> tuple[str, Any]:
        name, sep, value = text.rpartition("=")
        try:
            return (name if sep else "*"), kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes NAME={what} or {what}, not {text!r}") from None
    return parse


def as_flags(model: type[BaseModel], values: dict[str, Any], _path: tuple[str, ...] = ()) -> list[str]:
    """``values`` (as ``flag_values`` reads them) back as a command line, to hand to another party's command."""
    argv: list[str] = []
    for name, value in values.items():
        path = (*_path, name)
        info = _field(model, list(path))
        if isinstance(value, dict) and info is not None and _model(info.annotation) is not None:
            argv += as_flags(model, value, path)
            continue
        flag = flag_for(model, path)
        if isinstance(value, bool):
            argv += [flag] if value else [f"--no-{flag[2:]}"]
        elif isinstance(value, dict):
            argv += [f"{flag}={key}={item}" for key, item in value.items()]
        elif isinstance(value, (tuple, list)):
            argv.append(f"{flag}={','.join(map(str, value))}")
        elif value is None:  # each flag spells "none" its own way (secret, none): not guessed here
            raise ValueError(f"{flag}: an explicit None has no command-line spelling to hand on")
        else:
            argv.append(f"{flag}={value}")
    return argv
