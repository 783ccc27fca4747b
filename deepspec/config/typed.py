"""Enumerated config keys as ``Literal`` types, on top of OmegaConf.

The dataclasses in this package are the schema.  OmegaConf cannot hold ``Literal`` annotations, so
it works on a mirror of each dataclass whose ``Literal[...]`` fields are plain ``str`` (built once,
`omegaconf_schema`); `build` turns the composed, resolved values back into the real dataclasses and
checks every ``Literal`` value on the way, naming the key and its choices.  A bad choice is thus
refused when the config loads, not when some stage first reads it.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Dict, Literal, Mapping, Optional, Tuple

from ..errors import UsageError

__all__ = ["ConfigError", "build", "choices", "omegaconf_schema"]


class ConfigError(UsageError, ValueError):
    """A config that cannot be composed or validated (names the key or file)."""


def choices(hint) -> Optional[Tuple[Any, ...]]:
    """The allowed values of a ``Literal[...]`` or ``Optional[Literal[...]]`` hint (None included for the
    latter); None for any other hint."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        lits = [a for a in args if typing.get_origin(a) is Literal]
        if len(lits) == 1 and set(args) - set(lits) == {type(None)}:
            return (*typing.get_args(lits[0]), None)
    return None


def _mirror_hint(hint):
    c = choices(hint)
    if c is not None:
        return Optional[str] if None in c else str
    if dataclasses.is_dataclass(hint):
        return omegaconf_schema(hint)
    return hint


@functools.lru_cache(maxsize=None)
def omegaconf_schema(cls):
    """``cls`` with every ``Literal`` field typed ``str`` (nested dataclasses mirrored too)."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = _mirror_hint(hints[f.name])
        if dataclasses.is_dataclass(hints[f.name]):
            fields.append((f.name, hint, dataclasses.field(default_factory=hint)))
        elif f.default is not dataclasses.MISSING:
            fields.append((f.name, hint, dataclasses.field(default=f.default)))
        else:
            fields.append((f.name, hint, dataclasses.field(default_factory=f.default_factory)))
    return dataclasses.make_dataclass(cls.__name__, fields)


def build(cls, values: Mapping[str, Any], prefix: str = ""):
    """An instance of ``cls`` from plain (resolved) values, each ``Literal`` field checked."""
    hints = typing.get_type_hints(cls)
    kw: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v, hint, key = values[f.name], hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint) and isinstance(v, Mapping):
            v = build(hint, v, key + ".")
        else:
            allowed = choices(hint)
            if allowed is not None and v not in allowed:
                shown = ", ".join("null" if a is None else str(a) for a in allowed)
                raise ConfigError(f"{key}={v!r}: choose from {shown}")
        kw[f.name] = v
    return cls(**kw)
