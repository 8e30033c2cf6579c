"""TOML file + CLI overrides -> ``RecoverTrainer.Config``.

Precedence, lowest first:

1. the model's registered TorchTitan config (``[model] name / flavor``, see :mod:`titan_recover.models`);
2. the project's defaults (addressable data, JSONL metrics, seed 0, run folder ``outputs/<toml name>``);
3. the platform's defaults (CPU: fp32 parameters, no CUDA graphs);
4. the TOML file's sections, named like the config's fields (``[training]``, ``[parallelism]``, ...);
5. CLI overrides in TorchTitan's form: ``--training.steps 20``, ``--training.steps=20``, ``--metrics.enable_wandb``
   (a bare boolean flag sets it true; ``--metrics.no_enable_wandb`` sets it false).

Then the platform adapts the model spec (SDPA attention and sum-only reductions on CPU) and TorchTitan's own
config checks run again on the result.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import tomli

from titan_recover.config.apply import (
    apply_mapping,
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


def _model_choice(raw: dict[str, Any], overrides: list[tuple[str, str | None]]) -> tuple[str, str]:
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


def _as_trainer_config(base, config_cls):
    return config_cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})


def _project_defaults(config, run_name: str) -> None:
    from titan_recover.checkpoint import RecoverCheckpointManager
    from titan_recover.data.loader import AddressableDataLoader
    from titan_recover.metrics import RunMetrics

    config.dataloader = AddressableDataLoader.Config()
    base_checkpoint = config.checkpoint
    ours = settable_fields(RecoverCheckpointManager.Config)
    config.checkpoint = RecoverCheckpointManager.Config(
        **{name: getattr(base_checkpoint, name) for name in settable_fields(base_checkpoint) if name in ours}
    )
    base_metrics = config.metrics
    config.metrics = RunMetrics.Config(
        **{name: getattr(base_metrics, name) for name in settable_fields(base_metrics) if name != "log_freq"}
    )
    config.validator.enable = False  # TorchTitan's validator reads HF datasets; the project's data is offline
    config.debug.seed = 0
    config.dump_folder = os.path.join("outputs", run_name)


def _resolve_checkpoint(config) -> None:
    """What the project's checkpoint manager needs from other sections: whether recovery loads verified
    checkpoints (unset: with the parameter vote of replica groups) and the in-memory snapshots to refill from."""
    from titan_recover.checkpoint import RecoverCheckpointManager

    checkpoint, recover = config.checkpoint, config.recover
    if not isinstance(checkpoint, RecoverCheckpointManager.Config):
        return  # another checkpoint manager was chosen
    if checkpoint.load_verified is None:
        checkpoint.load_verified = recover.enabled and not recover.diloco_mode and recover.localize.vote
    checkpoint._snapshot = recover.snapshot


def _apply_override(config, key: str, raw_value: str | None) -> None:
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


def _recheck_project_sections(obj) -> None:
    """Re-run ``__post_init__`` checks of the project's sections: TOML values are set after construction."""
    for name in settable_fields(obj):
        value = getattr(obj, name)
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            continue
        if type(value).__module__.startswith("titan_recover") and hasattr(value, "__post_init__"):
            try:
                value.__post_init__()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        _recheck_project_sections(value)


def build_config(toml_path: str | None, cli_args: list[str] | None = None, *, device: str | None = None):
    """Build the fully resolved ``RecoverTrainer.Config`` (raises :class:`ConfigError` on any mistake)."""
    raw = read_toml(toml_path) if toml_path else {}
    overrides = parse_overrides(cli_args or [])

    from titan_recover import platform

    resolved_device = platform.activate(device or requested_device(raw, overrides))

    from titan_recover.models import get_model
    from titan_recover.trainer import RecoverTrainer

    name, flavor = _model_choice(raw, overrides)
    try:
        entry = get_model(name, flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    config = _as_trainer_config(entry.base_config(), RecoverTrainer.Config)
    config.model_spec = entry.model_spec()
    run_name = pathlib.Path(toml_path).stem if toml_path else f"{name}_{flavor}"
    _project_defaults(config, run_name)
    apply_mapping(config, platform.platform_defaults(resolved_device))

    sections = {k: v for k, v in raw.items() if k != "model"}
    valid = list(settable_fields(config))
    for key in sections:
        if key not in valid or key == "model_spec":
            raise unknown_key_error(key, "", ["model", *[v for v in valid if v != "model_spec"]], what="section")
    hf_assets_given = "hf_assets_path" in sections or any(k == "hf_assets_path" for k, _ in overrides)
    apply_mapping(config, sections)
    for key, value in overrides:
        if not key.startswith("model."):
            _apply_override(config, key, value)

    if not hf_assets_given and config.dataloader.dataset_path:
        config.hf_assets_path = config.dataloader.dataset_path  # the prepared folder holds the tokenizer
    config.model_spec = platform.adapt_model_spec(config.model_spec, config.platform, resolved_device)
    if getattr(config.dataloader, "document_positions", False) is None:
        config.dataloader.document_positions = platform.takes_document_masks(config.model_spec)
    _resolve_checkpoint(config)
    _recheck_project_sections(config)
    try:
        config.__post_init__()  # TorchTitan's own cross-field checks, on the final values
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return config
