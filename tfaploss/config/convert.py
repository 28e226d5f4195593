"""Typed conversion of raw YAML values: each value is checked against its field's
annotation and returned in canonical form, or refused with a :class:`ConfigError` naming
the dotted key, what is allowed and what was received. An unknown annotation is a
``TypeError`` on the first config checked; a section whose keys annotations cannot give
(``loss``) supplies a ``from_raw(raw, path)`` classmethod instead.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, Union

from tfaploss.config.fields import ConfigError

__all__ = ["build_dataclass", "close_match", "convert", "fail", "type_name"]

_FLOAT_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values, each {_describe(args[0])}"
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def type_name(value) -> str:
    """How a received value is named in an error ("a string", "null", ...)."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def fail(path: str, value, tp, extra: str = "") -> typing.NoReturn:
    """Raise the error for ``value`` at ``path`` not matching the annotation ``tp``."""
    raise ConfigError(
        f"config key '{path}': expected {_describe(tp)}, received {type_name(value)} "
        f"{value!r}.{(' ' + extra) if extra else ''}"
    )


def convert(value, tp, path: str):
    """Check ``value`` against the annotation ``tp`` and return it in canonical form."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            fail(path, value, tp)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        # Several alternatives failed: a nested error (bad enum inside a mapping) is
        # more useful than "expected X or Y".
        for err in errors:
            if not str(err).startswith(f"config key '{path}': expected"):
                raise err
        fail(path, value, tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ConfigError(
                f"config key '{path}': {value!r} is not allowed; choose one of "
                f"{', '.join(repr(a) for a in allowed)}."
            )
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            fail(path, value, tp)
        return build_dataclass(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            fail(path, value, tp)
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                fail(path, value, tp, f"It needs exactly {len(args)} values.")
            return tuple(convert(v, a, f"{path}[{i}]") for i, (v, a) in
                         enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            fail(path, value, tp)
        return dict(value)
    if tp in (bool, str):
        if not isinstance(value, tp):
            fail(path, value, tp)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            fail(path, value, tp)
        return value
    if tp is float:
        if isinstance(value, bool):
            fail(path, value, tp)
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                fail(path, value, tp, "It must be finite.")
            return float(value)
        # PyYAML reads `1e-4` (no dot) as a string; accept that spelling of a number.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
        fail(path, value, tp)
    raise TypeError(f"unsupported schema annotation {tp!r} at {path}")  # a bug here


def build_dataclass(cls, raw: dict, path: str):
    """Build the dataclass ``cls`` from the mapping ``raw`` found at ``path``."""
    from_raw = getattr(cls, "from_raw", None)
    if from_raw is not None:
        return from_raw(raw, path)
    hints = typing.get_type_hints(cls)
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields_)
    kwargs = {}
    # Sections that check themselves last: checking the loss imports TensorFlow, so
    # other mistakes are reported first.
    for key, value in sorted(raw.items(),
                             key=lambda item: hasattr(hints.get(item[0]), "from_raw")):
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            suggestion = close_match(str(key), names)
            raise ConfigError(
                f"unknown config key '{where}'.{suggestion} Allowed keys"
                f"{' in ' + repr(path) if path else ''}: {', '.join(names)}."
            )
        kwargs[key] = convert(value, hints[key], where)
        if "range" in fields_[key].metadata:
            fields_[key].metadata["range"].check(kwargs[key], where)
    return cls(**kwargs)


def close_match(key: str, names) -> str:
    """The hint " Did you mean 'x'?" naming the closest of ``names``, or ``""``."""
    import difflib

    match = difflib.get_close_matches(key, list(names), n=1)
    return f" Did you mean '{match[0]}'?" if match else ""

