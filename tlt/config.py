"""Config plumbing shared by every component: typed dataclasses built from dicts, YAML files and
`key=value` command-line overrides, rejecting unknown keys and ill-typed values with a message that
names the source and the field.

A config composes components: a field whose type is itself a config dataclass is a group, set by
dotted keys (`drafter.lr=1e-4` on the command line) or a nested mapping (`drafter: {lr: 1e-4}` in
YAML). Each component checks its own fields in `__post_init__` (`check`, `check_int`, ...) and raises
`FieldError`, which `from_dict` renames to the dotted key. A class may list the keys of an earlier
release in `RENAMED` (old key -> dotted key): they still set the new field, with a FutureWarning.
Fields made with `setting` carry a one-line meaning that `describe` lists.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any, TypeVar

from tlt.errors import ConfigError, FieldError

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
        # A number is a name here (a YAML `wandb_project: 2024`); a list, mapping, bool or null is not text.
        if value is None or isinstance(value, (bool, list, tuple, dict, set)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def setting(default: Any, meaning: str) -> Any:
    """A config field with its default and its one-line meaning (what `describe` prints)."""
    return dataclasses.field(default=default, metadata={"help": meaning})


def group(cls: type, meaning: str) -> Any:
    """A field holding the component config `cls` (its defaults unless given), with its meaning."""
    return dataclasses.field(default_factory=cls, metadata={"help": meaning})


def is_group(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def keys(cls: type) -> dict[str, Any]:
    """Every key of config `cls`, dotted within its groups, -> the type its value is coerced to."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_group(hints[f.name]):
            out.update({f"{f.name}.{k}": t for k, t in keys(hints[f.name]).items()})
        else:
            out[f.name] = hints[f.name]
    return out


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`data` with nested mappings (and config instances) spelled as dotted keys: {"tuner": {"arms": x}}
    -> {"tuner.arms": x}."""
    out = {}
    for key, value in data.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = to_dict(value)
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def renamed_key(cls: type, key: str) -> str:
    """The dotted key that `key` is now when it is a key of an earlier release `cls.RENAMED` lists."""
    return getattr(cls, "RENAMED", {}).get(key, key)


def upgrade(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """A config file tlt wrote (a run's config.json, nested or flat, of this release or the one before) as
    this release's dotted keys, without warnings: the user did not write those keys."""
    return {renamed_key(cls, k): v for k, v in flatten(data).items()}


def from_dict(cls: type[T], data: dict[str, Any], source: str = "config",
              sources: dict[str, str] | None = None) -> T:
    """Build dataclass `cls` from `data` (dotted keys, or nested mappings for groups), coercing strings
    (from YAML or the command line). A key of an earlier release sets its new field with a FutureWarning.
    Errors name the dotted key and where it came from: `sources` maps a key to its origin (a file,
    "command line"), `source` is the origin of the others."""
    return _build(cls, _gather(cls, data, lambda key: (sources or {}).get(key, source)), source)


def compose(cls: type[T], layers: list[tuple[dict[str, Any], str]]) -> T:
    """`cls` from layers of settings, each (mapping, where it came from), a later layer's value of a key
    replacing an earlier one's, whichever release's name either spells it with."""
    given = {}
    for data, where in layers:
        given.update(_gather(cls, data, lambda key, where=where: where))
    return _build(cls, given, layers[0][1] if layers else "config")


def _gather(cls: type, data: dict[str, Any], origin: typing.Callable[[str], str]) -> dict[str, tuple[Any, str]]:
    """`data` as {dotted key: (value, origin)}, the keys of an earlier release under their new names."""
    out = {}
    for key, value in flatten(data).items():
        where, new = origin(key), renamed_key(cls, key)
        if new != key:
            warnings.warn(f"{where}: key {key!r} is now {new!r}; the old name goes in the next release",
                          FutureWarning, stacklevel=3)
        if new in out:
            raise ConfigError(f"{where}: {new!r} is given twice (by an old name and the new one); keep {new!r}")
        out[new] = (value, where)
    return out


def _build(cls: type[T], given: dict[str, tuple[Any, str]], source: str) -> T:
    origin = {k: where for k, (_, where) in given.items()}
    known = keys(cls)
    unknown = sorted(set(given) - set(known))
    if unknown:
        owner = f"{cls.__module__}.{cls.__name__}"
        raise ConfigError("; ".join(f"{origin[k]}: {unknown_field(k, set(known), owner)}" for k in unknown))
    values = {k: _coerce(v, known[k], f"{origin[k]}: field {k!r}") for k, (v, _) in given.items()}
    return _construct(cls, values, origin, source)


def _construct(cls: type[T], values: dict[str, Any], origin: dict[str, str], source: str, prefix: str = "") -> T:
    """`cls` from coerced `values`, keyed by their full dotted keys (those of `cls` start with `prefix`),
    each group built first. A bad value is blamed on the origin of the key that holds it."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if is_group(hints[f.name]):
            inner = {k: v for k, v in values.items() if k.startswith(key + ".")}
            if inner:
                kwargs[f.name] = _construct(hints[f.name], inner, origin, source, key + ".")
        elif key in values:
            kwargs[f.name] = values[key]
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # Blame the origins of the fields the message names, else those of every key given.
        named = [k for k in values if _names(str(exc), k[len(prefix):])]
        if isinstance(exc, FieldError) and prefix:
            exc = exc.within(prefix[:-1])
        raise ConfigError(f"{_join([origin[k] for k in named or values], source)}: {exc}") from None


def _names(message: str, name: str) -> bool:
    """Whether `message` names field `name` (a one-word name only when quoted: it may be an ordinary word)."""
    pattern = rf"\b{re.escape(name)}\b" if "_" in name or "." in name else f"'{re.escape(name)}'"
    return re.search(pattern, message) is not None


def _join(origins: list[str], source: str) -> str:
    return " and ".join(dict.fromkeys(origins)) or source


def unknown_field(key: str, fields: set[str], owner: str) -> str:
    """'unknown field ...' with the closest known names, instead of every one of them."""
    import difflib

    inner = sorted(f for f in fields if f.startswith(key + "."))
    if inner:  # a group given a value of its own (`eval=3`, YAML `eval: null`)
        shown = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
        return f"{key!r} is a group of fields, not a field: set its keys as {key}.NAME ({shown})"
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


def _yaml_loader():
    """PyYAML's safe loader with YAML 1.2's booleans, true and false only. YAML 1.1 also reads on, off,
    yes and no as booleans, which turns `speculative: off` or `arms: [off, ngram-d4]` into False; as
    text they still set a bool field (`_coerce` reads them)."""
    import yaml

    merge_tag = "tag:yaml.org,2002:merge"

    class Loader(yaml.SafeLoader):
        """PyYAML keeps the last of two equal keys; a config that sets a field twice (the same key, or a
        dotted key beside its group: `loss.clip_low` and `loss: {clip_low}`) is an error naming both lines.
        Only keys as written count: one that overrides what a `<<: *base` merge brings is meant."""

        def __init__(self, stream) -> None:
            super().__init__(stream)
            self.written: dict[int, list] = {}  # id(mapping node) -> its pairs before flattening, merges left out
            self.checked: set[int] = set()

        def pairs(self, node) -> list:
            if id(node) not in self.written:
                self.written[id(node)] = [(k, v) for k, v in node.value if k.tag != merge_tag]
            return self.written[id(node)]

        def flatten_mapping(self, node) -> None:
            self.check_written(node)  # at first sight, before merges add their keys to node.value
            super().flatten_mapping(node)

        def fields(self, node, seen: set[int]) -> list:
            """(dotted path, its key node) of each field a mapping sets as written, through nested mappings
            (`seen`: the mapping nodes on the way, so an alias of an enclosing one ends the walk)."""
            out = []
            for key_node, value_node in self.pairs(node):
                key = self.construct_object(key_node, deep=True)  # cached by PyYAML: built once per node
                if not isinstance(key, str):  # PyYAML names an unhashable key itself
                    continue
                if isinstance(value_node, yaml.MappingNode) and id(value_node) not in seen:
                    out += [(f"{key}.{path}", at) for path, at in self.fields(value_node, seen | {id(value_node)})]
                else:
                    out.append((key, key_node))
            return out

        def check_written(self, node) -> None:
            """Each mapping once, its nested mappings first: a key repeated inside a group is named as such
            before the group's fields are compared with the dotted keys beside it."""
            if id(node) in self.checked:
                return
            self.checked.add(id(node))
            for _, value_node in self.pairs(node):
                if isinstance(value_node, yaml.MappingNode):
                    self.check_written(value_node)
            error = yaml.constructor.ConstructorError
            lines: dict[object, int] = {}
            for key_node, _ in self.pairs(node):
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, collections.abc.Hashable):  # PyYAML names an unhashable key itself
                    if key in lines:
                        raise error(None, None, f"duplicate key {key!r}, first set on line {lines[key] + 1}",
                                    key_node.start_mark)
                    lines[key] = key_node.start_mark.line
            paths: dict[str, int] = {}
            for path, at in self.fields(node, {id(node)}):
                if path in paths:
                    raise error(None, None, f"{path!r} is set twice, as a dotted key and inside its group, "
                                            f"first on line {paths[path] + 1}", at.start_mark)
                paths[path] = at.start_mark.line

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag != bool_tag]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Loader


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder; expected a YAML config file")
    if not path.is_file():
        raise ConfigError(f"{path}: config file is missing")
    try:
        data = yaml.load(path.read_bytes().decode("utf-8-sig"), Loader=_yaml_loader()) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if mark is None:
            raise ConfigError(f"{path}: invalid YAML ({' '.join(str(exc).split())})") from None
        what = " ".join(part for part in (getattr(exc, "context", None), exc.problem) if part)
        raise ConfigError(f"{path}: line {mark.line + 1}, column {mark.column + 1}: invalid YAML ({what})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value at the top level")
    return data


