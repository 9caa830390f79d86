"""Config plumbing shared by every component: typed dataclasses built from dicts, YAML files and
`key=value` command-line overrides, rejecting unknown keys and ill-typed values with a message that
names the source and the field."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from tlt.errors import ConfigError

T = TypeVar("T")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        errors = []
        for option in options:
            try:
                return _coerce(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin in (tuple, list):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = typing.get_args(annotation)[0] if typing.get_args(annotation) else Any
        out = [_coerce(v.strip() if isinstance(v, str) else v, inner, where) for v in items if v != ""]
        return tuple(out) if origin is tuple else out
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation in (int, float):
        bad = ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        if isinstance(value, bool) or (annotation is int and isinstance(value, float) and not value.is_integer()):
            raise bad
        try:
            return annotation(value)
        except (TypeError, ValueError):
            raise bad from None
    if annotation is str:
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], source: str = "config",
              sources: dict[str, str] | None = None) -> T:
    """Build dataclass `cls` from `data`, coercing strings (from YAML or the command line). Errors name
    where the offending key came from: `sources` maps a key to its origin (a file, "command line"),
    `source` is the origin of the others."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    origin = {k: (sources or {}).get(k, source) for k in data}
    unknown = sorted(set(data) - fields)
    if unknown:
        owner = f"{cls.__module__}.{cls.__name__}"
        raise ConfigError("; ".join(f"{origin[k]}: {unknown_field(k, fields, owner)}" for k in unknown))
    kwargs = {k: _coerce(v, hints[k], f"{origin[k]}: field {k!r}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # A check across fields: blame the origins of the fields its message names (a one-word name
        # only when quoted, since it may be an ordinary word of the message).
        named = [k for k in data if re.search(rf"\b{re.escape(k)}\b" if "_" in k else f"'{re.escape(k)}'", str(exc))]
        where = list(dict.fromkeys(origin[k] for k in named)) or list(dict.fromkeys(origin.values())) or [source]
        raise ConfigError(f"{' and '.join(where)}: {exc}") from None


def unknown_field(key: str, fields: set[str], owner: str) -> str:
    """'unknown field ...' with the closest known names, instead of every one of them."""
    import difflib

    close = difflib.get_close_matches(key, sorted(fields), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
            else f"no field has a similar name (the {len(fields)} fields are those of {owner})")
    return f"unknown field {key!r} for {owner}; {hint}"


def parse_overrides(items: list[str], source: str = "command line") -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file is missing")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(f"{path}: {line}invalid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value at the top level")
    return data


def build(cls: type[T], file: str | Path | None = None, overrides: list[str] = ()) -> T:
    """`cls` from an optional YAML file, then `key=value` overrides on top."""
    data = load_yaml(file) if file else {}
    given = parse_overrides(list(overrides))
    data.update(given)
    return from_dict(cls, data, source=str(file) if file else "command line",
                     sources=dict.fromkeys(given, "command line"))


def to_dict(config: Any) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def import_callable(spec: str, what: str):
    """The function an import path `module:function` names; `what` names the setting in errors."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r}: expected an import path 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def integer_flag(minimum: int):
    """An argparse `type`: an integer >= `minimum`; anything else is refused with the flag's name and what
    was expected (argparse's usage error, exit code 2) before the command loads anything."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def number_flag(text: str) -> float:
    """An argparse `type`: a finite number >= 0 (a temperature)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value
