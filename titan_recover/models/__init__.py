"""Model registry: ``[model] name / flavor`` picks a TorchTitan model spec and its training config.

TorchTitan registers models per module (``torchtitan.models.<name>.model_registry(flavor)`` plus a
``config_registry`` of training configs). This registry indexes those by ``(name, flavor)`` and lets the project
add flavors of its own (``llama3`` / ``tiny``) next to TorchTitan's without touching TorchTitan's modules.
A new model family is a new module that calls :func:`register_model`; nothing here changes.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

# Modules whose import registers models. Imported lazily: they import TorchTitan's trainer, which must come
# after titan_recover.platform.activate().
_PROVIDERS = ("titan_recover.models.llama3",)


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    flavor: str
    model_spec: Callable[[], Any]
    """Builds TorchTitan's ``ModelSpec`` (model config, parallelize / pipelining functions)."""
    base_config: Callable[[], Any]
    """Builds TorchTitan's registered ``Trainer.Config`` for this model (optimizer, schedule, batch...)."""
    hardware: str = ""
    """What the flavor is sized for, shown by ``--list-models``."""


_REGISTRY: dict[tuple[str, str], RegisteredModel] = {}


def register_model(entry: RegisteredModel) -> None:
    key = (entry.name, entry.flavor)
    if key in _REGISTRY:
        raise ValueError(f"model {entry.name}/{entry.flavor} is registered twice")
    _REGISTRY[key] = entry


def _load_providers() -> None:
    for module in _PROVIDERS:
        importlib.import_module(module)


def registered_models() -> list[RegisteredModel]:
    _load_providers()
    return sorted(_REGISTRY.values(), key=lambda e: (e.name, e.flavor))


def get_model(name: str, flavor: str) -> RegisteredModel:
    """Look up a registered model; a ``ValueError`` names the closest valid choice otherwise."""
    _load_providers()
    if (name, flavor) in _REGISTRY:
        return _REGISTRY[(name, flavor)]
    names = sorted({n for n, _ in _REGISTRY})
    if name not in names:
        hint = difflib.get_close_matches(name, names, n=1)
        raise ValueError(
            f"[model] name = {name!r} is not a registered model"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" Registered: {', '.join(names)}."
        )
    flavors = sorted(f for n, f in _REGISTRY if n == name)
    hint = difflib.get_close_matches(flavor, flavors, n=1)
    raise ValueError(
        f"[model] flavor = {flavor!r} is not a flavor of {name!r}"
        + (f"; did you mean {hint[0]!r}?" if hint else "")
        + f" Flavors of {name}: {', '.join(flavors)}."
    )
