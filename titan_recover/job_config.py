"""The run's whole config: TOML file + CLI overrides -> ``RecoverTrainer.Config``.

Precedence, lowest first:

1. the model's registered TorchTitan config (``[model] name / flavor``, see :mod:`titan_recover.models`);
2. the project's defaults (addressable data, JSONL metrics, seed 0, run folder ``outputs/<toml name>``);
3. the platform's defaults (CPU: fp32 parameters, no CUDA graphs);
4. the TOML file's sections, named like the config's fields (``[training]``, ``[parallelism]``, ...);
5. CLI overrides (:func:`titan_recover.config.loader.parse_overrides`).

Then the platform adapts the model spec (SDPA attention and sum-only reductions on CPU) and TorchTitan's own
config checks run again on the result. This module sits above the trainer (it builds the trainer's config class);
reading and applying TOML and CLI values is :mod:`titan_recover.config.loader`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

from titan_recover.config.apply import apply_mapping, ConfigError, settable_fields, unknown_key_error
from titan_recover.config.loader import apply_override, model_choice, parse_overrides, read_toml, requested_device
from titan_recover.config.validate import check_values


class _CheckpointDefaultsWarnings(logging.Filter):
    """Drops what TorchTitan's checkpoint-section checks warn while its registered config is built from
    TorchTitan's defaults (``initial_load_model_only = True`` without a path). The project replaces that section
    (``_project_defaults``) and TorchTitan's checks run again on the final values (``_recheck_project_sections``),
    so a warning that applies to the user's config is still printed, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and _CHECKPOINTER in pathlib.Path(record.pathname).parts)


_CHECKPOINTER = "checkpointer"
"""The folder of TorchTitan's checkpoint managers and their config checks."""


def _registered_config(entry):
    """TorchTitan's registered ``Trainer.Config`` of the model, built without its defaults' warnings."""
    root, quiet = logging.getLogger(), _CheckpointDefaultsWarnings()  # TorchTitan logs on the root logger
    root.addFilter(quiet)
    try:
        return entry.base_config()
    finally:
        root.removeFilter(quiet)


def _as_trainer_config(base, config_cls):
    return config_cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})


def _project_defaults(config, run_name: str) -> None:
    from titan_recover.checkpoint import RecoverCheckpointManager
    from titan_recover.data.loader import AddressableDataLoader
    from titan_recover.metrics import RunMetrics

    config.dataloader = AddressableDataLoader.Config()
    base_checkpoint = config.checkpoint
    ours = settable_fields(RecoverCheckpointManager.Config)
    config.checkpoint = RecoverCheckpointManager.Config(  # initial_load_model_only: resolved on the final values
        **{name: getattr(base_checkpoint, name) for name in settable_fields(base_checkpoint)
           if name in ours and name != "initial_load_model_only"}
    )
    base_metrics = config.metrics
    config.metrics = RunMetrics.Config(
        **{name: getattr(base_metrics, name) for name in settable_fields(base_metrics) if name != "log_freq"}
    )
    config.validator.enable = False  # TorchTitan's validator reads HF datasets; the project's data is offline
    config.debug.seed = 0
    config.dump_folder = os.path.join("outputs", run_name)
    config.metrics.wandb_group = run_name  # a config's runs (its --reference included) group together


def _resolve_checkpoint(config) -> None:
    """What the project's checkpoint manager needs from other sections: whether recovery loads verified
    checkpoints (unset: with the parameter vote of replica groups), the in-memory snapshots to refill from, and,
    in checkpoint-restart mode, the layout whose replicated dimension names its events' replicas."""
    from titan_recover.checkpoint import RecoverCheckpointManager

    checkpoint, recover = config.checkpoint, config.recover
    if not isinstance(checkpoint, RecoverCheckpointManager.Config):
        return  # another checkpoint manager was chosen
    if checkpoint.initial_load_model_only is None:  # TorchTitan's default where it means something
        checkpoint.initial_load_model_only = bool(checkpoint.initial_load_path)
    elif checkpoint.initial_load_model_only and not checkpoint.initial_load_path:
        raise ConfigError("checkpoint.initial_load_model_only = true has no effect without checkpoint."
                          "initial_load_path: set the path of the checkpoint to start from, or remove the key")
    if checkpoint.load_verified is None:
        checkpoint.load_verified = recover.enabled and not recover.diloco_mode and recover.localize.vote
    checkpoint._snapshot = recover.snapshot
    checkpoint._replicas_in = config.parallelism if recover.checkpoint_restart_mode else None


def _recheck_project_sections(obj, path: str = "") -> None:
    """Re-run ``__post_init__`` checks of the project's sections: TOML values are set after construction. An error
    that does not name its section yet is prefixed with the section's path."""
    for name in settable_fields(obj):
        value = getattr(obj, name)
        if not dataclasses.is_dataclass(value) or isinstance(value, type):
            continue
        where = f"{path}.{name}" if path else name
        if type(value).__module__.startswith("titan_recover") and hasattr(value, "__post_init__"):
            try:
                value.__post_init__()
            except ValueError as e:
                message = str(e)
                raise ConfigError(message if message.startswith(where) else f"[{where}] {message}") from None
        _recheck_project_sections(value, where)


def build_config(toml_path: str | None, cli_args: list[str] | None = None, *, device: str | None = None):
    """Build the fully resolved ``RecoverTrainer.Config`` (raises :class:`ConfigError` on any mistake)."""
    raw = read_toml(toml_path) if toml_path else {}
    overrides = parse_overrides(cli_args or [])

    from titan_recover import platform

    resolved_device = platform.activate(device or requested_device(raw, overrides))

    from titan_recover.models import get_model
    from titan_recover.trainer import RecoverTrainer

    name, flavor = model_choice(raw, overrides)
    try:
        entry = get_model(name, flavor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    config = _as_trainer_config(_registered_config(entry), RecoverTrainer.Config)
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
            apply_override(config, key, value)

    if not hf_assets_given and config.dataloader.dataset_path:
        config.hf_assets_path = config.dataloader.dataset_path  # the prepared folder holds the tokenizer
    config.model_spec = platform.adapt_model_spec(config.model_spec, config.platform, resolved_device)
    if getattr(config.dataloader, "document_positions", False) is None:
        config.dataloader.document_positions = platform.takes_document_masks(config.model_spec)
    _resolve_checkpoint(config)
    _recheck_project_sections(config)
    check_values(config)
    try:
        config.__post_init__()  # TorchTitan's own cross-field checks, on the final values
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return config
