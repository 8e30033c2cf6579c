"""Stock TorchTitan (``torchtitan.train.main``) on a project TOML, with only the CPU fixes applied.

The baseline of ``overhead_vs_torchtitan.py``. Run under torchrun::

    STOCK_TOML=train_configs/debug_model.toml STOCK_OVERRIDES='["--training.steps","10"]' \
      torchrun --standalone --nproc-per-node 2 benchmarks/stock_torchtitan.py

The config is resolved by the project's loader (same model, data, batch, seed) and handed to TorchTitan's own
``ConfigManager`` as a plain ``Trainer.Config`` (``--module __main__ --config from_toml``): TorchTitan's own
trainer, metrics and batch iteration run; the project's trainer subclass, JSONL metrics and config sections do not.
"""

from __future__ import annotations

import json
import os
import sys

from titan_recover import platform

platform.activate()  # the CPU fixes: device globals before TorchTitan's trainer is imported


def from_toml():
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    from titan_recover.config.apply import settable_fields
    from titan_recover.job_config import build_config

    config = build_config(os.environ["STOCK_TOML"], json.loads(os.environ.get("STOCK_OVERRIDES", "[]")))
    values = {name: getattr(config, name) for name in settable_fields(Trainer.Config())}
    values["model_spec"] = config.model_spec
    base_metrics = MetricsProcessor.Config()
    values["metrics"] = MetricsProcessor.Config(
        **{name: getattr(config.metrics, name) for name in settable_fields(base_metrics)}
    )
    return Trainer.Config(**values)


if __name__ == "__main__":
    sys.argv += ["--module", "__main__", "--config", "from_toml"]
    from torchtitan.train import main

    main()
