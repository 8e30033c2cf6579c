"""Render a resolved config as TOML (``--print-config``): what a run will use, every key where a user sets it."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from titan_recover.config.apply import settable_fields


def _value(v: Any) -> str | None:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else ("nan" if math.isnan(v) else repr(v))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        items = [_value(x) for x in v]
        return None if None in items else "[" + ", ".join(items) + "]"
    if isinstance(v, dict):
        items = {k: _value(x) for k, x in v.items()}
        if None in items.values():
            return None
        return "{" + ", ".join(f"{k} = {x}" for k, x in items.items()) + "}"
    if dataclasses.is_dataclass(v):
        return _value({k: getattr(v, k) for k in settable_fields(v)})
    return None


def _table(obj: Any, path: str, lines: list[str]) -> None:
    scalars, tables = [], []
    for name in settable_fields(obj):
        v = getattr(obj, name)
        if dataclasses.is_dataclass(v):
            tables.append((name, v))
        elif isinstance(v, list) and v and all(dataclasses.is_dataclass(x) for x in v):
            tables.append((name, v))
        else:
            scalars.append((name, v))
    if path:
        lines.append(f"\n[{path}]" + (f"  # {type(obj).__qualname__}" if "." in type(obj).__qualname__ else ""))
    for name, v in scalars:
        text = _value(v)
        lines.append(f"{name} = {text}" if text is not None else f"# {name} = {v!r}  (unset)")
    for name, v in tables:
        sub = f"{path}.{name}" if path else name
        if isinstance(v, list):
            for item in v:
                lines.append(f"\n[[{sub}]]")
                for key in settable_fields(item):
                    text = _value(getattr(item, key))
                    lines.append(f"{key} = {text}" if text is not None else f"# {key} = {getattr(item, key)!r}")
        else:
            _table(v, sub, lines)


def render_toml(config) -> str:
    lines = ["# fully resolved config (model defaults < project defaults < platform < TOML < CLI)"]
    tables: list[str] = []
    for name in settable_fields(config):
        v = getattr(config, name)
        if name == "model_spec":
            continue
        if dataclasses.is_dataclass(v):
            _table(v, name, tables)
        else:  # TOML wants top-level keys before the first table
            text = _value(v)
            lines.append(f"{name} = {text}" if text is not None else f"# {name} = {v!r}")
    lines += ["", "[model]", f'name = "{config.model_spec.name}"', f'flavor = "{config.model_spec.flavor}"']
    return "\n".join(lines + tables) + "\n"