def build(cls: type[T], file: str | Path | None = None, overrides: list[str] = ()) -> T:
    """`cls` from an optional YAML file, then `key=value` overrides on top."""
    layers = [(load_yaml(file), str(file))] if file else []
    return compose(cls, [*layers, (parse_overrides(list(overrides)), "command line")])


def to_dict(config: Any) -> dict[str, Any]:
    """`config` as a plain mapping, a nested one per group: the layout `from_dict` reads back."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def override(config: T, changes: dict[str, Any]) -> T:
    """`config` with `changes` (dotted keys or nested mappings -> typed values) made; each group changed is
    rebuilt, so it and `config` check themselves again."""
    top, inner = {}, {}
    for key, value in flatten(changes).items():
        head, dot, rest = key.partition(".")
        if dot:
            inner.setdefault(head, {})[rest] = value
        else:
            top[key] = value
    for head, sub in inner.items():
        if not dataclasses.is_dataclass(getattr(config, head, None)):
            raise ConfigError(f"{type(config).__name__} has no group {head!r} (in {head}.{next(iter(sub))})")
        try:
            top[head] = override(getattr(config, head), sub)
        except FieldError as exc:
            raise exc.within(head) from None
    return dataclasses.replace(config, **top)


def describe(cls: type, prefix: str = "") -> list[str]:
    """Every key of config `cls` (dotted within groups) as `key=default  meaning`, one line each, a group's
    keys after a line naming it; the default is written as a command line takes it."""
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        key, meaning = prefix + f.name, f.metadata.get("help", "")
        if is_group(hints[f.name]):
            lines += ["", f"{key}.*: {meaning}", *describe(hints[f.name], key + ".")]
        else:
            lines.append(f"{key}={format_value(f.default)}".ljust(36) + f"  {meaning}")
    return lines


def format_value(value: Any) -> str:
    """`value` as a `key=value` override spells it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(format_value(v) for v in value)
    return str(value)


