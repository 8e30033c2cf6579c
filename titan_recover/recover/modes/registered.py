"""Importing this module registers the project's training modes (:data:`~titan_recover.recover.modes.base.MODES`)."""

from titan_recover.recover.modes import diloco, single, sync  # noqa: F401
