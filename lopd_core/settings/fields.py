"""A setting defined once: its default, its help and its check in one `setting(...)`, checked on construction.

Why here and not only in the YAML loader: a section built in Python (`LopdConfig(steps=-1)`, or
`dataclasses.replace(params.lopd, steps=-1)`) must refuse the same values params.yaml and `--set` do, with the same
message naming the key. Every section is a frozen dataclass deriving from `Section`, whose `__post_init__` checks each
field's type and range and then the section's rules across keys (`check`). The help is what params.yaml's comments,
`lopd COMMAND --help` and `python -m lopd_core.config --list` print (lopd_core/settings/render.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing
from typing import Any, ClassVar

from lopd_core.settings.checks import Check, ConfigError


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    check: Check | None = None,
    factory: Any = dataclasses.MISSING,
    key_help: dict[str, str] | None = None,
) -> Any:
    """A dataclass field with its help text and optional check. A list, dict or section default goes in `factory`
    (a fresh one per instance). `key_help` documents the keys of a mapping setting (compare.presets)."""
    metadata = {"help": help, "check": check, "key_help": key_help or {}}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(cls, name: str) -> str:
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("help", "")


class Section:
    """Base of every settings section: fields are checked on construction, then the rules across keys."""

    SECTION: ClassVar[str] = ""  # the dotted name the section has in params.yaml, for error messages

    def __post_init__(self) -> None:
        check_fields(self, self.SECTION)
        self.check()

    def check(self) -> None:
        """Rules across keys (each key's own range is its field's); none by default."""


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_value(cls, field: dataclasses.Field, value: Any, key: str) -> Any:
    """`value` of `field` checked against its annotation and its check; returned coerced (ints widen to floats)."""
    value = coerce(value, _hints(cls)[field.name], key)
    check = field.metadata.get("check")
    if check is not None and not check.accepts(value):
        raise ConfigError(f"{key}: got {value!r}, expected {check.expected}")
    return value


def check_fields(section: Any, prefix: str) -> None:
    cls = type(section)
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        old = getattr(section, field.name)
        new = check_value(cls, field, old, key)
        if new is not old:  # a frozen section: coercion is the one write, and only here
            object.__setattr__(section, field.name, new)


_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints widen to floats, mappings build sections)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value  # checked when it was built
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {value!r}, expected a mapping of {tp.__name__} fields")
        return build(tp, value, key)
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: got {value!r}, expected a list")
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]  # a copy: no alias of the caller's
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {value!r}, expected a mapping")
        return {str(k): coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        errors = []
        for candidate in [a for a in typing.get_args(tp) if a is not type(None)]:
            try:  # the first type that takes the value (`float | str`: a number before a word)
                return coerce(value, candidate, key)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]  # what the first type expected (e.g. a finite number), naming the key and the value
    return _scalar(value, tp, key)


def _scalar(value: Any, tp: Any, key: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `3e-5` (no dot) as a string
        with contextlib.suppress(ValueError):  # a real string: reported below
            value = float(value)
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        # nan passes every `<`/`>` range check and inf trains a model of NaNs: no setting takes either
        raise ConfigError(f"{key}: got {value!r}, expected a finite number")
    if tp in _SCALARS:
        if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
            raise ConfigError(f"{key}: got {value!r}, expected {_SCALARS[tp]}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # a bug in the settings, not in the params


# Keys that moved to another section: a file that still sets one is told where it went.
MOVED = {"lopd.temperature": "rollout.temperature"}


def build(cls, raw: dict, prefix: str):
    """A section from a raw mapping: every key known and checked under its full dotted name, then the section's
    own rules across keys (its __post_init__)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        if key in MOVED:
            raise ConfigError(f"{key}: moved to {MOVED[key]} (value {raw[unknown[0]]!r}); set it there")
        raise ConfigError(f"{key}: unknown key (value {raw[unknown[0]]!r}); expected one of: {', '.join(fields)}")
    kwargs = {
        name: check_value(cls, fields[name], value, f"{prefix}.{name}" if prefix else name)
        for name, value in raw.items()
    }
    return cls(**kwargs)
