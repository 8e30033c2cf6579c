"""Strict application of TOML-shaped values onto config dataclasses.

Every key is checked against the dataclass it lands on (the *runtime* class of the section, so a section holding
a subclass config, e.g. the project's data loader, accepts that subclass's keys). An unknown key is an error that
names the closest valid key and the valid ones; a value of the wrong type names its TOML path and the type
expected. Nothing is ever ignored silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

_MISSING = object()


class ConfigError(ValueError):
    """A user mistake in a config file or override, with what is wrong and how to fix it."""


def settable_fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj) if f.init and not f.name.startswith("_")}


def unknown_key_error(key: str, path: str, valid: list[str], *, what: str = "key") -> ConfigError:
    where = f"[{path}]" if path else "the top level"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown {what} {key!r} in {where}.{hint} Valid {what}s there: {', '.join(sorted(valid))}. "
        "Run with --print-config to see every setting and its current value."
    )


def type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: fall back to the raw annotations
        hints: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            hints.update(getattr(klass, "__annotations__", {}))
        return hints


def apply_mapping(obj: Any, values: dict[str, Any], path: str = "") -> None:
    """Set ``values`` (nested dicts for nested sections) on dataclass instance ``obj``, strictly."""
    fields = settable_fields(obj)
    hints = type_hints(type(obj))
    for key, value in values.items():
        key_path = f"{path}.{key}" if path else key
        if key not in fields:
            raise unknown_key_error(key, path, list(fields))
        current = getattr(obj, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            apply_mapping(current, value, key_path)
            continue
        setattr(obj, key, convert(value, hints.get(key, Any), key_path))


def convert(value: Any, annotation: Any, path: str) -> Any:
    """Check ``value`` against ``annotation``; return it (converted where lossless, e.g. int -> float)."""
    result = _convert(value, annotation, path)
    if result is _MISSING:
        raise ConfigError(
            f"{path}: expected {describe(annotation)}, got {value!r} ({type(value).__name__}). "
            "Fix the value in the TOML file or the --" + path + " override."
        )
    return result


def _convert(value: Any, annotation: Any, path: str) -> Any:
    if annotation is Any or annotation is object or isinstance(annotation, (str, typing.ForwardRef)):
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return value if value in args else _MISSING
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                out = _convert(value, arm, path)
            except ConfigError:
                continue
            if out is not _MISSING:
                return out
        return _MISSING
    if origin is typing.Annotated:
        return _convert(value, args[0], path)
    if annotation is bool:
        return value if isinstance(value, bool) else _MISSING
    if annotation is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
    if annotation is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _MISSING
    if annotation is str:
        return value if isinstance(value, str) else _MISSING
    if annotation is type(None):
        return None if value is None else _MISSING
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return _MISSING
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                return _MISSING
            items = [convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            inner = args[0] if args else Any
            items = [convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or annotation) is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            return _MISSING
        inner = args[1] if len(args) == 2 else Any
        return {k: convert(v, inner, f"{path}.{k}") for k, v in value.items()}
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            return _MISSING
        return build_dataclass(annotation, value, path)
    if isinstance(annotation, type):
        return value if isinstance(value, annotation) else _MISSING
    return value  # an annotation this checker does not model (a callable type, a TypeVar...)


def build_dataclass(cls: type, values: dict[str, Any], path: str) -> Any:
    """Construct ``cls`` from a TOML table (an element of an array of tables, for example)."""
    fields = settable_fields(cls)
    for key in values:
        if key not in fields:
            raise unknown_key_error(key, path, list(fields))
    hints = type_hints(cls)
    kwargs = {k: convert(v, hints.get(k, Any), f"{path}.{k}") for k, v in values.items()}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{path}: missing required key(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is typing.Annotated:
        return describe(args[0])
    if annotation is type(None):
        return "none (omit the key)"
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(describe(a) for a in args)}]"
    if dataclasses.is_dataclass(annotation):
        return f"a table of {annotation.__qualname__} settings"
    return getattr(annotation, "__name__", str(annotation))