def check(config: Any, name: str, ok: bool, expected: str) -> None:
    """Unless `ok`: a FieldError "field NAME must be EXPECTED, got VALUE" for `config`'s field `name`."""
    if not ok:
        raise FieldError(name, f"must be {expected}, got {getattr(config, name)!r}")


def check_int(config: Any, name: str, low: int | None = None) -> None:
    """`config`'s field `name` is an integer (bools are not), at least `low` when given."""
    value = getattr(config, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
    check(config, name, ok, "an integer" + (f" >= {low}" if low is not None else ""))


def check_choice(config: Any, name: str, allowed: tuple) -> None:
    check(config, name, getattr(config, name) in allowed, f"one of {allowed}")


def check_numbers(config: Any) -> None:
    """Every float field of `config` holds a finite number (bools are not), so range checks can compare it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in ("float", float):
            check(config, f.name, not isinstance(value, bool) and isinstance(value, (int, float))
                  and math.isfinite(value), "a finite number")


def check_groups(config: Any) -> None:
    """Every group of `config` holds its component's config (`drafter="random"` is not `drafter.model`)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if is_group(hints[f.name]):
            check(config, f.name, isinstance(getattr(config, f.name), hints[f.name]),
                  f"a {hints[f.name].__name__} (set its keys as {f.name}.NAME)")


def import_callable(spec: str, what: str):
    """The function an import path `module:function` names; `what` names the setting in errors."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r}: expected an import path 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        a_file = module_name.endswith(".py") or "/" in module_name or "\\" in module_name
        hint = "; give the module's import name (my_rewards:f), its folder on PYTHONPATH, not a file path"
        raise ConfigError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc})"
                          f"{hint if a_file else ''}") from exc
    except Exception as exc:  # the module fails as it runs: a syntax error (its message names the line), a raise
        raise ConfigError(f"{what} {spec!r}: importing module {module_name!r} raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no function {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r}: {module_name}.{attr} is not callable (type {type(fn).__name__})")
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
