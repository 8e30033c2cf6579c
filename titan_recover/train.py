"""Worker entry point, one per rank under torchrun: ``python -m titan_recover.train CONFIG.toml [overrides]``.

``./run_train.sh`` (through :mod:`titan_recover.launch`) starts these; on a multi-node cluster, run them with
torchrun yourself (see README). The config is rebuilt here from the same file and overrides, identically on every
rank, and checked against this job's world size before TorchTitan starts.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    toml_path = argv.pop(0) if argv and not argv[0].startswith("--") else None

    from titan_recover.config.loader import build_config
    from titan_recover.config.validate import check_batch, resolve_layout

    config = build_config(toml_path, argv)
    layout = resolve_layout(config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
    check_batch(config.training, config.parallelism, layout)

    import torch
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.info(f"titan_recover: {config.model_spec.name}/{config.model_spec.flavor}, {layout}")
    trainer = None
    try:
        trainer = config.build()
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
