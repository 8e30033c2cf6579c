"""TOML file + CLI overrides, read and applied onto config dataclasses (pure; no TorchTitan import).

CLI overrides take TorchTitan's form: ``--training.steps 20``, ``--training.steps=20``, ``--metrics.enable_wandb``
(a bare boolean flag sets it true; ``--metrics.no_enable_wandb`` sets it false). The whole run's config is
composed from these by :func:`titan_recover.job_config.build_config`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import tomli

from titan_recover.config.apply import (
    ConfigError,
    convert,
    settable_fields,
    type_hints,
    unknown_key_error,
)

DEFAULT_MODEL = {"name": "llama3", "flavor": "debugmodel"}
MODEL_KEYS = ("name", "flavor")


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (configs live in train_configs/)")
    try:
        with p.open("rb") as fh:
            return tomli.load(fh)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from e


def parse_overrides(args: list[str]) -> list[tuple[str, str | None]]:
    """``["--a.b", "1", "--c.d=x", "--flag"]`` -> ``[("a.b", "1"), ("c.d", "x"), ("flag", None)]``.

    A value-less key (``None``) is a boolean flag; whether a following token is its value is decided later,
    from the key's type, by :func:`_take_values`.
    """
    out: list[tuple[str, str | None]] = []
    for token in args:
        if token.startswith("--"):
            key, sep, value = token[2:].partition("=")
            if not key:
                raise ConfigError(f"malformed override {token!r}: expected --section.key value")
            out.append((key.replace("-", "_"), value if sep else None))
        elif out and out[-1][1] is None:
            out[-1] = (out[-1][0], token)
        else:
            raise ConfigError(f"unexpected argument {token!r}: overrides look like --section.key value")
    return out


def model_choice(raw: dict[str, Any], overrides: list[tuple[str, str | None]]) -> tuple[str, str]:
    model = dict(DEFAULT_MODEL)
    section = raw.get("model", {})
    if not isinstance(section, dict):
        raise ConfigError("[model] must be a table with name and flavor")
    for key, value in section.items():
        if key not in MODEL_KEYS:
            raise unknown_key_error(key, "model", list(MODEL_KEYS))
        if not isinstance(value, str):
            raise ConfigError(f"model.{key}: expected str, got {value!r}")
        model[key] = value
    for key, value in overrides:
        if key.startswith("model."):
            sub = key.split(".", 1)[1]
            if sub not in MODEL_KEYS:
                raise unknown_key_error(sub, "model", list(MODEL_KEYS))
            if value is None:
                raise ConfigError(f"--{key} needs a value")
            model[sub] = value
    return model["name"], model["flavor"]


def requested_device(raw: dict[str, Any], overrides: list[tuple[str, str | None]]) -> str:
    """``[platform] device`` from the TOML or the CLI, read before anything imports TorchTitan's trainer."""
    device = raw.get("platform", {}).get("device", "auto") if isinstance(raw.get("platform"), dict) else "auto"
    for key, value in overrides:
        if key == "platform.device" and value is not None:
            device = value
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"platform.device: expected one of 'auto', 'cpu', 'cuda', got {device!r}")
    return device


def apply_override(config, key: str, raw_value: str | None) -> None:
    parts = key.split(".")
    obj, path = config, ""
    for part in parts[:-1]:
        fields = settable_fields(obj)
        if part not in fields:
            raise unknown_key_error(part, path, list(fields), what="section" if not path else "key")
        obj = getattr(obj, part)
        path = f"{path}.{part}" if path else part
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"--{key}: {path} is a value, not a section")
    name = parts[-1]
    fields = settable_fields(obj)
    annotation = type_hints(type(obj)).get(name)
    negated = False
    if name not in fields and name.startswith("no_") and name[3:] in fields and raw_value is None:
        name, negated = name[3:], True
        annotation = type_hints(type(obj)).get(name)
    if name not in fields:
        raise unknown_key_error(name, path, list(fields))
    if dataclasses.is_dataclass(getattr(obj, name)):
        raise ConfigError(f"--{key} is a section; set its keys, e.g. --{key}.<key> value")
    if raw_value is None:
        try:
            value = convert(not negated, annotation, key)
        except ConfigError:
            raise ConfigError(f"--{key} needs a value (only boolean settings can be given as bare flags)") from None
    else:
        value = _convert_cli_value(raw_value, annotation, key)
    setattr(obj, name, value)


def _convert_cli_value(raw: str, annotation, path: str):
    candidates: list[Any] = []
    try:
        candidates.append(tomli.loads(f"v = {raw}")["v"])
    except tomli.TOMLDecodeError:
        pass
    if raw.lower() in ("true", "false"):
        candidates.append(raw.lower() == "true")
    candidates.append(raw)
    if "," in raw:
        candidates.append(raw.split(","))
    first_error: ConfigError | None = None
    for candidate in candidates:
        try:
            return convert(candidate, annotation, path)
        except ConfigError as e:
            first_error = first_error or e
    assert first_error is not None
    raise first_error
