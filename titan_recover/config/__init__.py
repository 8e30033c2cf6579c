"""Configuration: TOML files and CLI overrides onto TorchTitan's config dataclasses, strictly."""

from titan_recover.config.apply import ConfigError

__all__ = ["ConfigError"]
